#include "gradcomp/op_queue.h"

#include <fmt/format.h>

#include <algorithm>

#include "gradcomp/error.h"
#include "transport/seconds_text.h"

namespace gradcomp {

void SignalledWork::wait(Milliseconds timeout) {
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

bool SignalledWork::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

void SignalledWork::finish(std::exception_ptr error) {
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

void SignalledWork::renew() {
  std::lock_guard lock(mutex_);
  done_ = false;
  error_ = nullptr;
}

void OpQueue::call(std::function<void()> op, Milliseconds timeout) {
  submit(std::move(op))->wait(timeout);
}

bool wait_drained(Work& marker, Milliseconds timeout) {
  try {
    marker.wait(timeout);
  } catch (const TimeoutError&) {
    return false;
  } catch (const Error&) {  // the transport is broken: still, everything before has finished
  }
  return true;
}

bool OpQueue::drain(Milliseconds timeout) {
  // Runs (or fails, when broken) after all queued before it.
  return wait_drained(*submit([] {}), timeout);
}

void OpQueue::loop() {
  for (;;) {
    std::shared_ptr<QueuedWork> work;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      work = queue_.pop();
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
