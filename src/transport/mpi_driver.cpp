#include "transport/mpi_driver.h"

#include <algorithm>
#include <thread>

#include "gradcomp/error.h"

namespace gradcomp::mpi {
namespace {

// A deadline far in the future (Milliseconds::max()) would overflow the clock: a year is
// "forever" for a collective.
Clock::time_point deadline_after(Clock::time_point start, Milliseconds timeout) {
  return start + std::min(timeout, Milliseconds(365LL * 24 * 3600 * 1000));
}

std::exception_ptr shut_down() {
  return std::make_exception_ptr(CommError("mpi: transport is shut down"));
}

}  // namespace

Driver::Driver() : thread_("gc-mpi-driver", [this] { loop(); }) {}

Driver::~Driver() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Driver::loop() {
  std::vector<Channel*> running;  // channels whose collective is in flight
  std::vector<Channel*> fresh;    // scratch of start_queued, kept to allocate nothing per step
  Clock::time_point busy_until{};
  std::chrono::microseconds sleep{1};
  for (;;) {
    if (running.empty() && !wait_for_work()) return;
    const bool started = start_queued(running, fresh);
    const bool progressed = poll(running);
    if (running.empty()) continue;
    // Poll closely while collectives move (a small one takes tens of microseconds), then
    // sleep, doubling, so a rank waiting on a slow peer costs a few percent of a core. Open
    // MPI only advances a collective inside MPI calls, so the cap also bounds how long a busy
    // transfer stalls between polls.
    const auto now = Clock::now();
    if (started || progressed) {
      busy_until = now + kPollSpin;
      sleep = std::chrono::microseconds(1);
    }
    if (now < busy_until) {
      std::this_thread::yield();  // other ranks may share this core (oversubscribed jobs)
      continue;
    }
    const auto oldest = std::min_element(running.begin(), running.end(), [](auto* a, auto* b) {
      return a->running_->started_ < b->running_->started_;
    });
    const bool long_wait = now - (*oldest)->running_->started_ >= kPollLongWait;
    std::unique_lock lock(mutex_);
    wake_.wait_for(lock, sleep, [&] { return pending_.load(std::memory_order_relaxed); });
    sleep = std::min(sleep * 2, long_wait ? kPollLongCap : kPollShortCap);
  }
}

bool Driver::wait_for_work() {
  // No spin while idle: one that waited 250 us for the next collective took the core from
  // the ranks sharing it (a 64 KiB allreduce at 4 ranks on 2 cores: 0.19 to 0.27 ms, against
  // 0.15 to 0.16 without it).
  std::unique_lock lock(mutex_);
  wake_.wait(lock, [&] { return stopping_ || pending_.load(std::memory_order_relaxed); });
  return !stopping_;
}

bool Driver::start_queued(std::vector<Channel*>& running, std::vector<Channel*>& fresh) {
  {
    std::lock_guard lock(mutex_);
    pending_.store(false, std::memory_order_relaxed);
    for (Channel* channel : channels_) {
      if (channel->running_ || channel->held_by_ != nullptr || channel->queue_.empty()) continue;
      channel->running_ = channel->queue_.pop();
      fresh.push_back(channel);
    }
  }
  const bool any = !fresh.empty();
  for (Channel* channel : fresh) {
    if (channel->broken_) {  // only this thread writes broken_
      finish(*channel, channel->broken_);
      continue;
    }
    DriverWork& work = *channel->running_;
    work.started_ = Clock::now();
    work.deadline_ =
        deadline_after(work.started_, work.timeout);  // from its start, not from its queuing
    if (advance(*channel)) running.push_back(channel);
  }
  fresh.clear();
  return any;
}

bool Driver::poll(std::vector<Channel*>& running) {
  bool any = false;
  for (size_t i = 0; i < running.size();) {
    Channel& channel = *running[i];
    DriverWork& work = *channel.running_;
    int flag = 0;
    int rc;
    {
      auto guard = lock();
      rc = MPI_Test(&work.request_, &flag, MPI_STATUS_IGNORE);
    }
    bool still_running = true;
    if (rc != MPI_SUCCESS) {
      finish(channel, comm_error(rc, channel.label(work)));
      still_running = false;
    } else if (flag) {
      still_running = advance(channel);
      any = true;
    } else if (Clock::now() >= work.deadline_) {
      finish(channel, timeout_error(channel.label(work), work.timeout));
      still_running = false;
    }
    if (still_running) {
      ++i;
    } else {
      running[i] = running.back();
      running.pop_back();
    }
  }
  return any;
}

bool Driver::advance(Channel& channel) {
  DriverWork& work = *channel.running_;
  int rc = MPI_SUCCESS;
  bool called;
  {
    auto guard = lock();
    called = work.start(&work.request_, &rc);
  }
  if (!called) {
    finish(channel, nullptr);
    return false;
  }
  if (rc != MPI_SUCCESS) {
    finish(channel, comm_error(rc, channel.label(work)));
    return false;
  }
  return true;
}

void Driver::finish(Channel& channel, std::exception_ptr error) {
  channel.running_->start.reset();  // what it captured goes now, not when the Work is reused
  std::lock_guard lock(mutex_);
  std::shared_ptr<DriverWork> work = std::move(channel.running_);
  if (error) {
    if (!channel.broken_) channel.broken_ = error;
    // A collective request cannot be cancelled: a failed one may stay pending in MPI.
    channel.failed_ = true;
    note_abandoned();
  } else if (work->hold_) {
    channel.held_by_ = work.get();
  }
  // The channel's next collective can start now (unless held: release() says so then).
  if (!channel.queue_.empty()) pending_.store(true, std::memory_order_relaxed);
  // Finished and let go under the lock: a caller woken by finish() queues its next collective
  // only after this reference is gone, so it gets this Work back.
  work->finish(error);
  work.reset();
  finished_.notify_all();
}

Channel::Channel(std::shared_ptr<Driver> driver, int rank, int size)
    : driver_(std::move(driver)), rank_(rank), size_(size) {
  std::lock_guard lock(driver_->mutex_);
  driver_->channels_.push_back(this);
}

bool Channel::drain(Milliseconds timeout) {
  // Runs (or fails, when broken) after all queued before it, and makes no MPI call.
  return wait_drained(*submit("drain", 0, timeout, [](MPI_Request*, int*) { return false; }),
                      timeout);
}

void Channel::close() {
  std::unique_lock lock(driver_->mutex_);
  if (closed_) return;
  closed_ = true;
  while (!queue_.empty()) {
    std::shared_ptr<DriverWork> work = queue_.pop();
    work->start.reset();
    work->finish(shut_down());
  }
  driver_->finished_.wait(lock, [&] { return running_ == nullptr; });
  auto& channels = driver_->channels_;
  channels.erase(std::find(channels.begin(), channels.end(), this));
}

void Channel::release(DriverWork& work) {
  std::lock_guard lock(driver_->mutex_);
  work.hold_ = false;  // not held yet (the wait gave up): it will not be
  if (held_by_ != &work) return;
  held_by_ = nullptr;
  driver_->pending_.store(true, std::memory_order_relaxed);
  driver_->wake_.notify_one();
}

}  // namespace gradcomp::mpi
