// The engine: three background stages (encoder, exchanger, decoder) over the buckets of a Plan,
// fed by ready() from the backward pass, drained by synchronize(). See engine.h and
// docs/architecture.md for the threading and ordering rules.
#include "gradcomp/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <unordered_map>

#include "common/environment.h"
#include "engine/consistency.h"
#include "engine/live_bucket.h"
#include "engine/rank_path.h"
#include "engine/state_file.h"
#include "gradcomp/error.h"
#include "gradcomp/kept_thread.h"
#include "gradcomp/timeline.h"
#include "route/frames.h"
#include "route/route.h"
#include "route/server_link.h"

namespace gradcomp {
namespace {

// The plan as the routes see it: every slice a tensor of its own (Plan::by_piece), and where
// each piece lies in the tensor the caller hands over.
struct PieceTable {
  PieceTable() = default;
  explicit PieceTable(const Plan& registered)
      : plan(registered.by_piece()), pieces(registered.pieces()) {
    const size_t tensors = registered.tensors.size();
    first.assign(tensors + 1, 0);
    for (const TensorPiece& p : pieces) ++first[p.tensor + 1];
    for (size_t t = 0; t < tensors; ++t) first[t + 1] += first[t];
  }

  Plan plan;
  std::vector<TensorPiece> pieces;
  std::vector<size_t> first;  // tensor t's pieces are [first[t], first[t + 1])
};

std::string timeline_from_environment() { return env_text("GRADCOMP_TIMELINE").value_or(""); }

constexpr int kDefaultStreams = 2;
constexpr int kMaxStreams = 16;

int streams_from_environment() {
  return static_cast<int>(env_int("GRADCOMP_STREAMS", 1, kMaxStreams, "buckets exchanged at once")
                              .value_or(kDefaultStreams));
}

}  // namespace

struct Engine::Impl {
  Impl(std::shared_ptr<Transport> transport_in, Plan plan_in, EngineOptions options_in);
  ~Impl();

  void ready(size_t tensor, std::span<float> grad);
  void synchronize();
  void set_plan(Plan next, bool trial);

  // Stage threads.
  void encoder_loop();
  void exchanger_loop(size_t stream);
  void decoder_loop();

  // Launches every complete bucket whose predecessors are launched (under mutex); returns the
  // buckets the caller must encode itself (EncodeOn::kCaller).
  std::vector<size_t> launch_complete_buckets();
  void encode_bucket(size_t b);
  void fail(std::exception_ptr error);  // records the first error and wakes every waiter
  void throw_if_failed() const;         // under mutex
  // synchronize()'s failure: waits until no stage thread works on this step's buffers (the
  // caller's gradients among them), then throws the engine's error.
  [[noreturn]] void fail_step(std::unique_lock<std::mutex>& lock);
  // Tells the stage threads to end their loops (they wait on `changed`).
  void stop_stages();
  // Waits (under `lock`) until `done` or an error or shutdown; false on error or shutdown.
  template <class Pred>
  bool wait_for(std::unique_lock<std::mutex>& lock, Pred done);
  bool wait_for_step(std::unique_lock<std::mutex>& lock);  // synchronize(): false on error
  size_t stages_done() const;
  void open_timeline(const std::string& path);
  void attach_timeline();  // points every bucket's Phases at the current timeline
  bool plan_needs_nodes() const;  // some bucket's route needs nodes (route_needs_nodes)
  void check_plans_agree();  // the collective check of the constructor and of set_plan
  void open_streams();
  // The stream (and exchange thread) of bucket b: routes over nodes stay on stream 0, whose
  // node groups they use, and so do routes to servers: the server link is one sequence (its
  // pull stream, at decode, overlaps the next push).
  size_t stream_of(size_t b) const {
    const BucketOption& o = options_of[b];
    return o.over_nodes || o.on_servers ? 0 : b % streams.size();
  }
  void make_routes(bool with_nodes);
  void name_lanes();
  // set_plan: adds what the old plan's routes hold and have not delivered to `carried`, by
  // tensor.
  void carry_out(const std::vector<LiveBucket>& old_buckets,
                 const std::vector<TensorSlot>& old_slots, const PieceTable& old_layout);
  // ready(): adds the carried memory of piece p (in the coming step's loss scale) to its
  // gradient, unless a trial plan holds it back (holds_back).
  void add_carried(size_t piece, std::span<float> grad);
  // During a trial plan, a tensor with a piece in a bucket that keeps no feedback memory
  // leaves its carried memory waiting (Engine::set_plan).
  bool holds_back(size_t tensor) const;
  void settle_step();  // under mutex, every bucket decoded
  void release_after_failure();
  StateOwner owner() const;

