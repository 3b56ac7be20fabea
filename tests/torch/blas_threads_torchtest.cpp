// The libtorch front end's check of the BLAS under torch: the threads of the OpenBLAS Debian's
// libtorch multiplies in are read from the library itself; more of them than torch uses is
// told once per process, at the first optimizer, with what to do about it.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "gradcomp/torch/blas_threads.h"
#include "gradcomp/torch/distributed_optimizer.h"
#include "optimizer_testing.h"
#include "support/mp_test.h"

namespace gradcomp::torch {
namespace {

using optimizer_testing::warnings_of;
using testing::world;

// openblas_set_num_threads of the OpenBLAS this process loaded (libtorch's).
void set_openblas_threads(int threads) {
  void* self = dlopen(nullptr, RTLD_LAZY);
  using Set = void (*)(int);
  const auto set = reinterpret_cast<Set>(dlsym(self, "openblas_set_num_threads"));
  ASSERT_NE(set, nullptr) << "no openblas_set_num_threads in this process";
  set(threads);
}

int blas_warnings(const std::vector<std::string>& warnings) {
  int n = 0;
  for (const auto& w : warnings) n += w.find("OpenBLAS runs") != std::string::npos;
  return n;
}

TEST(BlasThreads, OpenBlasThreadsAreReadFromTheLibraryAndToldOnceWhenTheyOutnumberTorchs) {
  ASSERT_TRUE(openblas_threads().has_value()) << "Debian's libtorch multiplies in OpenBLAS";
  at::set_num_threads(1);
  set_openblas_threads(3);
  EXPECT_EQ(openblas_threads(), 3);
  const std::string warning = blas_threads_warning(openblas_threads(), at::get_num_threads());
  EXPECT_NE(warning.find("torch uses 1 thread(s) but OpenBLAS runs 3"), std::string::npos)
      << warning;
  EXPECT_NE(warning.find("OMP_NUM_THREADS=1"), std::string::npos) << warning;
  EXPECT_EQ(blas_threads_warning(3, 3), "");
  EXPECT_EQ(blas_threads_warning(std::nullopt, 1), "");
  // The first optimizer of the process says it, the second does not.
  auto p = optimizer_testing::make_network(0, /*rows=*/false);
  ::torch::optim::SGD sgd(p.values(), ::torch::optim::SGDOptions(0.1));
  const auto first = warnings_of([&] { DistributedOptimizer opt(sgd, p, world()); });
  const auto second = warnings_of([&] { DistributedOptimizer opt(sgd, p, world()); });
  EXPECT_EQ(blas_warnings(first), 1);
  EXPECT_EQ(blas_warnings(second), 0);
  set_openblas_threads(1);
  EXPECT_EQ(openblas_threads(), 1);
}

}  // namespace
}  // namespace gradcomp::torch
