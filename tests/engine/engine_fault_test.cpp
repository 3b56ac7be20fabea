// A peer that dies or stops mid-run: the engines of the survivors fail within the timeout with
// an error naming the bucket and the phase, and never hang. Processes are started by the test
// (fork), each with a real Gloo transport over a file store.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "gradcomp/engine.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

constexpr int kWorld = 3;
constexpr int kVictim = 2;
constexpr auto kTimeout = Milliseconds(4000);

enum class Fate { kKilled, kStopped };

// The exit code of a survivor: 0 when synchronize() raised a CommError naming bucket and phase
// within the timeout (plus slack), otherwise what went wrong.
int survivor_verdict(const std::string& what, double seconds) {
  const bool named = what.find("bucket") != std::string::npos &&
                     what.find("phase") != std::string::npos;
  if (!named) return 10;
  if (seconds > 3 * kTimeout.count() / 1000.0 + 5) return 11;
  return 0;
}

// One rank: trains a few steps; the victim dies (or stops) at step 3 before its gradients.
[[noreturn]] void run_rank(int rank, const std::string& store, Fate fate,
                           const std::string& report) {
  int code = 20;
  try {
    auto transport = make_transport({.backend = "gloo", .rank = rank, .world_size = kWorld,
                                     .store = "file:" + store, .timeout = kTimeout});
    DefaultPlanSettings settings;
    settings.compressed = {.codec = "topk:ratio=0.1", .feedback = "ef", .route = "allgather"};
    settings.min_compress_elements = 1000;
    Engine engine(std::move(transport), make_default_plan({{"w", 200000}, {"b", 100}}, settings),
                  EngineOptions{.timeout = kTimeout});
    std::vector<float> w(200000, 1.0f), b(100, 1.0f);
    for (int step = 0; step < 50; ++step) {
      if (rank == kVictim && step == 3) {
        raise(fate == Fate::kKilled ? SIGKILL : SIGSTOP);
        pause();  // stopped: the parent kills it at the end
      }
      const auto start = std::chrono::steady_clock::now();
      try {
        engine.ready("w", w);
        engine.ready("b", b);
        engine.synchronize();
      } catch (const CommError& e) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                             .count();
        std::ofstream(report) << e.what() << "\n" << s << "\n";
        std::_Exit(survivor_verdict(e.what(), s));
      }
    }
    code = 21;  // the survivors never noticed
  } catch (const std::exception& e) {
    std::ofstream(report) << "unexpected: " << e.what() << "\n";
    code = 22;
  }
  std::_Exit(code);
}

void run_scenario(Fate fate) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("gradcomp_engine_fault_" + std::to_string(getpid()) +
                    (fate == Fate::kKilled ? "_kill" : "_stop"));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "store");
  std::vector<pid_t> pids;
  for (int r = 0; r < kWorld; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) run_rank(r, (dir / "store").string(), fate, (dir / std::to_string(r)).string());
    pids.push_back(pid);
  }
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kWorld; ++r) {
    if (r == kVictim) continue;
    int status = 0;
    // Bounded wait: a survivor that hangs fails the test instead of hanging it.
    for (;;) {
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) break;
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
        for (pid_t p : pids) kill(p, SIGKILL);
        FAIL() << "rank " << r << " hangs after its peer died";
      }
      usleep(20'000);
    }
    std::ifstream report(dir / std::to_string(r));
    std::string line;
    std::getline(report, line);
    std::printf("rank %d: %s\n", r, line.c_str());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " exit " << WEXITSTATUS(status) << ": " << line;
  }
  kill(pids[kVictim], SIGKILL);
  waitpid(pids[kVictim], nullptr, 0);
  std::filesystem::remove_all(dir);
}

TEST(EngineFaults, AKilledPeerIsAnErrorOnTheSurvivors) { run_scenario(Fate::kKilled); }

TEST(EngineFaults, AStoppedPeerIsATimeoutOnTheSurvivors) { run_scenario(Fate::kStopped); }

}  // namespace
}  // namespace gradcomp
