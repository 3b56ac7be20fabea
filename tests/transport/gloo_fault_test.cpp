// The Gloo backend when peers die or stop: ranks are processes forked by the test, connected
// through a file store in a fresh directory; each child reports through its exit code, and the
// parent bounds the whole run and kills whatever is left.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gradcomp/error.h"
#include "gradcomp/transport.h"

namespace gradcomp {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = 5000ms;
// A survivor must fail within the timeout, plus slack for a loaded 2-core machine.
constexpr auto kFailBound = kTimeout + 3000ms;

// Exit codes of a child.
enum Code : int {
  kOk = 0,
  kTimedOut = 10,
  kCommFailed = 11,
  kSucceeded = 12,
  kTooSlow = 13,
  kWrong = 14,
  kOther = 15
};

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "gloo_fault_XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::unique_ptr<Transport> connect(const std::string& dir, int rank, int world) {
  TransportOptions options;
  options.backend = "gloo";
  options.rank = rank;
  options.world_size = world;
  options.store = "file:" + dir;
  options.hostname = "127.0.0.1";
  options.timeout = kTimeout;
  return make_transport(options);
}

// Forks `world` ranks running body(rank); returns their wait statuses, or fails the test (and
// kills them) when they are not all done by `limit`. Rank `stopped` is expected to stop
// itself: it is killed once the others are done.
std::vector<int> run_ranks(int world, const std::function<int(int)>& body, Clock::duration limit,
                           int stopped = -1) {
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
      if (::getppid() != parent) ::_exit(kOther);
      int code = kOther;
      try {
        code = body(rank);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: unexpected error: %s\n", rank, e.what());
      }
      std::fflush(nullptr);
      ::_exit(code);  // no atexit handlers, no gtest teardown in the child
    }
    pids.push_back(pid);
  }
  std::vector<int> status(world, -1);
  const auto deadline = Clock::now() + limit;
  int left = world;
  while (left > 0 && Clock::now() < deadline) {
    for (int r = 0; r < world; ++r) {
      int st = 0;
      if (status[r] == -1 && ::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        status[r] = st;
        --left;
      }
    }
    if (left == 1 && stopped >= 0 && status[stopped] == -1) {
      ::kill(pids[stopped], SIGKILL);
      ::waitpid(pids[stopped], &status[stopped], 0);
      --left;
    }
    if (left > 0) std::this_thread::sleep_for(20ms);  // a test's bounded poll, not a product path
  }
  for (int r = 0; r < world; ++r) {
    if (status[r] == -1 || !(WIFEXITED(status[r]) || WIFSIGNALED(status[r]))) {
      ADD_FAILURE() << "rank " << r << " did not finish in time";
      ::kill(pids[r], SIGKILL);
      ::waitpid(pids[r], &status[r], 0);
      status[r] = -1;
    }
  }
  return status;
}

