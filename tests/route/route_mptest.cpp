// The routes between real processes (mpirun and `gradcomp launch`, W = 2 and 4). Every rank
// generates the inputs of ALL ranks (seeded by rank, step and case), computes the expected
// aggregate in-process with its own codec objects (route_reference.h), runs its route, and
// checks that the result equals the reference and is bit-identical on every rank.
//
// Exactness: allgather, twoway and hierarchical (nodes of 2 ranks, so the transport adds at
// most 2 values at a time) do the reference's arithmetic in the reference's order, and must
// match bit for bit. So must allreduce with W = 2 (a + b is commutative) and with integer
// payloads (intq). A float allreduce over W > 2 ranks associates the sum as the transport's
// algorithm chooses ((a + b) + (c + d) for recursive doubling; ring segments in rotated
// order), not as the reference's left fold, so there the result is compared within a few
// roundings of the sum's magnitude (the larger of the largest output and the largest mean of
// |input|, since partial sums of cancelling values exceed the result): 1e-5 of it for float32
// payloads, 2e-3 for float16 ones (each of the W - 1 float16 additions rounds to 11 bits). It
// must still be bit-identical across ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "gradcomp/error.h"
#include "gradcomp/spec.h"
#include "route/frames.h"
#include "route/node_split.h"
#include "route/route_reference.h"
#include "route/route_step.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"

namespace gradcomp::testing {
namespace {

constexpr uint64_t kSeed = 1234;
constexpr size_t kBucket = 3;
constexpr int kSteps = 3;
const std::vector<size_t> kSizes = {0, 1, 7, 1001, 100003};

uint32_t world_size() { return static_cast<uint32_t>(world()->size()); }
uint32_t my_rank() { return static_cast<uint32_t>(world()->rank()); }

// Rank r's gradient at `step` of case `salt`: different for every rank, step and case, and
// of a different scale per rank, so a route that mixes up ranks shows.
std::vector<std::vector<float>> all_inputs(size_t n, uint64_t step, uint64_t salt) {
  std::vector<std::vector<float>> inputs;
  for (uint32_t r = 0; r < world_size(); ++r) {
    inputs.push_back(gradient(n, 1 + r + 100 * step + 10000 * salt, 1.0f + 0.5f * static_cast<float>(r)));
  }
  return inputs;
}

StepState step_state(uint64_t s) {
  return {.step = s, .lr = 0.1 / static_cast<double>(s + 1),
          .prev_lr = s == 0 ? 0.0 : 0.1 / static_cast<double>(s)};
}

RouteEnv flat_env() { return {.world = world().get(), .seed = kSeed, .threads = 1}; }

RouteEnv node_env() {
  RouteEnv env = flat_env();
  env.intra = nodes().intra.get();
  env.leaders = nodes().leaders.get();
  env.cross = nodes().cross.get();
  return env;
}

std::vector<float> run_step(Route& route, const std::vector<float>& grad, const StepState& s) {
  return run_route_step(route, grad, s, kBucket, world()->timeout());
}

// How closely a route must match its reference (see the file comment).
double tolerance(const std::string& route, const std::string& codec) {
  if (route != "allreduce" || world_size() <= 2) return 0;
  const DType type = make_codec(codec)->traits().payload_type;
  if (type == DType::kF32) return 1e-5;
  if (type == DType::kF16 || type == DType::kBF16) return 2e-3;
  return 0;  // integer payloads add exactly in any order
}

// The magnitude a sum's rounding errors scale with: the largest mean of |input| over ranks
// (partial sums can exceed the result when values cancel), or the largest output.
float sum_scale(const std::vector<std::vector<float>>& inputs, const std::vector<float>& want) {
  float scale = 0;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i) {
    float mean_abs = 0;
    for (const auto& x : inputs) mean_abs += std::fabs(x[i]);
    scale = std::max(scale, mean_abs / static_cast<float>(inputs.size()));
  }
  return scale;
}

void expect_matches(const std::vector<float>& got, const std::vector<float>& want, double tol,
                    float scale = 0) {
  ASSERT_EQ(got.size(), want.size());
  if (tol == 0) {
    for (size_t i = 0; i < got.size(); ++i) {
      const bool same = std::memcmp(&got[i], &want[i], sizeof(float)) == 0 ||
                        (std::isnan(got[i]) && std::isnan(want[i]));
      ASSERT_TRUE(same) << "element " << i << " of " << got.size() << ": got " << got[i]
                        << ", the reference " << want[i];
    }
    return;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << "element " << i;
      continue;
    }
    ASSERT_LE(std::fabs(got[i] - want[i]), tol * scale)
        << "element " << i << ": got " << got[i] << ", the reference " << want[i];
  }
}

