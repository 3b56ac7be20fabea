// sharded: hierarchical, with every rank of a node at work across nodes (Espresso's and CGX's
// scatter-reduce-allgather), where the hierarchical route leaves it to one leader per node.
//   intra reduce-scatter: the bucket is cut into L contiguous shards (L: ranks per node); local
//            rank l receives shard l of every rank of its node (an alltoallv, float32 or
//            float16 with intra=fp16) and sums them in local-rank order: the node's sum of
//            shard l, then its mean
//   cross:   local rank l runs the inner route (allreduce / allgather / twoway) on shard l
//            among the ranks of local index l of every node; its codec and feedback hold that
//            shard's state
//   intra allgather: every rank of the node receives every shard's result (float32)
// Intra-node traffic per rank is about 2 (L - 1) / L of the bucket, against the leader route's
// allreduce and broadcast; the inter-node traffic is spread over all L ranks of a node.
// Every rank of a node ends with the same bits (the allgather copies them), and every node
// with the same (each inner route gives its group the same bits).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/half.h"
#include "gradcomp/error.h"
#include "route/frames.h"
#include "route/routes.h"

namespace gradcomp::route {
namespace {

constexpr const char* kShardedName = "sharded";

class ShardedRoute final : public Route {
 public:
  explicit ShardedRoute(const RouteConfig& config);

  void encode(std::span<float> grad, const StepState& step, const Phases& p) override;
  void exchange(const StepState& step, const Phases& p) override;
  void decode(std::span<float> out, const StepState& step, const Phases& p) override;

  size_t bytes_sent() const override { return sent_; }
  size_t memory_bytes() const override;
  bool stateful() const override { return inner_->stateful(); }
  void settle(bool keep, const StepState& step) override { inner_->settle(keep, step); }
  double carry(std::span<float> into) const override;
  std::vector<std::byte> save_state() const override;
  void load_state(std::span<const std::byte> state) override;

 private:
  void scatter_reduce(const Phases& p);
  void gather(const Phases& p);

