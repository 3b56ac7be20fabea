// The torch.distributed transport: each collective becomes one c10d call on byte tensors that
// view the caller's buffers (staged through the group's device when it is not the CPU), run on
// an OpQueue thread so collectives keep their issue order, and waited for with our timeout.
#include "gradcomp/torch/process_group_transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "gradcomp/error.h"
#include "gradcomp/op_queue.h"
#include "gradcomp/roll_call.h"

namespace gradcomp::torch {
namespace {

at::ScalarType scalar_type(DType type) {
  switch (type) {
    case DType::kF32: return at::kFloat;
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
    case DType::kI8: return at::kChar;
    case DType::kU8: return at::kByte;
    case DType::kI32: return at::kInt;
    case DType::kNone: break;
  }
  throw Error("process group: no tensor type for this payload type");
}

// A group whose collective failed may have a worker thread blocked in a receive from a dead or
// stopped peer until c10d's own timeout (30 minutes by default); destroying the group joins
// that thread, so the process could not exit after our (much shorter) timeout. Such a group
// is kept alive until the process ends; exiting does not wait for its threads.
void keep_until_exit(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  static std::mutex mutex;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>();  // never freed
  std::lock_guard lock(mutex);
  kept->push_back(std::move(group));
}

// The group's c10d store as the roll call's board (roll_call.h), under a prefix of its own.
class StoreAttendance final : public Attendance {
 public:
  StoreAttendance(c10::intrusive_ptr<c10d::Store> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix)) {}
  void sign(int rank) override { store_->set(key(rank), std::vector<uint8_t>{'1'}); }
  bool signed_by(int rank) override { return store_->check({key(rank)}); }
  std::string where() const override { return "the torch.distributed store"; }

 private:
  std::string key(int rank) const { return fmt::format("{}/failed/{}", prefix_, rank); }
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
};

class ProcessGroupTransport final : public Transport {
 public:
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device,
                        Milliseconds timeout, c10::intrusive_ptr<c10d::Store> store,
                        std::string board)
      : group_(std::move(group)),
        device_(device),
        timeout_(timeout),
        name_(fmt::format("torch.distributed ({})", group_->getBackendName())),
        store_(std::move(store)),
        board_(std::move(board)),
        queue_(name_) {}