  std::shared_ptr<Transport> transport;
  Plan plan;
  std::vector<BucketOption> options_of;  // plan.buckets' options, parsed once (Plan::validate)
  PieceTable layout;  // of `plan`: what the buckets hold
  EngineOptions options;
  std::shared_ptr<const NodeGroups> nodes;  // routes that need nodes only (the transport's)
  std::shared_ptr<route::ServerLink> servers;  // route servers only: the claimed link
  std::vector<Transport*> streams;          // the transport's streams in use: [0] is the transport
  uint64_t plan_changes = 0;                // set_plan calls that changed the plan
  std::unique_ptr<Timeline> timeline;
  std::vector<LiveBucket> buckets;
  bool settles_steps = false;  // some route keeps state: every step is kept or taken back whole
  std::vector<TensorSlot> slots;  // per piece: its bucket and place in the fused buffer
  std::unordered_map<std::string, size_t> index_of;
  // Per tensor, what a plan change carries (Engine::set_plan; empty values: nothing). Added to
  // the tensor's next gradient; kept until a step that took it is kept.
  struct Carried {
    Buffer<float> values;
    double scale = 0;  // the loss scale the values are in (0: unknown)
    bool taken = false;  // added to this step's gradient
  };
  std::vector<Carried> carried;
  bool trial = false;  // the plan in force is a trial (Engine::set_plan)

  mutable std::mutex mutex;
  std::condition_variable changed;  // any stage progressed, or an error, or shutdown
  std::deque<size_t> encode_queue;
  size_t next_launch = 0;    // the first bucket of this step not yet launched
  // Steps completed by this engine object: the stage threads count cycles with it. The step
  // number codecs see (step_state.step) continues from a loaded checkpoint instead.
  uint64_t cycle = 0;
  bool stopping = false;
  std::exception_ptr error;
  int working = 0;  // stage threads working outside the mutex, on the buckets' memory
  StepState step_state;
  StepStats stats;
  double next_lr = 0;
  double next_scale = 1;
  bool measure_norms = false;  // this step's decoder also sums each mean's squares
  Clock::time_point step_start{};
  bool step_started = false;
  double exchange_seconds = 0;

