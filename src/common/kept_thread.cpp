#include "gradcomp/kept_thread.h"

#include <pthread.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/thread_arena.h"
#include "common/thread_name.h"

namespace gradcomp {

struct KeptThread::Worker {
  explicit Worker(std::string role_in) : role(std::move(role_in)) {}
  void loop();

  const std::string role;
  std::mutex mutex;
  std::condition_variable wake, finished;
  std::function<void()> job;  // the next job; empty while idle or running one
  uint64_t issued = 0;        // jobs given to this thread
  uint64_t completed = 0;     // jobs that have returned
};

namespace {

// The idle threads of each role.
class Pool {
 public:
  KeptThread::Worker* take(const std::string& role) {
    std::lock_guard lock(mutex_);
    auto it = idle_.find(role);
    if (it == idle_.end() || it->second.empty()) return nullptr;
    KeptThread::Worker* worker = it->second.back();
    it->second.pop_back();
    return worker;
  }

  void park(KeptThread::Worker* worker) {
    std::lock_guard lock(mutex_);
    idle_[worker->role].push_back(worker);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, std::vector<KeptThread::Worker*>> idle_;
};

// Never destroyed: parked threads wait on their workers through the static destructors of a
// process that exits. A forked child has none of the parent's threads (a DataLoader's worker
// process): it starts from an empty pool, and the parent's records are left behind unused.
Pool*& pool() {
  static Pool* instance = [] {
    ::pthread_atfork(nullptr, nullptr, [] { pool() = new Pool; });
    return new Pool;
  }();
  return instance;
}

}  // namespace

void KeptThread::Worker::loop() {
  name_this_thread(role);
  fault_in_thread_arena();
  std::unique_lock lock(mutex);
  for (;;) {
    wake.wait(lock, [&] { return job != nullptr; });
    std::function<void()> run = std::move(job);
    job = nullptr;
    lock.unlock();
    run();
    run = nullptr;  // the job's captures go on this thread, before anyone hears it is done
    // Idle before done: a join followed by a new job of this role finds this thread, rather
    // than starting another.
    pool()->park(this);
    lock.lock();
    ++completed;
    finished.notify_all();
  }
}

KeptThread::KeptThread(std::string role, std::function<void()> job) {
  Worker* worker = pool()->take(role);
  if (worker == nullptr) {
    worker = new Worker(std::move(role));
    try {
      std::thread([worker] { worker->loop(); }).detach();
    } catch (...) {
      delete worker;
      throw;
    }
  }
  std::lock_guard lock(worker->mutex);
  worker->job = std::move(job);
  ticket_ = ++worker->issued;
  worker_ = worker;
  worker->wake.notify_one();
}

KeptThread::KeptThread(KeptThread&& other) noexcept
    : worker_(std::exchange(other.worker_, nullptr)), ticket_(other.ticket_) {}

KeptThread& KeptThread::operator=(KeptThread&& other) noexcept {
  if (this != &other) {
    join();
    worker_ = std::exchange(other.worker_, nullptr);
    ticket_ = other.ticket_;
  }
  return *this;
}

KeptThread::~KeptThread() { join(); }

void KeptThread::join() {
  if (worker_ == nullptr) return;
  std::unique_lock lock(worker_->mutex);
  worker_->finished.wait(lock, [&] { return worker_->completed >= ticket_; });
  lock.unlock();
  worker_ = nullptr;
}

}  // namespace gradcomp
