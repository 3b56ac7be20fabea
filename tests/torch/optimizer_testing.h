// What the libtorch optimizers' tests share: a small network held as plain tensors, its loss
// on each rank's own data, byte comparisons across ranks, and checkpoints through torch's
// archives (saved / load).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "gradcomp/torch/distributed_optimizer.h"
#include "gradcomp/torch/two_stage.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"

namespace gradcomp::torch::optimizer_testing {

using Parameters = ::torch::OrderedDict<std::string, at::Tensor>;

// A small network held as plain tensors: w1, b1, w2, b2 (their values shifted by `offset`),
// and with `rows`, "rows", an embedding-like table whose rows 1..3 loss_of gives gradients
// only from step `rows_from` on.
inline Parameters make_network(float offset, bool rows) {
  Parameters p;
  auto init = [offset](std::vector<int64_t> shape, float phase) {
    const int64_t n = c10::multiply_integers(shape);
    return (at::sin(at::arange(n, at::kFloat) * 0.37f + phase + offset) * 0.3f)
        .reshape(shape)
        .requires_grad_();
  };
  p.insert("w1", init({16, 8}, 0.1f));
  p.insert("b1", init({16}, 0.2f));
  p.insert("w2", init({4, 16}, 0.3f));
  p.insert("b2", init({4}, 0.4f));
  if (rows) p.insert("rows", init({4, 8}, 0.5f));
  return p;
}

inline Parameters make_parameters() { return make_network(0, /*rows=*/true); }

inline Parameters copy_of(const Parameters& p) {
  Parameters c;
  for (const auto& item : p) c.insert(item.key(), item.value().detach().clone().requires_grad_());
  return c;
}

inline at::Tensor loss_of(const Parameters& p, int rank, int step, int rows_from = 0) {
  const float k = 0.1f * static_cast<float>(rank + 1);
  const at::Tensor x = at::sin(at::arange(32 * 8, at::kFloat).reshape({32, 8}) * k + step);
  const at::Tensor y = at::cos(at::arange(32 * 4, at::kFloat).reshape({32, 4}) * k - step);
  const at::Tensor h = at::tanh(x.mm(p["w1"].t()) + p["b1"]);
  const at::Tensor rows = step >= rows_from ? p["rows"] : p["rows"].narrow(0, 0, 1);
  return (h.mm(p["w2"].t()) + p["b2"] - y).pow(2).mean() + (rows * x[0]).sum() * 0.01;
}

inline std::vector<std::byte> bytes_of(const Parameters& p) {
  std::vector<std::byte> out;
  for (const auto& item : p) {
    const at::Tensor c = item.value().detach().contiguous();
    const auto* data = static_cast<const std::byte*>(c.data_ptr());
    out.insert(out.end(), data, data + c.numel() * c.element_size());
  }
  return out;
}

inline void expect_identical_across_ranks(const Parameters& p, const std::string& what) {
  const auto mine = bytes_of(p);
  const auto all = testing::gather_bytes(mine);
  for (int r = 0; r < testing::world()->size(); ++r) {
    EXPECT_EQ(std::memcmp(mine.data(), all.data() + r * mine.size(), mine.size()), 0)
        << what << ": rank " << testing::world()->rank() << " differs from rank " << r;
  }
}

// Steps from..from+steps-1 of this rank's data.
inline void train(Parameters& p, TwoStageOptimizer& opt, int from, int steps, int rows_from = 0) {
  for (int step = from; step < from + steps; ++step) {
    opt.zero_grad();
    loss_of(p, testing::world()->rank(), step, rows_from).backward();
    opt.step();
  }
}

inline std::string saved(const ::torch::optim::Optimizer& optimizer) {
  ::torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

inline void load(::torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  ::torch::serialize::InputArchive archive;
  archive.load_from(in);
  optimizer.load(archive);
}

// A parameter's state in a two-stage optimizer, as the optimizer's own state type.
template <typename State>
const State& state_of(const TwoStageOptimizer& opt, const at::Tensor& p) {
  return static_cast<const State&>(*opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
}

// The warnings `fn` raised through c10's handler (TORCH_WARN), in order.
template <typename Fn>
std::vector<std::string> warnings_of(Fn&& fn) {
  struct Collect : c10::WarningHandler {
    std::vector<std::string> messages;
    void process(const c10::SourceLocation&, const std::string& msg, bool) override {
      messages.push_back(msg);
    }
  };
  Collect collect;
  c10::Warning::WarningHandlerGuard guard(&collect);
  fn();
  return collect.messages;
}

// What every two-stage optimizer refuses the same way: a parameter that is not float32 (named
// in the error), and being wrapped in DistributedOptimizer.
template <typename Optimizer>
void expect_refuses_wide_parameters_and_wrapping(const std::string& name) {
  Parameters wide = make_parameters();
  wide.insert("wide", at::ones({3}, at::kDouble).requires_grad_());
  EXPECT_TRUE(testing::contains(testing::error_text([&] { Optimizer opt(wide, testing::world()); }),
                                name + ": parameter 'wide' is a Double tensor on cpu; float32 "
                                       "contiguous CPU parameters only"));
  Parameters p = make_parameters();
  Optimizer opt(p, testing::world());
  EXPECT_TRUE(testing::contains(
      testing::error_text([&] { DistributedOptimizer wrapped(opt, p, testing::world()); }),
      name + " averages over the ranks by itself"));
}

}  // namespace gradcomp::torch::optimizer_testing