  KeptThread encoder, decoder;
  std::vector<KeptThread> exchangers;  // one per stream
};

Engine::Impl::Impl(std::shared_ptr<Transport> transport_in, Plan plan_in,
                   EngineOptions options_in)
    : transport(std::move(transport_in)), plan(std::move(plan_in)), options(options_in) {
  if (!transport) throw Error("Engine: the transport is null");
  options_of = plan.validate();
  layout = PieceTable(plan);
  // The transport fails a stuck collective at its own timeout; the engine's wait is a backstop.
  if (options.timeout.count() <= 0) options.timeout = 2 * transport->timeout() + Milliseconds(10'000);
  if (options.codec_threads < 1) {
    throw Error(fmt::format("Engine: codec_threads is {}; it must be at least 1",
                            options.codec_threads));
  }
  if (options.streams == 0) options.streams = streams_from_environment();
  if (options.streams < 1 || options.streams > kMaxStreams) {
    throw Error(
        fmt::format("Engine: streams is {}; it must be from 1 to {} (0: GRADCOMP_STREAMS, "
                    "else {})",
                    options.streams, kMaxStreams, kDefaultStreams));
  }
  for (size_t t = 0; t < plan.tensors.size(); ++t) index_of.emplace(plan.tensors[t].name, t);
  carried.resize(plan.tensors.size());
  // First of all collectives, so that ranks with different plans fail here with a message
  // naming the difference, before they could issue different collectives (the node split).
  check_plans_agree();
  open_streams();
  make_routes(plan_needs_nodes());
  const std::string path = options.timeline.empty() ? timeline_from_environment()
                                                    : options.timeline;
  if (!path.empty()) open_timeline(path);
  attach_timeline();
  // Named, so a debugger, top -H or a profiler tells the stages apart; kept across engines, so
  // a rebuilt engine runs on the threads (and malloc arenas) of the one before.
  try {
    encoder = KeptThread("gc-encoder", [this] { encoder_loop(); });
    for (size_t k = 0; k < streams.size(); ++k) {
      exchangers.emplace_back(
          k == 0 ? std::string("gc-exchanger") : fmt::format("gc-exchanger{}", k),
          [this, k] { exchanger_loop(k); });
    }
    decoder = KeptThread("gc-decoder", [this] { decoder_loop(); });
  } catch (...) {
    // No thread to be had: the stages already started must end, or their handles, destroyed
    // with this half-built engine, would wait for them forever.
    stop_stages();
    throw;
  }
}

void Engine::Impl::stop_stages() {
  {
    std::lock_guard lock(mutex);
    stopping = true;
  }
  changed.notify_all();
}

Engine::Impl::~Impl() {
  stop_stages();
  encoder.join();
  for (KeptThread& e : exchangers) e.join();
  decoder.join();
  if (error) release_after_failure();
}

// After a failure, collectives the engine stopped waiting for may still be queued or running,
// and write into the routes' buffers: wait for the transport to finish them first. A timed-out
// MPI request cannot be cancelled at all, so after a timeout (or a drain that does not end) the
// buffers are left allocated for the rest of the process rather than freed under a collective.
void Engine::Impl::release_after_failure() {
  bool timed_out = false;
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError&) {
    timed_out = true;
  } catch (...) {
  }
  bool drained = true;
  for (Transport* s : streams) drained = s->drain(options.timeout) && drained;
  if (servers) drained = servers->drain(options.timeout) && drained;
  if (!drained || timed_out) {
    static_cast<void>(new std::vector<LiveBucket>(std::move(buckets)));  // deliberately kept
  }
}

bool Engine::Impl::plan_needs_nodes() const {
  return std::any_of(options_of.begin(), options_of.end(),
                     [](const BucketOption& o) { return o.over_nodes; });
}

void Engine::Impl::check_plans_agree() {
  const bool with_nodes = plan_needs_nodes();
  if (with_nodes && options.local_size <= 0) {
    options.local_size = launch_info_from_environment().local_size;
  }
  check_consistency(*transport, plan,
                    {options.seed, static_cast<uint64_t>(with_nodes ? options.local_size : 0),
                     static_cast<uint64_t>(options.streams)},
                    transport->timeout());
}

// The streams are split once per transport (Transport::stream), by every rank at this point of
// the engine's construction, and kept for later engines on the same transport.
void Engine::Impl::open_streams() {
  const int count = transport->size() > 1 && transport->can_split() ? options.streams : 1;
  for (int k = 0; k < count; ++k) streams.push_back(&transport->stream(static_cast<size_t>(k)));
}

void Engine::Impl::make_routes(bool with_nodes) {
  RouteEnv env{.world = transport.get(), .seed = options.seed, .threads = options.codec_threads};
  if (with_nodes) {
    if (!nodes) nodes = transport->nodes(options.local_size);
    env.intra = nodes->intra.get();
    env.leaders = nodes->leaders();
    env.cross = nodes->cross.get();
  }
  const bool with_servers = std::any_of(options_of.begin(), options_of.end(),
                                        [](const BucketOption& o) { return o.on_servers; });
  if (with_servers && !servers) servers = route::ServerLink::claim(*transport);
  env.servers = servers.get();
  slots.assign(layout.pieces.size(), TensorSlot{});
  buckets.reserve(plan.buckets.size());
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    env.world = streams[stream_of(b)];
    buckets.emplace_back(layout.plan, b, options_of[b], env, slots, options.timeout);
    settles_steps = settles_steps || buckets.back().route->stateful();
  }
}

// A loss scaler skips the whole step when any gradient is not finite, so every stateful route
// keeps the step, or takes it back, as a whole: one bucket's feedback must not keep a step
// whose update never happens. The means are the same bits on every rank: all decide alike.
void Engine::Impl::settle_step() {
  const bool keep = std::all_of(buckets.begin(), buckets.end(),
                                [](const LiveBucket& b) { return b.finite; });
  if (settles_steps) {
    for (LiveBucket& b : buckets) b.route->settle(keep, step_state);
  }
  // Carried memory a kept step delivered is done; that of a step taken back goes again.
  for (Carried& c : carried) {
    if (c.taken && keep) c = Carried{};
    c.taken = false;
  }
  stats.finite = keep;
}

void Engine::Impl::carry_out(const std::vector<LiveBucket>& old_buckets,
                             const std::vector<TensorSlot>& old_slots,
                             const PieceTable& old_layout) {
  for (const LiveBucket& bucket : old_buckets) {
    Buffer<float> held(bucket.elements, 0.0f);
    const double scale = bucket.route->retire(held);
    for (size_t p = 0; p < old_slots.size(); ++p) {
      const TensorSlot& slot = old_slots[p];
      if (slot.bucket != bucket.index) continue;
      const auto part = std::span(held).subspan(slot.offset, slot.elements);
      if (std::all_of(part.begin(), part.end(), [](float x) { return x == 0.0f; })) continue;
      const TensorPiece& piece = old_layout.pieces[p];
      Carried& c = carried[piece.tensor];
      if (c.values.empty()) {
        c.values.assign(plan.tensors[piece.tensor].elements, 0.0f);
        c.scale = scale;
      } else if (c.scale > 0 && scale > 0 && c.scale != scale) {
        // Memory held back through a trial is in the loss scale of its own last step.
        const auto k = static_cast<float>(scale / c.scale);
        for (float& v : c.values) v *= k;
        c.scale = scale;
      }
      for (size_t i = 0; i < part.size(); ++i) c.values[piece.offset + i] += part[i];
    }
  }
}

