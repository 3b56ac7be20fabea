#include "bench_codecs.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/random.h"
#include "gradcomp/spec.h"

namespace gradcomp::tools {
namespace {

using Clock = std::chrono::steady_clock;

// Best (minimum) seconds per call of fn over repeated calls: the machine's capability, least
// disturbed by other load on a shared machine. `untimed` runs before each call, off the clock.
double best_seconds(const std::function<void()>& fn, const BenchCodecsOptions& o,
                    const std::function<void()>& untimed = {}) {
  double best = INFINITY, total = 0;
  const int max_repeats = untimed ? 20 : 1000;
  for (int rep = 0; rep < o.min_repeats || (total < o.min_seconds && rep < max_repeats); ++rep) {
    if (untimed) untimed();
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
  }
  return best;
}

// Writes a buffer twice the size of a large last-level cache, so that the next measurement
// starts with the sum buffer in memory, as a route's decode of a frame from another rank does
// (otherwise a sparse codec's scatter-add finds the lines it touched on the previous call).
constexpr double kColdBytes = 16 << 20;
void evict_caches() {
  static std::vector<uint64_t> junk(size_t{64} << 20 >> 3);
  static uint64_t round = 0;
  std::fill(junk.begin(), junk.end(), ++round);
}

std::vector<float> normal_gradient(size_t n) {
  const CounterRng rng(2024, 0, 0, 0, 1);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    const double u1 = (rng.bits(static_cast<uint32_t>(2 * i)) + 1.0) * 0x1.0p-32;
    const double u2 = rng.bits(static_cast<uint32_t>(2 * i + 1)) * 0x1.0p-32;
    x[i] = 1e-3f * static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307 * u2));
  }
  return x;
}

// Reads every byte once; the XOR fold keeps the compiler from skipping the loads.
uint64_t read_all(const std::vector<float>& x) {
  const auto* p = reinterpret_cast<const uint64_t*>(x.data());
  uint64_t a = 0, b = 0, c = 0, d = 0;
  const size_t words = x.size() / 2;
  size_t i = 0;
  for (; i + 4 <= words; i += 4) {
    a ^= p[i];
    b ^= p[i + 1];
    c ^= p[i + 2];
    d ^= p[i + 3];
  }
  for (; i < words; ++i) a ^= p[i];
  return a ^ b ^ c ^ d;
}

struct Baseline {
  double memcpy_gbps, read_gbps;
};

Baseline measure_baseline(const std::vector<float>& x, const BenchCodecsOptions& o) {
  std::vector<float> dst(x.size(), 1.0f);
  const double bytes = 4.0 * x.size();
  volatile uint64_t sink = 0;
  const double copy = best_seconds([&] { std::memcpy(dst.data(), x.data(), bytes); }, o);
  const double read = best_seconds([&] { sink = sink + read_all(x); }, o);
  return {bytes / copy / 1e9, bytes / read / 1e9};
}

// Runs the rounds before the last (a world of one): part of a multi-round codec's encode.
void run_early_rounds(Codec& codec, const std::vector<float>& x, std::vector<std::byte>& buf,
                      const Context& ctx) {
  for (int r = 0; r + 1 < codec.traits().rounds; ++r) {
    buf.resize(codec.max_round_bytes(r, x.size()));
    const size_t len = codec.encode_round(r, x, buf, ctx);
    codec.absorb_round(r, std::span(buf).first(len), ctx);
  }
}

struct CodecResult {
  std::string spec;
  double encode_gbps, encode_ef_gbps, decode_gbps;
  // The first frame of a sum: zeroing the buffer and accumulating into it (what routes did), and
  // decoding over the buffer (decode_into, what they do).
  double fill_decode_gbps, decode_into_gbps;
  size_t frame_bytes;
};

CodecResult measure_codec(const std::string& spec, const std::vector<float>& x,
                          const BenchCodecsOptions& o) {
  auto codec = make_codec(spec);
  const Context ctx{.seed = 1, .bucket = 0, .step = 0, .rank = 0, .world_size = 1, .threads = 1};
  std::vector<std::byte> frame(codec->max_frame_bytes(x.size())), round_buf;
  std::vector<float> residual(x.size()), sum(x.size(), 0.0f);
  size_t len = 0;
  const double bytes = 4.0 * x.size();
  const double enc = best_seconds([&] {
    run_early_rounds(*codec, x, round_buf, ctx);
    len = codec->encode(x, frame, ctx);
  }, o);
  const double enc_ef = best_seconds([&] {
    run_early_rounds(*codec, x, round_buf, ctx);
    codec->encode(x, frame, ctx, residual);
  }, o);
  // The EF pass above re-encoded the same input: `frame` holds the same bytes again.
  const auto view = std::span<const std::byte>(frame).first(len);
  // A sum buffer larger than the caches is in memory when a frame from another rank arrives;
  // a small one stays cached in a real step too, as it does here.
  const bool cold = bytes >= kColdBytes;
  const auto evict = cold ? evict_caches : std::function<void()>{};
  const double dec = best_seconds([&] { codec->decode_accumulate(view, sum, ctx); }, o, evict);
  const double fill_dec = best_seconds([&] {
    std::fill(sum.begin(), sum.end(), 0.0f);
    codec->decode_accumulate(view, sum, ctx);
  }, o, evict);
  const double into = best_seconds([&] { codec->decode_into(view, sum, ctx); }, o, evict);
  return {codec->spec(), bytes / enc / 1e9, bytes / enc_ef / 1e9, bytes / dec / 1e9,
          bytes / fill_dec / 1e9, bytes / into / 1e9, len};
}

}  // namespace

