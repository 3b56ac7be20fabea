// The Open MPI backend: a private duplicate of MPI_COMM_WORLD (our traffic never matches the
// application's own MPI calls). Each transport is a channel of the Driver it shares with the
// transports split from it (mpi_driver.h): its collectives are started non-blocking, in issue
// order, by the driver's one thread, and polled to completion against the timeout.
#include <fmt/format.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "gradcomp/error.h"
#include "transport/backends.h"
#include "transport/mpi_driver.h"
#include "transport/mpi_runtime.h"

namespace gradcomp {
namespace {

using mpi::Clock;

// MPI counts are int: larger collectives are split (allreduce, broadcast) or refused.
constexpr size_t kMaxCount = INT_MAX;

// MPI wants a valid address even for zero bytes; an empty span may hold a null pointer. Input
// and output get different ones: Open MPI's non-blocking collectives (libnbc) take sendbuf ==
// recvbuf as MPI_IN_PLACE, and a rank that ran an alltoallv with nothing to send or receive in
// place while the others did not left messages unmatched, so a later collective hung.
std::byte g_empty_input[1];
std::byte g_empty_output[1];
const std::byte* mpi_address(std::span<const std::byte> s) {
  return s.empty() ? g_empty_input : s.data();
}
std::byte* mpi_address(std::span<std::byte> s) { return s.empty() ? g_empty_output : s.data(); }

int to_int(size_t value, const char* op, const char* what) {
  if (value > kMaxCount) {
    throw Error(
        fmt::format("mpi: {} {} of {} bytes exceeds the {} bytes MPI can address in one "
                    "call; split the buffer",
                    op, what, value, kMaxCount));
  }
  return static_cast<int>(value);
}

// The start function (DriverWork::start) of a collective of one MPI call: `call(request)`
// makes it and returns MPI's code.
template <typename Call>
auto one_call(Call call) {
  return [call = std::move(call), called = false](MPI_Request* request, int* rc) mutable {
    if (called) return false;
    called = true;
    *rc = call(request);
    return true;
  };
}

// The start function of a collective over `total` elements in calls of at most INT_MAX each
// (reduction and broadcast are element-wise, so splitting is exact): `call(offset, count,
// request)`. Every rank has the same total, so the same calls.
template <typename Call>
auto chunked_calls(size_t total, Call call) {
  return [call = std::move(call), total, next = size_t{0}, called = false](MPI_Request* request,
                                                                           int* rc) mutable {
    if (called && next >= total) return false;
    called = true;
    const size_t count = std::min(total - next, kMaxCount);
    *rc = call(next, static_cast<int>(count), request);
    next += count;
    return true;
  };
}

// Counts and displacements of a v-collective, as MPI's int arrays.
struct Layout {
  std::vector<int> counts, displs;
};

// Layouts kept from call to call, so a v-collective allocates nothing once the pool holds as
// many as are ever queued at once. A queued operation holds its layout as a PooledLayout, which
// gives it back when the operation is destroyed.
class LayoutPool {
 public:
  struct GiveBack {
    LayoutPool* pool;
    void operator()(Layout* l) const { pool->give(l); }
  };
  using PooledLayout = std::unique_ptr<Layout, GiveBack>;

  // The layout of `counts` (converted to ints, with their displacements); throws Error naming
  // `op` and `what` when one does not fit an int.
  PooledLayout make(std::span<const size_t> counts, const char* op, const char* what) {
    PooledLayout l = take();
    size_t offset = 0;
    for (size_t c : counts) {
      l->counts.push_back(to_int(c, op, what));
      l->displs.push_back(to_int(offset, op, "displacement"));
      offset += c;
    }
    return l;
  }

 private:
  PooledLayout take() {
    std::lock_guard lock(mutex_);
    if (free_.empty()) return PooledLayout(new Layout, GiveBack{this});
    PooledLayout l(free_.back().release(), GiveBack{this});
    free_.pop_back();
    return l;
  }
  void give(Layout* l) {
    l->counts.clear();
    l->displs.clear();
    std::lock_guard lock(mutex_);
    free_.emplace_back(l);
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<Layout>> free_;
};

// Owns the communicator; outlives the channel that uses it (declared before it).
class Comm {
 public:
  explicit Comm(MPI_Comm comm) : comm_(comm) {}
  ~Comm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A timed-out request still refers to the communicator; freeing it could block or crash.
    if (finalized || abandoned_ || comm_ == MPI_COMM_NULL) return;
    auto guard = mpi::lock();
    MPI_Comm_free(&comm_);
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  MPI_Comm get() const { return comm_; }
  void abandon() {
    abandoned_ = true;
    mpi::note_abandoned();
  }