// memcmp of possibly empty spans (memcmp with a null pointer is undefined even for 0 bytes).
bool same_bytes(const void* a, const void* b, size_t bytes) {
  return bytes == 0 || std::memcmp(a, b, bytes) == 0;
}

void expect_same_on_all_ranks(const std::vector<float>& out) {
  const auto mine = std::as_bytes(std::span(out));
  const auto all = gather_bytes(mine);
  for (uint32_t r = 0; r < world_size(); ++r) {
    EXPECT_TRUE(same_bytes(all.data() + r * mine.size(), mine.data(), mine.size()))
        << "rank " << r << " ended with different bits than rank " << my_rank();
  }
}

struct Case {
  std::string route;  // the route spec
  std::string codec;
  std::string feedback;
};

std::string describe(const Case& c, size_t n) {
  return fmt::format("route '{}', codec '{}', feedback '{}', n = {}, W = {}", c.route, c.codec,
                     c.feedback, n, world_size());
}

// The reference of a case: a flat route, or the hierarchical one over nodes of 2.
class Reference {
 public:
  Reference(const Case& c, size_t n) {
    Spec spec = Spec::parse(c.route, "route");
    const Option option{.codec = c.codec, .feedback = c.feedback, .route = c.route};
    const std::string server = spec.has("server_feedback")
                                   ? spec.get_choice("server_feedback", "", feedback_names())
                                   : "";
    if (spec.name() == "hierarchical" || spec.name() == "sharded") {
      const std::string inner = spec.get_choice("inner", "allreduce", {"allreduce", "allgather", "twoway"});
      const bool fp16 = spec.get_choice("intra", "none", {"none", "fp16"}) == "fp16";
      if (spec.name() == "sharded") {
        sharded_ = std::make_unique<ShardedReference>(inner, fp16, option, server, kBucket, n,
                                                      world_size(), 2, kSeed);
      } else {
        hier_ = std::make_unique<HierarchicalReference>(inner, fp16, option, server, kBucket, n,
                                                        world_size(), 2, kSeed);
      }
    } else {
      flat_ = std::make_unique<FlatReference>(spec.name(), option, server, kBucket, n,
                                              world_size(), kSeed);
    }
  }
  std::vector<float> step(const std::vector<std::vector<float>>& in, const StepState& s) {
    if (sharded_) return sharded_->step(in, s);
    return flat_ ? flat_->step(in, s) : hier_->step(in, s);
  }
  FlatReference& flat() { return *flat_; }

 private:
  std::unique_ptr<FlatReference> flat_;
  std::unique_ptr<HierarchicalReference> hier_;
  std::unique_ptr<ShardedReference> sharded_;
};

bool is_hierarchical(const Case& c) { return route_needs_nodes(c.route); }

RouteEnv env_for(const Case& c) { return is_hierarchical(c) ? node_env() : flat_env(); }

// Twoway: the residuals of both feedbacks of this rank must equal the reference's, bit for bit
// (they are saved in the route state: codec, server codec, feedback, server feedback).
void expect_twoway_residuals(const Route& route, FlatReference& ref, size_t n, const Case& c) {
  const auto state = route.save_state();
  const auto parts = route::load_parts("twoway", state, {n, world_size()}, 4);
  SimRank& sim = ref.rank(my_rank());
  const auto worker = sim.feedback->save_state();
  const auto server = sim.server_feedback->save_state();
  ASSERT_EQ(parts[2].size(), worker.size());
  ASSERT_EQ(parts[3].size(), server.size());
  EXPECT_TRUE(same_bytes(parts[2].data(), worker.data(), worker.size())) << "worker residual";
  EXPECT_TRUE(same_bytes(parts[3].data(), server.data(), server.size())) << "server residual";
  // A lossy codec under error feedback must leave something behind (else the check is empty).
  const bool lossy = c.codec != "none" && c.feedback == "ef" && n >= 7;
  if (lossy) {
    const auto body = std::span(worker).subspan(22);  // after the feedback state header
    EXPECT_TRUE(std::any_of(body.begin(), body.end(), [](std::byte b) { return b != std::byte{0}; }))
        << "the worker residual stayed zero";
  }
}

