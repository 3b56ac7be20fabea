// The parameter server (gradcomp/server.h): on the link's control communicator it makes the
// channels the workers' engines claim; on each channel it reads that engine's headers in order
// and runs its side of each operation of route 'servers' (route/servers_route.cpp).
#include "gradcomp/server.h"

#include <fmt/format.h>

#include <cstring>
#include <algorithm>
#include <map>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>

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

// Runs `f` when the scope ends, however it ends.
template <class F>
class Finally {
 public:
  explicit Finally(F f) : f_(std::move(f)) {}
  Finally(const Finally&) = delete;
  Finally& operator=(const Finally&) = delete;
  ~Finally() { f_(); }

 private:
  F f_;
};

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
        copies_(max_frame_ * workers),
        shard_sizes_(workers, 0),
        result_sizes_(workers, 0),
        worker_words_(workers + servers, 0),
        in_counts_(workers + servers, 0),
        out_counts_(workers + servers, 0),
        nothing_(workers + servers, 0) {
    std::fill_n(worker_words_.begin(), workers, sizeof(uint64_t));
  }

  // One step's push: the workers' frames in, served; returns the bytes of this server's frame,
  // which pull() sends (on the pull stream's thread).
  size_t push(Transport& wire, const ServerHeader& h) {
    {
      // The workers push a bucket again only once they have its pull, so this never waits in
      // fact; it says so to the threads' memory model (and to TSan) too.
      std::unique_lock lock(mutex_);
      pulled_.wait(lock, [&] { return !pulling_; });
      pulling_ = true;
    }
    settle(h);
    for (uint32_t w = 0; w < workers_; ++w) in_counts_[w] = max_frame_;
    if (!fixed_) {
      run(wire.alltoallv({}, nothing_, route::bytes_of(shard_sizes_), worker_words_), wire,
          "shard sizes", h);
      for (uint32_t w = 0; w < workers_; ++w) {
        in_counts_[w] = route::checked_size(shard_sizes_[w], max_frame_, static_cast<int>(w),
                                            "shard frame size");
      }
    }
    const size_t in = std::accumulate(in_counts_.begin(), in_counts_.end(), size_t{0});
    run(wire.alltoallv({}, nothing_, std::span(frames_).first(in), in_counts_), wire, "shards", h);
    return serve(h.step, std::span(in_counts_).first(workers_));
  }

  // The step's pull: this server's frame to every worker. The workers push this bucket again
  // only once they have it, so the next push() cannot overwrite it before.
  void pull(Transport& wire, const ServerHeader& h, size_t bytes) {
    const Finally done([&] { end_pull(); });
    for (uint32_t w = 0; w < workers_; ++w) {
      std::memcpy(copies_.data() + w * bytes, frame_.data(), bytes);
      out_counts_[w] = bytes;
      result_sizes_[w] = bytes;
    }
    if (!fixed_) {
      run(wire.alltoallv(route::bytes_of(result_sizes_), worker_words_, {}, nothing_), wire,
          "result sizes", h);
    }
    run(wire.alltoallv(std::span(copies_).first(bytes * workers_), out_counts_, {}, nothing_),
        wire, "results", h);
  }

  // After a failed pull stream: this pull will not happen.
  void end_pull() {
    {
      std::lock_guard lock(mutex_);
      pulling_ = false;
    }
    pulled_.notify_all();
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

  // A checkpoint: this server's state of the bucket to its keeper.
  void save(Transport& wire, const ServerHeader& h) {
    settle(h);
    std::vector<std::vector<std::byte>> out(static_cast<size_t>(wire.size()));
    out[route::state_keeper(index_, workers_)] =
        route::save_parts(route::kServerStateName, shape(), coder_.save_state());
    swap(wire, out, 0, h, "save");
  }

  // A resumed checkpoint: the state its keeper sent (the workers checked it when they loaded).
  void restore(Transport& wire, const ServerHeader& h) {
    settle(h);
    const auto in = swap(wire, std::vector<std::vector<std::byte>>(wire.size()),
                         route::server_state_limit(spec_.elements), h, "restore");
    const auto parts = route::load_parts(route::kServerStateName,
                                         in[route::state_keeper(index_, workers_)], shape(), 2);
    coder_.load_state(parts[0], parts[1]);
  }

 private:
  route::StateShape shape() const { return {shard_.size(), workers_}; }

  static std::vector<std::vector<std::byte>> swap(Transport& wire,
                                                  const std::vector<std::vector<std::byte>>& out,
                                                  size_t limit, const ServerHeader& h,
                                                  const char* phase) {
    try {
      return route::swap_blobs(wire, out, limit);
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("bucket id {}, phase {}: {}", h.id, phase, e.what()));
    } catch (const CommError& e) {
      throw CommError(fmt::format("bucket id {}, phase {}: {}", h.id, phase, e.what()));
    }
  }

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
  // Sized once (a step allocates nothing). Per worker: the sizes of its frames here, and of
  // this server's frame to it (the pull's, apart: it runs on the pull thread).
  std::vector<uint64_t> shard_sizes_;
  std::vector<uint64_t> result_sizes_;
  // Per link rank: a size word to or from each worker (read-only: both threads use it), the
  // bytes each worker sends here and gets back, and zeros.
  std::vector<size_t> worker_words_;
  std::vector<size_t> in_counts_;
  std::vector<size_t> out_counts_;
  std::vector<size_t> nothing_;
  // From push() to the end of its pull(): frame_ is the pull's.
  std::mutex mutex_;
  std::condition_variable pulled_;
  bool pulling_ = false;
};

