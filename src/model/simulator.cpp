// Simulator: one step of a Plan as the engine runs it (src/engine/engine.cpp), in model time.
//
// Times are seconds from the start of the iteration: forward runs first, then backward hands
// over gradients at forward + lambda * ready_s (+ the caller's encoding so far). As in the
// engine, a bucket is launched once it is complete and every earlier bucket was launched; the
// buckets launched by one hand-over are encoded on the caller's thread right there (EncodeOn::
// kCaller, delaying every later gradient) or queued for the encoder thread. The exchanging and
// decoding threads then serve buckets in plan order, each after its previous stage.
#include "gradcomp/model/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"

namespace gradcomp::model {
namespace {

// Per-thread scratch, grown to the largest plan seen and reused: a simulation allocates
// nothing once warm (the planner calls it many times).
struct Scratch {
  std::vector<int> bucket_of;      // tensor -> bucket
  std::vector<size_t> pending;     // tensors a bucket still waits for
  std::vector<double> elements;    // per bucket
  std::vector<BucketTimes> times;  // per bucket
  std::vector<double> encoded;     // when each bucket's encoding ends
};

Scratch& scratch(size_t tensors, size_t buckets) {
  thread_local Scratch s;
  s.bucket_of.assign(tensors, -1);
  s.pending.assign(buckets, 0);
  s.elements.assign(buckets, 0);
  s.times.resize(buckets);
  s.encoded.assign(buckets, 0);
  return s;
}

void check_tensors(const Profile& profile, const Plan& plan) {
  if (plan.tensors.size() != profile.tensors.size()) {
    throw Error(fmt::format("simulate: the plan has {} tensors, the profile '{}' has {}",
                            plan.tensors.size(), profile.model, profile.tensors.size()));
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorInfo& a = plan.tensors[i];
    const ProfileTensor& b = profile.tensors[i];
    if (a.name != b.name || a.elements != b.elements) {
      throw Error(fmt::format("simulate: plan tensor {} is '{}' ({} elements), but the "
                              "profile's tensor {} is '{}' ({} elements); a plan must list the "
                              "profile's tensors in its order",
                              i, a.name, a.elements, i, b.name, b.elements));
    }
  }
}

// Fills bucket_of, pending and elements; a plan that is not a partition is an error.
void map_buckets(const Plan& plan, Scratch& s) {
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (size_t t : plan.buckets[b].tensors) {
      if (t >= plan.tensors.size() || s.bucket_of[t] >= 0) {
        throw Error(fmt::format("simulate: bucket {} lists tensor {}, which is {}", b, t,
                                t >= plan.tensors.size() ? "out of range" : "in another bucket"));
      }
      s.bucket_of[t] = static_cast<int>(b);
      ++s.pending[b];
      s.elements[b] += static_cast<double>(plan.tensors[t].elements);
    }
  }
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    if (s.bucket_of[t] < 0) {
      throw Error(fmt::format("simulate: tensor {} ('{}') is in no bucket", t, plan.tensors[t].name));
    }
  }
}

enum Lane { kCompute = 0, kEncode = 1, kExchange = 2, kDecode = 3 };
constexpr const char* kLaneNames[] = {"compute", "encode", "exchange", "decode"};

class Recorder {
 public:
  explicit Recorder(std::vector<Span>* spans) : spans_(spans) {}
  bool on() const { return spans_ != nullptr; }
  void add(Lane lane, std::string name, int bucket, double start, double end) const {
    if (spans_ != nullptr) spans_->push_back({kLaneNames[lane], std::move(name), bucket, start, end});
  }

 private:
  std::vector<Span>* spans_;
};

// The compute thread and the encoder: hands over gradients in backward order and launches
// buckets. Returns when backward ends.
class Backward {
 public:
  Backward(const Profile& profile, const Plan& plan, double lambda, Scratch& s, const Recorder& rec)
      : profile_(profile), plan_(plan), lambda_(lambda), s_(s), rec_(rec) {}

  double run() {
    const double start = profile_.forward_s;
    piece_start_ = start;
    for (size_t t = 0; t < profile_.tensors.size(); ++t) {
      const double now = start + lambda_ * profile_.tensors[t].ready_s + delay_;
      if (--s_.pending[s_.bucket_of[t]] == 0) launch(now);
    }
    const double end = start + lambda_ * profile_.backward_s + delay_;
    launch(end);  // empty buckets at the end of the plan
    if (rec_.on()) rec_.add(kCompute, "backward", -1, piece_start_, end);
    return end;
  }

