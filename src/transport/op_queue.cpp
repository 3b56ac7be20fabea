#include "gradcomp/op_queue.h"

#include <fmt/format.h>

#include <algorithm>

#include "gradcomp/error.h"
#include "transport/seconds_text.h"

namespace gradcomp {

void QueuedWork::wait(Milliseconds timeout) {
  // A deadline far in the future (Milliseconds::max()) would overflow the clock: cap it at a
  // year, which is "forever" for a collective.
  timeout = std::min(timeout, Milliseconds(365LL * 24 * 3600 * 1000));
  std::unique_lock lock(mutex_);
  if (!finished_.wait_for(lock, timeout, [&] { return done_; })) {
    throw TimeoutError(fmt::format("collective did not finish within {} s (GRADCOMP_TIMEOUT)",
                                   seconds_text(timeout)));
  }
  if (error_) std::rethrow_exception(error_);
}

bool QueuedWork::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

void QueuedWork::finish(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  finished_.notify_all();
}

OpQueue::OpQueue(std::string name)
    : name_(std::move(name)), thread_("gc-" + name_ + "-ops", [this] { loop(); }) {}

OpQueue::~OpQueue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void QueuedWork::renew() {
  std::lock_guard lock(mutex_);
  done_ = false;
  error_ = nullptr;
}

std::shared_ptr<QueuedWork> OpQueue::idle_work() {
  // use_count 1: only works_ holds it (the queue, the thread and every caller let go), and
  // only this function, under mutex_, hands it out again.
  for (const auto& work : works_) {
    if (work.use_count() == 1) {
      work->renew();
      return work;
    }
  }
  works_.push_back(std::make_shared<QueuedWork>());
  return works_.back();
}

void OpQueue::push(std::shared_ptr<QueuedWork> work) {
  if (count_ == ring_.size()) {  // full: unroll into a ring twice the size
    std::vector<std::shared_ptr<QueuedWork>> bigger(std::max<size_t>(16, 2 * ring_.size()));
    for (size_t i = 0; i < count_; ++i) bigger[i] = std::move(ring_[(head_ + i) % ring_.size()]);
    ring_ = std::move(bigger);
    head_ = 0;
  }
  ring_[(head_ + count_) % ring_.size()] = std::move(work);
  ++count_;
}

std::shared_ptr<QueuedWork> OpQueue::pop() {
  std::shared_ptr<QueuedWork> work = std::move(ring_[head_]);
  head_ = (head_ + 1) % ring_.size();
  --count_;
  return work;
}

void OpQueue::call(std::function<void()> op, Milliseconds timeout) {
  submit(std::move(op))->wait(timeout);
}

bool OpQueue::drain(Milliseconds timeout) {
  try {
    submit([] {})->wait(timeout);  // runs (or fails, when broken) after all queued before it
  } catch (const TimeoutError&) {
    return false;
  } catch (const Error&) {  // the transport is broken: still, everything before has finished
  }
  return true;
}

void OpQueue::loop() {
  for (;;) {
    std::shared_ptr<QueuedWork> work;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || count_ > 0; });
      if (count_ == 0) return;  // stopping, nothing left
      work = pop();
      if (stopping_ && !broken_) {
        broken_ = std::make_exception_ptr(CommError(name_ + ": transport is shut down"));
      }
    }
    std::exception_ptr error = broken_;
    if (!error) {
      try {
        work->op();
      } catch (const Error&) {
        error = std::current_exception();
      } catch (const std::exception& e) {  // a backend's own exception type
        error = std::make_exception_ptr(CommError(fmt::format("{}: {}", name_, e.what())));
      } catch (...) {  // anything else would escape the thread and terminate the process
        error = std::make_exception_ptr(CommError(name_ + ": collective failed (unknown error)"));
      }
    }
    work->op.reset();  // what it captured goes now, not when the Work is reused
    // Finished and let go under the queue's lock: a caller woken by finish() submits its next
    // collective only after this thread's reference is gone, so it gets this Work back.
    std::lock_guard lock(mutex_);
    if (error) broken_ = error;
    work->finish(error);
    work.reset();
  }
}

}  // namespace gradcomp
