// A thread for one of gradcomp's long-lived roles (an engine stage, a transport's queue) that,
// when its job returns, waits for the next job of the same role instead of exiting.
//
// Why: a process that builds engines again and again (a resume into a new engine, several
// optimizers over a run, a node split per hierarchical plan) used to start new threads each
// time, and glibc hands a new thread the malloc arena and the stack of a thread that ended, in
// whatever order they ended. So each role's allocations met every arena and every stack in
// turn, and resident memory crept for tens of thousands of steps with nothing leaked
// (docs/soak.md). A kept thread keeps its arena, its stack, its caches and its role.
//
// Threads of a role are started as needed (two live engines hold two encoders) and never end:
// a destroyed engine leaves its threads parked, holding only their stacks' and malloc arenas'
// resident pages and their small per-thread scratch (common/thread_scratch.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace gradcomp {

class KeptThread {
 public:
  KeptThread() = default;
  // Runs `job` on an idle thread kept for `role` (also the thread's name, as top -H shows it),
  // or on a new one. A job must not throw: as on a std::thread, that ends the process.
  KeptThread(std::string role, std::function<void()> job);
  KeptThread(KeptThread&& other) noexcept;
  KeptThread& operator=(KeptThread&& other) noexcept;
  KeptThread(const KeptThread&) = delete;
  KeptThread& operator=(const KeptThread&) = delete;
  ~KeptThread();  // waits for the job, as join()

  bool joinable() const { return worker_ != nullptr; }
  // Waits until the job has returned; the thread is then idle again. No-op when not joinable.
  void join();

  struct Worker;  // a kept thread: its role, its mailbox

 private:
  Worker* worker_ = nullptr;
  uint64_t ticket_ = 0;  // the number of the job this handle waits for, on worker_
};

}  // namespace gradcomp
