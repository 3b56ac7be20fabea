// powersgd: rank-r power iteration with warm start (Vogels et al., NeurIPS 2019).
//
// The bucket is cut into matrices and plain ranges (powersgd_view.h): every tensor of two or
// more dimensions its own matrix when the plan gives shapes, else the whole bucket as one
// rows x cols matrix (powersgd_matrix.h). For each matrix M, every rank holds the same Q
// (cols x r): drawn from shared randomness the first time, afterwards the aggregated Q of the
// previous step (warm start).
//   round 0: P_i = M_i Q            (rows x r)  -> allreduce sum -> P_hat = orthonormalise(sum P_i)
//   round 1: Q_i = M_i^T P_hat      (cols x r)  -> allreduce sum -> decode adds P_hat (sum Q_i)^T
// finalize divides by W, giving P_hat P_hat^T mean(M_i). The reduced Q of round 1 is the next
// step's warm start; its columns are scaled to unit length on absorb (P_hat does not depend on
// the column scale of Q, and this keeps M Q far from overflow) and a zero or non-finite column
// is redrawn from the shared randomness so one bad step does not stall later ones.
//
// The plain ranges are summed as they are, in round 1's payload.
//
// Payloads (float32, little-endian, column-major so each column is contiguous), per matrix:
//   round 0: P, rank * rows values, P[i][k] at index k * rows + i
//   round 1: Q, rank * cols values, Q[c][k] at index k * cols + c; then the plain values
// the matrices one after another (powersgd_view.h). Header aux is 0. Both payloads are
// summable as float32.
//
// State (save_state, common/state_io.h): "PSGS", u32 version 2, u8 has_q, then when has_q: u64 n, u64 matrices,
// per matrix u64 rows, u64 cols, u64 rank, then every matrix's warm-start Q (rank * cols
// float32, column-major). The fused view writes and reads version 1 (the same without the
// count), as it always did. round 0 keeps a copy
// of Q as it was (small beside the n of the bucket) for discard().
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>

#include "codec/factories.h"
#include "codec/one_decoder_codec.h"
#include "codec/powersgd_matrix.h"
#include "codec/powersgd_view.h"
#include "common/buffer.h"
#include "common/state_io.h"
#include "gradcomp/error.h"
#include "gradcomp/random.h"

namespace gradcomp {
namespace {

using powersgd::Shape;
using powersgd::View;

constexpr size_t kMaxRank = 1024;  // the rank parameter's upper bound

// Version 1: the fused view (one matrix of the whole bucket, no count); 2: a matrix per tensor.
constexpr StateKind kPowersgdState{"PSGS", 1, 2};

// The residual must be empty, the input itself (in place), or a separate array of the same
// length: a partial overlap would be overwritten before it is read.
void check_powersgd_residual(const char* codec, std::span<const float> input,
                             std::span<float> residual) {
  if (residual.empty()) return;
  if (residual.size() != input.size()) {
    throw Error(fmt::format("codec '{}': residual has {} elements, the input {}", codec,
                            residual.size(), input.size()));
  }
  const float* r = residual.data();
  const float* x = input.data();
  if (r != x && r < x + input.size() && x < r + residual.size()) {
    throw Error(
        fmt::format("codec '{}': the residual partly overlaps the input; it must be the "
                    "input itself or a separate array",
                    codec));
  }
}

class PowerSgdCodec final : public OneDecoderCodec<PowerSgdCodec> {
 public:
  PowerSgdCodec(size_t rank, size_t cols, bool warm_start)
      : rank_(rank), cols_(cols), warm_start_(warm_start) {}

  CodecId id() const override { return CodecId::kPowerSgd; }
  std::string spec() const override {
    return fmt::format("powersgd:rank={},cols={},warm_start={}", rank_, cols_,
                       warm_start_ ? "true" : "false");
  }
  CodecTraits traits() const override {
    // Nominal size: both rounds for a bucket of 2^20 elements viewed as one matrix.
    const Shape s = powersgd::make_shape(size_t{1} << 20, cols_, rank_);
    const double bits = 32.0 * static_cast<double>(s.rank * (s.rows + s.cols)) / (1 << 20);
    return {.summable = true,
            .payload_type = DType::kF32,
            .shardable = false,
            .shared_randomness = true,
            .rounds = 2,
            .bits_per_element = bits,
            .unbiased = false,
            .payload_carries_nonfinite = true,  // NaN in M spreads through P and Q
            .stateful = true,
            .uses_layout = true};
  }

