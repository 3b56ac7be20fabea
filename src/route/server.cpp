// The parameter server's loop (gradcomp/server.h): it reads the workers' control headers in
// order and runs its side of each operation of route 'servers' (route/servers_route.cpp).
#include "gradcomp/server.h"

#include <fmt/format.h>

#include <cstring>
#include <algorithm>
#include <map>
#include <numeric>

#include "gradcomp/error.h"
#include "route/coder.h"
#include "route/server_link.h"

namespace gradcomp {
namespace {

using route::Coder;
using route::Range;
using route::ServerBucketSpec;
using route::ServerHeader;
using route::ServerOp;
using route::ServerSettle;

// Shard `index` of one bucket: the server-side coder and its buffers, sized once.
class ServedShard {
 public:
  ServedShard(const ServerBucketSpec& spec, uint32_t index, uint32_t servers, uint32_t workers)
      : spec_(spec),
        index_(index),
        workers_(workers),
        decoder_(make_codec(spec.codec)),
        coder_(make_codec(spec.codec), make_feedback(spec.server_feedback)),
        shard_(route::shard_range(spec.elements, index, servers)),
        max_frame_(decoder_->max_frame_bytes(shard_.size())),
        fixed_(decoder_->traits().fixed_frame_size),
        frames_(max_frame_ * workers),
        sum_(shard_.size()),
        frame_(max_frame_),
        copies_(max_frame_ * workers) {}

  // One step: the workers' frames in, this server's frame out to every worker.
  void exchange(Transport& wire, const ServerHeader& h) {
    settle(h);
    const size_t ranks = static_cast<size_t>(wire.size());
    std::vector<uint64_t> sizes(ranks, 0), sizes_in(ranks, 0);
    std::vector<size_t> in_counts(ranks, 0), nothing(ranks, 0);
    for (uint32_t w = 0; w < workers_; ++w) in_counts[w] = max_frame_;
    if (!fixed_) {
      run(wire.alltoall(route::bytes_of(sizes), route::bytes_of(sizes_in)), wire, "shard sizes", h);
      for (uint32_t w = 0; w < workers_; ++w) {
        in_counts[w] = route::checked_size(sizes_in[w], max_frame_, static_cast<int>(w),
                                           "shard frame size");
      }
    }
    const size_t in = std::accumulate(in_counts.begin(), in_counts.end(), size_t{0});
    run(wire.alltoallv({}, nothing, std::span(frames_).first(in), in_counts), wire, "shards", h);
    const size_t bytes = serve(h.step, std::span(in_counts).first(workers_));
    for (uint32_t w = 0; w < workers_; ++w) {
      std::memcpy(copies_.data() + w * bytes, frame_.data(), bytes);
    }
    std::vector<size_t> out_counts(ranks, 0);
    for (uint32_t w = 0; w < workers_; ++w) out_counts[w] = bytes;
    if (!fixed_) {
      for (uint32_t w = 0; w < workers_; ++w) sizes[w] = bytes;
      run(wire.alltoall(route::bytes_of(sizes), route::bytes_of(sizes_in)), wire, "result sizes", h);
    }
    run(wire.alltoallv(std::span(copies_).first(bytes * workers_), out_counts, {}, nothing), wire,
        "results", h);
  }

  // The bucket leaves the plan: what the server feedback has not delivered, with its loss
  // scale, to every worker.
  void retire(Transport& wire, const ServerHeader& h) {
    settle(h);
    Buffer<float> held(shard_.size(), 0.0f);
    coder_.feedback().add_unsent(held);
    const double scale = coder_.memory_scale();
    const size_t block = sizeof(double) + held.size() * sizeof(float);
    std::vector<std::byte> out(block * workers_);
    for (uint32_t w = 0; w < workers_; ++w) {
      std::memcpy(out.data() + w * block, &scale, sizeof(double));
      std::memcpy(out.data() + w * block + sizeof(double), held.data(), held.size() * sizeof(float));
    }
    const size_t ranks = static_cast<size_t>(wire.size());
    std::vector<size_t> counts(ranks, 0), nothing(ranks, 0);
    for (uint32_t w = 0; w < workers_; ++w) counts[w] = block;
    run(wire.alltoallv(out, counts, {}, nothing), wire, "retire", h);
  }

 private:
  void settle(const ServerHeader& h) {
    if (h.settle != ServerSettle::kNone) coder_.settle(h.settle == ServerSettle::kKeep, h.settled);
  }

  Context context(const StepState& step, bool server, uint32_t rank) const {
    return {.seed = spec_.seed, .bucket = route::shard_key(spec_.key, index_, server),
            .step = step.step, .rank = rank, .world_size = workers_, .threads = spec_.threads};
  }

  // Sums the workers' frames, finalizes, compensates and re-encodes; returns the frame's bytes.
  size_t serve(const StepState& step, std::span<const size_t> counts) {
    route::decode_sum(*decoder_, frames_, counts, sum_,
                      [&](uint32_t w) { return context(step, false, w); });
    decoder_->finalize(sum_, workers_);
    const size_t bytes = coder_.encode(sum_, frame_, context(step, true, index_), step, workers_);
    if (fixed_) route::checked_fixed_size(coder_.codec(), bytes, max_frame_);
    return bytes;
  }

