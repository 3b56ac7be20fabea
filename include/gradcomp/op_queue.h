// The execution model both backends share: collectives run one at a time on one communication
// thread, in the order they were issued, and each completes a Work. Once one fails, the
// transport is broken and every later collective fails with the same error at once, so a dead
// peer surfaces on every pending bucket instead of a hang.
//
// Queuing a collective allocates nothing once the queue has seen its busiest moment: Works are
// reused when nobody holds them any more, and each keeps its operation in place. A step issues
// dozens of collectives from the engine's exchanger thread; allocating for each would spread
// short-lived chunks through that thread's malloc arena, whose resident pages then creep up
// plan after plan (docs/soak.md).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradcomp/error.h"
#include "gradcomp/kept_thread.h"
#include "gradcomp/transport.h"

namespace gradcomp {

// A callable stored in place: a collective's operation (a few pointers, spans and sizes).
class InlineOp {
 public:
  static constexpr size_t kCapacity = 160;

  InlineOp() = default;
  InlineOp(const InlineOp&) = delete;
  InlineOp& operator=(const InlineOp&) = delete;
  ~InlineOp() { reset(); }

  template <class F>
  void set(F&& f) {
    using Fn = std::decay_t<F>;
    static_assert(sizeof(Fn) <= kCapacity && alignof(Fn) <= alignof(std::max_align_t),
                  "a queued operation must fit InlineOp::kCapacity; capture less by value");
    reset();
    ::new (static_cast<void*>(storage_)) Fn(std::forward<F>(f));
    call_ = [](void* p) { (*static_cast<Fn*>(p))(); };
    destroy_ = [](void* p) { static_cast<Fn*>(p)->~Fn(); };
  }
  void operator()() { call_(storage_); }
  // Destroys the callable (and what it captured).
  void reset() {
    if (destroy_ != nullptr) destroy_(storage_);
    call_ = nullptr;
    destroy_ = nullptr;
  }

 private:
  alignas(std::max_align_t) std::byte storage_[kCapacity];
  void (*call_)(void*) = nullptr;
  void (*destroy_)(void*) = nullptr;
};

// A Work completed by the communication thread.
class QueuedWork : public Work {
 public:
  void wait(Milliseconds timeout) override;
  bool done() const override;
  // Marks the collective finished; `error` is null on success.
  void finish(std::exception_ptr error);
  // Ready for another collective (only while nobody else holds it).
  void renew();

  InlineOp op;  // set by OpQueue::submit, run and destroyed by its thread

 private:
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
};

class OpQueue {
 public:
  // `name` prefixes errors ("gloo", "mpi") and names the thread ("gc-gloo-ops").
  explicit OpQueue(std::string name);
  // Fails the collectives still queued and joins the thread (a running collective is bounded
  // by its backend's timeout).
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Queues `op` (it throws on failure) and returns its Work.
  template <class F>
  WorkPtr submit(F&& op) {
    std::unique_lock lock(mutex_);
    std::shared_ptr<QueuedWork> work = idle_work();
    if (stopping_) {
      lock.unlock();
      work->finish(std::make_exception_ptr(CommError(name_ + ": transport is shut down")));
      return work;
    }
    work->op.set(std::forward<F>(op));
    push(work);
    lock.unlock();
    wake_.notify_one();
    return work;
  }
  // Runs `op` on the communication thread and waits for it (set-up steps such as split, which
  // must stay in order with the collectives).
  void call(std::function<void()> op, Milliseconds timeout);
  // Waits until everything queued so far has run or failed (Transport::drain).
  bool drain(Milliseconds timeout);

 private:
  void loop();
  // Under mutex_: a Work nobody holds (renewed), or a new one kept for reuse.
  std::shared_ptr<QueuedWork> idle_work();
  // Under mutex_: the queue, first in first out, in a ring that grows when full.
  void push(std::shared_ptr<QueuedWork> work);
  std::shared_ptr<QueuedWork> pop();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::shared_ptr<QueuedWork>> works_;  // every Work made, for reuse
  std::vector<std::shared_ptr<QueuedWork>> ring_;   // the queue: count_ entries from head_
  size_t head_ = 0;
  size_t count_ = 0;
  bool stopping_ = false;
  std::exception_ptr broken_;  // the first failure; later ops fail with it
  KeptThread thread_;  // declared last: it starts once the members it reads exist
};

}  // namespace gradcomp