  void set_layout(std::span<const TensorShape> tensors) override;
  size_t max_frame_bytes(size_t n) const override {
    const auto v = view(n);
    return kFrameHeaderBytes + 4 * (v->q_values + v->plain_values);
  }
  ReduceOp round_op(int round) const override {
    check_round(round, 0, "round_op");
    return ReduceOp::kSum;
  }
  size_t max_round_bytes(int round, size_t n) const override {
    check_round(round, 0, "max_round_bytes");
    return kFrameHeaderBytes + 4 * view(n)->p_values;
  }

  size_t encode_round(int round, std::span<const float> input, std::span<std::byte> out,
                      const Context& ctx) override;
  void absorb_round(int round, std::span<const std::byte> reduced, const Context& ctx) override;
  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override;
  std::vector<std::byte> save_state() const override;
  void load_state(std::span<const std::byte> state) override;
  void discard() override;

 private:
  // What discard() puts back: Q as round 0 of the last step found it.
  struct SavedQ {
    Buffer<float> q;
    size_t n = 0;
    bool has = false;
    bool open = false;  // a step began and was not discarded
  };

  // How n elements are cut into matrices, made once (per-tensor: set_layout; fused: the first
  // call for n) and shared: every round of every step asks, and must not allocate.
  std::shared_ptr<const View> view(size_t n) const;
  // The fused view keeps version 1, byte for byte as before per-tensor matrices.
  uint32_t state_version() const { return layout_view_ ? 2 : 1; }
  void check_round(int round, int last, const char* what) const;
  void ensure_q(const View& v, const Context& ctx);
  void draw_q_column(size_t block, size_t k, const Context& ctx);
  void normalise_q(const Context& ctx);
  std::shared_ptr<const View> checked_view(const FrameHeader& h, size_t round) const;
  size_t write_frame(uint8_t round, uint64_t n, std::span<const float> values,
                     std::span<std::byte> out) const;
  void read_q_blocks(StateReader& in, uint32_t version, uint64_t n);
  // The last round's frame decoded, P_hat (sum Q)^T and the plain values, added into `out`
  // (kAdd) or written over it (0 + value): the blocks and plain ranges cover every element.
  friend class OneDecoderCodec<PowerSgdCodec>;
  template <bool kAdd>
  void decode(std::span<const std::byte> frame, std::span<float> out, const Context& ctx) const;

