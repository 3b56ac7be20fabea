// The MPI backend's communication thread: one thread makes every MPI call of a communicator's
// collectives and of the communicators split from it (its streams, its node groups).
//
// Each communicator is a Channel: its collectives start in the order they were queued, one at
// a time (MPI wants a communicator's collectives in one order on every rank), while those of
// different channels are in flight together, all started and polled by the one thread.
//
// Why one thread and not one per communicator: Open MPI advances every pending collective of
// the process inside any MPI call, so with a thread per stream each thread also completed, and
// freed, what the other's calls had allocated; glibc's per-thread caches and arenas then kept
// growing through a long run (docs/soak.md). And why the driver is the queue itself, not a
// thread the queues hand their calls to: each hand-off between threads costs a small
// collective tens of microseconds.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "gradcomp/kept_thread.h"
#include "gradcomp/op_queue.h"
#include "transport/mpi_runtime.h"

namespace gradcomp::mpi {

class Channel;

// A collective queued on a channel.
class DriverWork : public SignalledWork {
 public:
  // Called on the driver's thread to start the collective's next non-blocking MPI call (one
  // larger than MPI's int counts is several): false when none is left, else true with MPI's
  // return code in *rc.
  InlineFunction<bool(MPI_Request*, int*)> start;
  const char* op = "";     // names it in errors: "allreduce"
  size_t bytes = 0;        // likewise
  Milliseconds timeout{};  // from its first call

 private:
  friend class Driver;
  friend class Channel;
  MPI_Request request_ = MPI_REQUEST_NULL;
  Clock::time_point started_{}, deadline_{};
  bool hold_ = false;  // once done, its channel starts nothing until Channel::exclusive ends
};

class Driver {
 public:
  Driver();
  // Joins the thread. Every channel is closed by then (each holds the driver).
  ~Driver();
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

 private:
  friend class Channel;

  void loop();
  // Waits until something is queued or released; false when stopping.
  bool wait_for_work();
  // Moves each idle channel's next collective to `running` and makes its first call (`fresh`
  // is scratch); true when it took one.
  bool start_queued(std::vector<Channel*>& running, std::vector<Channel*>& fresh);
  // Tests each running collective; true when one finished a call.
  bool poll(std::vector<Channel*>& running);
  // Makes the running collective's next call, or finishes it when none is left; false when it
  // is no longer running.
  bool advance(Channel& channel);
  // Finishes the channel's running collective (error null on success) and lets it go.
  void finish(Channel& channel, std::exception_ptr error);

  std::mutex mutex_;
  std::condition_variable wake_;      // something queued or released, or stopping
  std::condition_variable finished_;  // a running collective finished (Channel::close waits)
  std::vector<Channel*> channels_;    // under mutex_
  std::atomic<bool> pending_{false};  // a channel may have a collective to start (under mutex_)
  bool stopping_ = false;             // under mutex_
  KeptThread thread_;                 // declared last: it starts once the members it reads exist
};

// The queue of one communicator's collectives, served by a Driver.
class Channel {
 public:
  // `rank` and `size` (in the communicator) name errors.
  Channel(std::shared_ptr<Driver> driver, int rank, int size);
  ~Channel() { close(); }
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Queues a collective: `start` as DriverWork::start; `timeout` bounds it from its first call.
  template <class Start>
  WorkPtr submit(const char* op, size_t bytes, Milliseconds timeout, Start&& start) {
    return queue(op, bytes, timeout, std::forward<Start>(start), false);
  }
  // Runs the collective `start` in order with the others, then `body` on this thread while the
  // channel starts nothing else (a blocking MPI call on the communicator, such as
  // MPI_Comm_split). Waits at most `wait` for the collective.
  template <class Start, class Body>
  void exclusive(const char* op, Milliseconds timeout, Milliseconds wait, Start&& start,
                 Body&& body) {
    auto work = queue(op, 0, timeout, std::forward<Start>(start), true);
    struct Release {
      Channel* channel;
      DriverWork* work;
      ~Release() { channel->release(*work); }
    } release{this, work.get()};
    work->wait(wait);
    body();
  }
  // Waits until everything queued so far has run or failed (Transport::drain).
  bool drain(Milliseconds timeout);
  // Fails what is still queued and waits for the running collective (bounded by its timeout).
  void close();
  // A collective failed or timed out: its request may still be pending in MPI, so the
  // communicator must not be freed.
  bool failed() const { return failed_.load(); }
  const std::shared_ptr<Driver>& driver() const { return driver_; }

 private:
  friend class Driver;

  template <class Start>
  std::shared_ptr<DriverWork> queue(const char* op, size_t bytes, Milliseconds timeout,
                                    Start&& start, bool hold) {
    std::unique_lock lock(driver_->mutex_);
    std::shared_ptr<DriverWork> work = works_.idle();
    if (closed_) {
      lock.unlock();
      work->finish(std::make_exception_ptr(CommError("mpi: transport is shut down")));
      return work;
    }
    work->start.set(std::forward<Start>(start));
    work->op = op;
    work->bytes = bytes;
    work->timeout = timeout;
    work->hold_ = hold;
    queue_.push(work);
    driver_->pending_.store(true, std::memory_order_release);  // under the lock: no lost wake-up
    lock.unlock();
    driver_->wake_.notify_one();
    return work;
  }
  // Ends the hold of `work` (Channel::exclusive), taken or not yet.
  void release(DriverWork& work);
  WaitLabel label(const DriverWork& work) const {
    return {.op = work.op, .bytes = work.bytes, .rank = rank_, .size = size_};
  }

  std::shared_ptr<Driver> driver_;
  int rank_, size_;
  // Under the driver's mutex_:
  WorkPool<DriverWork> works_;
  WorkRing<DriverWork> queue_;
  std::shared_ptr<DriverWork> running_;  // started, not finished (its request the thread's)
  const DriverWork* held_by_ = nullptr;  // an exclusive's collective, until released
  std::exception_ptr broken_;            // the first failure; later collectives fail with it
  bool closed_ = false;
  std::atomic<bool> failed_{false};
};

}  // namespace gradcomp::mpi
