// How busy the cores of the machines a job runs on are: the CPU time a process spends per step,
// and how many ranks share each machine's cores. Where several ranks share few cores (and a
// codec runs on the CPU), the step is bound by the CPU, whatever the network: compression then
// gains less than the model says, and auto says so (docs/auto.md, "The host's CPU").
#pragma once

#include <string>

#include "gradcomp/transport.h"

namespace gradcomp::schedule {

// CPU seconds this process has used, every thread counted (user and system).
double process_cpu_seconds();

// The ranks of one machine (one running kernel: ranks in other containers or network
// namespaces of the same machine count) and the cores they may run on (the union of their CPU
// affinity masks).
struct MachineShare {
  int ranks = 1;
  int cores = 1;
  double ranks_per_core() const { return static_cast<double>(ranks) / cores; }
};

// The machine of the job with the most ranks per core; the same on every rank. A collective
// (one allgather).
MachineShare most_crowded_machine(Transport& transport);

// The share of a step that the machine's cores were busy: `ranks` ranks each using `cpu_ms` of
// CPU per step of `step_ms`, over `cores` cores.
double core_load(const MachineShare& machine, double cpu_ms, double step_ms);

// What to tell the user when the cores were busy for most of the step (core_load at least
// kBusyCores): that the step is bound by the machine's CPU; empty otherwise. 70%: the rest of
// a CPU-bound step is what the exchange's CPU work cannot overlap (the forward pass: on the
// emulated cluster, 4 ranks on 2 cores, such steps measured 77% busy).
inline constexpr double kBusyCores = 0.7;
std::string cpu_bound_note(const MachineShare& machine, double cpu_ms, double step_ms);

}  // namespace gradcomp::schedule
