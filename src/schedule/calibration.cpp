#include "schedule/calibration.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gradcomp/codec.h"
#include "gradcomp/plan.h"
#include "gradcomp/random.h"
#include "schedule/agreement.h"

namespace gradcomp::schedule {
namespace {

using Clock = std::chrono::steady_clock;

double fastest(int repeats, const std::function<void()>& fn) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

// Least squares y = c0 + c1 x.
std::pair<double, double> fit_line(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sx += x[i];
    sy += y[i];
    sxx += x[i] * x[i];
    sxy += x[i] * y[i];
  }
  const double denominator = n * sxx - sx * sx;
  if (denominator <= 0) return {sy / n, 0};
  const double c1 = (n * sxy - sx * sy) / denominator;
  return {(sy - c1 * sx) / n, c1};
}

model::Linear linear_through(double n1, double s1, double n2, double s2) {
  const double b = std::max(0.0, (s2 - s1) / (n2 - n1));
  return {std::max(0.0, s1 - b * n1), b};
}

std::vector<float> gradient_like(size_t n) {
  const CounterRng rng(2026, 0, 0, 0, 3);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    const double u = (rng.bits(static_cast<uint32_t>(i)) + 0.5) * 0x1.0p-32;
    x[i] = static_cast<float>(1e-3 * (2 * u - 1));
  }
  return x;
}

// Runs a multi-round codec's rounds before the last, in a world of one (part of its encode).
void early_rounds(Codec& codec, std::span<const float> x, std::vector<std::byte>& buf,
                  const Context& ctx) {
  for (int r = 0; r + 1 < codec.traits().rounds; ++r) {
    buf.resize(codec.max_round_bytes(r, x.size()));
    const size_t len = codec.encode_round(r, x, buf, ctx);
    codec.absorb_round(r, std::span(buf).first(len), ctx);
  }
}

// Seconds of encode, encode with residual and decode at n elements, the fastest of 3.
std::array<double, 3> time_codec(const std::string& spec, size_t n) {
  auto codec = make_codec(spec);
  const auto x = gradient_like(n);
  const Context ctx{.seed = 1};
  std::vector<std::byte> frame(codec->max_frame_bytes(n)), rounds;
  std::vector<float> residual(n), sum(n, 0.0f);
  size_t len = 0;
  const double encode = fastest(3, [&] {
    early_rounds(*codec, x, rounds, ctx);
    len = codec->encode(x, frame, ctx);
  });
  const double encode_ef = fastest(3, [&] {
    early_rounds(*codec, x, rounds, ctx);
    codec->encode(x, frame, ctx, residual);
  });
  const auto view = std::span<const std::byte>(frame).first(len);
  const double decode = fastest(3, [&] { codec->decode_accumulate(view, sum, ctx); });
  return {encode, encode_ef, decode};
}

}  // namespace

// The probe sizes, in floats.
constexpr size_t kProbeFloats[] = {size_t{1} << 10, size_t{1} << 14, size_t{1} << 18,
                                   size_t{1} << 20};

LinkFit calibrate_link(Transport& transport, int repeats) {
  LinkFit fit;
  const int p = transport.size();
  if (p < 2) {
    fit.link = {model::kMaxBytesPerS, 0};
    return fit;
  }
  std::vector<double> mine;
  for (size_t floats : kProbeFloats) {
    std::vector<float> buffer(floats, 1.0f);
    transport.barrier()->wait(transport.timeout());  // every rank starts together
    mine.push_back(fastest(repeats, [&] {
      transport.allreduce(buffer)->wait(transport.timeout());
    }));
    fit.probes.push_back({4.0 * static_cast<double>(floats), 0});
  }
  const auto agreed = max_over_ranks(transport, mine);
  for (size_t i = 0; i < agreed.size(); ++i) fit.probes[i].seconds = agreed[i];
  fit.link = fit_ring_link(fit.probes, p);
  return fit;
}

