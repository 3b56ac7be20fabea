#include "schedule/host_load.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <map>
#include <span>
#include <thread>

#include "gradcomp/frame.h"

namespace gradcomp::schedule {
namespace {

constexpr size_t kMaskWords = sizeof(cpu_set_t) / sizeof(uint64_t);

// One running kernel: its boot id (the same in every container and network namespace of the
// machine), else the host name.
uint64_t machine_id() {
  std::string id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id;
  if (id.empty()) {
    std::array<char, 256> host{};
    gethostname(host.data(), host.size() - 1);
    id = host.data();
  }
  return fnv1a64(id);
}

// The cores this process may run on, as bits; all of them when the kernel does not say.
std::array<uint64_t, kMaskWords> affinity_mask() {
  std::array<uint64_t, kMaskWords> mask{};
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) == 0) {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  }
  for (size_t c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) mask[c / 64] |= uint64_t{1} << (c % 64);
  }
  return mask;
}

}  // namespace

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

MachineShare most_crowded_machine(Transport& transport) {
  // Per rank: its machine, then its affinity mask.
  constexpr size_t kWords = 1 + kMaskWords;
  std::array<uint64_t, kWords> mine{};
  mine[0] = machine_id();
  const auto mask = affinity_mask();
  std::copy(mask.begin(), mask.end(), mine.begin() + 1);
  const auto world = static_cast<size_t>(transport.size());
  std::vector<uint64_t> all(kWords * world);
  transport.allgather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)))
      ->wait(transport.timeout());
  std::map<uint64_t, std::pair<int, std::array<uint64_t, kMaskWords>>> machines;
  for (size_t r = 0; r < world; ++r) {
    auto& [ranks, cores] = machines[all[r * kWords]];
    ++ranks;
    for (size_t w = 0; w < kMaskWords; ++w) cores[w] |= all[r * kWords + 1 + w];
  }
  MachineShare most{.ranks = 0, .cores = 1};  // beaten by any machine
  for (const auto& [id, machine] : machines) {
    int cores = 0;
    for (uint64_t word : machine.second) cores += std::popcount(word);
    const MachineShare share{machine.first, std::max(cores, 1)};
    if (share.ranks_per_core() > most.ranks_per_core()) most = share;
  }
  return most;
}

double core_load(const MachineShare& machine, double cpu_ms, double step_ms) {
  return step_ms > 0 ? machine.ranks_per_core() * cpu_ms / step_ms : 0;
}

std::string cpu_bound_note(const MachineShare& machine, double cpu_ms, double step_ms) {
  const double load = core_load(machine, cpu_ms, step_ms);
  if (load < kBusyCores) return {};
  return fmt::format("the cores were busy {:.0f}% of its step ({} rank{} sharing {} core{}, "
                     "{:.1f} ms of CPU a step each): the step is bound by the machine's CPU "
                     "more than by the network",
                     100 * std::min(load, 1.0), machine.ranks, machine.ranks == 1 ? "" : "s",
                     machine.cores, machine.cores == 1 ? "" : "s", cpu_ms);
}

}  // namespace gradcomp::schedule