void run_case(const Case& c, uint64_t salt) {
  const std::string route_name = Spec::parse(c.route, "route").name();
  for (size_t n : kSizes) {
    SCOPED_TRACE(describe(c, n));
    Reference ref(c, n);
    const auto route = make_route({.codec = c.codec, .feedback = c.feedback, .route = c.route},
                                  kBucket, n, env_for(c));
    for (uint64_t s = 0; s < kSteps; ++s) {
      SCOPED_TRACE(fmt::format("step {}", s));
      const auto inputs = all_inputs(n, s, salt);
      const auto want = ref.step(inputs, step_state(s));
      const auto got = run_step(*route, inputs[my_rank()], step_state(s));
      expect_matches(got, want, tolerance(route_name, c.codec), sum_scale(inputs, want));
      expect_same_on_all_ranks(got);
      if (route_name == "twoway") expect_twoway_residuals(*route, ref.flat(), n, c);
    }
  }
}

void run_cases(const std::vector<Case>& cases) {
  uint64_t salt = 0;
  for (const auto& c : cases) run_case(c, ++salt);
}

std::vector<Case> crossed(const std::string& route, const std::vector<std::string>& codecs,
                          const std::vector<std::string>& feedbacks) {
  std::vector<Case> cases;
  for (const auto& codec : codecs) {
    for (const auto& fb : feedbacks) cases.push_back({route, codec, fb});
  }
  return cases;
}

TEST(RouteMp, AllreduceMatchesTheReference) {
  run_cases(crossed("allreduce",
                    {"none", "fp16", "randomk:ratio=0.1", "powersgd", "intq", "intq:bits=4"},
                    {"none", "ef"}));
}

TEST(RouteMp, AllreduceOfFloat32SumsExactlyTheSupportReference) {
  // The fast path (none / none) and the framed path against aggregate_allreduce itself.
  if (world_size() > 2) GTEST_SKIP() << "float sums over W > 2 associate as the transport does";
  for (const std::string codec : {"none", "fp16", "randomk:ratio=0.1", "intq"}) {
    SCOPED_TRACE(codec);
    const auto inputs = all_inputs(1001, 0, 99);
    const auto route = make_route({.codec = codec}, kBucket, 1001, flat_env());
    const auto got = run_step(*route, inputs[my_rank()], step_state(0));
    const auto want = aggregate_allreduce(
        codec, inputs, {.seed = kSeed, .bucket = kBucket, .step = 0});
    expect_matches(got, want, 0);
  }
}

TEST(RouteMp, AllgatherMatchesTheReference) {
  run_cases(crossed("allgather",
                    {"none", "fp16", "randomk:ratio=0.1", "topk:ratio=0.1", "efsignsgd", "qsgd",
                     "signsgd"},
                    {"none", "ef"}));
}

TEST(RouteMp, TwowayMatchesTheReferenceWithFeedbackOnBothSides) {
  auto cases = crossed("twoway",
                       {"none", "fp16", "randomk:ratio=0.1", "topk:ratio=0.1", "efsignsgd", "qsgd"},
                       {"none", "ef"});
  cases.push_back({"twoway:server_feedback=none", "topk:ratio=0.1", "ef"});
  cases.push_back({"twoway:server_feedback=ef", "qsgd", "none"});
  run_cases(cases);
}

TEST(RouteMp, HierarchicalMatchesTheReference) {
  std::vector<Case> cases;
  for (const std::string intra : {"none", "fp16"}) {
    const std::string r = "hierarchical:inner=allreduce,intra=" + intra;
    cases.push_back({r, "none", "none"});
    cases.push_back({r, "fp16", "none"});
    cases.push_back({r, "randomk:ratio=0.1", "ef"});
    cases.push_back({r, "powersgd", "ef"});
    cases.push_back({r, "intq", "none"});
  }
  cases.push_back({"hierarchical:inner=allgather", "topk:ratio=0.1", "ef"});
  cases.push_back({"hierarchical:inner=allgather", "qsgd", "none"});
  cases.push_back({"hierarchical:inner=twoway", "topk:ratio=0.1", "ef"});
  cases.push_back({"hierarchical:inner=twoway,intra=fp16", "efsignsgd", "ef"});
  cases.push_back({"hierarchical:inner=twoway,server_feedback=none", "randomk:ratio=0.1", "ef"});
  run_cases(cases);
}

