// The execution model both backends share: collectives run one at a time on one communication
// thread, in the order they were issued, and each completes a Work. Once one fails, the
// transport is broken and every later collective fails with the same error at once, so a dead
// peer surfaces on every pending bucket instead of a hang.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "gradcomp/transport.h"

namespace gradcomp {

// A Work completed by the communication thread.
class QueuedWork : public Work {
 public:
  void wait(Milliseconds timeout) override;
  bool done() const override;
  // Marks the collective finished; `error` is null on success.
  void finish(std::exception_ptr error);

 private:
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
};

class OpQueue {
 public:
  // `name` prefixes errors ("gloo", "mpi").
  explicit OpQueue(std::string name);
  // Fails the collectives still queued and joins the thread (a running collective is bounded
  // by its backend's timeout).
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Queues `op` (it throws on failure) and returns its Work.
  WorkPtr submit(std::function<void()> op);
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
  std::deque<std::pair<std::function<void()>, std::shared_ptr<QueuedWork>>> queue_;
  bool stopping_ = false;
  std::exception_ptr broken_;  // the first failure; later ops fail with it
  std::thread thread_;
};

}  // namespace gradcomp