  Transport& intra_;
  size_t bucket_;
  size_t n_;
  uint32_t local_size_;
  uint32_t local_rank_;
  bool fp16_;
  std::vector<Range> shards_;  // shard l: local rank l's
  Range mine_;
  size_t wire_;                // bytes per element inside the node (4, or 2 with intra=fp16)
  std::vector<size_t> send_counts_, recv_counts_, gather_counts_;  // bytes
  std::unique_ptr<Route> inner_;  // this shard's route across nodes
  std::span<float> sum_;          // the engine's bucket buffer: the input, then the result
  Buffer<uint16_t> half_;         // intra=fp16: the bucket as float16
  Buffer<std::byte> received_;    // shard `mine_` from every local rank, local-rank order
  Buffer<float> shard_;           // the node's mean of shard `mine_`, then its result
  size_t sent_ = 0;
};

void check_sharded_env(const RouteEnv& env) {
  if (env.intra == nullptr || env.cross == nullptr) {
    throw Error(
        "route 'sharded' needs the node transports: RouteEnv::intra (this node's ranks) and "
        "RouteEnv::cross (this local index's ranks on every node); the engine takes them from "
        "Transport::nodes");
  }
}

ShardedRoute::ShardedRoute(const RouteConfig& c)
    : intra_((check_sharded_env(c.env), *c.env.intra)),
      bucket_(c.bucket),
      n_(c.elements),
      local_size_(static_cast<uint32_t>(intra_.size())),
      local_rank_(static_cast<uint32_t>(intra_.rank())),
      fp16_(c.option.intra_fp16),
      wire_(fp16_ ? sizeof(uint16_t) : sizeof(float)) {
  for (uint32_t l = 0; l < local_size_; ++l) shards_.push_back(shard_range(n_, l, local_size_));
  mine_ = shards_[local_rank_];
  for (const Range& r : shards_) {
    send_counts_.push_back(r.size() * wire_);
    recv_counts_.push_back(mine_.size() * wire_);
    gather_counts_.push_back(r.size() * sizeof(float));
  }
  if (fp16_) half_.resize(n_);
  received_.resize(mine_.size() * wire_ * local_size_);
  shard_.resize(mine_.size());
  RouteConfig inner = inner_route_config(c, c.env.cross);
  inner.key = shard_key(c.key, local_rank_, false);  // each shard draws its own randomness
  inner.elements = mine_.size();
  inner.layout.clear();  // the tensors' shapes are the bucket's, not the shard's
  inner_ = make_flat_route(inner);
}

void ShardedRoute::encode(std::span<float> grad, const StepState&, const Phases& p) {
  check_length(kShardedName, bucket_, "gradient", grad.size(), n_);
  sent_ = 0;
  sum_ = grad;  // the engine leaves the bucket to the route until decode (route.h)
  if (fp16_) encode_half(grad, half_, p);
}

void ShardedRoute::scatter_reduce(const Phases& p) {
  const auto in = fp16_ ? std::as_bytes(std::span(half_)) : std::as_bytes(sum_);
  const auto issued = Clock::now();
  p.wait(intra_.alltoallv(in, send_counts_, received_, recv_counts_), "intra reduce-scatter",
         issued);
  sent_ += in.size() - send_counts_[local_rank_];  // its own shard stays here
  p.run("node mean", [&] {
    const size_t m = mine_.size();
    const auto inv = 1.0f / static_cast<float>(local_size_);
    if (fp16_) {
      const auto* h = reinterpret_cast<const uint16_t*>(received_.data());
      for (size_t i = 0; i < m; ++i) {
        float s = half_to_float(h[i]);
        for (uint32_t l = 1; l < local_size_; ++l) s += half_to_float(h[l * m + i]);
        shard_[i] = s * inv;
      }
    } else {
      const auto* f = reinterpret_cast<const float*>(received_.data());
      for (size_t i = 0; i < m; ++i) {
        float s = f[i];
        for (uint32_t l = 1; l < local_size_; ++l) s += f[l * m + i];
        shard_[i] = s * inv;
      }
    }
  });
}

void ShardedRoute::gather(const Phases& p) {
  const auto issued = Clock::now();
  p.wait(intra_.allgatherv(std::as_bytes(std::span(shard_)), std::as_writable_bytes(sum_),
                           gather_counts_),
         "intra allgather", issued);
  sent_ += (local_size_ - 1) * shard_.size() * sizeof(float);
}

void ShardedRoute::exchange(const StepState& step, const Phases& p) {
  if (local_size_ > 1) {
    scatter_reduce(p);
  } else {
    p.run("node mean", [&] { std::copy(sum_.begin(), sum_.end(), shard_.begin()); });
  }
  inner_->encode(shard_, step, p);
  inner_->exchange(step, p);
  inner_->decode(shard_, step, p);
  sent_ += inner_->bytes_sent();
  if (local_size_ > 1) {
    gather(p);
  } else {
    std::copy(shard_.begin(), shard_.end(), sum_.begin());
  }
}

void ShardedRoute::decode(std::span<float> out, const StepState&, const Phases& p) {
  check_length(kShardedName, bucket_, "output", out.size(), n_);
  if (out.data() != sum_.data() && n_ > 0) {  // normally the same memory (route.h)
    p.run("decode", [&] { std::memcpy(out.data(), sum_.data(), n_ * sizeof(float)); });
  }
}

// The inner route's memory is in units of the node's mean of this shard, which this rank's
// gradient enters divided by the local size: it is handed over local-size times.
double ShardedRoute::carry(std::span<float> into) const {
  Buffer<float> inner(mine_.size(), 0.0f);
  const double scale = inner_->carry(inner);
  const auto local = static_cast<float>(local_size_);
  for (size_t i = 0; i < inner.size(); ++i) into[mine_.begin + i] += local * inner[i];
  return scale;
}

size_t ShardedRoute::memory_bytes() const {
  return half_.size() * sizeof(uint16_t) + received_.size() + shard_.size() * sizeof(float) +
         inner_->memory_bytes();
}

std::vector<std::byte> ShardedRoute::save_state() const {
  return save_parts(kShardedName, {n_, local_size_}, {inner_->save_state()});
}

void ShardedRoute::load_state(std::span<const std::byte> state) {
  const auto parts = load_parts(kShardedName, state, {n_, local_size_}, 1);
  inner_->load_state(parts[0]);
}

}  // namespace

std::unique_ptr<Route> make_sharded_route(const RouteConfig& config) {
  return std::make_unique<ShardedRoute>(config);
}

}  // namespace gradcomp::route
