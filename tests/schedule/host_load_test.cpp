// How busy a machine's cores are: the process's CPU clock advances with work, a job of one rank
// finds its own machine and the cores it may run on, and the note auto adds to a decision
// speaks only when the cores were busy for most of the step.
#include "schedule/host_load.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <chrono>
#include <cmath>

#include "support/single_rank.h"

namespace gradcomp::schedule {
namespace {

TEST(HostLoad, TheProcessCpuClockAdvancesWithWork) {
  const double start = process_cpu_seconds();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  volatile double sink = 0;
  // 20 ms of CPU: on a loaded machine it takes longer in wall time, never forever.
  while (process_cpu_seconds() - start < 0.02 && std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 10000; ++i) sink = sink + std::sqrt(static_cast<double>(i));
  }
  EXPECT_GE(process_cpu_seconds() - start, 0.02);
}

TEST(HostLoad, OneRankFindsItsMachineAndTheCoresItMayRunOn) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const MachineShare share = most_crowded_machine(*testing::single_rank_transport());
  EXPECT_EQ(share.ranks, 1);
  EXPECT_EQ(share.cores, CPU_COUNT(&set));
}

TEST(HostLoad, TheNoteSpeaksOnlyWhenTheCoresWereBusyForMostOfTheStep) {
  const MachineShare crowded{.ranks = 4, .cores = 2};
  // 4 ranks, each 132 ms of CPU a step of 326 ms, on 2 cores: busy 81% of the step.
  EXPECT_NEAR(core_load(crowded, 132, 326), 4.0 * 132 / (2 * 326), 1e-12);
  const std::string note = cpu_bound_note(crowded, 132, 326);
  EXPECT_NE(note.find("busy 81%"), std::string::npos) << note;
  EXPECT_NE(note.find("4 ranks sharing 2 cores, 132.0 ms of CPU a step each"), std::string::npos)
      << note;
  // A core per rank and half the step on the CPU: nothing to say; from 70% of it, the note.
  EXPECT_EQ(cpu_bound_note({.ranks = 2, .cores = 2}, 125, 250), "");
  EXPECT_EQ(cpu_bound_note({.ranks = 2, .cores = 2}, 69, 100), "");
  EXPECT_NE(cpu_bound_note({.ranks = 2, .cores = 2}, 71, 100), "");
  // Busier than the cores can be (threads of one rank on several cores): at most 100%.
  EXPECT_NE(cpu_bound_note({.ranks = 1, .cores = 1}, 300, 250).find("busy 100%"),
            std::string::npos);
  EXPECT_EQ(core_load(crowded, 100, 0), 0);  // no step measured: no load
}

}  // namespace
}  // namespace gradcomp::schedule
