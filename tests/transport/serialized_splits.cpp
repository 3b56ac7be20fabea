// Splits at MPI_THREAD_SERIALIZED (part of transport_serialized_mptest, with
// support/serialized_mpi.cpp): a process splits one communicator at a time (mpi::SplitTurn).
// The transport suite's test of two splits from two threads in different orders on different
// ranks cannot pass at this level (the program's filter leaves it out): here it is an error
// within the timeout, not a hang.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "gradcomp/error.h"
#include "gradcomp/transport.h"

namespace gradcomp::testing {
namespace {

// A world of its own with a short timeout, so that a split's timeout costs seconds.
std::unique_ptr<Transport> short_world() {
  TransportOptions options;
  options.backend = "mpi";
  options.timeout = std::chrono::seconds(2);
  return make_transport(options);
}

// Two threads each split a stream, stream 1 first on every rank. Rank 0 comes late to the
// first split, so on the other ranks the second starts while the first waits in its barrier:
// it waits for its turn, and both splits succeed.
TEST(SerializedSplits, ASplitStartedDuringAnotherWaitsForItsTurn) {
  auto world = short_world();
  Transport& s1 = world->stream(1);
  Transport& s2 = world->stream(2);
  const bool late = world->rank() == 0;
  std::unique_ptr<Transport> sub1, sub2;
  std::thread first([&] {
    if (late) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    sub1 = s1.split(0, world->rank());
  });
  std::thread second([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(late ? 700 : 100));
    sub2 = s2.split(0, -world->rank());
  });
  first.join();
  second.join();
  ASSERT_NE(sub1, nullptr);
  ASSERT_NE(sub2, nullptr);
  EXPECT_EQ(sub2->rank(), world->size() - 1 - world->rank());
  std::vector<float> x{1.0f}, y{static_cast<float>(world->rank())};
  WorkPtr a = sub1->allreduce(x);
  WorkPtr b = sub2->allreduce(y);
  b->wait(sub2->timeout());
  a->wait(sub1->timeout());
  const int w = world->size();
  EXPECT_EQ(x[0], static_cast<float>(w));
  EXPECT_EQ(y[0], static_cast<float>(w * (w - 1) / 2));
}

// Stream 1 first on even ranks, stream 2 first on odd ones (the suite's test, which passes
// with MPI_THREAD_MULTIPLE): each rank's first split waits for a barrier that the other rank's
// held-back split never reaches. Every split fails within the timeout, the first by timing out
// and saying why, the one behind it refused without starting; none hangs (a hang would end at
// ctest's timeout, failing the test).
TEST(SerializedSplits, SplitsFromTwoThreadsInDifferentOrdersFailWithinTheTimeout) {
  auto world = short_world();
  Transport& s1 = world->stream(1);
  Transport& s2 = world->stream(2);
  const bool even = world->rank() % 2 == 0;
  std::string errors[2];
  std::atomic<int> succeeded{0};
  auto split = [&](Transport& stream, int slot) {
    try {
      if (stream.split(0, world->rank())) ++succeeded;
    } catch (const Error& e) {
      errors[slot] = e.what();
    }
  };
  // The later thread starts well inside the earlier one's turn (its barrier waits 2 s).
  const auto later = std::chrono::milliseconds(500);
  std::thread first([&] {
    if (!even) std::this_thread::sleep_for(later);
    split(s1, 0);
  });
  std::thread second([&] {
    if (even) std::this_thread::sleep_for(later);
    split(s2, 1);
  });
  first.join();
  second.join();
  EXPECT_EQ(succeeded.load(), 0);
  const std::string& timed_out = even ? errors[0] : errors[1];
  const std::string& refused = even ? errors[1] : errors[0];
  EXPECT_NE(timed_out.find("did not finish"), std::string::npos) << timed_out;
  EXPECT_NE(timed_out.find("MPI_THREAD_SERIALIZED"), std::string::npos) << timed_out;
  EXPECT_NE(refused.find("failed while this one waited for its turn"), std::string::npos)
      << refused;
}

}  // namespace
}  // namespace gradcomp::testing