// Per tensor, so that the slices of a tensor take their parts of its carried memory together.
bool Engine::Impl::holds_back(size_t tensor) const {
  if (!trial) return false;
  for (size_t p = layout.first[tensor]; p < layout.first[tensor + 1]; ++p) {
    const BucketOption& o = options_of[slots[p].bucket];
    const bool server_memory =
        (o.codec_route() == RouteKind::kTwoway || o.on_servers) && o.server_feedback != "none";
    if (o.text.feedback == "none" && !server_memory) return true;
  }
  return false;
}

void Engine::Impl::add_carried(size_t piece, std::span<float> grad) {
  const TensorPiece& p = layout.pieces[piece];
  Carried& c = carried[p.tensor];
  if (c.values.empty() || holds_back(p.tensor)) return;
  // The memory was kept in the loss scale of its last step; the gradient carries this step's.
  const bool rescale = c.scale > 0 && step_state.scale > 0 && c.scale != step_state.scale;
  const auto k = static_cast<float>(rescale ? step_state.scale / c.scale : 1.0);
  const float* held = c.values.data() + p.offset;
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = std::fma(k, held[i], grad[i]);
  c.taken = true;
}

// Everything new is built before anything old is let go, so a failure leaves the engine as it
// was. The stage threads are idle between steps: they wait, under this mutex, for the first
// bucket of the next step, and read the bucket list afresh when they wake.
void Engine::Impl::set_plan(Plan next, bool next_is_trial) {
  std::lock_guard lock(mutex);
  throw_if_failed();
  if (step_started) throw Error("set_plan: a step is in flight; call synchronize() first");
  if (next == plan) {  // the plan in force: only whether it is a trial changes
    check_plans_agree();
    trial = next_is_trial;
    return;
  }
  std::vector<BucketOption> next_options = next.validate();
  if (next.tensors.size() != plan.tensors.size()) {
    throw Error(fmt::format("set_plan: the plan registers {} tensors; this engine's has {} (a "
                            "plan change keeps the tensors and changes how they travel)",
                            next.tensors.size(), plan.tensors.size()));
  }
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    const auto& a = plan.tensors[t];
    const auto& b = next.tensors[t];
    if (a.name != b.name || a.elements != b.elements) {
      throw Error(fmt::format("set_plan: tensor {} is '{}' of {} elements; this engine's is "
                              "'{}' of {} (the same tensors, in the same order)",
                              t, b.name, b.elements, a.name, a.elements));
    }
  }
  PieceTable next_layout(next);
  std::swap(plan, next);  // `next` now holds the old plan, until the new routes stand
  std::swap(options_of, next_options);
  std::swap(layout, next_layout);
  std::vector<LiveBucket> old_buckets = std::move(buckets);
  std::vector<TensorSlot> old_slots = std::move(slots);
  const bool old_settles = settles_steps;
  buckets.clear();
  settles_steps = false;
  try {
    check_plans_agree();
    make_routes(plan_needs_nodes());
  } catch (...) {
    std::swap(plan, next);
    std::swap(options_of, next_options);
    std::swap(layout, next_layout);
    buckets = std::move(old_buckets);
    slots = std::move(old_slots);
    settles_steps = old_settles;
    throw;
  }
  carry_out(old_buckets, old_slots, next_layout);  // next_layout: the old plan's, swapped
  trial = next_is_trial;
  ++plan_changes;
  changed.notify_all();  // an exchange thread waiting for a bucket of the old plan starts over
  old_buckets.clear();  // the old routes go; the threads stay
  next_launch = 0;
  encode_queue.clear();
  name_lanes();
  attach_timeline();
}

void Engine::Impl::open_timeline(const std::string& path) {
  timeline = std::make_unique<Timeline>(rank_path(path, transport->rank()), transport->rank());
  name_lanes();
}

void Engine::Impl::name_lanes() {
  if (!timeline) return;
  for (size_t b = 0; b < buckets.size(); ++b) {
    timeline->name_lane(static_cast<int>(b), buckets[b].describe(layout.plan));
  }
}

void Engine::Impl::attach_timeline() {
  for (LiveBucket& b : buckets) b.phases = Phases(b.index, options.timeout, timeline.get());
}