  std::string name() const override { return name_; }
  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }
  Milliseconds timeout() const override { return timeout_; }
  bool drain(Milliseconds timeout) override { return queue_.drain(timeout); }

  bool can_split() const override { return false; }
  std::unique_ptr<Transport> split(int, int) override {
    throw Error(
        "torch.distributed transport: a process group cannot be split from gradcomp; the "
        "routes over nodes (hierarchical, sharded) need gradcomp's own transport "
        "(transport='gloo' or 'mpi')");
  }

 protected:
  WorkPtr start_allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) override {
    return submit("allreduce", buffer.size(), [=, this] {
      if (buffer.empty()) return;  // nothing to reduce (see gather_blocks)
      at::Tensor host = view(buffer, type);
      // Gloo's c10d backend has no bfloat16 sum: reduce those in float32 and round once.
      const bool widen = type == DType::kBF16 && group_->getBackendName() == "gloo";
      at::Tensor t = stage(widen ? host.to(at::kFloat) : host);
      std::vector<at::Tensor> tensors{t};
      c10d::AllreduceOptions options;
      options.reduceOp = op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
      wait(group_->allreduce(tensors, options));
      unstage(tensors[0], host);
    });
  }

  WorkPtr start_allgather(std::span<const std::byte> in, std::span<std::byte> out) override {
    return submit("allgather", in.size(), [=, this] { gather_blocks(in, out, in.size()); });
  }

  WorkPtr start_allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                           std::span<const size_t> counts) override {
    std::vector<size_t> sizes(counts.begin(), counts.end());
    return submit("allgatherv", in.size(), [=, this] {
      // c10d gathers equal blocks only: gather padded blocks, then pack them.
      const size_t block = *std::max_element(sizes.begin(), sizes.end());
      std::vector<std::byte> padded(block * sizes.size());
      std::vector<std::byte> mine(block);
      std::copy(in.begin(), in.end(), mine.begin());
      gather_blocks(mine, padded, block);
      size_t offset = 0;
      for (size_t r = 0; r < sizes.size(); ++r) {
        std::memcpy(out.data() + offset, padded.data() + r * block, sizes[r]);
        offset += sizes[r];
      }
    });
  }

  WorkPtr start_alltoall(std::span<const std::byte> in, std::span<std::byte> out) override {
    return submit("alltoall", in.size(), [=, this] {
      at::Tensor src = stage(view(in));
      at::Tensor host_out = view(out);
      at::Tensor dst = stage(host_out);
      std::vector<int64_t> none;
      wait(group_->alltoall_base(dst, src, none, none));
      unstage(dst, host_out);
    });
  }

  WorkPtr start_alltoallv(std::span<const std::byte> in, std::span<const size_t> in_counts,
                          std::span<std::byte> out, std::span<const size_t> out_counts) override {
    std::vector<int64_t> send(in_counts.begin(), in_counts.end());
    std::vector<int64_t> receive(out_counts.begin(), out_counts.end());
    return submit("alltoallv", in.size(), [=, this]() mutable {
      at::Tensor src = stage(view(in));
      at::Tensor host_out = view(out);
      at::Tensor dst = stage(host_out);
      wait(group_->alltoall_base(dst, src, receive, send));
      unstage(dst, host_out);
    });
  }

  WorkPtr start_broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout) override {
    return submit("broadcast", buffer.size(), [=, this] {
      if (buffer.empty()) return;  // the same size on every rank, so every rank skips
      at::Tensor host = view(buffer);
      std::vector<at::Tensor> tensors{stage(host)};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      options.timeout = timeout;
      wait(group_->broadcast(tensors, options), timeout);
      unstage(tensors[0], host);
    });
  }

  WorkPtr start_barrier() override {
    return submit("barrier", 0, [this] { wait(group_->barrier()); });
  }

 private:
  // Runs `body` on the queue, turning c10d's exceptions into ours with the operation named.
  WorkPtr submit(const char* op, size_t bytes, std::function<void()> body) {
    return queue_.submit([=, this, body = std::move(body)] {
      try {
        body();
      } catch (const TimeoutError& e) {
        fail(op, bytes, e.what(), true);
      } catch (const Error&) {
        keep_until_exit(group_);
        throw;
      } catch (const std::exception& e) {
        const std::string what = e.what();
        fail(op, bytes, what.substr(0, what.find('\n')),
             what.find("imed out") != std::string::npos ||
                 what.find("imeout") != std::string::npos);
      }
    });
  }

  [[noreturn]] void fail(const char* op, size_t bytes, const std::string& what, bool timed_out) {
    keep_until_exit(group_);
    if (!missing_) missing_ = missing_peers();
    const std::string message = fmt::format("{}: {} of {} bytes (rank {} of {}) failed; {} [{}]",
                                            name_, op, bytes, rank(), size(), *missing_, what);
    if (timed_out) throw TimeoutError(message);
    throw CommError(message);
  }

  // Which peers are gone (roll_call.h): known only when the group's store was given.
  std::string missing_peers() const {
    if (!store_) return "a peer may have died or stopped";
    const Milliseconds grace = roll_call_grace(timeout_);
    return roll_call(std::make_shared<StoreAttendance>(store_, board_), rank(), size(), grace);
  }

  void wait(const c10::intrusive_ptr<c10d::Work>& work) const { wait(work, timeout_); }
  static void wait(const c10::intrusive_ptr<c10d::Work>& work, Milliseconds timeout) {
    if (!work->wait(timeout)) {
      throw TimeoutError(fmt::format("did not finish within {:.3g} s (GRADCOMP_TIMEOUT)",
                                     timeout.count() / 1000.0));
    }
  }

  // All ranks contribute `block` bytes; out receives them in rank order.
  void gather_blocks(std::span<const std::byte> in, std::span<std::byte> out, size_t block) {
    // Gloo's allgather divides by the block size (SIGFPE on zero bytes). Every rank knows the
    // block size, so every rank skips alike.
    if (block == 0) return;
    at::Tensor src = stage(view(in));
    std::vector<at::Tensor> host_blocks, blocks;
    for (int r = 0; r < size(); ++r) {
      host_blocks.push_back(view(out.subspan(r * block, block)));
      blocks.push_back(stage(host_blocks.back()));
    }
    std::vector<std::vector<at::Tensor>> outputs{blocks};
    std::vector<at::Tensor> inputs{src};
    wait(group_->allgather(outputs, inputs));
    for (int r = 0; r < size(); ++r) unstage(outputs[0][r], host_blocks[r]);
  }

  static at::Tensor view(std::span<const std::byte> bytes, DType type = DType::kU8) {
    const auto n = static_cast<int64_t>(bytes.size() / dtype_size(type));
    // c10d wants a real address even for an empty tensor.
    static std::byte empty[8];
    void* data = bytes.empty() ? empty : const_cast<std::byte*>(bytes.data());
    return at::from_blob(data, {n}, at::TensorOptions().dtype(scalar_type(type)));
  }

  at::Tensor stage(const at::Tensor& host) const {
    return device_.is_cpu() ? host : host.to(device_);
  }
  static void unstage(const at::Tensor& result, at::Tensor& host) {
    if (!result.is_same(host)) host.copy_(result);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::Device device_;
  Milliseconds timeout_;
  std::string name_;
  c10::intrusive_ptr<c10d::Store> store_;  // the roll call's board; may be null
  std::string board_;                      // its key prefix, this transport's own
  std::optional<std::string> missing_;     // the roll call's verdict, once a collective failed
  OpQueue queue_;
};

}  // namespace

std::shared_ptr<Transport> make_process_group_transport(
    c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device, Milliseconds timeout,
    c10::intrusive_ptr<c10d::Store> store) {
  if (!group) throw Error("torch.distributed transport: the process group is null");
  if (timeout.count() <= 0) timeout = timeout_from_environment();
  // Every rank makes its transports in the same order (each is made collectively), so the
  // count names the same board on every rank.
  static std::atomic<int> made{0};
  std::string board = fmt::format("gradcomp/rollcall/{}", made++);
  return std::make_shared<ProcessGroupTransport>(std::move(group), device, timeout,
                                                 std::move(store), std::move(board));
}

}  // namespace gradcomp::torch