 private:
  MPI_Comm comm_;
  std::atomic<bool> abandoned_{false};
};

int comm_query(int (*query)(MPI_Comm, int*), MPI_Comm comm, const char* what) {
  int value = 0;
  auto guard = mpi::lock();
  mpi::check(query(comm, &value), what);
  return value;
}

class MpiTransport final : public Transport {
 public:
  MpiTransport(MPI_Comm comm, Milliseconds timeout, std::shared_ptr<mpi::Driver> driver)
      : comm_(comm),
        rank_(comm_query(MPI_Comm_rank, comm, "MPI_Comm_rank")),
        size_(comm_query(MPI_Comm_size, comm, "MPI_Comm_size")),
        timeout_(timeout),
        channel_(std::move(driver), rank_, size_) {}
  ~MpiTransport() override {
    channel_.close();
    if (channel_.failed()) comm_.abandon();
  }

  std::string name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<Transport> split(int color, int key) override;
  bool drain(Milliseconds timeout) override { return channel_.drain(timeout); }

 protected:
  WorkPtr start_allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) override;
  WorkPtr start_allgather(std::span<const std::byte> in, std::span<std::byte> out) override;
  WorkPtr start_allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                           std::span<const size_t> counts) override;
  WorkPtr start_alltoall(std::span<const std::byte> in, std::span<std::byte> out) override;
  WorkPtr start_alltoallv(std::span<const std::byte> in, std::span<const size_t> in_counts,
                          std::span<std::byte> out, std::span<const size_t> out_counts) override;
  WorkPtr start_broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout) override;
  WorkPtr start_barrier() override;

 private:
  // Queues a collective of `bytes` (named `op` in errors), bounded by the transport's timeout.
  template <typename Start>
  WorkPtr submit(const char* op, size_t bytes, Start start) {
    return channel_.submit(op, bytes, timeout_, std::move(start));
  }
  MPI_Comm comm() const { return comm_.get(); }

  Comm comm_;
  int rank_, size_;
  Milliseconds timeout_;
  LayoutPool layouts_;    // before the channel: its collectives give their layouts back to it
  mpi::Channel channel_;  // last: closed before the communicator is freed
};

WorkPtr MpiTransport::start_allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) {
  const MPI_Datatype element = mpi::element_type(type);
  const MPI_Op mpi_op = mpi::reduce_op(type, op);
  const size_t width = dtype_size(type);
  return submit("allreduce", buffer.size(),
                chunked_calls(buffer.size() / width, [this, buffer, element, mpi_op, width](
                                                         size_t offset, int count, MPI_Request* r) {
                  return MPI_Iallreduce(MPI_IN_PLACE, mpi_address(buffer.subspan(offset * width)),
                                        count, element, mpi_op, comm(), r);
                }));
}

WorkPtr MpiTransport::start_allgather(std::span<const std::byte> in, std::span<std::byte> out) {
  const int n = to_int(in.size(), "allgather", "input");
  to_int(out.size(), "allgather", "output");  // displacements are ints too
  return submit("allgather", out.size(), one_call([this, in, out, n](MPI_Request* r) {
                  return MPI_Iallgather(mpi_address(in), n, MPI_BYTE, mpi_address(out), n, MPI_BYTE,
                                        comm(), r);
                }));
}

WorkPtr MpiTransport::start_allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                                       std::span<const size_t> counts) {
  auto l = layouts_.make(counts, "allgatherv", "count");
  return submit("allgatherv", out.size(),
                one_call([this, in, out, l = std::move(l)](MPI_Request* r) {
                  return MPI_Iallgatherv(mpi_address(in), static_cast<int>(in.size()), MPI_BYTE,
                                         mpi_address(out), l->counts.data(), l->displs.data(),
                                         MPI_BYTE, comm(), r);
                }));
}

WorkPtr MpiTransport::start_alltoall(std::span<const std::byte> in, std::span<std::byte> out) {
  const int block = to_int(in.size() / static_cast<size_t>(size_), "alltoall", "block");
  to_int(in.size(), "alltoall", "input");
  return submit("alltoall", in.size(), one_call([this, in, out, block](MPI_Request* r) {
                  return MPI_Ialltoall(mpi_address(in), block, MPI_BYTE, mpi_address(out), block,
                                       MPI_BYTE, comm(), r);
                }));
}

