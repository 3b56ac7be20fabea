// hierarchical: reduce inside the node first (fast links), compress only between nodes.
//   intra allreduce of the bucket (float32, or float16 with intra=fp16)
//   leaders: divide by the local size, run the inner route (allreduce / allgather / twoway)
//            among the leaders; its codec and feedback live on the leaders only
//   intra broadcast of the leader's result, so every rank of a node ends with its bits.
// All nodes must have the same local size (Transport::nodes insists): the leaders'
// mean of node means is then the mean over all ranks.
#include <fmt/format.h>

#include <cstring>

#include "common/half.h"
#include "gradcomp/error.h"
#include "route/frames.h"
#include "route/routes.h"

namespace gradcomp::route {
namespace {

constexpr const char* kHierarchicalName = "hierarchical";

class HierarchicalRoute final : public Route {
 public:
  explicit HierarchicalRoute(const RouteConfig& config);

  void encode(std::span<float> grad, const StepState& step, const Phases& p) override;
  void exchange(const StepState& step, const Phases& p) override;
  void decode(std::span<float> out, const StepState& step, const Phases& p) override;

  size_t bytes_sent() const override { return sent_; }
  size_t memory_bytes() const override;
  bool stateful() const override { return inner_ && inner_->stateful(); }
  void settle(bool keep, const StepState& step) override {
    if (inner_) inner_->settle(keep, step);
  }
  double carry(std::span<float> into) const override;
  std::vector<std::byte> save_state() const override;
  void load_state(std::span<const std::byte> state) override;

 private:
  void reduce_in_node(const Phases& p);
  void run_inner(const StepState& step, const Phases& p);

  Transport& intra_;
  size_t bucket_;
  size_t n_;
  uint32_t local_size_;
  bool leader_;
  bool fp16_;
  std::unique_ptr<Route> inner_;  // leaders only
  std::span<float> sum_;          // the engine's bucket buffer: the node's sum, then the result
  Buffer<uint16_t> half_;    // intra=fp16: the float16 sum
  size_t sent_ = 0;
};

// Throws unless the transports the route needs are there and agree with each other.
void check_hierarchical_env(const RouteEnv& env) {
  if (env.intra == nullptr) {
    throw Error(
        "route 'hierarchical' needs the node transports: RouteEnv::intra (this node's ranks, "
        "rank 0 the leader) and, on leaders, RouteEnv::leaders; the engine takes them from "
        "Transport::nodes");
  }
  const bool leader = env.intra->rank() == 0;
  if (leader && env.leaders == nullptr) {
    throw Error("route 'hierarchical': this rank leads its node (intra rank 0) but "
                "RouteEnv::leaders is null");
  }
  if (!leader && env.leaders != nullptr) {
    throw Error(fmt::format("route 'hierarchical': intra rank {} is not a node leader but "
                            "RouteEnv::leaders is set; only intra rank 0 joins the leaders",
                            env.intra->rank()));
  }
}

HierarchicalRoute::HierarchicalRoute(const RouteConfig& c)
    : intra_((check_hierarchical_env(c.env), *c.env.intra)),
      bucket_(c.bucket),
      n_(c.elements),
      local_size_(static_cast<uint32_t>(intra_.size())),
      leader_(intra_.rank() == 0),
      fp16_(c.option.intra_fp16) {
  if (fp16_) half_.resize(n_);
  if (!leader_) return;
  inner_ = make_flat_route(inner_route_config(c, c.env.leaders));
}

void HierarchicalRoute::encode(std::span<float> grad, const StepState&, const Phases& p) {
  check_length(kHierarchicalName, bucket_, "gradient", grad.size(), n_);
  sent_ = 0;
  sum_ = grad;  // the engine leaves the bucket to the route until decode (route.h)
  if (fp16_) encode_half(grad, half_, p);
}

void HierarchicalRoute::reduce_in_node(const Phases& p) {
  if (local_size_ == 1) return;  // a node of one rank: nothing to add
  const auto issued = Clock::now();
  if (fp16_) {
    const auto bytes = std::as_writable_bytes(std::span(half_));
    p.wait(intra_.allreduce(bytes, DType::kF16, ReduceOp::kSum), "intra allreduce", issued);
    sent_ += bytes.size();
  } else {
    p.wait(intra_.allreduce(sum_), "intra allreduce", issued);
    sent_ += n_ * sizeof(float);
  }
}

void HierarchicalRoute::run_inner(const StepState& step, const Phases& p) {
  p.run("node mean", [&] {
    if (fp16_) {
      for (size_t i = 0; i < n_; ++i) sum_[i] = half_to_float(half_[i]);
    }
    const auto local = static_cast<float>(local_size_);
    if (local_size_ > 1) {
      for (float& x : sum_) x /= local;
    }
  });
  inner_->encode(sum_, step, p);
  inner_->exchange(step, p);
  inner_->decode(sum_, step, p);
  sent_ += inner_->bytes_sent();
}

void HierarchicalRoute::exchange(const StepState& step, const Phases& p) {
  reduce_in_node(p);
  if (leader_) run_inner(step, p);
  if (local_size_ == 1) return;
  const auto issued = Clock::now();
  p.wait(intra_.broadcast(std::as_writable_bytes(sum_), 0), "intra broadcast",
         issued);
  if (leader_) sent_ += n_ * sizeof(float);
}

void HierarchicalRoute::decode(std::span<float> out, const StepState&, const Phases& p) {
  check_length(kHierarchicalName, bucket_, "output", out.size(), n_);
  if (out.data() != sum_.data() && n_ > 0) {  // normally the same memory (route.h)
    p.run("decode", [&] { std::memcpy(out.data(), sum_.data(), n_ * sizeof(float)); });
  }
}

// The inner route's memory is in units of the node's mean, which the leader's gradient enters
// divided by the local size: the leader hands it over local-size times.
double HierarchicalRoute::carry(std::span<float> into) const {
  if (!inner_) return 0;  // nothing is held off the leaders
  Buffer<float> inner(n_, 0.0f);
  const double scale = inner_->carry(inner);
  const auto local = static_cast<float>(local_size_);
  for (size_t i = 0; i < n_; ++i) into[i] += local * inner[i];
  return scale;
}

size_t HierarchicalRoute::memory_bytes() const {
  return half_.size() * sizeof(uint16_t) +
         (inner_ ? inner_->memory_bytes() : 0);
}

std::vector<std::byte> HierarchicalRoute::save_state() const {
  // Codec and feedback live on the leaders: other ranks save an empty list of parts.
  std::vector<std::vector<std::byte>> parts;
  if (inner_) parts.push_back(inner_->save_state());
  return save_parts(kHierarchicalName, {n_, local_size_}, parts);
}

void HierarchicalRoute::load_state(std::span<const std::byte> state) {
  const auto parts = load_parts(kHierarchicalName, state, {n_, local_size_}, inner_ ? 1 : 0);
  if (inner_) inner_->load_state(parts[0]);
}

}  // namespace

std::unique_ptr<Route> make_hierarchical_route(const RouteConfig& config) {
  return std::make_unique<HierarchicalRoute>(config);
}

}  // namespace gradcomp::route