NodeLinkFit calibrate_node_links(Transport& world, const NodeGroups& nodes, int repeats) {
  NodeLinkFit fit;
  fit.intra = calibrate_link(*nodes.intra, repeats);
  // Only the leaders probe between nodes, so each node's link carries one stream. The other
  // ranks wait in the agreement below until the leaders join it.
  if (Transport* leaders = nodes.leaders()) fit.inter = calibrate_link(*leaders, repeats);
  // Every node agreed on its own fits; the world agrees on the slowest node's inside and on
  // the leaders' between (the others contribute zeros).
  std::vector<double> mine;
  for (const auto& probe : fit.intra.probes) mine.push_back(probe.seconds);
  for (size_t i = 0; i < std::size(kProbeFloats); ++i) {
    mine.push_back(fit.inter.probes.empty() ? 0.0 : fit.inter.probes[i].seconds);
  }
  const auto agreed = max_over_ranks(world, mine);
  const int local = nodes.intra->size();
  const int node_count = world.size() / local;
  fit.inter.probes.clear();
  for (size_t i = 0; i < std::size(kProbeFloats); ++i) {
    const double bytes = 4.0 * static_cast<double>(kProbeFloats[i]);
    fit.intra.probes[i] = {bytes, agreed[i]};
    fit.inter.probes.push_back({bytes, agreed[std::size(kProbeFloats) + i]});
  }
  fit.intra.link = fit_ring_link(fit.intra.probes, local);
  fit.inter.link = fit_ring_link(fit.inter.probes, node_count);
  return fit;
}

double time_link_probe(Transport& world, const NodeGroups* nodes, double bytes, int repeats) {
  Transport* on = nodes ? nodes->leaders() : &world;
  double mine = 0;  // ranks that do not probe (not a node's leader) add nothing to the maximum
  if (on) {
    std::vector<float> buffer(static_cast<size_t>(bytes / 4), 1.0f);
    on->barrier()->wait(on->timeout());  // every prober starts together
    mine = fastest(repeats, [&] { on->allreduce(buffer)->wait(on->timeout()); });
  }
  return max_over_ranks(world, {mine})[0];
}

model::Link fit_ring_link(const std::vector<LinkProbe>& probes, int world) {
  if (probes.empty() || world < 2) return {model::kMaxBytesPerS, 0};  // nothing to fit
  std::vector<double> x, y;
  for (const auto& probe : probes) {
    x.push_back(probe.bytes);
    y.push_back(probe.seconds);
  }
  const double steps = 2.0 * (world - 1);
  const double moved = steps / world;  // bytes each rank sends per byte of the buffer
  auto [c0, c1] = fit_line(x, y);
  if (c1 <= 0) {  // no slope: latency from the smallest probe, transfer from the largest
    const auto smallest = std::min_element(x.begin(), x.end()) - x.begin();
    const auto largest = std::max_element(x.begin(), x.end()) - x.begin();
    c0 = y[static_cast<size_t>(smallest)];
    c1 = y[static_cast<size_t>(largest)] / x[static_cast<size_t>(largest)];
  }
  const double beta = c1 / moved;  // seconds per byte on the link
  return {.bytes_per_s = beta > 0 ? std::clamp(1 / beta, model::kMinBytesPerS, model::kMaxBytesPerS)
                                  : model::kMaxBytesPerS,
          .latency_s = std::clamp(c0 / steps, 0.0, model::kMaxLatencyS)};
}

model::CodecCosts calibrate_codecs(Transport& transport,
                                   const std::vector<std::string>& options) {
  // Every codec spec of the options (canonical: the cost model looks a codec's spec up first),
  // "none" always; a codec's name gets its first spec's costs, for settings not timed here.
  struct Timed {
    std::string name, canonical, written;
  };
  std::vector<Timed> timed{{"none", "none", "none"}};
  std::set<std::string> seen{"none"};
  for (const auto& text : options) {
    const std::string written = parse_option(text).codec;
    const auto codec = make_codec(written);
    if (seen.insert(codec->spec()).second) timed.push_back({codec->name(), codec->spec(), written});
  }
  constexpr size_t kSmall = size_t{1} << 14, kLarge = size_t{1} << 18;
  std::vector<double> mine;
  for (const auto& t : timed) {
    const auto small = time_codec(t.written, kSmall);
    const auto large = time_codec(t.written, kLarge);
    mine.insert(mine.end(), small.begin(), small.end());
    mine.insert(mine.end(), large.begin(), large.end());
  }
  const auto agreed = max_over_ranks(transport, mine);
  model::CodecCosts costs;
  const auto n1 = static_cast<double>(kSmall), n2 = static_cast<double>(kLarge);
  for (size_t i = 0; i < timed.size(); ++i) {
    const double* s = agreed.data() + 6 * i;
    costs.set_measured(timed[i].name, timed[i].canonical,
                       {.encode = linear_through(n1, s[0], n2, s[3]),
                        .encode_ef = linear_through(n1, s[1], n2, s[4]),
                        .decode = linear_through(n1, s[2], n2, s[5])});
  }
  return costs;
}

}  // namespace gradcomp::schedule