void Engine::Impl::fail(std::exception_ptr e) {
  {
    std::lock_guard lock(mutex);
    if (!error) error = e;
  }
  changed.notify_all();
}

void Engine::Impl::throw_if_failed() const {
  if (error) std::rethrow_exception(error);
}

// A stage thread that is working finishes its piece (or fails it, at the transport's timeout)
// and then stops, seeing the error: once synchronize() has thrown, the engine no longer writes
// into the gradients the caller handed over, which the caller may free or reuse.
void Engine::Impl::fail_step(std::unique_lock<std::mutex>& lock) {
  changed.wait_for(lock, options.timeout, [&] { return working == 0; });
  std::rethrow_exception(error);
}

template <class Pred>
bool Engine::Impl::wait_for(std::unique_lock<std::mutex>& lock, Pred done) {
  changed.wait(lock, [&] { return done() || error || stopping; });
  return !error && !stopping;
}

void Engine::Impl::ready(size_t tensor, std::span<float> grad) {
  std::vector<size_t> to_encode;
  {
    std::lock_guard lock(mutex);
    throw_if_failed();
    if (tensor >= plan.tensors.size()) {
      throw Error(fmt::format("ready: tensor {} is not registered; the plan has {} tensors",
                              tensor, plan.tensors.size()));
    }
    const TensorInfo& info = plan.tensors[tensor];
    if (grad.size() != info.elements) {
      throw Error(fmt::format("ready: tensor '{}' has {} elements; it was registered with {}",
                              info.name, grad.size(), info.elements));
    }
    const size_t first = layout.first[tensor], end = layout.first[tensor + 1];
    if (slots[first].ready) {
      throw Error(fmt::format("ready: tensor '{}' was handed over twice in step {}", info.name,
                              step_state.step));
    }
    if (!step_started) {
      step_started = true;
      step_start = Clock::now();
    }
    bool completed = false;
    for (size_t p = first; p < end; ++p) {  // a sliced tensor: each slice to its bucket
      TensorSlot& slot = slots[p];
      slot.ready = true;
      LiveBucket& bucket = buckets[slot.bucket];
      // What a plan change carried goes into the caller's gradient (which receives the mean
      // later anyway) before the bucket takes it: copied or compensated in parts alike.
      const auto piece = grad.subspan(layout.pieces[p].offset, slot.elements);
      add_carried(p, piece);
      bucket.take(slot, piece, step_state);
      if (bucket.pending == 0) {
        bucket.complete_at = Clock::now();
        completed = true;
      }
    }
    if (completed) to_encode = launch_complete_buckets();
  }
  changed.notify_all();
  for (size_t b : to_encode) encode_bucket(b);
}

std::vector<size_t> Engine::Impl::launch_complete_buckets() {
  std::vector<size_t> on_caller;
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
    LiveBucket& bucket = buckets[next_launch];
    if (timeline) {
      timeline->span(static_cast<int>(next_launch), "ready", bucket.first_ready_at,
                     bucket.complete_at);
    }
    if (plan.buckets[next_launch].option.encode_on == EncodeOn::kCaller) {
      on_caller.push_back(next_launch);
    } else {
      encode_queue.push_back(next_launch);
    }
    ++next_launch;
  }
  return on_caller;
}

void Engine::Impl::encode_bucket(size_t b) {
  LiveBucket& bucket = buckets[b];
  try {
    bucket.route->encode(bucket.buffer(), step_state, bucket.phases);
  } catch (...) {
    fail(std::current_exception());
    return;
  }
  {
    std::lock_guard lock(mutex);
    bucket.encoded_step = cycle;
  }
  changed.notify_all();
}

void Engine::Impl::encoder_loop() {
  std::unique_lock lock(mutex);
  for (;;) {
    if (!wait_for(lock, [&] { return !encode_queue.empty(); })) return;
    const size_t b = encode_queue.front();
    encode_queue.pop_front();
    ++working;
    lock.unlock();
    encode_bucket(b);
    lock.lock();
    --working;
    changed.notify_all();  // synchronize() may be waiting for the stages to stop
  }
}

