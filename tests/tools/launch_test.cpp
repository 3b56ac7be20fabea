// `gradcomp launch`, run as a user would: the environment it gives the ranks, and what happens
// when a rank fails.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/run_cli.h"

namespace {

using Clock = std::chrono::steady_clock;

using Result = gradcomp::testing::CliResult;
using gradcomp::testing::run_cli;

TEST(Launch, GivesEveryRankTorchrunsEnvironment) {
  const Result r = run_cli(
      "launch -n 3 --master-port 29123 --timeout 7 -- sh -c "
      "'echo env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR "
      "$MASTER_PORT $GRADCOMP_TIMEOUT'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::set<std::string> lines;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);) lines.insert(line);
  for (int rank = 0; rank < 3; ++rank) {
    const std::string expected =
        "env " + std::to_string(rank) + " 3 " + std::to_string(rank) + " 3 0 127.0.0.1 29123 7";
    EXPECT_TRUE(lines.contains(expected)) << expected << "\n" << r.output;
  }
}

// torchrun's spelling of the rank count works too, so a torchrun command line carries over.
TEST(Launch, AcceptsTorchrunsNprocPerNode) {
  for (const char* flag : {"--nproc_per_node 2", "--nproc_per_node=2", "--nproc-per-node 2"}) {
    const Result r = run_cli(std::string("launch ") + flag + " -- sh -c 'echo size $WORLD_SIZE'");
    ASSERT_EQ(r.exit_code, 0) << flag << ": " << r.output;
    EXPECT_NE(r.output.find("size 2"), std::string::npos) << flag << ": " << r.output;
  }
}

TEST(Launch, DefaultsAndInheritedVariables) {
  const Result r = run_cli("launch -n 1 -- sh -c 'echo $MASTER_ADDR:$MASTER_PORT $HOME'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("127.0.0.1:29500 " + std::string(getenv("HOME"))), std::string::npos)
      << r.output;
}

// Ranks sharing the machine get one OpenMP/BLAS thread each, as under torchrun, unless the
// user chose a count; a single rank keeps the machine's default. The notice says so once.
TEST(Launch, OneOpenMpThreadPerRankUnlessTheUserChose) {
  const char* inherited = std::getenv("OMP_NUM_THREADS");
  const std::string saved = inherited ? inherited : "";
  ::unsetenv("OMP_NUM_THREADS");
  const Result two = run_cli("launch -n 2 -- sh -c 'echo threads=$OMP_NUM_THREADS.'");
  const Result one = run_cli("launch -n 1 -- sh -c 'echo threads=$OMP_NUM_THREADS.'");
  ::setenv("OMP_NUM_THREADS", "3", 1);
  const Result chosen = run_cli("launch -n 2 -- sh -c 'echo threads=$OMP_NUM_THREADS.'");
  if (inherited)
    ::setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  else
    ::unsetenv("OMP_NUM_THREADS");

  const auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_EQ(count(two.output, "threads=1."), 2u) << two.output;
  EXPECT_EQ(count(two.output, "OMP_NUM_THREADS=1 for each of the 2 ranks"), 1u) << two.output;
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(count(one.output, "threads=."), 1u) << one.output;
  EXPECT_EQ(count(one.output, "OMP_NUM_THREADS=1 for each"), 0u) << one.output;
  ASSERT_EQ(chosen.exit_code, 0) << chosen.output;
  EXPECT_EQ(count(chosen.output, "threads=3."), 2u) << chosen.output;
  EXPECT_EQ(count(chosen.output, "OMP_NUM_THREADS=1 for each"), 0u) << chosen.output;
}

TEST(Launch, FailingRankStopsTheOthersAndItsCodeIsReturned) {
  const auto start = Clock::now();
  const Result r = run_cli("launch -n 3 -- sh -c 'if [ $RANK = 1 ]; then exit 3; fi; sleep 60'");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

TEST(Launch, SurvivorsGetTimeToReportTheirOwnError) {
  const auto start = Clock::now();
  const Result r = run_cli(
      "launch -n 2 --notice 20 -- sh -c "
      "'if [ $RANK = 0 ]; then exit 3; fi; sleep 0.5; echo rank 1 saw the failure; exit 1'");
  EXPECT_EQ(r.exit_code, 3) << r.output;  // the first failure decides
  EXPECT_NE(r.output.find("rank 1 saw the failure"), std::string::npos) << r.output;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));  // not the whole notice period
}

TEST(Launch, RankKilledBySignalIsReported) {
  const Result r =
      run_cli("launch -n 2 -- sh -c 'if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60'");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("rank 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("signal 9"), std::string::npos) << r.output;
}

TEST(Launch, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  const auto start = Clock::now();
  const Result r = run_cli(
      "launch -n 2 --grace 1 -- sh -c "
      "'if [ $RANK = 0 ]; then sleep 0.5; exit 4; fi; trap \"\" TERM; sleep 60 & wait; sleep 60'");
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(1400));  // waited out the grace
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

// Waits (bounded) until `path` holds `lines` lines; returns them.
std::vector<std::string> wait_for_lines(const std::string& path, size_t lines) {
  std::vector<std::string> got;
  for (int i = 0; i < 500 && got.size() < lines; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    got.clear();
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) got.push_back(line);
  }
  return got;
}

TEST(Launch, SigtermIsForwardedAndNothingIsLeftBehind) {
  const auto pids = std::filesystem::temp_directory_path() / "gradcomp_launch_test_pids";
  std::filesystem::remove(pids);
  // Each rank records its shell and a child of it (the sleep), then waits.
  const std::string script = "sleep 60 & echo $$ $! >> " + pids.string() + "; wait";
  const pid_t launcher = ::fork();
  if (launcher == 0) {
    ::execl(GRADCOMP_CLI, GRADCOMP_CLI, "launch", "-n", "2", "--", "sh", "-c", script.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto lines = wait_for_lines(pids.string(), 2);
  ASSERT_EQ(lines.size(), 2u);
  const auto start = Clock::now();
  ::kill(launcher, SIGTERM);
  int status = 0;
  ASSERT_EQ(::waitpid(launcher, &status, 0), launcher);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(8));
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  for (const auto& line : lines) {
    std::istringstream in(line);
    for (pid_t pid; in >> pid;) {
      EXPECT_TRUE(::kill(pid, 0) != 0 && errno == ESRCH) << "process " << pid << " survived";
    }
  }
  std::filesystem::remove(pids);
}

// CLI::Range and CLI::PositiveNumber let NaN (and PositiveNumber inf) through.
TEST(Launch, NumberOptionsMustBeFiniteAndInRange) {
  const std::pair<const char*, const char*> cases[] = {
      {"--notice nan", "--notice: nan is not allowed; allowed: a finite number in 0 .. 3600"},
      {"--grace nan", "--grace: nan is not allowed"},
      {"--grace 1e9", "--grace: 1e9 is not allowed"},
      {"--timeout inf", "--timeout: inf is not allowed"},
      {"--timeout nan", "--timeout: nan is not allowed"},
      {"--master-port 70000", "--master-port"},
      {"--master-port 65535 --servers 1", "port 65536 (master port + 1); give --server-port"},
      {"--servers 1 --server-timeout nan", "--server-timeout: nan is not allowed"},
      {"--servers 1 --server-timeout 0", "--server-timeout: 0 is not allowed"},
  };
  for (const auto& [option, message] : cases) {
    const Result r = run_cli(std::string("launch -n 1 ") + option + " -- true");
    EXPECT_NE(r.exit_code, 0) << option;
    EXPECT_NE(r.output.find(message), std::string::npos) << option << ": " << r.output;
  }
}

TEST(Launch, MissingCommandIsAClearError) {
  const Result r = run_cli("launch -n 2 -- /nonexistent/program");
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_NE(r.output.find("cannot run '/nonexistent/program'"), std::string::npos) << r.output;
  const Result usage = run_cli("launch -n 2");
  EXPECT_NE(usage.exit_code, 0) << usage.output;
}

}  // namespace