int exit_code(int status) { return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

// Runs allreduces until one fails; the code says how and how fast.
int next_collective_fails(Transport& t, size_t elements) {
  std::vector<float> data(elements, 1.0f);
  for (int i = 0; i < 100; ++i) {
    const auto start = Clock::now();
    try {
      t.allreduce(std::span<float>(data))->wait(3 * kTimeout);
    } catch (const TimeoutError& e) {
      std::fprintf(stderr, "rank %d: %s\n", t.rank(), e.what());
      return Clock::now() - start < kFailBound ? kTimedOut : kTooSlow;
    } catch (const CommError& e) {
      std::fprintf(stderr, "rank %d: %s\n", t.rank(), e.what());
      return Clock::now() - start < kFailBound ? kCommFailed : kTooSlow;
    }
  }
  return kSucceeded;
}

// Every later collective fails at once with the same error: the transport is broken.
bool stays_broken(Transport& t) {
  try {
    t.barrier()->wait(1000ms);
  } catch (const CommError&) {
    return true;
  }
  return false;
}

int warm_up(Transport& t) {
  int value = t.rank() + 1;
  t.allreduce(std::as_writable_bytes(std::span<int>(&value, 1)), DType::kI32, ReduceOp::kSum)
      ->wait(kTimeout);
  const int world = t.size();
  if (value != world * (world + 1) / 2) return kWrong;
  t.barrier()->wait(kTimeout);
  return kOk;
}

// Every rank issues the same collectives (the contract): the victim dies (or stops) inside
// die(), while the survivors run allreduces of `elements` floats until one fails.
int survivor_or_victim(const std::string& dir, int rank, int victim,
                       const std::function<void(Transport&)>& die, size_t elements = 1 << 20) {
  auto t = connect(dir, rank, 3);
  if (int code = warm_up(*t); code != kOk) return code;
  if (rank == victim) {
    die(*t);
    return kOther;  // not reached: die() kills or stops this process
  }
  int code = next_collective_fails(*t, elements);
  if ((code == kTimedOut || code == kCommFailed) && !stays_broken(*t)) code = kWrong;
  return code;
}

void expect_survivors_failed(const std::vector<int>& status, int victim) {
  for (int r = 0; r < 3; ++r) {
    if (r == victim) continue;
    const int code = exit_code(status[r]);
    EXPECT_TRUE(code == kTimedOut || code == kCommFailed) << "rank " << r << " exit " << code;
  }
}

TEST(GlooFault, PeerKilledBetweenCollectives) {
  TempDir dir;
  const auto start = Clock::now();
  const auto status = run_ranks(
      3,
      [&](int rank) {
        return survivor_or_victim(dir.path(), rank, 2, [](Transport&) { ::raise(SIGKILL); });
      },
      30s);
  ASSERT_TRUE(WIFSIGNALED(status[2]) && WTERMSIG(status[2]) == SIGKILL);
  expect_survivors_failed(status, 2);
  EXPECT_LT(Clock::now() - start, 25s);
}

TEST(GlooFault, PeerKilledDuringABigAllreduce) {
  TempDir dir;
  constexpr size_t kBig = 16 << 20;  // 64 MB: still running when the kill comes
  const auto status = run_ranks(
      3,
      [&](int rank) {
        return survivor_or_victim(
            dir.path(), rank, 1,
            [](Transport& t) {
              std::thread([] {
                std::this_thread::sleep_for(30ms);
                ::raise(SIGKILL);
              }).detach();
              std::vector<float> big(kBig, 1.0f);
              for (;;) t.allreduce(std::span<float>(big))->wait(3 * kTimeout);
            },
            kBig);
      },
      30s);
  ASSERT_TRUE(WIFSIGNALED(status[1]) && WTERMSIG(status[1]) == SIGKILL);
  expect_survivors_failed(status, 1);
}

TEST(GlooFault, StoppedPeerIsATimeout) {
  TempDir dir;
  const auto status = run_ranks(
      3,
      [&](int rank) {
        return survivor_or_victim(dir.path(), rank, 0, [](Transport&) { ::raise(SIGSTOP); });
      },
      30s, /*stopped=*/0);
  expect_survivors_failed(status, 0);
  // At least one survivor waited on the stopped peer itself and saw the timeout; the other may
  // see its connection to that survivor close first.
  EXPECT_TRUE(exit_code(status[1]) == kTimedOut || exit_code(status[2]) == kTimedOut);
}

// A broadcast given a timeout of its own waits that long, past the transport's (a parameter
// server waiting for its workers' next step). (StoppedPeerIsATimeout: one without it fails.)
TEST(GlooFault, ABroadcastWaitsAsLongAsItsOwnTimeout) {
  TempDir dir;
  constexpr auto kLate = kTimeout + 2000ms;
  const auto status = run_ranks(
      2,
      [&](int rank) -> int {
        auto t = connect(dir.path(), rank, 2);
        if (int code = warm_up(*t); code != kOk) return code;
        uint64_t value = rank == 0 ? 0x5eed : 0;
        if (rank == 0) std::this_thread::sleep_for(kLate);  // the root comes late
        try {
          t->broadcast(std::as_writable_bytes(std::span(&value, 1)), 0, kLate * 3)->wait(kLate * 3);
        } catch (const TimeoutError&) {
          return kTimedOut;
        } catch (const CommError&) {
          return kCommFailed;
        }
        return value == 0x5eed ? kOk : kWrong;
      },
      40s);
  EXPECT_EQ(exit_code(status[0]), kOk);
  EXPECT_EQ(exit_code(status[1]), kOk);
}

TEST(GlooFault, SingleRankRunsEveryCollectiveAlone) {
  TempDir dir;
  auto t = connect(dir.path(), 0, 1);
  ASSERT_EQ(t->size(), 1);
  std::vector<float> x{1, 2, 3};
  t->allreduce(std::span<float>(x))->wait(kTimeout);
  EXPECT_EQ(x, (std::vector<float>{1, 2, 3}));
  std::array<std::byte, 4> in{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}}, out{};
  t->allgather(in, out)->wait(kTimeout);
  EXPECT_EQ(in, out);
  out = {};
  const size_t counts[] = {4};
  t->allgatherv(in, out, counts)->wait(kTimeout);
  EXPECT_EQ(in, out);
  out = {};
  t->alltoall(in, out)->wait(kTimeout);
  EXPECT_EQ(in, out);
  out = {};
  t->alltoallv(in, counts, out, counts)->wait(kTimeout);
  EXPECT_EQ(in, out);
  t->broadcast(out, 0)->wait(kTimeout);
  EXPECT_EQ(in, out);
  t->barrier()->wait(kTimeout);
  EXPECT_EQ(t->split(-1, 0), nullptr);
  auto alone = t->split(5, 0);
  ASSERT_NE(alone, nullptr);
  EXPECT_EQ(alone->size(), 1);
  alone->barrier()->wait(kTimeout);
}