// Exchanges the buckets of one stream in order; the threads of the streams run side by side.
// A plan change between steps (set_plan) may move buckets to this stream or away from it while
// this thread waits for the step: it then starts over on the new plan's buckets, and it ends
// its part of a step only once the step is closed, so a bucket added late is not missed.
void Engine::Impl::exchanger_loop(size_t stream) {
  std::unique_lock lock(mutex);
  uint64_t current = cycle;  // the step this thread works on
  for (;;) {
    try {
      uint64_t plan_seen = plan_changes;
      size_t b = 0;
      for (;;) {
        while (b < buckets.size() && stream_of(b) != stream) ++b;
        const bool all_done = b == buckets.size();
        if (!wait_for(lock, [&] {
              return plan_changes != plan_seen || cycle > current ||
                     (!all_done && buckets[b].encoded_step == current);
            })) {
          return;
        }
        if (cycle > current) break;  // the step is closed
        if (plan_changes != plan_seen) {
          plan_seen = plan_changes;
          b = 0;
          continue;
        }
        ++working;
        lock.unlock();
        const auto start = Clock::now();
        buckets[b].route->exchange(step_state, buckets[b].phases);
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        lock.lock();
        --working;
        exchange_seconds += seconds;
        buckets[b].exchanged_step = current;
        changed.notify_all();
        ++b;
      }
    } catch (...) {
      if (!lock.owns_lock()) {
        lock.lock();
        --working;
      }
      if (!error) error = std::current_exception();
      changed.notify_all();
      return;
    }
    // On to the step open now. A stream with no bucket takes no part in a step, so the steps
    // may close faster than this thread wakes: counting them one by one, it would wait for a
    // step that has already closed, and never exchange a bucket a plan change gives it.
    current = cycle;
  }
}

void Engine::Impl::decoder_loop() {
  std::unique_lock lock(mutex);
  uint64_t current = cycle;
  for (;;) {
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (!wait_for(lock, [&] { return buckets[b].exchanged_step == current; })) return;
      const bool norms = measure_norms;  // read under the lock: set between steps
      ++working;
      lock.unlock();
      try {
        LiveBucket& bucket = buckets[b];
        const float factor =
            bucket.route->decode_unscaled(bucket.buffer(), step_state, bucket.phases);
        // Every mean is checked: the stats say whether the step may be applied (a skipped
        // step on every rank), stateful routes or not.
        route::Scan scanned;
        bucket.phases.run("write back", [&] { scanned = bucket.give_back(factor, norms); });
        bucket.finite = scanned.finite;
        if (norms) bucket.mean_sum_of_squares = scanned.sum_of_squares;
      } catch (...) {
        lock.lock();
        --working;
        if (!error) error = std::current_exception();
        changed.notify_all();
        return;
      }
      lock.lock();
      --working;
      buckets[b].decoded_step = current;
      changed.notify_all();
    }
    // Next step: wait until synchronize() has closed this one (several, when a plan without
    // buckets let them close without this thread; see exchanger_loop).
    if (!wait_for(lock, [&] { return cycle > current; })) return;
    current = cycle;
  }
}

// The stages this step has finished, over all buckets: what progress means to the backstop.
size_t Engine::Impl::stages_done() const {
  size_t done = 0;
  for (const LiveBucket& b : buckets) {
    done += (b.encoded_step == cycle) + (b.exchanged_step == cycle) + (b.decoded_step == cycle);
  }
  return done;
}

// Waits until every bucket of the step is decoded. The transport fails a stuck collective at
// its own timeout; a step in which no stage finished for the engine's (longer) timeout, and no
// stage thread works, has a stage that will never move: an error rather than a hang.
bool Engine::Impl::wait_for_step(std::unique_lock<std::mutex>& lock) {
  const auto decoded = [&] {
    return std::all_of(buckets.begin(), buckets.end(),
                       [&](const LiveBucket& b) { return b.decoded_step == cycle; });
  };
  for (size_t seen = stages_done();; seen = stages_done()) {
    const bool moved = changed.wait_for(lock, options.timeout, [&] {
      return decoded() || error || stopping || stages_done() != seen;
    });
    if (error || stopping) return false;
    if (decoded()) return true;
    if (!moved && working == 0) break;
  }
  std::vector<size_t> stuck;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (buckets[b].decoded_step != cycle) stuck.push_back(b);
  }
  error = std::make_exception_ptr(TimeoutError(fmt::format(
      "synchronize: step {} made no progress for {:.0f} s: bucket(s) {} not exchanged and "
      "decoded, with no collective under way (an engine fault: please report it)",
      step_state.step, options.timeout.count() / 1000.0, fmt::join(stuck, ", "))));
  changed.notify_all();
  return false;
}

