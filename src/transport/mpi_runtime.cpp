#include "transport/mpi_runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <thread>

#include "common/reduce.h"
#include "gradcomp/error.h"
#include "transport/seconds_text.h"

namespace gradcomp::mpi {
namespace {

std::mutex g_mpi_mutex;
std::atomic<bool> g_serialize{true};   // false once we know MPI_THREAD_MULTIPLE is provided
std::atomic<bool> g_abandoned{false};  // a request was left pending (timeout)

constexpr int kTypes = 7;  // DType values, kNone included
constexpr int kOps = 2;    // ReduceOp values
std::array<MPI_Op, kTypes * kOps> g_ops = [] {
  std::array<MPI_Op, kTypes * kOps> ops;
  ops.fill(MPI_OP_NULL);
  return ops;
}();

template <DType Type, ReduceOp Op>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  // MPI's contract: inout[i] = in[i] (op) inout[i]; our kernels are commutative.
  reduce_into(inout, in, static_cast<size_t>(*len), Type, Op);
}

template <DType Type>
void create_ops() {
  const int base = static_cast<int>(Type) * kOps;
  check(MPI_Op_create(&user_reduce<Type, ReduceOp::kSum>, 1, &g_ops[base]), "MPI_Op_create");
  check(MPI_Op_create(&user_reduce<Type, ReduceOp::kMax>, 1, &g_ops[base + 1]), "MPI_Op_create");
}

void create_all_ops() {
  create_ops<DType::kF32>();
  create_ops<DType::kF16>();
  create_ops<DType::kBF16>();
  create_ops<DType::kI8>();
  create_ops<DType::kU8>();
  create_ops<DType::kI32>();
}

// Registered with atexit when we initialised MPI, so it runs on the thread that called exit()
// (the main thread, which also initialised MPI, as MPI asks).
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || g_abandoned.load()) return;
  for (MPI_Op& op : g_ops) {
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  }
  MPI_Finalize();
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    default:
      return "MPI_THREAD_MULTIPLE";
  }
}

// Returns the thread level MPI provides, initialising it if needed.
int initialize_once() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    throw Error(
        "mpi: MPI has already been finalised in this process; a transport needs it "
        "running (create transports before MPI_Finalize)");
  }
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    throw Error(
        fmt::format("mpi: MPI runs at thread level {}; gradcomp calls MPI from its own "
                    "communication threads and needs MPI_THREAD_SERIALIZED or "
                    "MPI_THREAD_MULTIPLE (initialise MPI with MPI_Init_thread)",
                    thread_level_name(provided)));
  }
  return provided;
}

}  // namespace

void ensure_initialized() {
  static std::once_flag once;
  // call_once retries after an exception, so a failed start is reported again, not hidden.
  std::call_once(once, [] {
    const int provided = initialize_once();
    g_serialize = provided < MPI_THREAD_MULTIPLE;
    auto guard = lock();
    create_all_ops();
  });
}

bool serialized() { return g_serialize.load(std::memory_order_relaxed); }

namespace {
struct SplitTurns {
  std::mutex mutex;
  std::condition_variable ended;
  bool busy = false;      // a split holds the turn
  uint64_t failures = 0;  // splits that ended without done()
};
SplitTurns& split_turns() {
  static SplitTurns turns;
  return turns;
}
}  // namespace

SplitTurn::SplitTurn() {
  if (!serialized()) return;
  SplitTurns& turns = split_turns();
  std::unique_lock lock(turns.mutex);
  const uint64_t failures = turns.failures;
  turns.ended.wait(lock, [&] { return !turns.busy; });
  if (turns.failures != failures) {
    throw Error(
        "mpi: another split of this process failed while this one waited for its turn; not "
        "started, so that no rank waits in it (MPI runs at MPI_THREAD_SERIALIZED, where a "
        "process splits one communicator at a time: split from one thread, or initialise MPI "
        "with MPI_THREAD_MULTIPLE)");
  }
  turns.busy = held_ = true;
}

SplitTurn::~SplitTurn() {
  if (!held_) return;
  SplitTurns& turns = split_turns();
  {
    std::lock_guard lock(turns.mutex);
    turns.busy = false;
    if (!done_) ++turns.failures;
  }
  turns.ended.notify_all();
}

std::unique_lock<std::mutex> lock() {
  if (!g_serialize.load(std::memory_order_relaxed)) return {};
  return std::unique_lock(g_mpi_mutex);
}

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw CommError(fmt::format("mpi: {} failed: {}", what, std::string_view(text, length)));
}

MPI_Datatype element_type(DType type) {
  switch (type) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kF16:
    case DType::kBF16:
      return MPI_UINT16_T;  // bits only: our operator interprets them
    case DType::kI8:
      return MPI_INT8_T;
    case DType::kU8:
      return MPI_UINT8_T;
    case DType::kNone:
      break;
  }
  throw Error("mpi: allreduce needs an element type (f32, f16, bf16, i8, u8 or i32)");
}

MPI_Op reduce_op(DType type, ReduceOp op) {
  return g_ops[static_cast<size_t>(type) * kOps + (op == ReduceOp::kSum ? 0 : 1)];
}

std::string WaitLabel::text() const {
  if (rank < 0) return op;
  return fmt::format("{} of {} bytes (rank {} of {})", op, bytes, rank, size);
}

void wait(MPI_Request& request, Clock::time_point deadline, Milliseconds timeout,
          const WaitLabel& what) {
  using std::chrono::microseconds;
  // Spin first, yielding the core between polls: a small collective over TCP takes tens of
  // microseconds, and a first sleep would cost far more (sleep_for rounds up to ~60 us of timer
  // slack; measured: 1-float allreduce ~40 us with a 250 us spin, ~300 us with a 30 us one).
  // Then sleep, doubling up to a cap that rises once the wait is long, so a rank waiting on a
  // slow peer costs a few percent of a core. Open MPI only advances a non-blocking collective
  // inside MPI calls, so the cap also bounds how long a busy transfer stalls between polls.
  const auto start = Clock::now();
  const auto spin_until = start + kPollSpin;
  microseconds sleep{1};
  for (;;) {
    int flag = 0;
    int rc;
    {
      auto guard = lock();
      rc = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) {
      note_abandoned();
      check(rc, what.text().c_str());
    }
    if (flag) return;
    const auto now = Clock::now();
    if (now >= deadline) {
      note_abandoned();
      std::rethrow_exception(timeout_error(what, timeout));
    }
    if (now < spin_until) {
      std::this_thread::yield();  // other ranks may share this core (oversubscribed jobs)
      continue;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, now - start < kPollLongWait ? kPollShortCap : kPollLongCap);
  }
}

std::exception_ptr comm_error(int rc, const WaitLabel& what) {
  try {
    check(rc, what.text().c_str());
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

std::exception_ptr timeout_error(const WaitLabel& what, Milliseconds timeout) {
  return std::make_exception_ptr(
      TimeoutError(fmt::format("mpi: {} did not finish within {} s; a peer may have died or "
                               "stopped (GRADCOMP_TIMEOUT)",
                               what.text(), seconds_text(timeout))));
}

void note_abandoned() { g_abandoned = true; }

}  // namespace gradcomp::mpi
