// The process-wide side of the MPI backend: initialising (and finalising) MPI, serialising MPI
// calls when the library gives less than MPI_THREAD_MULTIPLE, the reduction operators, and
// waiting for a request with a deadline.
#pragma once

// Only the C API: Open MPI's deprecated C++ bindings would need their own library.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <mutex>
#include <string_view>

#include "gradcomp/transport.h"

namespace gradcomp::mpi {

using Clock = std::chrono::steady_clock;

// Initialises MPI unless the application already did (then finalises it at exit), and checks
// the thread level: our calls come from the transports' own threads, so at least
// MPI_THREAD_SERIALIZED is needed. Throws Error when MPI cannot serve us. Idempotent.
void ensure_initialized();

// Held around every MPI call. With MPI_THREAD_MULTIPLE it holds nothing; with SERIALIZED it
// serialises our threads (each family of communicators has its driver thread, and a split makes
// its blocking call on the caller's).
std::unique_lock<std::mutex> lock();

// Whether MPI gives less than MPI_THREAD_MULTIPLE, so that lock() serialises our calls.
bool serialized();

// A split's turn, from its barrier to its end: under MPI_THREAD_SERIALIZED the splits of this
// process run one at a time (with MULTIPLE it holds nothing). There the blocking
// MPI_Comm_split holds lock() until every rank has joined it, so two splits overlapping in one
// process would deadlock against a rank whose threads came the other way round: each would sit
// in the split the other rank holds back. One at a time, that race is a split's TimeoutError.
// A split that waited for its turn while the one before failed is refused (Error) rather than
// started: the failed one's barrier stays pending in MPI, another rank's next barrier could be
// paired with it, and that rank would then wait in a split that this rank never makes.
class SplitTurn {
 public:
  SplitTurn();   // waits for the turn; throws Error as above
  ~SplitTurn();  // ends it: failed unless done() was called
  SplitTurn(const SplitTurn&) = delete;
  SplitTurn& operator=(const SplitTurn&) = delete;
  void done() { done_ = true; }

 private:
  bool held_ = false;
  bool done_ = false;
};

// Throws CommError "mpi: <what> failed: <MPI's message>" when rc is not MPI_SUCCESS.
void check(int rc, const char* what);

// The MPI element type and operator for an allreduce of `type` with `op`. The operators are
// our own (half_reduce.h), so every backend reduces to the same bits.
MPI_Datatype element_type(DType type);
MPI_Op reduce_op(DType type, ReduceOp op);

// What a wait is for, put into words only when it fails: formatting it for every collective
// would cost an allocation each.
struct WaitLabel {
  const char* op;  // "allreduce", "start-up (MPI_Comm_idup)"
  size_t bytes = 0;
  int rank = -1;  // -1: not a collective of a communicator yet (bytes and size unused)
  int size = 0;
  std::string text() const;
};

// How waits poll (wait() and the Driver's loop): spin for kPollSpin, yielding the core between
// polls (small collectives finish there), then sleep, doubling up to kPollShortCap, or
// kPollLongCap once the wait is older than kPollLongWait.
inline constexpr std::chrono::microseconds kPollSpin{250};
inline constexpr std::chrono::microseconds kPollShortCap{200};
inline constexpr std::chrono::microseconds kPollLongCap{500};
inline constexpr std::chrono::milliseconds kPollLongWait{20};

// Polls `request` until it completes: spins for a few microseconds (small collectives finish
// there), then sleeps a growing interval up to a cap, so a rank waiting on a slow peer costs
// little CPU. Throws TimeoutError naming `what` (the operation, its bytes and this rank) at
// `deadline`, or CommError if MPI reports an error; the request is then abandoned (a
// collective request cannot be cancelled), which note_abandoned() records.
void wait(MPI_Request& request, Clock::time_point deadline, Milliseconds timeout,
          const WaitLabel& what);

// The error of a collective that MPI failed with `rc`, or that outlived `timeout`.
std::exception_ptr comm_error(int rc, const WaitLabel& what);
std::exception_ptr timeout_error(const WaitLabel& what, Milliseconds timeout);

// Once a request was abandoned, MPI_Finalize at exit could wait forever for a dead peer, so
// it is skipped (the job is failing anyway).
void note_abandoned();

}  // namespace gradcomp::mpi