void Engine::Impl::synchronize() {
  std::unique_lock lock(mutex);
  if (error) fail_step(lock);
  std::vector<std::string> missing;
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    if (!slots[layout.first[t]].ready) missing.push_back(plan.tensors[t].name);
  }
  if (!missing.empty()) {
    const size_t shown = std::min<size_t>(missing.size(), 5);
    std::vector<std::string> head(missing.begin(), missing.begin() + shown);
    auto e = std::make_exception_ptr(Error(fmt::format(
        "synchronize: {} registered tensor(s) were not handed over in step {}: {}{}; every "
        "rank must hand over every registered gradient each step (the engine cannot finish "
        "this step and stops)",
        missing.size(), step_state.step, fmt::join(head, ", "), missing.size() > shown ? ", ..." : "")));
    error = e;
    changed.notify_all();
    fail_step(lock);
  }
  const bool finished = wait_for_step(lock);
  if (error) fail_step(lock);
  if (!finished) throw Error("synchronize: the engine is shutting down");
  settle_step();

  stats.step = step_state.step;
  stats.bytes_sent = 0;
  stats.uncompressed_bytes = 0;
  for (const LiveBucket& b : buckets) {
    stats.bytes_sent += b.route->bytes_sent();
    stats.uncompressed_bytes += b.elements * sizeof(float);
  }
  stats.step_seconds =
      step_started ? std::chrono::duration<double>(Clock::now() - step_start).count() : 0;
  stats.exchange_seconds = exchange_seconds;
  exchange_seconds = 0;

  for (TensorSlot& slot : slots) slot.ready = false;
  for (LiveBucket& b : buckets) b.reset();
  measure_norms = false;
  next_launch = 0;
  step_started = false;
  ++cycle;
  ++step_state.step;
  step_state.prev_lr = step_state.lr;
  step_state.lr = next_lr;
  step_state.prev_scale = step_state.scale;
  step_state.scale = next_scale;
  if (timeline) timeline->flush();
  changed.notify_all();
}

Engine::Engine(std::shared_ptr<Transport> transport, Plan plan, EngineOptions options)
    : impl_(std::make_unique<Impl>(std::move(transport), std::move(plan), options)) {}

Engine::~Engine() = default;

void Engine::ready(size_t tensor, std::span<float> grad) { impl_->ready(tensor, grad); }

void Engine::ready(const std::string& name, std::span<float> grad) {
  auto it = impl_->index_of.find(name);
  if (it == impl_->index_of.end()) {
    throw Error(fmt::format("ready: no registered tensor is named '{}'", name));
  }
  impl_->ready(it->second, grad);
}

void Engine::synchronize() { impl_->synchronize(); }

void Engine::set_plan(Plan plan, bool trial) { impl_->set_plan(std::move(plan), trial); }

void Engine::set_learning_rate(double lr) {
  if (!(lr >= 0)) throw Error(fmt::format("set_learning_rate: {} is not a learning rate", lr));
  std::lock_guard lock(impl_->mutex);
  impl_->next_lr = lr;
  if (!impl_->step_started) impl_->step_state.lr = lr;  // before the step's first gradient
}

void Engine::set_loss_scale(double scale) {
  if (!(scale > 0) || !std::isfinite(scale)) {
    throw Error(fmt::format("set_loss_scale: {} is not a loss scale; it must be a finite number "
                            "above 0 (the factor the gradients carry, a GradScaler's scale)",
                            scale));
  }
  std::lock_guard lock(impl_->mutex);
  impl_->next_scale = scale;
  if (!impl_->step_started) impl_->step_state.scale = scale;  // before the step's first gradient
}

void Engine::measure_mean_norms() {
  std::lock_guard lock(impl_->mutex);
  if (impl_->step_started) throw Error("measure_mean_norms: a step is in flight");
  impl_->measure_norms = true;
}

std::vector<Engine::BucketHealth> Engine::feedback_health() const {
  std::lock_guard lock(impl_->mutex);
  if (impl_->step_started) throw Error("feedback_health: a step is in flight; call synchronize() first");
  std::vector<BucketHealth> health;
  for (const LiveBucket& b : impl_->buckets) {
    Buffer<float> held(b.elements, 0.0f);
    b.route->carry(held);
    health.push_back({std::sqrt(route::scan(held).sum_of_squares),
                      std::sqrt(b.mean_sum_of_squares)});
  }
  return health;
}

const Plan& Engine::plan() const { return impl_->plan; }

const StepStats& Engine::last_step() const { return impl_->stats; }

uint64_t Engine::step() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->step_state.step;
}

size_t Engine::memory_bytes() const {
  std::lock_guard lock(impl_->mutex);  // the stage threads are idle between steps
  if (impl_->step_started) {
    throw Error("memory_bytes: a step is in flight; call synchronize() first");
  }
  size_t total = 0;
  for (const LiveBucket& b : impl_->buckets) total += b.memory_bytes();
  for (const auto& c : impl_->carried) total += c.values.size() * sizeof(float);
  return total;
}

StateOwner Engine::Impl::owner() const {
  return {.plan_hash = plan.hash(), .seed = options.seed,
          .rank = static_cast<uint32_t>(transport->rank()),
          .world_size = static_cast<uint32_t>(transport->size())};
}

