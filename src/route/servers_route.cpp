// servers: BytePS-Compress's two-way compression with dedicated parameter servers (`gradcomp
// server` processes, route/server.cpp), reached over the server link (route/server_link.h).
// The bucket is cut into S contiguous shards; server s holds shard s.
//   worker:  compensate the whole bucket (worker feedback), encode each shard (its residual
//            goes into the matching slice of the feedback's residual)
//   control: the header that tells the servers which bucket and step come (and how to settle
//            the bucket's previous step)
//   alltoallv x 2: each worker's frame of shard s goes to server s (its size first, 8 bytes,
//            unless the codec's frames have a fixed size)
//   server:  decode the W frames in worker order, finalize, compensate with the server
//            feedback, re-encode with residual
//   alltoallv x 2: every server's frame goes to every worker (its size first, likewise),
//            on the link's pull stream, at decode: meanwhile the next bucket is pushed
//   decode:  frame s into out[shard s]; the servers already aggregated.
// Checkpoints: fetch_remote_state() has every server send its state of the bucket to its keeper
// (worker s % W), which saves it with its own; after load_state the keepers send it back before
// the bucket's next operation.
// A worker sends and receives about one compressed bucket per step whatever W and S, and does
// no server work: that runs on the servers' own cores.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "gradcomp/error.h"
#include "route/flat_route.h"
#include "route/server_link.h"

namespace gradcomp::route {
namespace {

constexpr const char* kServersName = "servers";

class ServersRoute final : public FlatRoute {
 public:
  explicit ServersRoute(const RouteConfig& config);
  ~ServersRoute() override { link_.forget(id_); }

  void encode(std::span<float> grad, const StepState& step, const Phases& p) override;
  void exchange(const StepState& step, const Phases& p) override;
  void decode(std::span<float> out, const StepState& step, const Phases& p) override;

  bool stateful() const override { return worker_.stateful() || server_stateful_; }
  // The servers settle with the bucket's next header.
  void settle(bool keep, const StepState& step) override {
    worker_.settle(keep, step);
    settle_ = keep ? ServerSettle::kKeep : ServerSettle::kRollBack;
    settled_ = step;
  }
  // The worker's residual only: the servers' share is with the servers (retire fetches it).
  double carry(std::span<float> into) const override {
    worker_.feedback().add_unsent(into);
    return worker_.memory_scale();
  }
  double retire(std::span<float> into) override;
  void fetch_remote_state() override;
  size_t memory_bytes() const override;
  std::vector<std::byte> save_state() const override;
  std::vector<std::byte> save_undo_state() const override;
  void load_state(std::span<const std::byte> state) override;

 private:
  Context context(const StepState& step, uint32_t shard, bool server, uint32_t rank) const {
    return codec_context(env_, shard_key(key_, shard, server), step, rank, world_size_);
  }
  ServerHeader header(ServerOp op, const StepState& step);
  // Runs `operation` (collectives on the link); a CommError or TimeoutError it raises comes
  // back with the link's ranks named (its messages speak of link ranks).
  template <typename F>
  void on_link(F operation) {
    try {
      operation();
    } catch (const CommError& e) {
      rethrow_with_link_ranks(e, link_.workers(), servers_);
    }
  }
  void send_shards(const Phases& p);
  void receive_results(const Phases& p);
  void restore_if_loaded();
  // The servers whose state this worker keeps in checkpoints, in server order.
  std::vector<uint32_t> kept_servers() const;
  // Throws Error unless `state` is a server state of shard s that the servers' coder accepts.
  void check_server_state(uint32_t s, std::span<const std::byte> state) const;

  ServerLink& link_;
  Transport& wire_;  // the link's transport (headers, pushes): W workers, then S servers
  Transport& pull_;  // the link's pull stream (the servers' results), the same ranks
  uint32_t servers_;
  Coder worker_;
  std::string codec_spec_;
  std::string server_feedback_;
  bool server_stateful_;
  // The servers' states this worker keeps (kept_servers() order): fetched for a checkpoint, or
  // loaded from one; `held_current_` while they are the servers' state (no step since), and
  // `restore_` until the servers got them back.
  std::vector<std::vector<std::byte>> held_;
  bool held_current_ = false;
  bool restore_ = false;
  uint64_t id_ = 0;
  ServerSettle settle_ = ServerSettle::kNone;
  StepState settled_{};
  std::vector<Range> shards_;
  std::vector<size_t> max_frames_;  // the largest frame of each shard
  bool fixed_;  // every frame of shard s is max_frames_[s] bytes: no size exchanges

