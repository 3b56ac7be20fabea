// The Open MPI backend: a private duplicate of MPI_COMM_WORLD (our traffic never matches the
// application's own MPI calls), collectives started non-blocking on the transport's OpQueue
// thread and polled to completion against the transport's timeout (mpi_runtime.h).
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
#include "transport/mpi_runtime.h"
#include "gradcomp/op_queue.h"

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

// Owns the communicator; outlives the OpQueue thread that uses it (declared before it).
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
  MpiTransport(MPI_Comm comm, Milliseconds timeout)
      : comm_(comm),
        rank_(comm_query(MPI_Comm_rank, comm, "MPI_Comm_rank")),
        size_(comm_query(MPI_Comm_size, comm, "MPI_Comm_size")),
        timeout_(timeout) {}

  std::string name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<Transport> split(int color, int key) override;
  bool drain(Milliseconds timeout) override { return queue_.drain(timeout); }

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
  // Starts one non-blocking MPI call (under the MPI lock) and waits for it until `deadline`,
  // which is `timeout` (the transport's unless given) after the collective started.
  template <typename Start>
  void run(const char* op, size_t bytes, Clock::time_point deadline, Start start) {
    run(op, bytes, deadline, timeout_, start);
  }
  template <typename Start>
  void run(const char* op, size_t bytes, Clock::time_point deadline, Milliseconds timeout,
           Start start) {
    MPI_Request request = MPI_REQUEST_NULL;
    {
      auto guard = mpi::lock();
      mpi::check(start(&request), op);
    }
    try {
      mpi::wait(request, deadline, timeout,
                {.op = op, .bytes = bytes, .rank = rank_, .size = size_});
    } catch (...) {
      comm_.abandon();
      throw;
    }
  }
  // Queues `body(deadline)`; the deadline starts when the collective starts, not when queued.
  template <typename Body>
  WorkPtr submit(Body body) {
    return submit(timeout_, std::move(body));
  }
  template <typename Body>
  WorkPtr submit(Milliseconds timeout, Body body) {
    return queue_.submit(
        [timeout, body = std::move(body)]() mutable { body(Clock::now() + timeout); });
  }
  MPI_Comm comm() const { return comm_.get(); }

  Comm comm_;
  int rank_, size_;
  Milliseconds timeout_;
  LayoutPool layouts_;    // before the queue: its operations give their layouts back to it
  OpQueue queue_{"mpi"};  // last: its thread stops before the communicator is freed
};

WorkPtr MpiTransport::start_allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) {
  const MPI_Datatype element = mpi::element_type(type);
  const MPI_Op mpi_op = mpi::reduce_op(type, op);
  const size_t width = dtype_size(type);
  return submit([this, buffer, element, mpi_op, width](Clock::time_point deadline) {
    // Chunks of at most INT_MAX elements: reduction is element-wise, so splitting is exact.
    const size_t total = buffer.size() / width;
    size_t done = 0;
    do {
      const size_t count = std::min(total - done, kMaxCount);
      run("allreduce", buffer.size(), deadline, [&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, mpi_address(buffer.subspan(done * width)),
                              static_cast<int>(count), element, mpi_op, comm(), r);
      });
      done += count;
    } while (done < total);
  });
}

WorkPtr MpiTransport::start_allgather(std::span<const std::byte> in, std::span<std::byte> out) {
  const int n = to_int(in.size(), "allgather", "input");
  to_int(out.size(), "allgather", "output");  // displacements are ints too
  return submit([this, in, out, n](Clock::time_point deadline) {
    run("allgather", out.size(), deadline, [&](MPI_Request* r) {
      return MPI_Iallgather(mpi_address(in), n, MPI_BYTE, mpi_address(out), n, MPI_BYTE, comm(), r);
    });
  });
}