WorkPtr MpiTransport::start_alltoallv(std::span<const std::byte> in,
                                      std::span<const size_t> in_counts, std::span<std::byte> out,
                                      std::span<const size_t> out_counts) {
  auto send = layouts_.make(in_counts, "alltoallv", "in_counts entry");
  auto recv = layouts_.make(out_counts, "alltoallv", "out_counts entry");
  return submit(
      "alltoallv", in.size() + out.size(),
      one_call([this, in, out, send = std::move(send), recv = std::move(recv)](MPI_Request* r) {
        return MPI_Ialltoallv(mpi_address(in), send->counts.data(), send->displs.data(), MPI_BYTE,
                              mpi_address(out), recv->counts.data(), recv->displs.data(), MPI_BYTE,
                              comm(), r);
      }));
}

WorkPtr MpiTransport::start_broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout) {
  return channel_.submit(
      "broadcast", buffer.size(), timeout,
      chunked_calls(buffer.size(), [this, buffer, root](size_t offset, int count, MPI_Request* r) {
        return MPI_Ibcast(mpi_address(buffer.subspan(offset)), count, MPI_BYTE, root, comm(), r);
      }));
}

WorkPtr MpiTransport::start_barrier() {
  return submit("barrier", 0, one_call([this](MPI_Request* r) { return MPI_Ibarrier(comm(), r); }));
}

std::unique_ptr<Transport> MpiTransport::split(int color, int key) {
  MPI_Comm result = MPI_COMM_NULL;
  mpi::SplitTurn turn;  // one split at a time under MPI_THREAD_SERIALIZED (mpi_runtime.h)
  // MPI_Comm_split blocks without a timeout: a barrier first (in order with the channel's
  // collectives) turns a dead peer into a TimeoutError instead of a hang. The split itself runs
  // on this thread while the channel starts nothing else: on the driver's it would stall every
  // other communicator's collectives, and two splits issued in different orders on different
  // ranks would wait for each other for ever.
  try {
    channel_.exclusive(
        "split", timeout_, 2 * timeout_,  // the barrier's own deadline comes first
        one_call([this](MPI_Request* r) { return MPI_Ibarrier(comm(), r); }), [&] {
          auto guard = mpi::lock();
          mpi::check(MPI_Comm_split(comm(), color < 0 ? MPI_UNDEFINED : color, key, &result),
                     "MPI_Comm_split");
          if (result != MPI_COMM_NULL) MPI_Comm_set_errhandler(result, MPI_ERRORS_RETURN);
        });
  } catch (const TimeoutError& e) {
    if (!mpi::serialized()) throw;
    throw TimeoutError(fmt::format(
        "{} (MPI runs at MPI_THREAD_SERIALIZED, where a process splits one communicator at a "
        "time: splits made from several threads at once wait for each other, and ranks whose "
        "threads came in different orders time out; split from one thread, or initialise MPI "
        "with MPI_THREAD_MULTIPLE)",
        e.what()));
  }
  turn.done();
  if (result == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiTransport>(result, timeout_, channel_.driver());
}

// MPI_Comm_dup is collective and blocking; its non-blocking twin lets a missing peer surface
// as a TimeoutError at start-up.
MPI_Comm duplicate_world(Milliseconds timeout) {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  {
    auto guard = mpi::lock();
    mpi::check(MPI_Comm_idup(MPI_COMM_WORLD, &comm, &request), "MPI_Comm_idup");
  }
  mpi::wait(request, Clock::now() + timeout, timeout, {.op = "start-up (MPI_Comm_idup)"});
  auto guard = mpi::lock();
  // Errors come back as codes (CommError) instead of aborting the job.
  mpi::check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  return comm;
}

void check_expected(const char* what, int expected, int actual, const char* source) {
  if (expected >= 0 && expected != actual) {
    throw Error(
        fmt::format("mpi: the options ask for {} {}, but MPI says {} ({}); leave it at "
                    "-1 to take MPI's, or launch with a matching mpirun",
                    what, expected, actual, source));
  }
}

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options, const LaunchInfo&) {
  mpi::ensure_initialized();
  auto transport = std::make_unique<MpiTransport>(duplicate_world(options.timeout), options.timeout,
                                                  std::make_shared<mpi::Driver>());
  check_expected("rank", options.rank, transport->rank(), "MPI_Comm_rank");
  check_expected("world size", options.world_size, transport->size(), "MPI_Comm_size");
  return transport;
}

}  // namespace gradcomp
