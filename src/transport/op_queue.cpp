#include "transport/op_queue.h"

#include <algorithm>

#include <fmt/format.h>

#include "gradcomp/error.h"

namespace gradcomp {

void QueuedWork::wait(Milliseconds timeout) {
  // A deadline far in the future (Milliseconds::max()) would overflow the clock: cap it at a
  // year, which is "forever" for a collective.
  timeout = std::min(timeout, Milliseconds(365LL * 24 * 3600 * 1000));
  std::unique_lock lock(mutex_);
  if (!finished_.wait_for(lock, timeout, [&] { return done_; })) {
    throw TimeoutError(fmt::format("collective did not finish within {:.3g} s (GRADCOMP_TIMEOUT)",
                                   timeout.count() / 1000.0));
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

OpQueue::OpQueue(std::string name) : name_(std::move(name)), thread_([this] { loop(); }) {}

OpQueue::~OpQueue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

WorkPtr OpQueue::submit(std::function<void()> op) {
  auto work = std::make_shared<QueuedWork>();
  {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      work->finish(std::make_exception_ptr(CommError(name_ + ": transport is shut down")));
      return work;
    }
    queue_.emplace_back(std::move(op), work);
  }
  wake_.notify_one();
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
    std::function<void()> op;
    std::shared_ptr<QueuedWork> work;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      op = std::move(queue_.front().first);
      work = std::move(queue_.front().second);
      queue_.pop_front();
      if (stopping_ && !broken_) {
        broken_ = std::make_exception_ptr(CommError(name_ + ": transport is shut down"));
      }
    }
    std::exception_ptr error = broken_;
    if (!error) {
      try {
        op();
      } catch (const Error&) {
        error = std::current_exception();
      } catch (const std::exception& e) {  // a backend's own exception type
        error = std::make_exception_ptr(CommError(fmt::format("{}: {}", name_, e.what())));
      } catch (...) {  // anything else would escape the thread and terminate the process
        error = std::make_exception_ptr(CommError(name_ + ": collective failed (unknown error)"));
      }
      if (error) {
        std::lock_guard lock(mutex_);
        broken_ = error;
      }
    }
    work->finish(error);
  }
}

}  // namespace gradcomp