// The first failure of a server's threads (the others' are usually its consequence).
class FirstFailure {
 public:
  void record(std::exception_ptr e) {
    std::lock_guard lock(mutex_);
    if (!first_) first_ = std::move(e);
  }
  void rethrow() {
    std::lock_guard lock(mutex_);
    if (first_) std::rethrow_exception(first_);
  }
  bool failed() {
    std::lock_guard lock(mutex_);
    return first_ != nullptr;
  }

 private:
  std::mutex mutex_;
  std::exception_ptr first_;
};

// The pull stream's thread: sends each served bucket's frame in the order the pushes came,
// which is the order the workers pull in (their engine's decode stage), while the link's own
// thread takes the next push.
class Puller {
 public:
  Puller(Transport& wire, FirstFailure& failure)
      : wire_(wire), failure_(failure), thread_([this] { loop(); }) {}
  ~Puller() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  void add(std::shared_ptr<ServedShard> shard, const ServerHeader& h, size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back({std::move(shard), h, bytes});
    }
    ready_.notify_one();
  }

 private:
  struct Job {
    std::shared_ptr<ServedShard> shard;  // held: a retire may drop it from the map meanwhile
    ServerHeader header;
    size_t bytes;
  };
  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      try {
        if (broken_) {
          job.shard->end_pull();  // the link's thread stops at its next header
        } else {
          job.shard->pull(wire_, job.header, job.bytes);
        }
      } catch (...) {
        failure_.record(std::current_exception());
        broken_ = true;
      }
      lock.lock();
    }
  }

  Transport& wire_;
  FirstFailure& failure_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  bool broken_ = false;  // the pull stream failed: later pulls are dropped
  std::thread thread_;  // last: starts once the rest is made
};

// A header from worker 0, waited for without a time limit: the workers send the next one
// whenever they take their next step, after an evaluation or a checkpoint of any length (a
// dead worker's connections close, which ends the wait at once). Error when malformed.
ServerHeader next_header(Transport& wire, uint32_t index) {
  constexpr Milliseconds kWhenever = std::chrono::hours(24 * 365);
  ServerHeader h;
  h.magic = 0;
  wire.broadcast(std::as_writable_bytes(std::span(&h, 1)), 0, kWhenever)->wait(kWhenever);
  if (h.magic != ServerHeader::kMagic) {
    throw Error(
        fmt::format("server {}: a control message from the workers is malformed "
                    "(magic {:#x}, expected {:#x}); do workers and server run the "
                    "same gradcomp?",
                    index, h.magic, ServerHeader::kMagic));
  }
  return h;
}

