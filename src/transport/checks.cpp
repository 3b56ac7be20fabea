// The argument checks every backend shares: Transport's public collectives validate, then call
// the backend's start_*.
#include <numeric>

#include <fmt/format.h>

#include "gradcomp/error.h"
#include "gradcomp/transport.h"

namespace gradcomp {
namespace {

size_t sum(std::span<const size_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), size_t{0});
}

void check_counts(const char* op, const char* what, std::span<const size_t> counts, int ranks) {
  if (counts.size() != static_cast<size_t>(ranks)) {
    throw Error(fmt::format("{}: {} has {} entries; it needs one per rank ({})", op, what,
                            counts.size(), ranks));
  }
}

}  // namespace

WorkPtr Transport::allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) {
  const size_t width = dtype_size(type);
  if (width == 0) throw Error("allreduce: the element type must be f32, f16, bf16, i8, u8 or i32");
  if (buffer.size() % width != 0) {
    throw Error(fmt::format("allreduce: {} bytes is not a whole number of {}-byte elements",
                            buffer.size(), width));
  }
  return start_allreduce(buffer, type, op);
}

WorkPtr Transport::allgather(std::span<const std::byte> in, std::span<std::byte> out) {
  if (out.size() != in.size() * static_cast<size_t>(size())) {
    throw Error(fmt::format("allgather: output has {} bytes; it needs ranks x input = {} x {}",
                            out.size(), size(), in.size()));
  }
  return start_allgather(in, out);
}

WorkPtr Transport::allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                              std::span<const size_t> counts) {
  check_counts("allgatherv", "counts", counts, size());
  if (in.size() != counts[static_cast<size_t>(rank())]) {
    throw Error(fmt::format("allgatherv: input has {} bytes but counts[{}] says {}", in.size(),
                            rank(), counts[static_cast<size_t>(rank())]));
  }
  if (out.size() != sum(counts)) {
    throw Error(fmt::format("allgatherv: output has {} bytes; the counts add up to {}",
                            out.size(), sum(counts)));
  }
  return start_allgatherv(in, out, counts);
}

WorkPtr Transport::alltoall(std::span<const std::byte> in, std::span<std::byte> out) {
  const auto ranks = static_cast<size_t>(size());
  if (in.size() % ranks != 0 || out.size() != in.size()) {
    throw Error(fmt::format("alltoall: input ({} bytes) and output ({} bytes) must be equal and "
                            "split into {} equal blocks",
                            in.size(), out.size(), ranks));
  }
  return start_alltoall(in, out);
}

WorkPtr Transport::alltoallv(std::span<const std::byte> in, std::span<const size_t> in_counts,
                             std::span<std::byte> out, std::span<const size_t> out_counts) {
  check_counts("alltoallv", "in_counts", in_counts, size());
  check_counts("alltoallv", "out_counts", out_counts, size());
  if (in.size() != sum(in_counts)) {
    throw Error(fmt::format("alltoallv: input has {} bytes; in_counts add up to {}", in.size(),
                            sum(in_counts)));
  }
  if (out.size() != sum(out_counts)) {
    throw Error(fmt::format("alltoallv: output has {} bytes; out_counts add up to {}",
                            out.size(), sum(out_counts)));
  }
  const auto me = static_cast<size_t>(rank());
  if (in_counts[me] != out_counts[me]) {
    throw Error(
        fmt::format("alltoallv: rank {} sends itself {} bytes (in_counts[{}]) but "
                    "receives {} from itself (out_counts[{}]); the two must be equal",
                    me, in_counts[me], me, out_counts[me], me));
  }
  return start_alltoallv(in, in_counts, out, out_counts);
}

WorkPtr Transport::broadcast(std::span<std::byte> buffer, int root) {
  return broadcast(buffer, root, timeout());
}

WorkPtr Transport::broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout) {
  if (root < 0 || root >= size()) {
    throw Error(fmt::format("broadcast: root {} is not a rank (0..{})", root, size() - 1));
  }
  if (timeout.count() <= 0) {
    throw Error(fmt::format("broadcast: timeout is {} ms; it must be positive", timeout.count()));
  }
  return start_broadcast(buffer, root, timeout);
}

WorkPtr Transport::barrier() { return start_barrier(); }

}  // namespace gradcomp