 private:
  // Launches every complete bucket from next_ on, at `now`, as Engine::ready does.
  void launch(double now) {
    double caller = now;  // the caller's thread encodes its buckets one after another
    for (; next_ < plan_.buckets.size() && s_.pending[next_] == 0; ++next_) {
      const double encode = s_.times[next_].encode_s;
      const int b = static_cast<int>(next_);
      if (plan_.buckets[next_].option.encode_on == EncodeOn::kCaller) {
        if (rec_.on() && caller > piece_start_) rec_.add(kCompute, "backward", -1, piece_start_, caller);
        if (rec_.on()) rec_.add(kCompute, fmt::format("bucket {} encode", b), b, caller, caller + encode);
        caller += encode;
        delay_ += encode;
        piece_start_ = caller;
        s_.encoded[next_] = caller;
      } else {
        const double begin = std::max(now, encoder_free_);
        encoder_free_ = begin + encode;
        if (rec_.on()) rec_.add(kEncode, fmt::format("bucket {} encode", b), b, begin, encoder_free_);
        s_.encoded[next_] = encoder_free_;
      }
    }
  }

  const Profile& profile_;
  const Plan& plan_;
  double lambda_;
  Scratch& s_;
  const Recorder& rec_;
  size_t next_ = 0;
  double delay_ = 0;         // caller encoding so far: every later gradient comes this much later
  double encoder_free_ = 0;
  double piece_start_ = 0;   // where the current stretch of backward compute began
};

// The exchanging and decoding threads, bucket after bucket. Returns the last decode's end.
double exchange_and_decode(const Plan& plan, const CostModel& cost, const Scratch& s,
                           const Recorder& rec, double& bytes) {
  double exchanger = 0, decoder = 0;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const BucketTimes& t = s.times[b];
    const double start = std::max(s.encoded[b], exchanger);
    exchanger = start + t.exchange_s;
    decoder = std::max(exchanger, decoder) + t.decode_s;
    bytes += t.bytes;
    if (!rec.on()) continue;
    const int id = static_cast<int>(b);
    double at = start;
    for (const Phase& p : cost.bucket(plan.buckets[b].option, s.elements[b]).phases) {
      rec.add(kExchange, fmt::format("bucket {} {}", b, p.name), id, at, at + p.seconds);
      at += p.seconds;
    }
    rec.add(kDecode, fmt::format("bucket {} decode", b), id, decoder - t.decode_s, decoder);
  }
  return decoder;
}

}  // namespace

SimResult simulate(const Profile& profile, const Plan& plan, const CostModel& cost,
                   const SimulatorSettings& settings, bool keep_spans) {
  if (!(settings.lambda >= 1) || !std::isfinite(settings.lambda)) {
    throw Error(fmt::format("simulate: lambda = {} must be >= 1 (the slow-down of compute "
                            "while communicating; 1 is none, measured 1.04-1.1)",
                            settings.lambda));
  }
  check_tensors(profile, plan);
  if (plan.sliced()) {  // every slice becomes ready with its tensor
    return simulate(profile.by_piece(plan.pieces()), plan.by_piece(), cost, settings, keep_spans);
  }
  Scratch& s = scratch(plan.tensors.size(), plan.buckets.size());
  map_buckets(plan, s);
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    s.times[b] = cost.bucket_times(plan.buckets[b].option, s.elements[b]);
  }
  SimResult r;
  const Recorder rec(keep_spans ? &r.spans : nullptr);
  if (keep_spans) rec.add(kCompute, "forward", -1, 0, profile.forward_s);
  r.backward_end_s = Backward(profile, plan, settings.lambda, s, rec).run();
  r.exchange_end_s = exchange_and_decode(plan, cost, s, rec, r.bytes_sent);
  r.iteration_s = std::max(r.backward_end_s, r.exchange_end_s);
  return r;
}

double compute_bound(const Profile& profile) { return profile.forward_s + profile.backward_s; }

nlohmann::json SimResult::chrome_trace() const {
  // The engine's timeline format (src/timeline/timeline.cpp): JSON Array Format, microseconds,
  // metadata events naming the process and one thread per lane.
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 0},
                    {"args", {{"name", "simulated step"}}}});
  for (int lane = 0; lane < 4; ++lane) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", lane},
                      {"args", {{"name", kLaneNames[lane]}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", lane},
                      {"args", {{"sort_index", lane}}}});
  }
  for (const Span& s : spans) {
    const auto lane = std::find(std::begin(kLaneNames), std::end(kLaneNames), s.lane) -
                      std::begin(kLaneNames);
    json event = {{"name", s.name}, {"ph", "X"}, {"ts", s.start_s * 1e6},
                  {"dur", std::max(0.0, s.end_s - s.start_s) * 1e6}, {"pid", 0}, {"tid", lane}};
    if (s.bucket >= 0) event["args"] = {{"bucket", s.bucket}};
    events.push_back(std::move(event));
  }
  return events;
}

}  // namespace gradcomp::model