// One channel's thread: the headers of the engine that claimed it, in order, each operation's
// part on the channel; the pulls go to the Puller.
class Server {
 public:
  Server(Transport& wire, const ServerOptions& o, FirstFailure& failure)
      : wire_(&wire),
        index_(static_cast<uint32_t>(o.index)),
        servers_(static_cast<uint32_t>(o.servers)),
        workers_(static_cast<uint32_t>(o.workers)),
        failure_(failure) {}

  // Until the workers' stop; then the pulls still queued go out.
  void run() {
    {
      Puller puller(wire_->stream(1), failure_);  // the workers split it at their rendezvous
      try {
        serve(puller);
      } catch (...) {
        failure_.record(std::current_exception());
      }
    }
    failure_.rethrow();
  }

 private:
  void serve(Puller& puller) {
    for (;;) {
      const ServerHeader h = next_header(*wire_, index_);
      switch (h.op) {
        case ServerOp::kOpen: open(h); break;
        case ServerOp::kExchange: {
          const auto served = shard(h);
          puller.add(served, h, served->push(*wire_, h));
          break;
        }
        case ServerOp::kRetire:
          shard(h)->retire(*wire_, h);
          shards_.erase(h.id);
          break;
        case ServerOp::kSave: shard(h)->save(*wire_, h); break;
        case ServerOp::kRestore: shard(h)->restore(*wire_, h); break;
        case ServerOp::kStop: return;
        default:
          throw Error(fmt::format("server {}: unknown operation {} from the workers", index_,
                                  static_cast<uint32_t>(h.op)));
      }
      if (failure_.failed()) return;  // the pull stream's (run() throws it)
    }
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
    shards_[h.id] = std::make_shared<ServedShard>(spec, index_, servers_, workers_);
  }

  const std::shared_ptr<ServedShard>& shard(const ServerHeader& h) {
    auto it = shards_.find(h.id);
    if (it == shards_.end()) {
      throw Error(fmt::format("server {}: the workers name bucket id {}, which was never opened "
                              "here (was this server started after the workers' engine?)",
                              index_, h.id));
    }
    return it->second;
  }

  Transport* wire_;
  uint32_t index_;
  uint32_t servers_;
  uint32_t workers_;
  FirstFailure& failure_;
  std::map<uint64_t, std::shared_ptr<ServedShard>> shards_;
};

// The control communicator's thread (run_server's): a channel for each engine that claims one
// (kChannel, numbered from 0 in the order the workers make them), each split from the control
// communicator and served on a thread of its own, until the workers' stop.
class Control {
 public:
  Control(Transport& wire, const ServerOptions& o) : wire_(wire), options_(o) {}

  void run() {
    try {
      serve();
    } catch (...) {
      failure_->record(std::current_exception());
    }
    // Each channel ended on its own stop, which the workers send before ours. After a failure
    // a channel may wait for a header that never comes: its thread owns what it uses, and ends
    // with the process.
    for (auto& t : threads_) failure_->failed() ? t.detach() : t.join();
    failure_->rethrow();
  }

 private:
  void serve() {
    const auto index = static_cast<uint32_t>(options_.index);
    for (;;) {
      const ServerHeader h = next_header(wire_, index);
      if (h.op == ServerOp::kStop) return;
      if (h.op != ServerOp::kChannel || h.id > threads_.size()) {
        throw Error(
            fmt::format("server {}: operation {} (id {}) on the control link, where the "
                        "workers send channels (next: {}) and the stop",
                        index, static_cast<uint32_t>(h.op), h.id, threads_.size()));
      }
      if (h.id < threads_.size()) continue;  // an engine claims a channel another one freed
      std::shared_ptr<Transport> channel = wire_.split(0, wire_.rank());
      threads_.emplace_back([channel, options = options_, failure = failure_] {
        try {
          Server(*channel, options, *failure).run();
        } catch (...) {
          failure->record(std::current_exception());
        }
      });
    }
  }

  Transport& wire_;
  ServerOptions options_;
  std::shared_ptr<FirstFailure> failure_ = std::make_shared<FirstFailure>();
  std::vector<std::thread> threads_;  // channel k's at index k; each owns its transport
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
    Control(*wire, options).run();
  } catch (const CommError& e) {
    route::rethrow_with_link_ranks(e, static_cast<uint32_t>(options.workers),
                                   static_cast<uint32_t>(options.servers));
  }
}

}  // namespace gradcomp