const std::vector<std::string>& recommended_bench_specs() {
  static const std::vector<std::string> specs = {
      "none", "fp16", "bf16", "qsgd:levels=16", "terngrad", "natural", "dither:levels=8",
      "signsgd", "efsignsgd", "signum", "onebit", "topk:ratio=0.01", "randomk:ratio=0.01",
      "dgc:ratio=0.01", "threshold:tau=0.002576",  // ~1% of N(0, 1e-3) entries
      "powersgd:rank=4", "intq:bits=8", "intq:bits=4"};
  return specs;
}

int bench_codecs(const BenchCodecsOptions& o) {
  const auto& specs = o.specs.empty() ? recommended_bench_specs() : o.specs;
  for (const auto& s : specs) make_codec(s);  // reject bad specs before measuring anything
  nlohmann::json doc = {{"command", "gradcomp bench codecs"}, {"threads", 1},
                        {"timing", "best of repeated calls; decode of buffers >= 16 MiB starts with cold caches"}, {"unit", "GB/s of float32 input"},
                        {"baselines", nlohmann::json::array()}, {"results", nlohmann::json::array()}};
  for (int log2n : o.log2_sizes) {
    const size_t n = size_t{1} << log2n;
    const auto x = normal_gradient(n);
    const Baseline base = measure_baseline(x, o);
    fmt::print("\n2^{} elements ({:.1f} MB):  memcpy {:.2f} GB/s   read {:.2f} GB/s ({:.2f}x memcpy)\n",
               log2n, 4.0 * n / 1e6, base.memcpy_gbps, base.read_gbps,
               base.read_gbps / base.memcpy_gbps);
    fmt::print("{:<28} {:>9} {:>7} {:>9} {:>7} {:>9} {:>7} {:>9} {:>9} {:>9}\n", "codec",
               "encode", "x mcpy", "enc+EF", "x mcpy", "decode", "x mcpy", "fill+dec", "dec into",
               "ratio");
    doc["baselines"].push_back({{"elements", n}, {"memcpy_gbps", base.memcpy_gbps},
                                {"read_gbps", base.read_gbps}});
    for (const auto& spec : specs) {
      const CodecResult r = measure_codec(spec, x, o);
      const double ratio = 4.0 * n / static_cast<double>(r.frame_bytes);
      fmt::print("{:<28} {:>9.2f} {:>6.2f}x {:>9.2f} {:>6.2f}x {:>9.2f} {:>6.2f}x {:>9.2f} "
                 "{:>9.2f} {:>8.1f}x\n",
                 spec, r.encode_gbps, r.encode_gbps / base.memcpy_gbps, r.encode_ef_gbps,
                 r.encode_ef_gbps / base.memcpy_gbps, r.decode_gbps,
                 r.decode_gbps / base.memcpy_gbps, r.fill_decode_gbps, r.decode_into_gbps, ratio);
      std::fflush(stdout);
      doc["results"].push_back({{"codec", Spec::parse(spec).name()}, {"spec", r.spec},
                                {"elements", n}, {"encode_gbps", r.encode_gbps},
                                {"encode_ef_gbps", r.encode_ef_gbps}, {"decode_gbps", r.decode_gbps},
                                {"fill_decode_gbps", r.fill_decode_gbps},
                                {"decode_into_gbps", r.decode_into_gbps},
                                {"memcpy_gbps", base.memcpy_gbps}, {"read_gbps", base.read_gbps},
                                {"encode_x_memcpy", r.encode_gbps / base.memcpy_gbps},
                                {"encode_ef_x_memcpy", r.encode_ef_gbps / base.memcpy_gbps},
                                {"decode_x_memcpy", r.decode_gbps / base.memcpy_gbps},
                                {"frame_bytes", r.frame_bytes}, {"compression_ratio", ratio}});
    }
  }
  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    if (!out) throw Error(fmt::format("cannot write the JSON report to '{}'", o.json_path));
    out << doc.dump(2) << '\n';
    fmt::print("\nwrote {}\n", o.json_path);
  }
  return 0;
}

}  // namespace gradcomp::tools
