// The execution model every backend shares: a transport's collectives run one at a time, in
// the order they were issued, each completing a Work. Once one fails, the transport is broken
// and every later collective fails with the same error at once, so a dead peer surfaces on every
// pending bucket instead of a hang. OpQueue gives a transport a communication thread of its own
// (Gloo's, a transport written outside the library); the MPI backend's channels keep the same
// rules on one thread for a communicator and its splits (src/transport/mpi_driver.h).
//
// Queuing a collective allocates nothing once the queue has seen its busiest moment: Works are
// reused when nobody holds them any more, and each keeps its operation in place. A step issues
// dozens of collectives from the engine's exchanger thread; allocating for each would spread
// short-lived chunks through that thread's malloc arena, whose resident pages then creep up
// plan after plan (docs/soak.md).
#pragma once

#include <algorithm>
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
template <class Signature>
class InlineFunction;

template <class R, class... Args>
class InlineFunction<R(Args...)> {
 public:
  static constexpr size_t kCapacity = 160;

  InlineFunction() = default;
  InlineFunction(const InlineFunction&) = delete;
  InlineFunction& operator=(const InlineFunction&) = delete;
  ~InlineFunction() { reset(); }

  template <class F>
  void set(F&& f) {
    using Fn = std::decay_t<F>;
    static_assert(sizeof(Fn) <= kCapacity && alignof(Fn) <= alignof(std::max_align_t),
                  "a queued operation must fit InlineFunction::kCapacity; capture less by value");
    reset();
    ::new (static_cast<void*>(storage_)) Fn(std::forward<F>(f));
    call_ = [](void* p, Args... args) -> R {
      return (*static_cast<Fn*>(p))(std::forward<Args>(args)...);
    };
    destroy_ = [](void* p) { static_cast<Fn*>(p)->~Fn(); };
  }
  R operator()(Args... args) { return call_(storage_, std::forward<Args>(args)...); }
  // Destroys the callable (and what it captured).
  void reset() {
    if (destroy_ != nullptr) destroy_(storage_);
    call_ = nullptr;
    destroy_ = nullptr;
  }

 private:
  alignas(std::max_align_t) std::byte storage_[kCapacity];
  R (*call_)(void*, Args...) = nullptr;
  void (*destroy_)(void*) = nullptr;
};

using InlineOp = InlineFunction<void()>;

// A Work that another thread completes (a transport's communication thread).
class SignalledWork : public Work {
 public:
  void wait(Milliseconds timeout) override;
  bool done() const override;
  // Marks the collective finished; `error` is null on success.
  void finish(std::exception_ptr error);
  // Ready for another collective (only while nobody else holds it).
  void renew();

 private:
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Waits for `marker`, a no-op queued behind everything to drain (Transport::drain): true once it
// ran or failed (a broken transport fails it, everything before it having finished), false when
// `timeout` passed first.
bool wait_drained(Work& marker, Milliseconds timeout);

// A Work completed by an OpQueue's thread.
class QueuedWork : public SignalledWork {
 public:
  InlineOp op;  // set by OpQueue::submit, run and destroyed by its thread
};

// Works in first-in first-out order, in a ring that grows when full (and never shrinks, so a
// queue allocates nothing once it has seen its busiest moment).
template <class T>
class WorkRing {
 public:
  bool empty() const { return count_ == 0; }
  void push(std::shared_ptr<T> work) {
    if (count_ == ring_.size()) {  // full: unroll into a ring twice the size
      std::vector<std::shared_ptr<T>> bigger(std::max<size_t>(16, 2 * ring_.size()));
      for (size_t i = 0; i < count_; ++i) bigger[i] = std::move(ring_[(head_ + i) % ring_.size()]);
      ring_ = std::move(bigger);
      head_ = 0;
    }
    ring_[(head_ + count_) % ring_.size()] = std::move(work);
    ++count_;
  }
  std::shared_ptr<T> pop() {
    std::shared_ptr<T> work = std::move(ring_[head_]);
    head_ = (head_ + 1) % ring_.size();
    --count_;
    return work;
  }

 private:
  std::vector<std::shared_ptr<T>> ring_;  // count_ entries from head_
  size_t head_ = 0;
  size_t count_ = 0;
};

// Every Work a queue made, for reuse: one nobody else holds is handed out again.
template <class T>
class WorkPool {
 public:
  // A Work nobody holds (renewed), or a new one kept for reuse. Callers serialise (a lock).
  std::shared_ptr<T> idle() {
    // use_count 1: only works_ holds it (the queue, the thread and every caller let go), and
    // only this function, under the caller's lock, hands it out again.
    for (const auto& work : works_) {
      if (work.use_count() == 1) {
        work->renew();
        return work;
      }
    }
    works_.push_back(std::make_shared<T>());
    return works_.back();
  }

 private:
  std::vector<std::shared_ptr<T>> works_;
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
    std::shared_ptr<QueuedWork> work = works_.idle();
    if (stopping_) {
      lock.unlock();
      work->finish(std::make_exception_ptr(CommError(name_ + ": transport is shut down")));
      return work;
    }
    work->op.set(std::forward<F>(op));
    queue_.push(work);
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

  std::string name_;
  std::mutex mutex_;
  std::condition_variable wake_;
  WorkPool<QueuedWork> works_;  // under mutex_
  WorkRing<QueuedWork> queue_;  // under mutex_
  bool stopping_ = false;
  std::exception_ptr broken_;  // the first failure; later ops fail with it
  KeptThread thread_;          // declared last: it starts once the members it reads exist
};

}  // namespace gradcomp
