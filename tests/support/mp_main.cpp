// main() of every multi-process test: connects the transport from the environment, runs the
// tests on every rank, and makes all ranks agree on the verdict, so a failure on any rank fails
// the test on all of them (and the launcher reports it).
#include <cstdio>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "mp_test.h"

namespace gradcomp::testing {
namespace {
std::shared_ptr<Transport> g_world;
}

std::shared_ptr<Transport> world() { return g_world; }

std::vector<std::byte> gather_bytes(std::span<const std::byte> local) {
  const size_t n = local.size();
  std::vector<std::byte> all(n * static_cast<size_t>(g_world->size()));
  g_world->allgather(local, all)->wait(g_world->timeout());
  return all;
}

}  // namespace gradcomp::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using gradcomp::testing::g_world;
  try {
    g_world = gradcomp::make_transport();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "could not start the transport: %s\n", e.what());
    return 2;
  }
  const int rank = g_world->rank();
  if (rank != 0) {  // rank 0 prints the run; the others print only their failures
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int verdict = failed;
  try {
    g_world->allreduce(std::as_writable_bytes(std::span<int>(&verdict, 1)), gradcomp::DType::kI32,
                       gradcomp::ReduceOp::kMax)
        ->wait(g_world->timeout());
    g_world->barrier()->wait(g_world->timeout());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: could not agree on the verdict: %s\n", rank, e.what());
    return 1;
  }
  if (verdict != 0 && failed == 0 && rank == 0) {
    std::fprintf(stderr, "another rank failed\n");
  }
  if (rank != 0 && failed) std::fprintf(stderr, "rank %d failed\n", rank);
  g_world.reset();
  return verdict;
}