std::vector<std::byte> Engine::save_state(StateFor use) const {
  std::lock_guard lock(impl_->mutex);
  if (impl_->step_started) throw Error("save_state: a step is in flight; call synchronize() first");
  impl_->throw_if_failed();
  EngineState state;
  state.step_state = impl_->step_state;
  for (const LiveBucket& b : impl_->buckets) {
    state.routes.push_back(use == StateFor::kUndo ? b.route->save_undo_state()
                                                  : b.route->save_state());
  }
  for (size_t t = 0; t < impl_->carried.size(); ++t) {
    const auto& c = impl_->carried[t];
    if (!c.values.empty()) state.carried.push_back({.tensor = t, .scale = c.scale, .values = {c.values.begin(), c.values.end()}});
  }
  return write_engine_state(impl_->owner(), state);
}

void Engine::fetch_remote_state() {
  std::lock_guard lock(impl_->mutex);
  if (impl_->step_started) {
    throw Error("fetch_remote_state: a step is in flight; call synchronize() first");
  }
  impl_->throw_if_failed();
  for (const LiveBucket& b : impl_->buckets) b.route->fetch_remote_state();
}

std::vector<std::vector<std::byte>> Engine::save_all_states() {
  fetch_remote_state();
  const std::vector<std::byte> mine = save_state();
  Transport& t = *impl_->transport;
  const auto world = static_cast<size_t>(t.size());
  const uint64_t my_size = mine.size();
  std::vector<uint64_t> sizes(world);
  t.allgather(std::as_bytes(std::span(&my_size, 1)), std::as_writable_bytes(std::span(sizes)))
      ->wait(t.timeout());
  const std::vector<size_t> counts(sizes.begin(), sizes.end());
  std::vector<std::byte> all(std::accumulate(counts.begin(), counts.end(), size_t{0}));
  t.allgatherv(mine, all, counts)->wait(t.timeout());
  std::vector<std::vector<std::byte>> states;
  size_t at = 0;
  for (size_t n : counts) {
    const auto begin = all.begin() + static_cast<std::ptrdiff_t>(at);
    states.emplace_back(begin, begin + static_cast<std::ptrdiff_t>(n));
    at += n;
  }
  return states;
}

void Engine::load_state(std::span<const std::byte> state) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->step_started) throw Error("load_state: a step is in flight; call synchronize() first");
  impl_->throw_if_failed();
  std::vector<size_t> elements;
  for (const auto& t : impl_->plan.tensors) elements.push_back(t.elements);
  EngineState loaded = read_engine_state(state, impl_->owner(), impl_->buckets.size(), elements);
  // All or nothing: if any bucket refuses its state, the ones loaded before it go back.
  std::vector<std::vector<std::byte>> before;
  for (const LiveBucket& b : impl_->buckets) before.push_back(b.route->save_undo_state());
  size_t b = 0;
  try {
    for (; b < impl_->buckets.size(); ++b) impl_->buckets[b].route->load_state(loaded.routes[b]);
  } catch (...) {
    // Bucket b too: its route may have loaded its codec before its feedback refused.
    for (size_t i = 0; i <= b && i < before.size(); ++i) {
      impl_->buckets[i].route->load_state(before[i]);
    }
    throw;
  }
  impl_->step_state = loaded.step_state;  // the stage threads keep counting cycles
  for (auto& c : impl_->carried) c = Impl::Carried{};
  for (auto& c : loaded.carried) {
    impl_->carried[c.tensor] = {.values = {c.values.begin(), c.values.end()}, .scale = c.scale};
  }
  impl_->next_lr = loaded.step_state.lr;
  // Checkpoints keep no loss scale: the coming step's is the one set last, and the scale the
  // loaded memory was accumulated under is unknown (no correction in the first step).
  impl_->step_state.scale = impl_->next_scale;
  impl_->step_state.prev_scale = 0;
}

void Engine::timeline_event(std::string_view name, Clock::time_point start,
                            Clock::time_point end, const nlohmann::json& args) {
  std::lock_guard lock(impl_->mutex);
  if (!impl_->timeline) return;
  constexpr int kCallerLane = 1 << 20;  // below any bucket's
  impl_->timeline->name_lane(kCallerLane, "compression=auto");
  impl_->timeline->span(kCallerLane, name, start, end, args);
}

void Engine::set_timeline(const std::string& path) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->step_started) throw Error("set_timeline: a step is in flight; call synchronize() first");
  impl_->timeline.reset();
  if (!path.empty()) impl_->open_timeline(path);
  impl_->attach_timeline();
}

}  // namespace gradcomp
