// The libtorch DistributedOptimizer over route 'servers' across real processes (mpirun and the
// Gloo launcher, W = 2 and 4), with W dedicated parameter servers on threads of the worker
// processes (support/server_threads.h): with S = W the route computes what the co-located
// two-way route does, bit for bit, and a checkpoint taken with save_all_states (which fetches
// what the servers hold) resumes exactly.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "gradcomp/torch/distributed_optimizer.h"
#include "optimizer_testing.h"
#include "support/mp_test.h"
#include "support/server_threads.h"

namespace gradcomp::torch {
namespace {

using optimizer_testing::bytes_of;
using optimizer_testing::copy_of;
using optimizer_testing::expect_identical_across_ranks;
using optimizer_testing::make_parameters;
using optimizer_testing::Parameters;
using testing::world;

[[maybe_unused]] auto* const g_servers =
    ::testing::AddGlobalTestEnvironment(new testing::ServerThreads);

GradientOptions options_for(const std::string& route) {
  GradientOptions options;
  options.compression = parse_compression("topk:ratio=0.25|ef|" + route);
  options.min_compress_elements = 1;  // compress every tensor
  options.engine.seed = 5;
  return options;
}

void train(Parameters& p, DistributedOptimizer& opt, int from, int steps) {
  for (int step = from; step < from + steps; ++step) {
    opt.zero_grad();
    optimizer_testing::loss_of(p, world()->rank(), step).backward();
    opt.step();
  }
}

// The parameters after `steps` steps of momentum SGD over `route`.
std::vector<std::byte> trained(const std::string& route, int steps) {
  Parameters p = make_parameters();
  ::torch::optim::SGD sgd(p.values(), ::torch::optim::SGDOptions(0.1).momentum(0.9));
  DistributedOptimizer opt(sgd, p, world(), options_for(route));
  train(p, opt, 0, steps);
  EXPECT_LT(opt.gradients().last_step().bytes_sent, opt.gradients().last_step().uncompressed_bytes);
  expect_identical_across_ranks(p, route);
  return bytes_of(p);
}

TEST(DistributedOptimizerOverServers, ComputesWhatTheCoLocatedTwoWayRouteDoes) {
  const auto twoway = trained("twoway", 4);
  EXPECT_EQ(trained("servers", 4), twoway);
  EXPECT_NE(bytes_of(make_parameters()), twoway);  // they trained
}

// The servers keep error feedback of their own: save_all_states fetches it, and a new
// optimizer loaded from it continues exactly as the run that went on; a fresh one does not.
TEST(DistributedOptimizerOverServers, AllRanksCheckpointResumesExactly) {
  const GradientOptions options = options_for("servers");
  Parameters p = make_parameters();
  ::torch::optim::SGD sgd(p.values(), ::torch::optim::SGDOptions(0.1));
  std::vector<std::byte> state;
  Parameters saved;
  std::vector<std::byte> went_on;
  {
    DistributedOptimizer opt(sgd, p, world(), options);
    train(p, opt, 0, 3);
    state = opt.gradients().save_all_states().at(static_cast<size_t>(world()->rank()));
    saved = copy_of(p);
    train(p, opt, 3, 3);
    went_on = bytes_of(p);
  }
  const auto continued = [&](bool load) {
    Parameters q = copy_of(saved);
    ::torch::optim::SGD sgd_q(q.values(), ::torch::optim::SGDOptions(0.1));
    DistributedOptimizer opt(sgd_q, q, world(), options);
    if (load) opt.gradients().load_state(state);
    train(q, opt, 3, 3);
    return bytes_of(q);
  };
  EXPECT_EQ(continued(true), went_on);
  EXPECT_NE(continued(false), went_on);
}

}  // namespace
}  // namespace gradcomp::torch