// Every collective on 3 ranks, against what it must give (the contract test covers more).
int check_collectives(Transport& t) {
  const int r = t.rank(), w = t.size();
  std::vector<uint16_t> half(1000, 0x3c00);  // f16 1.0
  t.allreduce(std::as_writable_bytes(std::span<uint16_t>(half)), DType::kF16, ReduceOp::kSum)
      ->wait(kTimeout);
  if (half[999] != 0x4200) return kWrong;  // 3.0
  int8_t wraps = 100;
  t.allreduce(std::as_writable_bytes(std::span<int8_t>(&wraps, 1)), DType::kI8, ReduceOp::kSum)
      ->wait(kTimeout);
  if (wraps != static_cast<int8_t>(300 - 256)) return kWrong;
  float top = static_cast<float>(r);
  t.allreduce(std::span<float>(&top, 1), ReduceOp::kMax)->wait(kTimeout);
  if (top != w - 1) return kWrong;
  // allgatherv with an empty contribution from rank 1.
  std::vector<size_t> counts{3, 0, 5};
  std::vector<std::byte> mine(counts[r], std::byte(r + 1)), all(8);
  t.allgatherv(mine, all, counts)->wait(kTimeout);
  if (all[0] != std::byte{1} || all[3] != std::byte{3} || all[7] != std::byte{3}) return kWrong;
  // alltoallv: rank r sends j+1 bytes of value r to rank j.
  std::vector<size_t> in_counts{1, 2, 3}, out_counts(3, static_cast<size_t>(r + 1));
  std::vector<std::byte> in(6, std::byte(r)), out(3 * (r + 1));
  t.alltoallv(in, in_counts, out, out_counts)->wait(kTimeout);
  for (int i = 0; i < 3; ++i) {
    if (out[i * (r + 1)] != std::byte(i)) return kWrong;
  }
  std::vector<std::byte> block(3, std::byte(r)), blocks(3);
  t.alltoall(block, blocks)->wait(kTimeout);
  if (blocks[2] != std::byte{2}) return kWrong;
  std::vector<std::byte> b(16, std::byte(r == 1 ? 7 : 0));
  t.broadcast(b, 1)->wait(kTimeout);
  if (b[15] != std::byte{7}) return kWrong;
  // split: ranks 0 and 2 together, ordered by key (2 first), rank 1 out.
  auto sub = t.split(r == 1 ? -1 : 0, r == 2 ? 0 : 1);
  if (r == 1) return sub == nullptr ? kOk : kWrong;
  if (!sub || sub->size() != 2 || sub->rank() != (r == 2 ? 0 : 1)) return kWrong;
  int v = r;
  sub->allreduce(std::as_writable_bytes(std::span<int>(&v, 1)), DType::kI32, ReduceOp::kSum)
      ->wait(kTimeout);
  return v == 2 ? kOk : kWrong;
}

TEST(GlooFault, HealthyRanksRunEveryCollective) {
  TempDir dir;
  const auto status = run_ranks(
      3,
      [&](int rank) {
        auto t = connect(dir.path(), rank, 3);
        const int code = check_collectives(*t);
        t->barrier()->wait(kTimeout);
        return code;
      },
      30s);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(exit_code(status[r]), kOk) << "rank " << r;
}

