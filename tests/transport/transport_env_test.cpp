// How a transport learns where it sits from the launcher's environment (torchrun, mpirun,
// gradcomp launch), and the errors make_transport gives before any backend starts. One process;
// every test starts from an environment with none of the variables set.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "gradcomp/error.h"
#include "gradcomp/transport.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::error_text;

constexpr const char* kVariables[] = {"RANK",
                                      "WORLD_SIZE",
                                      "LOCAL_RANK",
                                      "LOCAL_WORLD_SIZE",
                                      "OMPI_COMM_WORLD_RANK",
                                      "OMPI_COMM_WORLD_SIZE",
                                      "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "OMPI_COMM_WORLD_LOCAL_SIZE",
                                      "GRADCOMP_LOCAL_SIZE",
                                      "GRADCOMP_TIMEOUT",
                                      "GRADCOMP_TRANSPORT"};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Clears the launcher variables for the test and puts the originals back afterwards.
class TransportEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kVariables) {
      if (const char* value = std::getenv(name)) saved_[name] = value;
      unsetenv(name);
    }
  }
  void TearDown() override {
    for (const char* name : kVariables) unsetenv(name);
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }
  static void set(const char* name, const char* value) { setenv(name, value, 1); }

 private:
  std::map<std::string, std::string> saved_;
};

TEST_F(TransportEnv, DefaultsToOneProcess) {
  const LaunchInfo info = launch_info_from_environment();
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.local_size, 1);
  EXPECT_FALSE(info.under_mpirun);
}

TEST_F(TransportEnv, TorchrunVariables) {
  set("RANK", "5");
  set("WORLD_SIZE", "8");
  set("LOCAL_RANK", "1");
  set("LOCAL_WORLD_SIZE", "4");
  const LaunchInfo info = launch_info_from_environment();
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_size, 4);
  EXPECT_FALSE(info.under_mpirun);
}

TEST_F(TransportEnv, MpirunVariables) {
  set("OMPI_COMM_WORLD_RANK", "3");
  set("OMPI_COMM_WORLD_SIZE", "4");
  set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  const LaunchInfo info = launch_info_from_environment();
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_size, 2);
  EXPECT_TRUE(info.under_mpirun);
}

TEST_F(TransportEnv, TorchrunVariablesWinOverMpirun) {
  set("OMPI_COMM_WORLD_RANK", "3");
  set("OMPI_COMM_WORLD_SIZE", "4");
  set("RANK", "1");
  set("WORLD_SIZE", "2");
  const LaunchInfo info = launch_info_from_environment();
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 2);
  EXPECT_TRUE(info.under_mpirun);
}

TEST_F(TransportEnv, LocalSizeFallsBackToGradcompLocalSizeThenWorld) {
  set("RANK", "2");
  set("WORLD_SIZE", "4");
  LaunchInfo info = launch_info_from_environment();
  EXPECT_EQ(info.local_rank, 2);  // one node: local = global
  EXPECT_EQ(info.local_size, 4);
  set("GRADCOMP_LOCAL_SIZE", "3");
  set("LOCAL_RANK", "2");
  info = launch_info_from_environment();
  EXPECT_EQ(info.local_size, 3);
}

TEST_F(TransportEnv, MalformedIntegersAreErrors) {
  for (const char* bad : {"abc", "-1", "2x", "1.5", "99999999999"}) {
    set("RANK", bad);
    const std::string text = error_text([] { launch_info_from_environment(); });
    EXPECT_TRUE(contains(text, "RANK")) << bad << ": " << text;
    EXPECT_TRUE(contains(text, "must be a whole number from 0 to 2147483647"))
        << bad << ": " << text;
  }
}

TEST_F(TransportEnv, RankOutsideWorldIsAnError) {
  set("RANK", "4");
  set("WORLD_SIZE", "4");
  EXPECT_TRUE(contains(error_text([] { launch_info_from_environment(); }),
                       "rank 4 is not within world size 4"));
  set("WORLD_SIZE", "0");
  set("RANK", "0");
  EXPECT_TRUE(
      contains(error_text([] { launch_info_from_environment(); }), "not within world size 0"));
}

TEST_F(TransportEnv, LocalRankOutsideLocalSizeIsAnError) {
  set("RANK", "3");
  set("WORLD_SIZE", "4");
  set("LOCAL_RANK", "2");
  set("LOCAL_WORLD_SIZE", "2");
  EXPECT_TRUE(contains(error_text([] { launch_info_from_environment(); }),
                       "local rank 2 is not within local size 2"));
}

TEST_F(TransportEnv, TimeoutDefaultsTo300Seconds) {
  EXPECT_EQ(timeout_from_environment(), Milliseconds(300'000));
}

TEST_F(TransportEnv, TimeoutInSeconds) {
  set("GRADCOMP_TIMEOUT", "2.5");
  EXPECT_EQ(timeout_from_environment(), Milliseconds(2500));
  set("GRADCOMP_TIMEOUT", "60");
  EXPECT_EQ(timeout_from_environment(), Milliseconds(60'000));
  set("GRADCOMP_TIMEOUT", "0.0001");  // positive, so never 0 (which would mean unset)
  EXPECT_EQ(timeout_from_environment(), Milliseconds(1));
}

TEST_F(TransportEnv, MalformedTimeoutIsAnError) {
  for (const char* bad : {"abc", "0", "-5", "10s", "nan", "inf", "1e9"}) {
    set("GRADCOMP_TIMEOUT", bad);
    const std::string text = error_text([] { timeout_from_environment(); });
    EXPECT_TRUE(contains(text, "GRADCOMP_TIMEOUT")) << bad << ": " << text;
    EXPECT_TRUE(contains(text, "positive number of seconds")) << bad << ": " << text;
  }
}

TEST_F(TransportEnv, TransportNames) {
  EXPECT_EQ(transport_names(), (std::vector<std::string>{"mpi", "gloo"}));
}

// make_transport checks all of this before starting a backend, so nothing here connects.
TEST_F(TransportEnv, UnknownBackendIsAnError) {
  TransportOptions options;
  options.backend = "nccl";
  EXPECT_TRUE(contains(error_text([&] { make_transport(options); }),
                       "unknown transport 'nccl'; available: mpi, gloo"));
  set("GRADCOMP_TRANSPORT", "tcp");
  EXPECT_TRUE(contains(error_text([] { make_transport(); }), "unknown transport 'tcp'"));
}

TEST_F(TransportEnv, MakeTransportRejectsBadTimeout) {
  set("GRADCOMP_TRANSPORT", "nccl");  // never reached
  set("GRADCOMP_TIMEOUT", "soon");
  EXPECT_TRUE(contains(error_text([] { make_transport(); }), "GRADCOMP_TIMEOUT='soon'"));
}

TEST_F(TransportEnv, MakeTransportRejectsRankOutsideWorld) {
  set("GRADCOMP_TRANSPORT", "nccl");  // never reached
  set("RANK", "2");
  set("WORLD_SIZE", "2");
  EXPECT_TRUE(contains(error_text([] { make_transport(); }), "rank 2 is not within world size 2"));
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");

  TransportOptions options;
  options.rank = 3;
  options.world_size = 2;
  EXPECT_TRUE(
      contains(error_text([&] { make_transport(options); }), "rank 3 is not within world size 2"));
  // An explicit rank must also fit the world size the environment gives.
  set("WORLD_SIZE", "2");
  options.world_size = -1;
  EXPECT_TRUE(
      contains(error_text([&] { make_transport(options); }), "rank 3 is not within world size 2"));
}

}  // namespace
}  // namespace gradcomp