WorkPtr MpiTransport::start_allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                                       std::span<const size_t> counts) {
  auto l = layouts_.make(counts, "allgatherv", "count");
  return submit([this, in, out, l = std::move(l)](Clock::time_point deadline) {
    run("allgatherv", out.size(), deadline, [&](MPI_Request* r) {
      return MPI_Iallgatherv(mpi_address(in), static_cast<int>(in.size()), MPI_BYTE,
                             mpi_address(out), l->counts.data(), l->displs.data(), MPI_BYTE, comm(),
                             r);
    });
  });
}

WorkPtr MpiTransport::start_alltoall(std::span<const std::byte> in, std::span<std::byte> out) {
  const int block = to_int(in.size() / static_cast<size_t>(size_), "alltoall", "block");
  to_int(in.size(), "alltoall", "input");
  return submit([this, in, out, block](Clock::time_point deadline) {
    run("alltoall", in.size(), deadline, [&](MPI_Request* r) {
      return MPI_Ialltoall(mpi_address(in), block, MPI_BYTE, mpi_address(out), block, MPI_BYTE,
                           comm(), r);
    });
  });
}

WorkPtr MpiTransport::start_alltoallv(std::span<const std::byte> in,
                                      std::span<const size_t> in_counts, std::span<std::byte> out,
                                      std::span<const size_t> out_counts) {
  auto send = layouts_.make(in_counts, "alltoallv", "in_counts entry");
  auto recv = layouts_.make(out_counts, "alltoallv", "out_counts entry");
  return submit(
      [this, in, out, send = std::move(send), recv = std::move(recv)](Clock::time_point deadline) {
        run("alltoallv", in.size() + out.size(), deadline, [&](MPI_Request* r) {
          return MPI_Ialltoallv(mpi_address(in), send->counts.data(), send->displs.data(), MPI_BYTE,
                                mpi_address(out), recv->counts.data(), recv->displs.data(),
                                MPI_BYTE, comm(), r);
        });
      });
}

WorkPtr MpiTransport::start_broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout) {
  return submit(timeout, [this, buffer, root, timeout](Clock::time_point deadline) {
    size_t done = 0;
    do {  // chunks of at most INT_MAX bytes; every rank has the same size, so the same chunks
      const size_t count = std::min(buffer.size() - done, kMaxCount);
      run("broadcast", buffer.size(), deadline, timeout, [&](MPI_Request* r) {
        return MPI_Ibcast(mpi_address(buffer.subspan(done)), static_cast<int>(count), MPI_BYTE,
                          root, comm(), r);
      });
      done += count;
    } while (done < buffer.size());
  });
}

WorkPtr MpiTransport::start_barrier() {
  return submit([this](Clock::time_point deadline) {
    run("barrier", 0, deadline, [&](MPI_Request* r) { return MPI_Ibarrier(comm(), r); });
  });
}

std::unique_ptr<Transport> MpiTransport::split(int color, int key) {
  // Shared with the queued op, which may outlive this call if the wait below times out.
  auto result = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  queue_.call(
      [this, color, key, result] {
        const auto deadline = Clock::now() + timeout_;
        // MPI_Comm_split blocks without a timeout; a barrier first turns a dead peer into a
        // TimeoutError instead of a hang.
        run("split", 0, deadline, [&](MPI_Request* r) { return MPI_Ibarrier(comm(), r); });
        auto guard = mpi::lock();
        mpi::check(MPI_Comm_split(comm(), color < 0 ? MPI_UNDEFINED : color, key, result.get()),
                   "MPI_Comm_split");
        if (*result != MPI_COMM_NULL) MPI_Comm_set_errhandler(*result, MPI_ERRORS_RETURN);
      },
      2 * timeout_);  // the barrier's own deadline comes first; this only bounds the queue
  if (*result == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiTransport>(*result, timeout_);
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
  auto transport =
      std::make_unique<MpiTransport>(duplicate_world(options.timeout), options.timeout);
  check_expected("rank", options.rank, transport->rank(), "MPI_Comm_rank");
  check_expected("world size", options.world_size, transport->size(), "MPI_Comm_size");
  return transport;
}

}  // namespace gradcomp
