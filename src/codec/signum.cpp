// signum: the sign of momentum (Bernstein et al., signSGD with majority vote, "Signum"). The
// codec keeps a momentum m (n floats: zeros at the first encode; n must not change after)
// and on each encode of gradient g computes
//     m <- beta * m + (1 - beta) * g        (as fma(beta, m, float(1 - beta) * g) in float32)
// and sends sign(m), decoded as +1 / -1; the aggregate of W ranks is the majority vote, 0 on a
// tie. The residual is g - sign(m) (input minus decoded). A NaN or Inf gradient element leaves
// its momentum unchanged, so one overflow does not poison the state for good; the frame carries
// the non-finite flag instead and the decoder adds NaN everywhere. docs/wire-format.md (signum).
//
// Payload: ceil(n/8) bytes of sign bits of m, LSB-first, bit = 1 when m < 0.
// State (save_state, common/state_io.h): "SGNM", u32 version 1, u64 n, then n float32 values of m; no bytes
// before the first encode. encode() writes the new m into a second buffer and swaps, so the old
// one stays for discard() (a swap back; 2n floats, no pass over the data).
#include "codec/casts_frame.h"
#include "codec/factories.h"
#include "common/buffer.h"
#include "common/state_io.h"
#include "codec/sign_bits.h"

namespace gradcomp {
namespace {

constexpr const char* kSignumName = "signum";
constexpr StateKind kSignumState{"SGNM"};
constexpr uint32_t kStateVersion = 1;

class SignumCodec final : public Codec {
 public:
  explicit SignumCodec(double beta)
      : beta_(beta),
        beta_f_(static_cast<float>(beta)),
        one_minus_beta_f_(static_cast<float>(1.0 - beta)) {}

  CodecId id() const override { return CodecId::kSignum; }
  std::string spec() const override {
    return fmt::format("{}:momentum={}", kSignumName, format_number(beta_));
  }
  // Not shardable: the momentum belongs to the whole bucket and its size is fixed.
  CodecTraits traits() const override {
    return {.shardable = false, .bits_per_element = 1, .unbiased = false,
            .aggregation = Aggregation::kMajorityVote, .stateful = true};
  }
  size_t max_frame_bytes(size_t n) const override {
    return kFrameHeaderBytes + sign_bits::bytes_for(n);
  }

  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override {
    const size_t n = input.size();
    casts::check_buffers(kSignumName, n, out, max_frame_bytes(n), residual);
    prepare_momentum(n);
    auto* bits = reinterpret_cast<uint8_t*>(out.data() + kFrameHeaderBytes);
    const bool non_finite = reduce_chunks<int>(
        n, ctx.threads, 0,
        [&](size_t b, size_t e) {
          return static_cast<int>(sign_bits::momentum_pack(
              input.data() + b, momentum_.data() + b, next_.data() + b, e - b, beta_f_,
              one_minus_beta_f_, bits + b / 8, residual.empty() ? nullptr : residual.data() + b));
        },
        [](int a, int c) { return a | c; }) != 0;
    momentum_.swap(next_);  // next_ keeps the old momentum for discard()
    write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                        .flags = non_finite ? kFlagNonFinite : uint8_t{0},
                        .param_hash = param_hash(), .elements = n,
                        .payload_bytes = sign_bits::bytes_for(n)},
                       out);
    return max_frame_bytes(n);
  }

  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override {
    FrameHeader h;
    const auto payload = check_frame(frame, expectation(sum.size()), &h);
    casts::accumulate_unscaled_signs(kSignumName, h, payload, sum, ctx.threads);
  }

  void finalize(std::span<float> sum, uint32_t) const override { sign_bits::majority_vote(sum); }

  std::vector<std::byte> save_state() const override {
    if (!has_momentum_) return {};
    StateWriter out(kSignumState, kStateVersion);
    out.put(static_cast<uint64_t>(momentum_.size())).floats(momentum_);
    return std::move(out).finish();
  }

  void load_state(std::span<const std::byte> state) override {
    step_open_ = false;  // the loaded state is not a step to take back
    if (state.empty()) {  // the state of a codec that never encoded
      momentum_.clear();
      has_momentum_ = false;
      return;
    }
    StateReader in(fmt::format("codec '{}': cannot load state", kSignumName), state, kSignumState);
    const auto count = in.get<uint64_t>("the momentum's length");
    const size_t body = in.left();
    if (body % 4 != 0 || count != body / 4) {
      in.fail(fmt::format("it announces {} momentum values but holds {} bytes after its header; "
                          "expected 4 per value",
                          count, body));
    }
    Buffer<float> momentum(count);
    in.floats(momentum, "the momentum");
    momentum_ = std::move(momentum);
    has_momentum_ = true;
  }

  void discard() override {
    if (!step_open_) {
      throw Error(
          fmt::format("codec '{}': discard() without a step to take back; call it once "
                      "per step, after decode",
                      kSignumName));
    }
    step_open_ = false;
    momentum_.swap(next_);
    has_momentum_ = had_momentum_;  // a discarded first step leaves no momentum
  }

 private:
  // Creates the momentum (zeros) on the first encode. A codec instance serves one bucket,
  // whose length never changes: another length means the codec is shared by mistake, and
  // silently restarting the momentum would hide that.
  // Opens the step discard() may take back.
  void prepare_momentum(size_t n) {
    if (has_momentum_ && momentum_.size() != n) {
      throw Error(
          fmt::format("codec '{}': its momentum holds {} elements but the input has {}; "
                      "a signum codec serves one bucket of a fixed length",
                      kSignumName, momentum_.size(), n));
    }
    had_momentum_ = has_momentum_;
    step_open_ = true;
    if (!has_momentum_) {
      momentum_.assign(n, 0.0f);
      has_momentum_ = true;
    }
    next_.resize(n);  // allocated once; every element is written before it is read
  }

  double beta_;
  float beta_f_;
  float one_minus_beta_f_;
  Buffer<float> momentum_;
  Buffer<float> next_;  // the new momentum during encode; the old one after, for discard()
  bool has_momentum_ = false;
  bool had_momentum_ = false;  // has_momentum_ before the last encode
  bool step_open_ = false;     // encode ran and discard() did not since
};

}  // namespace

std::unique_ptr<Codec> make_signum(Spec& spec) {
  return std::make_unique<SignumCodec>(spec.get_double("momentum", 0.9, 0.0, 1.0, false, true));
}

}  // namespace gradcomp
