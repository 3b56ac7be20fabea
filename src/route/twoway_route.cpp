// twoway: BytePS-Compress's two-way compression, with the servers co-located on the workers.
// The bucket is cut into W contiguous shards; rank s is the server of shard s.
//   worker:  compensate the whole bucket (worker feedback), encode each shard (its residual goes
//            into the matching slice of the feedback's residual)
//   alltoallv: shard s of every rank goes to rank s (sizes first, 8 bytes per pair, unless the
//            codec's frames have a fixed size)
//   server:  decode the W frames of its shard in rank order, finalize (mean or majority vote),
//            compensate with the server feedback, re-encode with residual
//   allgatherv: every server's frame goes to every rank (sizes first, likewise)
//   decode:  frame s into out[shard s]; no finalize, the server already aggregated.
// Each rank sends about 2 compressed copies of the bucket whatever W, as the paper's servers do.
#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "gradcomp/error.h"
#include "route/flat_route.h"

namespace gradcomp::route {
namespace {

constexpr const char* kTwowayName = "twoway";

class TwowayRoute final : public FlatRoute {
 public:
  explicit TwowayRoute(const RouteConfig& config);

  void encode(std::span<float> grad, const StepState& step, const Phases& p) override;
  void exchange(const StepState& step, const Phases& p) override;
  void decode(std::span<float> out, const StepState& step, const Phases& p) override;

  bool stateful() const override { return worker_.stateful() || server_.stateful(); }
  // Both sides: the step is kept or rolled back whole.
  void settle(bool keep, const StepState& step) override {
    worker_.settle(keep, step);
    server_.settle(keep, step);
  }
  double carry(std::span<float> into) const override;
  size_t memory_bytes() const override;
  std::vector<std::byte> save_state() const override;
  void load_state(std::span<const std::byte> state) override;

 private:
  // Worker frames of shard s are keyed by (bucket, s, worker), the server's by (bucket, s,
  // server); `rank` is the encoding rank, used again to decode.
  Context context(const StepState& step, uint32_t shard, bool server, uint32_t rank) const {
    return FlatRoute::context(step, shard_key(key_, shard, server), rank);
  }
  void send_shards(const Phases& p);
  void serve(const StepState& step, const Phases& p);
  void gather_results(const Phases& p);

  Coder worker_;
  Coder server_;  // its own codec object: codecs may keep state
  std::vector<Range> shards_;
  std::vector<size_t> max_frames_;  // the largest frame of each shard
  size_t my_max_frame_;             // ... of this rank's shard
  bool fixed_;  // every frame of shard s is max_frames_[s] bytes: no size exchanges