  Buffer<std::byte> sent_frames_;     // this worker's S shard frames, consecutive
  std::vector<uint64_t> shard_sizes_;   // S words: this worker's frame of shard s, to server s
  std::vector<uint64_t> result_sizes_;  // S words: server s's frame
  std::vector<size_t> server_words_;    // per link rank: a size word to or from each server
  std::vector<size_t> send_counts_;     // per link rank; workers get nothing
  std::vector<size_t> recv_counts_;
  // Zeros, one per link rank: what a push receives and a pull sends (sized once: the exchange
  // thread allocates nothing per step).
  std::vector<size_t> no_counts_;
  Buffer<std::byte> results_;  // every server's frame, shard order
};

// The server side's codec and feedback, as a two-way route's; whether they keep state decides
// whether the engine settles steps.
bool server_keeps_state(const RouteConfig& c) {
  return Coder(make_codec(c.codec()), make_feedback(c.option.server_feedback)).stateful();
}

ServersRoute::ServersRoute(const RouteConfig& c)
    : FlatRoute(kServersName, c),
      link_(*c.env.servers),
      wire_(link_.transport()),
      pull_(link_.pull_transport()),
      servers_(link_.servers()),
      worker_(make_codec(c.codec()), make_feedback(c.feedback())),
      codec_spec_(c.codec()),
      server_feedback_(c.option.server_feedback),
      server_stateful_(server_keeps_state(c)) {
  const Codec& codec = worker_.codec();
  check_codec_fits(kServersName, codec);
  if (link_.workers() != world_size_ || link_.rank() != rank_) {
    throw Error(fmt::format("route 'servers': bucket {} runs on worker {} of {}, the server "
                            "link on worker {} of {}",
                            bucket_, rank_, world_size_, link_.rank(), link_.workers()));
  }
  shards_ = server_shards(n_, servers_);
  for (const Range& r : shards_) max_frames_.push_back(codec.max_frame_bytes(r.size()));
  fixed_ = codec.traits().fixed_frame_size;
  const size_t all_frames = std::accumulate(max_frames_.begin(), max_frames_.end(), size_t{0});
  const size_t ranks = static_cast<size_t>(wire_.size());
  sent_frames_.resize(all_frames);
  shard_sizes_.assign(servers_, 0);
  result_sizes_.assign(servers_, 0);
  server_words_.assign(ranks, 0);
  send_counts_.assign(ranks, 0);
  recv_counts_.assign(ranks, 0);
  no_counts_.assign(ranks, 0);
  for (uint32_t s = 0; s < servers_; ++s) {
    recv_counts_[link_.server_rank(s)] = max_frames_[s];
    server_words_[link_.server_rank(s)] = sizeof(uint64_t);
  }
  results_.resize(all_frames);
  on_link([&] {
    id_ = link_.open({.codec = c.codec(),
                      .server_feedback = c.option.server_feedback,
                      .elements = n_,
                      .key = key_,
                      .seed = env_.seed,
                      .threads = env_.threads,
                      .live = {}});
  });
}

ServerHeader ServersRoute::header(ServerOp op, const StepState& step) {
  ServerHeader h;
  h.op = op;
  h.id = id_;
  h.step = step;
  h.settle = settle_;
  h.settled = settled_;
  settle_ = ServerSettle::kNone;
  return h;
}

void ServersRoute::encode(std::span<float> grad, const StepState& step, const Phases& p) {
  start_step(grad);
  p.run("encode", [&] {
    // The link's ranks: W workers (nothing goes to them), then server s gets shard s.
    const auto to_servers = std::span(send_counts_).subspan(link_.server_rank(0));
    encode_shards(
        worker_, grad, shards_, max_frames_, sent_frames_, step, world_size_,
        [&](uint32_t s) { return context(step, s, false, rank_); }, to_servers);
    std::copy(to_servers.begin(), to_servers.end(), shard_sizes_.begin());
  });
}

void ServersRoute::send_shards(const Phases& p) {
  auto issued = Clock::now();
  if (!fixed_) {
    p.wait(wire_.alltoallv(bytes_of(shard_sizes_), server_words_, {}, no_counts_), "shard sizes",
           issued);
    sent_ += servers_ * sizeof(uint64_t);
  }
  const size_t out = std::accumulate(send_counts_.begin(), send_counts_.end(), size_t{0});
  issued = Clock::now();
  p.wait(wire_.alltoallv(std::span(sent_frames_).first(out), send_counts_, {}, no_counts_),
         "shards", issued);
  sent_ += out;
}

void ServersRoute::receive_results(const Phases& p) {
  auto issued = Clock::now();
  if (!fixed_) {
    p.wait(pull_.alltoallv({}, no_counts_, bytes_of(result_sizes_), server_words_),
           "result sizes", issued);
    for (uint32_t s = 0; s < servers_; ++s) {
      const int from = link_.server_rank(s);
      recv_counts_[from] = checked_size(result_sizes_[s], max_frames_[s], from, "server frame size");
    }
  }
  const size_t in = std::accumulate(recv_counts_.begin(), recv_counts_.end(), size_t{0});
  issued = Clock::now();
  p.wait(pull_.alltoallv({}, no_counts_, std::span(results_).first(in), recv_counts_), "results",
         issued);
}

// The push; the pull waits for decode (the engine's next stage), so that the exchange stage
// pushes the next bucket meanwhile.
void ServersRoute::exchange(const StepState& step, const Phases& p) {
  on_link([&] {
    restore_if_loaded();
    held_current_ = false;
    held_ = {};  // the servers' state moves on
    link_.send(header(ServerOp::kExchange, step), {}, &p);
    send_shards(p);
  });
}

void ServersRoute::decode(std::span<float> out, const StepState& step, const Phases& p) {
  check_output(out);
  on_link([&] { receive_results(p); });
  p.run("decode", [&] {
    decode_shards(
        worker_.codec(), results_, shards_, out,
        [&](uint32_t s) { return context(step, s, true, s); },
        [&](uint32_t s) { return recv_counts_[link_.server_rank(s)]; });
  });
}

// The servers send what they hold of the bucket (their feedback's unsent memory, in units of
// the mean, and its loss scale) to every worker, and drop it. Every worker adds it, so a later
// mean over the W workers delivers it once.
double ServersRoute::retire(std::span<float> into) {
  check_output(into);
  const double scale = carry(into);
  const size_t ranks = static_cast<size_t>(wire_.size());
  std::vector<size_t> counts(ranks, 0);
  for (uint32_t s = 0; s < servers_; ++s) {
    counts[link_.server_rank(s)] = sizeof(double) + shards_[s].size() * sizeof(float);
  }
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  std::vector<std::byte> held(total);
  const std::vector<size_t> nothing(ranks, 0);
  on_link([&] {
    restore_if_loaded();
    link_.send(header(ServerOp::kRetire, StepState{}), {}, nullptr);
    wire_.alltoallv({}, nothing, held, counts)->wait(wire_.timeout() + Milliseconds(1000));
  });
  double server_scale = 0;
  size_t at = 0;
  for (uint32_t s = 0; s < servers_; ++s) {
    double scale_s = 0;
    std::memcpy(&scale_s, held.data() + at, sizeof(double));
    at += sizeof(double);
    const Range r = shards_[s];
    const auto* values = reinterpret_cast<const float*>(held.data() + at);
    for (size_t i = 0; i < r.size(); ++i) into[r.begin + i] += values[i];
    at += r.size() * sizeof(float);
    if (scale_s > 0) server_scale = scale_s;
  }
  // Both sides keep steps alike; a side without state has no scale to tell.
  return worker_.stateful() ? scale : server_scale;
}

size_t ServersRoute::memory_bytes() const {
  return sent_frames_.size() + results_.size() + worker_.memory_bytes();
}

std::vector<uint32_t> ServersRoute::kept_servers() const {
  std::vector<uint32_t> kept;
  for (uint32_t s = 0; s < servers_; ++s) {
    if (state_keeper(s, world_size_) == rank_) kept.push_back(s);
  }
  return kept;
}

void ServersRoute::fetch_remote_state() {
  if (!server_stateful_) return;
  on_link([&] {
    restore_if_loaded();
    link_.send(header(ServerOp::kSave, StepState{}), {}, nullptr);
    const auto in = swap_blobs(wire_, std::vector<std::vector<std::byte>>(wire_.size()),
                               server_state_limit(n_));
    held_.clear();
    for (uint32_t s : kept_servers()) {
      check_server_state(s, in[link_.server_rank(s)]);
      held_.push_back(in[link_.server_rank(s)]);
    }
    held_current_ = true;
  });
}

void ServersRoute::restore_if_loaded() {
  if (!restore_) return;
  link_.send(header(ServerOp::kRestore, StepState{}), {}, nullptr);
  std::vector<std::vector<std::byte>> out(wire_.size());
  const std::vector<uint32_t> kept = kept_servers();
  for (size_t i = 0; i < kept.size(); ++i) out[link_.server_rank(kept[i])] = held_[i];
  swap_blobs(wire_, out, 0);
  restore_ = false;
}

void ServersRoute::check_server_state(uint32_t s, std::span<const std::byte> state) const {
  const auto parts = load_parts(kServerStateName, state, {shards_[s].size(), world_size_}, 2);
  Coder scratch(make_codec(codec_spec_), make_feedback(server_feedback_));
  scratch.load_state(parts[0], parts[1]);
}

// A route whose servers keep state saves the worker's two parts, a flag part (1: the states of
// the servers this worker keeps follow, one part each; 0: the servers keep theirs, an undo
// state), then those states.
std::vector<std::byte> ServersRoute::save_state() const {
  if (server_stateful_ && !held_current_) {
    throw Error(fmt::format(
        "route 'servers' (bucket {}): the parameter servers hold this bucket's server-side "
        "state; save it with state_dict(all_ranks=True) (C++: save_all_states()), a "
        "collective every rank calls, which fetches it",
        bucket_));
  }
  return save_undo_state();
}

std::vector<std::byte> ServersRoute::save_undo_state() const {
  auto parts = worker_.save_state();
  if (server_stateful_) {
    parts.push_back({std::byte{held_current_}});
    if (held_current_) parts.insert(parts.end(), held_.begin(), held_.end());
  }
  return save_parts(kServersName, shape(), parts);
}

// All or nothing: the servers' states are checked before anything changes.
void ServersRoute::load_state(std::span<const std::byte> state) {
  const std::vector<uint32_t> kept = kept_servers();
  std::vector<std::span<const std::byte>> parts;
  bool with_servers = false;
  try {
    // How many parts: the flag part says (load_parts checks the count it is told).
    const auto head =
        load_parts(kServersName, state, shape(), 2 + (server_stateful_ ? 1 : 0), true);
    with_servers = server_stateful_ && head[2].size() == 1 && head[2][0] == std::byte{1};
    if (server_stateful_ && head[2].size() != 1) throw Error("the servers' flag part is malformed");
    parts = load_parts(kServersName, state, shape(),
                       (server_stateful_ ? 3 : 2) + (with_servers ? kept.size() : 0));
    for (size_t i = 0; with_servers && i < kept.size(); ++i) {
      check_server_state(kept[i], parts[3 + i]);
    }
  } catch (const Error& e) {
    throw Error(fmt::format("route 'servers' (bucket {}, {} servers, of which worker {} keeps "
                            "{} in its checkpoint): {}",
                            bucket_, servers_, rank_, kept.size(), e.what()));
  }
  worker_.load_state(parts[0], parts[1]);
  held_.clear();
  for (size_t i = 0; with_servers && i < kept.size(); ++i) {
    held_.emplace_back(parts[3 + i].begin(), parts[3 + i].end());
  }
  held_current_ = restore_ = with_servers;
}

}  // namespace

std::unique_ptr<Route> make_servers_route(const RouteConfig& config) {
  if (config.env.servers == nullptr) {
    throw Error(fmt::format("route 'servers' (bucket {}): no server link was given", config.bucket));
  }
  return std::make_unique<ServersRoute>(config);
}

}  // namespace gradcomp::route