TEST(RouteMp, ShardedMatchesTheReference) {
  std::vector<Case> cases;
  for (const std::string intra : {"none", "fp16"}) {
    const std::string r = "sharded:inner=allreduce,intra=" + intra;
    cases.push_back({r, "none", "none"});
    cases.push_back({r, "randomk:ratio=0.1", "ef"});
    cases.push_back({r, "powersgd", "ef"});
  }
  cases.push_back({"sharded:inner=allgather", "topk:ratio=0.1", "ef"});
  cases.push_back({"sharded:inner=allgather", "qsgd", "none"});
  cases.push_back({"sharded:inner=twoway", "topk:ratio=0.1", "ef"});
  cases.push_back({"sharded:inner=twoway,intra=fp16", "efsignsgd", "ef"});
  run_cases(cases);
}

// Inside a node of L ranks each rank sends (L - 1) / L of the bucket in the reduce-scatter and
// as much in the allgather: 2 (L - 1) / L in all, against the leader route's allreduce plus
// broadcast; the rest of what it sends is its shard's inner route.
TEST(RouteMp, ShardedSendsTwoShardsOfTheBucketInsideTheNode) {
  const size_t n = 100000;  // even shards of nodes of 2
  const auto route = make_route({.route = "sharded:inner=allreduce"}, kBucket, n, node_env());
  run_step(*route, all_inputs(n, 0, 3)[my_rank()], step_state(0));
  const size_t intra = 2 * (n / 2) * sizeof(float);  // L = 2: one shard out, one shard back
  const size_t cross = (n / 2) * sizeof(float);  // the inner allreduce counts its shard
  EXPECT_EQ(route->bytes_sent(), intra + cross);
}

// The engine does not call decode: it takes decode_unscaled's sum and factor and writes the
// mean into the gradients with route::write_mean, its check of the mean in the same pass. That
// must give decode's bits for every route, with a -0 in the input (the uncompressed allreduce's
// sum keeps it; the mean must be +0 as a decode into zeros makes it), a NaN (the check) and the
// majority vote (no factor left).
TEST(RouteMp, TheEnginesFusedPassGivesDecodesBits) {
  const std::vector<std::pair<Option, bool>> cases = {
      {{.codec = "none"}, false},
      {{.codec = "none", .feedback = "ef"}, false},
      {{.codec = "fp16"}, false},
      {{.codec = "randomk:ratio=0.1", .feedback = "ef"}, false},
      {{.codec = "powersgd", .feedback = "ef"}, false},
      {{.codec = "topk:ratio=0.1", .feedback = "ef", .route = "allgather"}, false},
      {{.codec = "signsgd", .route = "allgather"}, false},
      {{.codec = "qsgd", .feedback = "ef", .route = "twoway"}, false},
      {{.codec = "fp16", .route = "sharded"}, true},
      {{.codec = "topk:ratio=0.1", .feedback = "ef", .route = "hierarchical:inner=allgather"}, true},
  };
  for (const auto& [option, with_nodes] : cases) {
    for (const bool nan : {false, true}) {
      SCOPED_TRACE(option.codec + " / " + option.feedback + " / " + option.route +
                   (nan ? " / with a NaN" : ""));
      const RouteEnv env = with_nodes ? node_env() : flat_env();
      const auto decoded = make_route(option, kBucket, 1001, env);
      const auto fused = make_route(option, kBucket, 1001, env);
      const Phases p(kBucket, world()->timeout(), nullptr);
      for (uint64_t step = 0; step < 2; ++step) {
        auto grad = all_inputs(1001, step, 7)[my_rank()];
        grad[0] = -0.0f;
        if (nan && my_rank() == 0) grad[5] = std::numeric_limits<float>::quiet_NaN();
        const auto want = run_step(*decoded, grad, step_state(step));
        std::vector<float> sum = grad;
        std::vector<float> mean(grad.size(), 42.0f);
        const StepState s = step_state(step);
        fused->encode(sum, s, p);
        fused->exchange(s, p);
        const float factor = fused->decode_unscaled(sum, s, p);
        const route::Scan scanned = route::write_mean(sum, mean, factor, true);
        fused->settle(scanned.finite, s);
        expect_matches(mean, want, 0);
        EXPECT_EQ(scanned.finite, !nan);
        if (!nan) {
          EXPECT_EQ(scanned.sum_of_squares, route::scan(want).sum_of_squares);
        }
        std::vector<float> in_place = sum;
        route::write_mean(in_place, in_place, factor, false);
        expect_matches(in_place, want, 0);
      }
    }
  }
}