// Every split connects a new group through the store; the addresses are erased once every
// member is connected, so a long job that splits again and again (plan changes, resumes) does
// not grow the store: here its directory holds as many files after 12 splits as after 2.
TEST(GlooRendezvous, SplitsLeaveNothingInTheStore) {
  TempDir dir;
  const auto files = [&] {
    return std::distance(std::filesystem::recursive_directory_iterator(dir.path()),
                         std::filesystem::recursive_directory_iterator());
  };
  const auto split_and_use = [](Transport& t, int times) {
    for (int i = 0; i < times; ++i) {
      auto half = t.split(t.rank() % 2, t.rank());
      float x = 1.0f;
      half->allreduce(std::span<float>(&x, 1))->wait(kTimeout);
      if (x != static_cast<float>(half->size())) return kWrong;
    }
    t.barrier()->wait(kTimeout);
    return kOk;
  };
  std::vector<long> counts;
  for (int round : {2, 12}) {
    const auto status = run_ranks(
        3,
        [&](int rank) {
          auto t = connect(dir.path(), rank, 3);
          return split_and_use(*t, round);
        },
        60s);
    for (int r = 0; r < 3; ++r) ASSERT_EQ(exit_code(status[r]), kOk) << "rank " << r;
    counts.push_back(static_cast<long>(files()));
    std::filesystem::remove_all(dir.path());
    std::filesystem::create_directories(dir.path());
  }
  EXPECT_EQ(counts[1], counts[0]) << "store files after 12 splits vs 2";
}

// ---- ranks started inconsistently: found by gradcomp's own rendezvous, on every rank, fast.

// A port no one listens on now (the kernel's choice), for a TCP store of this test alone.
// A port nobody listens on now, below the kernel's ephemeral range: the source ports of
// outgoing connections (other tests' Gloo meshes, running beside this one) come from that
// range, so none can take the port before rank 0's store listens on it. At random, so that
// tests side by side rarely pick the same one.
int free_port() {
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  std::random_device entropy;
  std::uniform_int_distribution<int> pick(std::max(1024, low - 12000), low - 1);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = pick(entropy);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (bound) return port;
  }
  throw std::runtime_error("no free TCP port below the ephemeral range");
}

// One process's attempt to join as `rank` of `world`: kOk when it fails with `expected` in its
// message well before the timeout, kSucceeded when it connects, else kWrong or kTooSlow.
int join_fails_with(const std::string& store, int rank, int world, const std::string& expected) {
  TransportOptions options;
  options.backend = "gloo";
  options.rank = rank;
  options.world_size = world;
  options.store = store;
  options.hostname = "127.0.0.1";
  options.timeout = kTimeout;
  const auto start = Clock::now();
  try {
    make_transport(options);
    return kSucceeded;
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d of %d: %s\n", rank, world, e.what());
    if (std::string(e.what()).find(expected) == std::string::npos) return kWrong;
    return Clock::now() - start < kTimeout / 2 ? kOk : kTooSlow;
  }
}

TEST(GlooRendezvous, WorldSizeMismatchIsReportedOnEveryRank) {
  const std::string expected = "ranks disagree on the world size (rank 0: 2, rank 1: 3)";
  const std::string tcp = "tcp://127.0.0.1:" + std::to_string(free_port());
  TempDir dir;
  for (const std::string& store : {tcp, "file:" + dir.path()}) {
    const auto status = run_ranks(
        2, [&](int rank) { return join_fails_with(store, rank, rank == 0 ? 2 : 3, expected); },
        20s);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(exit_code(status[r]), kOk) << store << " rank " << r;
  }
}

TEST(GlooRendezvous, DuplicateRankIsReportedOnEveryProcess) {
  // Three processes of a world of 3, two of them RANK=1 (and no rank 2): before, one waited
  // out the timeout and the others reported a port in use or a timeout.
  const std::string expected = "rank 1 is claimed by two processes";
  const std::string tcp = "tcp://127.0.0.1:" + std::to_string(free_port());
  TempDir dir;
  for (const std::string& store : {tcp, "file:" + dir.path()}) {
    const std::string message = expected;
    const auto status = run_ranks(
        3,
        [&](int process) {
          const int rank = process == 0 ? 0 : 1;
          return join_fails_with(store, rank, 3, message);
        },
        20s);
    for (int p = 0; p < 3; ++p) EXPECT_EQ(exit_code(status[p]), kOk) << store << " process " << p;
  }
}

TEST(GlooFault, MissingRendezvousNamesTheVariables) {
  for (const char* name : {"GRADCOMP_STORE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
  TransportOptions options;
  options.backend = "gloo";
  options.rank = 0;
  options.world_size = 2;
  try {
    make_transport(options);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("MASTER_ADDR"), std::string::npos) << what;
    EXPECT_NE(what.find("GRADCOMP_STORE"), std::string::npos) << what;
  }
  options.store = "redis://x";
  EXPECT_THROW(make_transport(options), Error);
}

}  // namespace
}  // namespace gradcomp