  Buffer<std::byte> sent_frames_;    // this rank's W shard frames, consecutive
  std::vector<uint64_t> send_sizes_;      // their sizes (block j to rank j)
  std::vector<uint64_t> recv_sizes_;      // the sizes of this shard's frames from every rank
  std::vector<size_t> send_counts_;
  std::vector<size_t> recv_counts_;
  Buffer<std::byte> shard_frames_;   // this shard's frames from every rank, rank order
  Buffer<float> shard_sum_;          // their aggregate
  Buffer<std::byte> server_frame_;   // this server's re-encoded shard
  std::vector<uint64_t> server_size_;     // one element: what the size allgather sends
  std::vector<uint64_t> result_sizes_;    // every server's frame size
  std::vector<size_t> result_counts_;
  Buffer<std::byte> results_;        // every server's frame, shard order
};

TwowayRoute::TwowayRoute(const RouteConfig& c)
    : FlatRoute(kTwowayName, c),
      worker_(make_codec(c.codec()), make_feedback(c.feedback())),
      server_(make_codec(c.codec()),
              make_feedback(c.option.server_feedback.empty() ? c.feedback()
                                                             : c.option.server_feedback)) {
  const Codec& codec = worker_.codec();
  check_codec_fits(kTwowayName, codec);
  for (uint32_t s = 0; s < world_size_; ++s) {
    shards_.push_back(shard_range(n_, s, world_size_));
    max_frames_.push_back(codec.max_frame_bytes(shards_.back().size()));
  }
  my_max_frame_ = max_frames_[rank_];
  fixed_ = codec.traits().fixed_frame_size;
  const size_t all_frames = std::accumulate(max_frames_.begin(), max_frames_.end(), size_t{0});
  sent_frames_.resize(all_frames);
  send_sizes_.resize(world_size_);
  recv_sizes_.resize(world_size_);
  send_counts_.resize(world_size_);
  recv_counts_.assign(world_size_, my_max_frame_);
  shard_frames_.resize(my_max_frame_ * world_size_);
  shard_sum_.resize(shards_[rank_].size());
  server_frame_.resize(my_max_frame_);
  server_size_.resize(1);
  result_sizes_.resize(world_size_);
  result_counts_ = max_frames_;
  results_.resize(all_frames);
}

// The whole bucket is compensated once; each shard is encoded on its own, its residual going
// into the matching slice of the feedback's residual.
void TwowayRoute::encode(std::span<float> grad, const StepState& step, const Phases& p) {
  start_step(grad);
  p.run("encode", [&] {
    encode_shards(
        worker_, grad, shards_, max_frames_, sent_frames_, step, world_size_,
        [&](uint32_t s) { return context(step, s, false, rank_); }, send_counts_);
    std::copy(send_counts_.begin(), send_counts_.end(), send_sizes_.begin());
  });
}

void TwowayRoute::send_shards(const Phases& p) {
  auto issued = Clock::now();
  if (!fixed_) {
    p.wait(world_.alltoall(bytes_of(send_sizes_), bytes_of(recv_sizes_)), "shard sizes", issued);
    for (uint32_t r = 0; r < world_size_; ++r) {
      recv_counts_[r] = checked_size(recv_sizes_[r], my_max_frame_, static_cast<int>(r),
                                     "shard frame size");
    }
    sent_ += (world_size_ - 1) * sizeof(uint64_t);  // its own size stays here
  }
  const size_t out = std::accumulate(send_counts_.begin(), send_counts_.end(), size_t{0});
  const size_t in = std::accumulate(recv_counts_.begin(), recv_counts_.end(), size_t{0});
  issued = Clock::now();
  p.wait(world_.alltoallv(std::span(sent_frames_).first(out), send_counts_,
                          std::span(shard_frames_).first(in), recv_counts_),
         "shards", issued);
  sent_ += out - send_counts_[rank_];  // the frame of its own shard does not leave the rank
}

void TwowayRoute::serve(const StepState& step, const Phases& p) {
  p.run("server", [&] {
    decode_sum(worker_.codec(), shard_frames_, recv_counts_, shard_sum_,
               [&](uint32_t r) { return context(step, rank_, false, r); });
    worker_.codec().finalize(shard_sum_, world_size_);
    server_size_[0] =
        server_.encode(shard_sum_, server_frame_, context(step, rank_, true, rank_), step,
                       world_size_);
    if (fixed_) checked_fixed_size(server_.codec(), server_size_[0], my_max_frame_);
  });
}

void TwowayRoute::gather_results(const Phases& p) {
  auto issued = Clock::now();
  if (!fixed_) {
    p.wait(world_.allgather(bytes_of(server_size_), bytes_of(result_sizes_)), "result sizes",
           issued);
    for (uint32_t s = 0; s < world_size_; ++s) {
      result_counts_[s] = checked_size(result_sizes_[s], max_frames_[s], static_cast<int>(s),
                                       "server frame size");
    }
    sent_ += sizeof(uint64_t);
  }
  const size_t total = std::accumulate(result_counts_.begin(), result_counts_.end(), size_t{0});
  const size_t mine = static_cast<size_t>(server_size_[0]);
  issued = Clock::now();
  p.wait(world_.allgatherv(std::span(server_frame_).first(mine),
                           std::span(results_).first(total), result_counts_),
         "results", issued);
  sent_ += mine;
}

void TwowayRoute::exchange(const StepState& step, const Phases& p) {
  send_shards(p);
  serve(step, p);
  gather_results(p);
}

void TwowayRoute::decode(std::span<float> out, const StepState& step, const Phases& p) {
  check_output(out);
  p.run("decode", [&] {
    decode_shards(
        server_.codec(), results_, shards_, out,
        [&](uint32_t s) { return context(step, s, true, s); },
        [&](uint32_t s) { return result_counts_[s]; });
  });
}

// The worker's residual, and this rank's server residual: it is in units of the shard's mean,
// so it enters this rank's next gradient W times, to count once in the mean over W ranks.
double TwowayRoute::carry(std::span<float> into) const {
  worker_.feedback().add_unsent(into);
  const Range mine = shards_[rank_];
  Buffer<float> server(mine.size(), 0.0f);
  server_.feedback().add_unsent(server);
  const auto w = static_cast<float>(world_size_);
  for (size_t i = 0; i < server.size(); ++i) into[mine.begin + i] += w * server[i];
  // Both sides keep steps alike; a side without state has no scale to tell.
  return worker_.stateful() ? worker_.memory_scale() : server_.memory_scale();
}

size_t TwowayRoute::memory_bytes() const {
  return sent_frames_.size() + shard_frames_.size() + shard_sum_.size() * sizeof(float) +
         server_frame_.size() + results_.size() + worker_.memory_bytes() + server_.memory_bytes();
}

// Parts: worker codec, server codec, worker feedback, server feedback (the order of the
// first checkpoints).
std::vector<std::byte> TwowayRoute::save_state() const {
  auto worker = worker_.save_state();
  auto server = server_.save_state();
  return save_parts(kTwowayName, shape(), {worker[0], server[0], worker[1], server[1]});
}

void TwowayRoute::load_state(std::span<const std::byte> state) {
  const auto parts = load_parts(kTwowayName, state, shape(), 4);
  worker_.load_state(parts[0], parts[2]);
  server_.load_state(parts[1], parts[3]);
}

}  // namespace

std::unique_ptr<Route> make_twoway_route(const RouteConfig& config) {
  return std::make_unique<TwowayRoute>(config);
}

}  // namespace gradcomp::route