// A route whose feedback compensates element by element takes the gradient in parts as the
// engine hands over each tensor (Route::take_part), with no copy into the bucket: in any order
// of the parts, over steps with a learning-rate change (ef's lr correction) and a rollback,
// the means are decode's bits of the whole gradient, and encode does not read its buffer.
TEST(RouteMp, AGradientInPartsGivesTheWholeGradientsBits) {
  const std::vector<Option> cases = {
      {.codec = "randomk:ratio=0.1", .feedback = "ef:lr_correction=true"},
      {.codec = "powersgd", .feedback = "ef"},
      {.codec = "topk:ratio=0.1", .feedback = "ef:decay=0.9", .route = "allgather"},
      {.codec = "fp16", .feedback = "ef", .start_step = 2},
  };
  constexpr size_t kN = 1001;
  const std::vector<std::pair<size_t, size_t>> parts = {{700, 301}, {0, 300}, {300, 400}};
  for (const Option& option : cases) {
    SCOPED_TRACE(option.codec + " / " + option.feedback + " / " + option.route);
    const auto whole = make_route(option, kBucket, kN, flat_env());
    const auto in_parts = make_route(option, kBucket, kN, flat_env());
    const Phases p(kBucket, world()->timeout(), nullptr);
    for (uint64_t step = 0; step < 5; ++step) {
      StepState s = step_state(step);
      auto grad = all_inputs(kN, step, 11)[my_rank()];
      if (step == 3) grad[9] = std::numeric_limits<float>::infinity();  // rolled back
      const auto want = run_step(*whole, grad, s);
      ASSERT_EQ(in_parts->takes_parts(s), step >= option.start_step);
      std::vector<float> buffer(kN, 42.0f);  // not the gradient: must not be read
      if (in_parts->takes_parts(s)) {
        for (const auto& [offset, size] : parts) {
          in_parts->take_part(offset, std::span(grad).subspan(offset, size), s);
        }
      } else {
        buffer = grad;
      }
      in_parts->encode(buffer, s, p);
      in_parts->exchange(s, p);
      in_parts->decode(buffer, s, p);
      in_parts->settle(route::all_finite(buffer), s);
      expect_matches(buffer, want, 0);
      EXPECT_EQ(in_parts->save_state(), whole->save_state());
    }
  }
}

TEST(RouteMp, NonFiniteInputReachesEveryRank) {
  // Rank 0's gradient holds a NaN and an Inf. randomk and intq carry them only in the frame's
  // flag, which the allreduce route must OR across ranks; the others carry them in the payload.
  const size_t n = 1001;
  for (const std::string codec : {"none", "fp16", "randomk:ratio=0.1", "intq", "powersgd"}) {
    for (const std::string route : {"allreduce", "hierarchical"}) {
      const Case c{route, codec, "none"};
      SCOPED_TRACE(describe(c, n));
      auto inputs = all_inputs(n, 0, 77);
      inputs[0][3] = std::numeric_limits<float>::quiet_NaN();
      inputs[0][500] = std::numeric_limits<float>::infinity();
      Reference ref(c, n);
      const auto want = ref.step(inputs, step_state(0));
      const auto r = make_route({.codec = codec, .route = route}, kBucket, n, env_for(c));
      const auto got = run_step(*r, inputs[my_rank()], step_state(0));
      // EXPECT, not ASSERT: every rank must reach the collective below.
      size_t differ = n;
      for (size_t i = 0; i < n && differ == n; ++i) {
        if (std::isfinite(got[i]) != std::isfinite(want[i])) differ = i;
      }
      EXPECT_EQ(differ, n) << "finiteness differs from the reference first at this element";
      EXPECT_FALSE(std::isfinite(got[3]));
      expect_same_on_all_ranks(got);
    }
  }
}