  size_t rank_, cols_;
  bool warm_start_;
  std::shared_ptr<const View> layout_view_;  // per-tensor view, when set_layout gave shapes
  mutable std::shared_ptr<const View> fused_view_;  // the last fused view made (atomic access)
  Buffer<float> q_;  // warm-start Q of every block (column-major), valid for q_view_
  View q_view_;
  bool has_q_ = false;
  Buffer<float> p_;  // P_hat of the current step, every block, valid for p_n_ elements
  size_t p_n_ = 0;
  bool has_p_ = false;
  Buffer<float> scratch_;  // this rank's P (round 0) or Q and plain values (last round)
  SavedQ saved_;
};

void PowerSgdCodec::set_layout(std::span<const TensorShape> tensors) {
  // An explicit cols asks for the fused view; a plan without shapes keeps it too.
  if (cols_ != 0 || !powersgd::shapes_known(tensors)) return;
  layout_view_ = std::make_shared<const View>(powersgd::tensor_view(tensors, rank_));
}

std::shared_ptr<const View> PowerSgdCodec::view(size_t n) const {
  if (!layout_view_) {
    // The encoder, exchanger and decoder threads may ask at once: the cache is swapped whole.
    std::shared_ptr<const View> cached = std::atomic_load(&fused_view_);
    if (cached && cached->n == n) return cached;
    auto made = std::make_shared<const View>(powersgd::fused_view(n, cols_, rank_));
    std::atomic_store(&fused_view_, made);
    return made;
  }
  if (n != layout_view_->n) {
    throw Error(fmt::format("codec 'powersgd': {} elements, but the bucket's tensors hold {}", n,
                            layout_view_->n));
  }
  return layout_view_;
}

void PowerSgdCodec::check_round(int round, int last, const char* what) const {
  if (round < 0 || round > last) {
    throw Error(fmt::format("codec 'powersgd': {} of round {}; rounds before the last are 0 .. {}",
                            what, round, last));
  }
}

// Column k of a block's initial Q: uniform in [-1, 1) from randomness all ranks share. Keyed
// by (seed, bucket) only with warm start, so a rank that joins later draws the same start; by
// step too without warm start, so each step gets a fresh projection. Block 0's streams are
// those of the fused view (a plan without shapes draws what it always drew).
void PowerSgdCodec::draw_q_column(size_t block, size_t k, const Context& ctx) {
  const auto stream = static_cast<uint32_t>(block * kMaxRank + k);
  const CounterRng rng(ctx.seed, ctx.bucket, warm_start_ ? 0 : ctx.step, CounterRng::kSharedRank,
                       stream);
  const powersgd::Block& b = q_view_.blocks[block];
  float* q = q_.data() + b.q_at + k * b.shape.cols;
  for (size_t c = 0; c < b.shape.cols; ++c) {
    q[c] = 2.0f * rng.uniform(static_cast<uint32_t>(c)) - 1.0f;
  }
}

void PowerSgdCodec::ensure_q(const View& v, const Context& ctx) {
  if (warm_start_ && has_q_ && q_view_.n == v.n) return;
  q_view_ = v;
  q_.assign(v.q_values, 0.0f);
  for (size_t b = 0; b < v.blocks.size(); ++b) {
    for (size_t k = 0; k < v.blocks[b].shape.rank; ++k) draw_q_column(b, k, ctx);
  }
  has_q_ = true;
}

// Unit-length columns; zero or non-finite ones are redrawn (see the file comment).
void PowerSgdCodec::normalise_q(const Context& ctx) {
  for (size_t b = 0; b < q_view_.blocks.size(); ++b) {
    const powersgd::Block& block = q_view_.blocks[b];
    for (size_t k = 0; k < block.shape.rank; ++k) {
      float* q = q_.data() + block.q_at + k * block.shape.cols;
      double norm2 = 0;
      for (size_t c = 0; c < block.shape.cols; ++c) norm2 += double{q[c]} * q[c];
      if (!(norm2 > 0) || !std::isfinite(norm2)) {
        draw_q_column(b, k, ctx);
        continue;
      }
      const double inv = 1.0 / std::sqrt(norm2);
      for (size_t c = 0; c < block.shape.cols; ++c) q[c] = static_cast<float>(q[c] * inv);
    }
  }
}

size_t PowerSgdCodec::write_frame(uint8_t round, uint64_t n, std::span<const float> values,
                                  std::span<std::byte> out) const {
  const size_t bytes = 4 * values.size();
  if (out.size() < kFrameHeaderBytes + bytes) {
    throw Error(
        fmt::format("codec 'powersgd': output buffer of {} bytes cannot hold the {}-byte "
                    "round-{} frame",
                    out.size(), kFrameHeaderBytes + bytes, round));
  }
  if (bytes > 0) std::memcpy(out.data() + kFrameHeaderBytes, values.data(), bytes);
  write_frame_header({.codec_id = static_cast<uint8_t>(id()),
                      .round = round,
                      .param_hash = param_hash(),
                      .elements = n,
                      .payload_bytes = bytes},
                     out);
  return kFrameHeaderBytes + bytes;
}

size_t PowerSgdCodec::encode_round(int round, std::span<const float> input,
                                   std::span<std::byte> out, const Context& ctx) {
  check_round(round, 0, "encode_round");
  const auto held = view(input.size());
  const View& v = *held;
  saved_.q.assign(q_.begin(), q_.end());  // the step begins: Q as it was, for discard()
  saved_.n = q_view_.n;
  saved_.has = has_q_;
  saved_.open = true;
  ensure_q(v, ctx);
  scratch_.assign(v.p_values, 0.0f);
  for (const powersgd::Block& b : v.blocks) {
    powersgd::multiply_q(input.subspan(b.offset, b.shape.n), b.shape, q_.data() + b.q_at,
                         scratch_.data() + b.p_at, ctx.threads);
  }
  return write_frame(0, v.n, scratch_, out);
}

// The view of the frame's element count, after checking that the payload holds exactly the
// values of that round (P of every block; or Q of every block and the plain values),
// overflow-safe.
std::shared_ptr<const View> PowerSgdCodec::checked_view(const FrameHeader& h,
                                                        size_t round) const {
  // Non-finite values travel in the float32 payload (absorb redraws a non-finite Q column), so
  // no flag is ever written, and aux is 0.
  check_plain_header(h, "powersgd", /*summable=*/true, /*allowed_flags=*/0);
  auto held = view(h.elements);
  const View& v = *held;
  const size_t values = round == 0 ? v.p_values : v.q_values + v.plain_values;
  size_t bytes = 0;
  if (__builtin_mul_overflow(values, size_t{4}, &bytes) || bytes != h.payload_bytes) {
    throw FrameError(fmt::format(
        "codec 'powersgd': round-{} payload of {} bytes does not match {} elements as {} "
        "matri{} at rank {} ({} float32 values expected)",
        round, h.payload_bytes, h.elements, v.blocks.size(), v.blocks.size() == 1 ? "x" : "ces",
        rank_, values));
  }
  return held;
}

void PowerSgdCodec::absorb_round(int round, std::span<const std::byte> reduced,
                                 const Context& ctx) {
  check_round(round, 1, "absorb_round");
  const FrameHeader peek = read_frame_header(reduced);
  FrameHeader h;
  const auto payload =
      check_frame(reduced, expectation(peek.elements, static_cast<uint8_t>(round)), &h);
  const auto held = checked_view(h, static_cast<size_t>(round));
  const View& v = *held;
  // Copied into the buffers kept from step to step (same size every step: no allocation).
  if (round == 0) {  // P_hat of every block, for this step's last round and decode
    p_.resize(payload.size() / 4);
    if (!payload.empty()) std::memcpy(p_.data(), payload.data(), payload.size());
    for (const powersgd::Block& b : v.blocks) {
      powersgd::orthonormalize(p_.data() + b.p_at, b.shape.rows, b.shape.rank);
    }
    p_n_ = v.n;
    has_p_ = true;
  } else {  // the aggregated Q of every block: next step's warm start
    q_.resize(v.q_values);  // the plain values that follow are not state
    if (v.q_values > 0) std::memcpy(q_.data(), payload.data(), 4 * v.q_values);
    q_view_ = v;
    has_q_ = true;
    normalise_q(ctx);
  }
}

size_t PowerSgdCodec::encode(std::span<const float> input, std::span<std::byte> out,
                             const Context& ctx, std::span<float> residual) {
  const auto held = view(input.size());
  const View& v = *held;
  if (!has_p_ || p_n_ != v.n) {
    throw Error(
        fmt::format("codec 'powersgd': the last round of {} elements needs round 0 of "
                    "the same elements absorbed first (encode_round(0), allreduce, "
                    "absorb_round(0))",
                    v.n));
  }
  check_powersgd_residual("powersgd", input, residual);
  scratch_.assign(v.q_values + v.plain_values, 0.0f);
  for (const powersgd::Block& b : v.blocks) {
    powersgd::multiply_p(input.subspan(b.offset, b.shape.n), b.shape, p_.data() + b.p_at,
                         scratch_.data() + b.q_at, ctx.threads);
  }
  float* plain = scratch_.data() + v.q_values;
  for (const powersgd::Range& r : v.plain) {
    std::copy_n(input.data() + r.offset, r.n, plain);
    plain += r.n;
  }
  const size_t size = write_frame(1, v.n, scratch_, out);
  if (residual.empty()) return size;
  // The residual: input - P_hat Q_i^T over each matrix (over the input itself when they
  // alias); a plain range is sent exactly, so nothing of it is left.
  const bool in_place = residual.data() == input.data();
  for (const powersgd::Block& b : v.blocks) {
    powersgd::for_each_reconstructed_row(
        b.shape, p_.data() + b.p_at, scratch_.data() + b.q_at, ctx.threads,
        [&](size_t begin, const float* row, size_t len) {
          const size_t at = b.offset + begin;
          if (in_place) {
            powersgd::subtract_row_in_place(residual.data() + at, row, len);
          } else {
            powersgd::subtract_row(input.data() + at, row, residual.data() + at, len);
          }
        });
  }
  for (const powersgd::Range& r : v.plain) std::fill_n(residual.data() + r.offset, r.n, 0.0f);
  return size;
}

template <bool kAdd>
void PowerSgdCodec::decode(std::span<const std::byte> frame, std::span<float> sum,
                           const Context& ctx) const {
  const auto put = kAdd ? powersgd::add_row : powersgd::store_row;
  FrameHeader h;
  const auto payload = check_frame(frame, expectation(sum.size(), 1), &h);
  const auto held = checked_view(h, 1);
  const View& v = *held;
  if (!has_p_ || p_n_ != v.n) {
    throw Error(
        fmt::format("codec 'powersgd': a last-round frame of {} elements decodes with "
                    "P_hat from round 0, and round 0 of {} elements was not absorbed",
                    v.n, v.n));
  }
  // Copied out of the frame (checked_view checked its size): aligned for the kernels.
  const std::span<float> values =
      thread_scratch<float, struct DecodedValues>(v.q_values + v.plain_values);
  if (!payload.empty()) std::memcpy(values.data(), payload.data(), payload.size());
  for (const powersgd::Block& b : v.blocks) {
    powersgd::for_each_reconstructed_row(
        b.shape, p_.data() + b.p_at, values.data() + b.q_at, ctx.threads,
        [&](size_t begin, const float* row, size_t len) {
          put(row, sum.data() + b.offset + begin, len);
        });
  }
  const float* plain = values.data() + v.q_values;
  for (const powersgd::Range& r : v.plain) {
    put(plain, sum.data() + r.offset, r.n);
    plain += r.n;
  }
}

std::vector<std::byte> PowerSgdCodec::save_state() const {
  StateWriter out(kPowersgdState, state_version());
  out.put(static_cast<uint8_t>(has_q_));
  if (!has_q_) return std::move(out).finish();
  out.put(static_cast<uint64_t>(q_view_.n));
  if (layout_view_) out.put(static_cast<uint64_t>(q_view_.blocks.size()));  // not in version 1
  for (const powersgd::Block& b : q_view_.blocks) {
    out.put(uint64_t{b.shape.rows}).put(uint64_t{b.shape.cols}).put(uint64_t{b.shape.rank});
  }
  out.floats(q_);
  return std::move(out).finish();
}

void PowerSgdCodec::discard() {
  if (!saved_.open) {
    throw Error("codec 'powersgd': discard() without a step to take back; call it once per "
                "step, after decode");
  }
  q_.swap(saved_.q);
  if (saved_.has) q_view_ = *view(saved_.n);
  has_q_ = saved_.has;
  saved_.open = false;
}

// The blocks of a saved Q must be those this codec views n elements as: version 1 (the
// fused view only) holds one block without a count.
void PowerSgdCodec::read_q_blocks(StateReader& in, uint32_t version, uint64_t n) {
  const auto held = view(n);
  const View& v = *held;
  const uint64_t blocks = version == 1 ? 1 : in.get<uint64_t>("the matrix count");
  const auto mismatch = [&](const std::string& what) {
    return Error(fmt::format("codec 'powersgd': state for {} elements {}; this codec ({}) "
                             "views {} elements as {} matri{} ({} float32 values of Q)",
                             n, what, spec(), n, v.blocks.size(),
                             v.blocks.size() == 1 ? "x" : "ces", v.q_values));
  };
  if (blocks != v.blocks.size()) throw mismatch(fmt::format("holds {} matrices", blocks));
  for (size_t b = 0; b < v.blocks.size(); ++b) {
    const Shape& s = v.blocks[b].shape;
    const auto rows = in.get<uint64_t>("a matrix's rows");
    const auto cols = in.get<uint64_t>("a matrix's columns");
    const auto rank = in.get<uint64_t>("a matrix's rank");
    if (rows != s.rows || cols != s.cols || rank != s.rank) {
      throw mismatch(fmt::format("holds matrix {} as {} x {} at rank {}, not {} x {} at rank {}",
                                 b, rows, cols, rank, s.rows, s.cols, s.rank));
    }
  }
  if (in.left() != 4 * v.q_values) {
    throw mismatch(fmt::format("has {} bytes of values", in.left()));
  }
  Buffer<float> q(v.q_values);
  in.floats(q, "the values of Q");
  q_ = std::move(q);
  q_view_ = v;
  has_q_ = true;
}

void PowerSgdCodec::load_state(std::span<const std::byte> state) {
  saved_.open = false;  // the loaded state is not a step to take back
  StateReader in("codec 'powersgd': cannot load state", state, kPowersgdState);
  if (in.version() != state_version()) {
    in.fail(fmt::format("it is of version {}; expected version {} for this codec (1 for one "
                        "matrix of the whole bucket, 2 for a matrix per tensor)",
                        in.version(), state_version()));
  }
  const auto has = in.get<uint8_t>("the has-Q flag");
  if (has > 1) in.fail(fmt::format("the has-Q flag is {}, neither 0 nor 1", has));
  if (has == 0) {
    in.expect_end("the has-Q flag");
    has_q_ = false;
    q_.clear();
    return;
  }
  read_q_blocks(in, in.version(), in.get<uint64_t>("the length"));
}

}  // namespace

std::unique_ptr<Codec> make_powersgd(Spec& spec) {
  const auto rank = spec.get_int("rank", 1, 1, static_cast<int64_t>(kMaxRank));
  const auto cols = spec.get_int("cols", 0, 0, int64_t{1} << 30);
  const bool warm_start = spec.get_bool("warm_start", true);
  return std::make_unique<PowerSgdCodec>(static_cast<size_t>(rank), static_cast<size_t>(cols),
                                         warm_start);
}

}  // namespace gradcomp