  static void run(const WorkPtr& work, Transport& wire, const char* phase, const ServerHeader& h) {
    try {
      work->wait(wire.timeout() + Milliseconds(1000));
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("bucket id {}, step {}, phase {}: {}", h.id, h.step.step,
                                     phase, e.what()));
    } catch (const CommError& e) {
      throw CommError(fmt::format("bucket id {}, step {}, phase {}: {}", h.id, h.step.step, phase,
                                  e.what()));
    }
  }

  ServerBucketSpec spec_;
  uint32_t index_;
  uint32_t workers_;
  std::unique_ptr<Codec> decoder_;  // the workers' frames (its own object: codecs may keep state)
  Coder coder_;                     // the server side
  Range shard_;
  size_t max_frame_;
  bool fixed_;
  Buffer<std::byte> frames_;  // the workers' frames of this shard, worker order
  Buffer<float> sum_;
  Buffer<std::byte> frame_;   // this server's frame
  Buffer<std::byte> copies_;  // one copy per worker (alltoallv sends a block to each)
};

class Server {
 public:
  Server(std::unique_ptr<Transport> wire, const ServerOptions& o)
      : wire_(std::move(wire)),
        index_(static_cast<uint32_t>(o.index)),
        servers_(static_cast<uint32_t>(o.servers)),
        workers_(static_cast<uint32_t>(o.workers)) {}

  void run() {
    for (;;) {
      const ServerHeader h = next_header();
      switch (h.op) {
        case ServerOp::kOpen: open(h); break;
        case ServerOp::kExchange: shard(h).exchange(*wire_, h); break;
        case ServerOp::kRetire:
          shard(h).retire(*wire_, h);
          shards_.erase(h.id);
          break;
        case ServerOp::kStop: return;
        default:
          throw Error(fmt::format("server {}: unknown operation {} from the workers", index_,
                                  static_cast<uint32_t>(h.op)));
      }
    }
  }

 private:
  ServerHeader next_header() {
    ServerHeader h;
    h.magic = 0;
    wire_->broadcast(std::as_writable_bytes(std::span(&h, 1)), 0)
        ->wait(wire_->timeout() + Milliseconds(1000));
    if (h.magic != ServerHeader::kMagic) {
      throw Error(fmt::format("server {}: a control message from the workers is malformed "
                              "(magic {:#x}, expected {:#x}); do workers and server run the "
                              "same gradcomp?",
                              index_, h.magic, ServerHeader::kMagic));
    }
    return h;
  }

  void open(const ServerHeader& h) {
    if (h.payload == 0 || h.payload > (size_t{1} << 20)) {
      throw Error(fmt::format("server {}: bucket id {}: configuration of {} bytes", index_, h.id,
                              h.payload));
    }
    std::string text(h.payload, '\0');
    wire_->broadcast(std::as_writable_bytes(std::span(text.data(), text.size())), 0)
        ->wait(wire_->timeout() + Milliseconds(1000));
    const ServerBucketSpec spec = ServerBucketSpec::from_json(text);
    // The buckets of engines that are gone, or of a plan that changed.
    for (auto it = shards_.begin(); it != shards_.end();) {
      const bool live = std::find(spec.live.begin(), spec.live.end(), it->first) != spec.live.end();
      it = live ? std::next(it) : shards_.erase(it);
    }
    shards_.erase(h.id);
    shards_.emplace(std::piecewise_construct, std::forward_as_tuple(h.id),
                    std::forward_as_tuple(spec, index_, servers_, workers_));
  }

  ServedShard& shard(const ServerHeader& h) {
    auto it = shards_.find(h.id);
    if (it == shards_.end()) {
      throw Error(fmt::format("server {}: the workers name bucket id {}, which was never opened "
                              "here (was this server started after the workers' engine?)",
                              index_, h.id));
    }
    return it->second;
  }

  std::unique_ptr<Transport> wire_;
  uint32_t index_;
  uint32_t servers_;
  uint32_t workers_;
  std::map<uint64_t, ServedShard> shards_;
};

void check(const ServerOptions& o) {
  if (o.servers < 1 || o.servers > 4096) {
    throw Error(fmt::format("server: servers is {}; it must be from 1 to 4096", o.servers));
  }
  if (o.index < 0 || o.index >= o.servers) {
    throw Error(fmt::format("server: index is {}; it must be from 0 to {} (servers - 1)", o.index,
                            o.servers - 1));
  }
  if (o.workers < 1 || o.workers > 4096) {
    throw Error(fmt::format("server: workers is {}; it must be from 1 to 4096", o.workers));
  }
  if (o.store.empty()) {
    throw Error("server: no store given (the workers' GRADCOMP_SERVER_STORE, tcp://host:port)");
  }
  if (o.timeout.count() <= 0) {
    throw Error(fmt::format("server: timeout is {} ms; it must be positive", o.timeout.count()));
  }
}

}  // namespace

void stop_servers() { route::ServerLink::stop(Milliseconds(30'000)); }

void run_server(const ServerOptions& options) {
  check(options);
  TransportOptions t;
  t.backend = "gloo";
  t.rank = options.workers + options.index;
  t.world_size = options.workers + options.servers;
  t.store = options.store;
  t.timeout = options.timeout;
  t.rendezvous = route::kServerRendezvous;
  auto wire = make_transport(t);
  try {
    Server(std::move(wire), options).run();
  } catch (const CommError& e) {
    route::rethrow_with_link_ranks(e, static_cast<uint32_t>(options.workers),
                                   static_cast<uint32_t>(options.servers));
  }
}

}  // namespace gradcomp
