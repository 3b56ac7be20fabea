// OpQueue, the communication thread both backends share: operations run in issue order, a
// failure breaks the queue for everything after it, and queuing reuses Works nobody holds and
// keeps each operation in place (what it captured is released once it ran).
#include "gradcomp/op_queue.h"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "support/counting_new.h"

namespace gradcomp {
namespace {

constexpr Milliseconds kWait{10'000};

TEST(OpQueue, RunsOperationsInIssueOrder) {
  OpQueue queue("test");
  std::vector<int> order;
  std::vector<WorkPtr> works;
  for (int i = 0; i < 100; ++i) works.push_back(queue.submit([&order, i] { order.push_back(i); }));
  for (auto& w : works) w->wait(kWait);
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(OpQueue, AFailureFailsItAndEverythingAfter) {
  OpQueue queue("test");
  auto ok = queue.submit([] {});
  auto bad = queue.submit([] { throw CommError("peer 3 is gone"); });
  auto later = queue.submit([] { ADD_FAILURE() << "ran after the queue broke"; });
  ok->wait(kWait);
  EXPECT_THROW(bad->wait(kWait), CommError);
  try {
    later->wait(kWait);
    FAIL() << "no error";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("peer 3 is gone"), std::string::npos) << e.what();
  }
}

TEST(OpQueue, AWorkNobodyHoldsIsReusedAndAHeldOneIsNot) {
  OpQueue queue("test");
  auto first = queue.submit([] {});
  first->wait(kWait);
  Work* const address = first.get();
  auto held = queue.submit([] {});  // `first` is still held: a new Work
  EXPECT_NE(held.get(), address);
  held->wait(kWait);
  first.reset();
  // The queue's thread lets go of a Work right after finishing it; until then it is busy.
  WorkPtr again;
  for (int i = 0; i < 1000 && again.get() != address; ++i) {
    again = queue.submit([] {});
    again->wait(kWait);
    if (again.get() != address) again.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(again.get(), address) << "a finished Work nobody holds was not reused";
  EXPECT_NE(again.get(), held.get());
}

TEST(OpQueue, QueuingAllocatesNothingOnceWarm) {
  OpQueue queue("test");
  std::array<char, 64> payload{};  // more than std::function keeps in place
  long sum = 0;
  auto cycle = [&] {
    auto work = queue.submit([&sum, payload] { sum += payload[0] + 1; });
    work->wait(kWait);
  };
  for (int i = 0; i < 100; ++i) cycle();
  const long before = g_allocations;
  for (int i = 0; i < 1000; ++i) cycle();
  EXPECT_EQ(g_allocations - before, 0) << "allocations on the submitting thread";
  EXPECT_EQ(sum, 1100);
}

// A finished Work nobody holds goes back to the pool first: whatever Work the queued ones get
// (reused or new), none is done before it ran.
TEST(OpQueue, QueuedWorksAreNotDoneUntilTheyRan) {
  OpQueue queue("test");
  auto finished = queue.submit([] {});
  finished->wait(kWait);
  finished.reset();
  std::atomic<bool> release{false};
  auto gate = queue.submit([&] {
    while (!release) std::this_thread::yield();
  });
  std::vector<WorkPtr> waiting;
  for (int i = 0; i < 8; ++i) waiting.push_back(queue.submit([] {}));
  for (const auto& w : waiting) EXPECT_FALSE(w->done());  // queued behind the gate
  release = true;
  for (const auto& w : waiting) EXPECT_NO_THROW(w->wait(kWait));
  gate->wait(kWait);
}

TEST(OpQueue, WhatAnOperationCapturedIsReleasedOnceItRan) {
  OpQueue queue("test");
  auto token = std::make_shared<int>(7);
  std::array<char, 64> payload{};  // a capture of some size, stored in place
  auto work = queue.submit([token, payload] { EXPECT_EQ(*token + payload[0], 7); });
  work->wait(kWait);
  for (int i = 0; i < 1000 && token.use_count() > 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(token.use_count(), 1) << "the queued operation still holds its capture";
}

TEST(OpQueue, ShutDownFailsWhatIsStillQueued) {
  std::atomic<bool> release{false};
  WorkPtr queued;
  std::thread opener;
  {
    OpQueue queue("test");
    queue.submit([&] {
      while (!release) std::this_thread::yield();
    });
    queued = queue.submit([] { ADD_FAILURE() << "ran after shut-down"; });
    opener = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      release = true;
    });
  }  // the destructor waits for the running operation and fails the queued one
  opener.join();
  EXPECT_THROW(queued->wait(kWait), CommError);
}

}  // namespace
}  // namespace gradcomp
