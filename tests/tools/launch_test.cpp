// `gradcomp launch`, run as a user would: the environment it gives the ranks, and what happens
// when a rank fails.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <set>
#include <sstream>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

struct Result {
  int exit_code;
  std::string output;  // stdout and stderr
};

Result run(const std::string& args) {
  const std::string command = std::string(GRADCOMP_CLI) + " " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t got = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), got);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(Launch, GivesEveryRankTorchrunsEnvironment) {
  const Result r =
      run("launch -n 3 --master-port 29123 --timeout 7 -- sh -c "
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

TEST(Launch, DefaultsAndInheritedVariables) {
  const Result r = run("launch -n 1 -- sh -c 'echo $MASTER_ADDR:$MASTER_PORT $HOME'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("127.0.0.1:29500 " + std::string(getenv("HOME"))), std::string::npos)
      << r.output;
}

TEST(Launch, FailingRankStopsTheOthersAndItsCodeIsReturned) {
  const auto start = Clock::now();
  const Result r = run("launch -n 3 -- sh -c 'if [ $RANK = 1 ]; then exit 3; fi; sleep 60'");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

TEST(Launch, RankKilledBySignalIsReported) {
  const Result r = run("launch -n 2 -- sh -c 'if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60'");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("rank 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("signal 9"), std::string::npos) << r.output;
}

TEST(Launch, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  const auto start = Clock::now();
  const Result r =
      run("launch -n 2 --grace 1 -- sh -c "
          "'if [ $RANK = 0 ]; then exit 4; fi; trap \"\" TERM; sleep 60 & wait; sleep 60'");
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

TEST(Launch, MissingCommandIsAClearError) {
  const Result r = run("launch -n 2 -- /nonexistent/program");
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_NE(r.output.find("cannot run '/nonexistent/program'"), std::string::npos) << r.output;
  const Result usage = run("launch -n 2");
  EXPECT_NE(usage.exit_code, 0) << usage.output;
}

}  // namespace