TEST(RouteMp, SaveAndLoadMidRunContinueIdentically) {
  const std::vector<Case> cases = {
      {"allreduce", "powersgd", "ef"},
      {"allreduce", "randomk:ratio=0.1", "ef"},
      {"allgather", "topk:ratio=0.1", "ef"},
      {"twoway", "topk:ratio=0.1", "ef"},
      {"hierarchical:inner=twoway", "topk:ratio=0.1", "ef"},
      {"hierarchical:inner=allreduce", "powersgd", "ef"},
      {"sharded:inner=twoway", "topk:ratio=0.1", "ef"},
      {"sharded:inner=allreduce", "powersgd", "ef"},
  };
  const size_t n = 1001;
  for (const auto& c : cases) {
    SCOPED_TRACE(describe(c, n));
    const Option option{.codec = c.codec, .feedback = c.feedback, .route = c.route};
    const auto first = make_route(option, kBucket, n, env_for(c));
    for (uint64_t s = 0; s < 2; ++s) run_step(*first, all_inputs(n, s, 5)[my_rank()], step_state(s));
    const auto state = first->save_state();
    const auto second = make_route(option, kBucket, n, env_for(c));
    second->load_state(state);
    for (uint64_t s = 2; s < 4; ++s) {
      const auto grad = all_inputs(n, s, 5)[my_rank()];
      const auto a = run_step(*first, grad, step_state(s));
      const auto b = run_step(*second, grad, step_state(s));
      EXPECT_TRUE(same_bytes(a.data(), b.data(), n * sizeof(float))) << "step " << s;
    }
    // A state cannot land in a bucket of another size.
    const auto other = make_route(option, kBucket, n + 1, env_for(c));
    EXPECT_THROW(other->load_state(state), Error);
  }
}

TEST(RouteMp, BytesSentCountWhatThisRankHandsOver) {
  const size_t n = 1001;
  const uint32_t w = world_size();
  const auto grad = all_inputs(n, 0, 3)[my_rank()];
  const auto raw = make_route(Option{}, kBucket, n, flat_env());
  run_step(*raw, grad, step_state(0));
  EXPECT_EQ(raw->bytes_sent(), n * sizeof(float));  // the fast path: the bucket itself
  const auto fp16 = make_route({.codec = "fp16"}, kBucket, n, flat_env());
  run_step(*fp16, grad, step_state(0));
  EXPECT_EQ(fp16->bytes_sent(), 2 * n);  // the payload; the header is not sent
  const auto gather = make_route({.codec = "fp16", .route = "allgather"}, kBucket, n, flat_env());
  run_step(*gather, grad, step_state(0));
  EXPECT_EQ(gather->bytes_sent(), kFrameHeaderBytes + 2 * n);  // fixed frame size: no size word
  const auto twoway = make_route({.codec = "fp16", .route = "twoway"}, kBucket, n, flat_env());
  run_step(*twoway, grad, step_state(0));
  // The W - 1 shard frames for the other ranks (its own stays here), then its server frame.
  const auto shard = [&](uint32_t s) { return n * (s + 1) / w - n * s / w; };
  EXPECT_EQ(twoway->bytes_sent(), (w - 1) * kFrameHeaderBytes + 2 * (n - shard(my_rank())) +
                                      kFrameHeaderBytes + 2 * shard(my_rank()));
  // A codec whose frame size depends on the data sends its sizes first: 8 bytes per rank. This
  // threshold keeps nothing, so all its frames are as long as an empty one, of any length.
  const std::string keep_nothing = "threshold:tau=1e30";
  const auto codec = make_codec(keep_nothing);
  std::vector<std::byte> frame(codec->max_frame_bytes(n));
  const size_t empty = codec->encode(grad, frame, {});
  const auto sized = make_route({.codec = keep_nothing, .route = "allgather"}, kBucket, n, flat_env());
  run_step(*sized, grad, step_state(0));
  EXPECT_EQ(sized->bytes_sent(), 8 + empty);
  const auto sized_twoway = make_route({.codec = keep_nothing, .route = "twoway"}, kBucket, n,
                                       flat_env());
  run_step(*sized_twoway, grad, step_state(0));
  EXPECT_EQ(sized_twoway->bytes_sent(), 8 * (w - 1) + (w - 1) * empty + 8 + empty);
}

}  // namespace
}  // namespace gradcomp::testing
