// powersgd: rank-r power iteration with warm start (Vogels et al., NeurIPS 2019).
//
// The bucket of n floats is a rows x cols row-major matrix M (see powersgd_matrix.h for the
// shape rule). Every rank holds the same Q (cols x r): drawn from shared randomness the first
// time, afterwards the aggregated Q of the previous step (warm start).
//   round 0: P_i = M_i Q            (rows x r)  -> allreduce sum -> P_hat = orthonormalise(sum P_i)
//   round 1: Q_i = M_i^T P_hat      (cols x r)  -> allreduce sum -> decode adds P_hat (sum Q_i)^T
// finalize divides by W, giving P_hat P_hat^T mean(M_i). The reduced Q of round 1 is the next
// step's warm start; its columns are scaled to unit length on absorb (P_hat does not depend on
// the column scale of Q, and this keeps M Q far from overflow) and a zero or non-finite column
// is redrawn from the shared randomness so one bad step does not stall later ones.
//
// Payloads (float32, little-endian, column-major so each column is contiguous):
//   round 0: P, rank * rows values, P[i][k] at index k * rows + i
//   round 1: Q, rank * cols values, Q[c][k] at index k * cols + c
// Header aux is 0. Both payloads are summable as float32.
//
// State (save_state): "PSGS", u32 version 1, u8 has_q, then when has_q: u64 n, u64 rows,
// u64 cols, u64 rank, and rank * cols float32 (the warm-start Q, column-major). round 0 keeps
// a copy of Q as it was (rank * cols floats, small beside the n of the bucket) for discard().
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "codec/factories.h"
#include "codec/powersgd_matrix.h"
#include "gradcomp/error.h"
#include "gradcomp/random.h"

namespace gradcomp {
namespace {

using powersgd::Shape;

constexpr uint32_t kStateMagic = 0x53475350;  // "PSGS"
constexpr uint32_t kStateVersion = 1;

// Appends raw bytes (resize + memcpy: vector::insert of byte ranges trips GCC 12's
// -Wstringop-overflow false positive).
void put(std::vector<std::byte>& out, const void* data, size_t bytes) {
  const size_t at = out.size();
  out.resize(at + bytes);
  if (bytes > 0) std::memcpy(out.data() + at, data, bytes);
}

// Reads fixed-size fields from a state blob, refusing to run past its end.
class StateReader {
 public:
  explicit StateReader(std::span<const std::byte> in) : in_(in) {}
  template <typename T>
  T get() {
    T v;
    take(&v, sizeof v);
    return v;
  }
  void take(void* out, size_t bytes) {
    if (bytes > in_.size() - pos_) {
      throw Error(
          fmt::format("codec 'powersgd': state truncated: needs {} more bytes at offset "
                      "{}, {} left",
                      bytes, pos_, in_.size() - pos_));
    }
    // A Q of 0 elements (a zero-length bucket) has a null data(): memcpy must not see it.
    if (bytes > 0) std::memcpy(out, in_.data() + pos_, bytes);
    pos_ += bytes;
  }
  size_t left() const { return in_.size() - pos_; }

 private:
  std::span<const std::byte> in_;
  size_t pos_ = 0;
};

// The residual must be empty, the input itself (in place), or a separate array of the same
// length: a partial overlap would be overwritten before it is read.
void check_residual(const char* codec, std::span<const float> input, std::span<float> residual) {
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

class PowerSgdCodec final : public Codec {
 public:
  PowerSgdCodec(size_t rank, size_t cols, bool warm_start)
      : rank_(rank), cols_(cols), warm_start_(warm_start) {}

  CodecId id() const override { return CodecId::kPowerSgd; }
  std::string spec() const override {
    return fmt::format("powersgd:rank={},cols={},warm_start={}", rank_, cols_,
                       warm_start_ ? "true" : "false");
  }
  CodecTraits traits() const override {
    // Nominal size: both rounds for a bucket of 2^20 elements.
    const Shape s = shape(size_t{1} << 20);
    const double bits = 32.0 * static_cast<double>(s.rank * (s.rows + s.cols)) / (1 << 20);
    return {.summable = true,
            .payload_type = DType::kF32,
            .shardable = false,
            .shared_randomness = true,
            .rounds = 2,
            .bits_per_element = bits,
            .unbiased = false,
            .payload_carries_nonfinite = true,  // NaN in M spreads through P and Q
            .stateful = true};
  }

  size_t max_frame_bytes(size_t n) const override {
    const Shape s = shape(n);
    return kFrameHeaderBytes + 4 * s.rank * s.cols;
  }
  ReduceOp round_op(int round) const override {
    check_round(round, 0, "round_op");
    return ReduceOp::kSum;
  }
  size_t max_round_bytes(int round, size_t n) const override {
    check_round(round, 0, "max_round_bytes");
    const Shape s = shape(n);
    return kFrameHeaderBytes + 4 * s.rank * s.rows;
  }

  size_t encode_round(int round, std::span<const float> input, std::span<std::byte> out,
                      const Context& ctx) override;
  void absorb_round(int round, std::span<const std::byte> reduced, const Context& ctx) override;
  size_t encode(std::span<const float> input, std::span<std::byte> out, const Context& ctx,
                std::span<float> residual) override;
  void decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                         const Context& ctx) const override;
  std::vector<std::byte> save_state() const override;
  void load_state(std::span<const std::byte> state) override;
  void discard() override;

 private:
  // What discard() puts back: Q as round 0 of the last step found it.
  struct SavedQ {
    std::vector<float> q;
    Shape shape;
    bool has = false;
    bool open = false;  // a step began and was not discarded
  };

  Shape shape(uint64_t n) const { return powersgd::make_shape(n, cols_, rank_); }
  void check_round(int round, int last, const char* what) const;
  void ensure_q(const Shape& s, const Context& ctx);
  void draw_q_column(size_t k, const Context& ctx);
  void normalise_q(const Context& ctx);
  Shape checked_shape(const FrameHeader& h, size_t round) const;
  size_t write_frame(uint8_t round, uint64_t n, const std::vector<float>& values,
                     std::span<std::byte> out) const;

  size_t rank_, cols_;
  bool warm_start_;
  std::vector<float> q_;  // warm-start Q (column-major), valid for q_shape_
  Shape q_shape_;
  bool has_q_ = false;
  std::vector<float> p_;  // P_hat of the current step (column-major), valid for p_shape_
  Shape p_shape_;
  bool has_p_ = false;
  std::vector<float> scratch_;  // this rank's P (round 0) or Q (last round)
  SavedQ saved_;
};

void PowerSgdCodec::check_round(int round, int last, const char* what) const {
  if (round < 0 || round > last) {
    throw Error(fmt::format("codec 'powersgd': {} of round {}; rounds before the last are 0 .. {}",
                            what, round, last));
  }
}

// Column k of the initial Q: uniform in [-1, 1) from randomness all ranks share. Keyed by
// (seed, bucket) only with warm start, so a rank that joins later draws the same start;
// by step too without warm start, so each step gets a fresh projection.
void PowerSgdCodec::draw_q_column(size_t k, const Context& ctx) {
  const CounterRng rng(ctx.seed, ctx.bucket, warm_start_ ? 0 : ctx.step, CounterRng::kSharedRank,
                       static_cast<uint32_t>(k));
  float* q = q_.data() + k * q_shape_.cols;
  for (size_t c = 0; c < q_shape_.cols; ++c) {
    q[c] = 2.0f * rng.uniform(static_cast<uint32_t>(c)) - 1.0f;
  }
}

void PowerSgdCodec::ensure_q(const Shape& s, const Context& ctx) {
  if (warm_start_ && has_q_ && q_shape_.n == s.n) return;
  q_shape_ = s;
  q_.assign(s.rank * s.cols, 0.0f);
  for (size_t k = 0; k < s.rank; ++k) draw_q_column(k, ctx);
  has_q_ = true;
}

// Unit-length columns; zero or non-finite ones are redrawn (see the file comment).
void PowerSgdCodec::normalise_q(const Context& ctx) {
  for (size_t k = 0; k < q_shape_.rank; ++k) {
    float* q = q_.data() + k * q_shape_.cols;
    double norm2 = 0;
    for (size_t c = 0; c < q_shape_.cols; ++c) norm2 += double{q[c]} * q[c];
    if (!(norm2 > 0) || !std::isfinite(norm2)) {
      draw_q_column(k, ctx);
      continue;
    }
    const double inv = 1.0 / std::sqrt(norm2);
    for (size_t c = 0; c < q_shape_.cols; ++c) q[c] = static_cast<float>(q[c] * inv);
  }
}

size_t PowerSgdCodec::write_frame(uint8_t round, uint64_t n, const std::vector<float>& values,
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
  const Shape s = shape(input.size());
  saved_.q.assign(q_.begin(), q_.end());  // the step begins: Q as it was, for discard()
  saved_.shape = q_shape_;
  saved_.has = has_q_;
  saved_.open = true;
  ensure_q(s, ctx);
  scratch_.assign(s.rank * s.rows, 0.0f);
  powersgd::multiply_q(input, s, q_.data(), scratch_.data(), ctx.threads);
  return write_frame(0, s.n, scratch_, out);
}

// The shape of the frame's element count, after checking that the payload holds exactly
// rank * extent float32 values (extent = rows for round 0, cols for round 1), overflow-safe.
Shape PowerSgdCodec::checked_shape(const FrameHeader& h, size_t round) const {
  // Non-finite values travel in the float32 payload (absorb redraws a non-finite Q column), so
  // no flag is ever written, and aux is 0.
  check_plain_header(h, "powersgd", /*summable=*/true, /*allowed_flags=*/0);
  const Shape s = shape(h.elements);
  const size_t extent = round == 0 ? s.rows : s.cols;
  size_t values = 0, bytes = 0;
  if (__builtin_mul_overflow(extent, s.rank, &values) ||
      __builtin_mul_overflow(values, size_t{4}, &bytes) || bytes != h.payload_bytes) {
    throw FrameError(fmt::format(
        "codec 'powersgd': round-{} payload of {} bytes does not match {} elements as a {} x {} "
        "matrix at rank {} ({} x {} float32 values expected)",
        round, h.payload_bytes, h.elements, s.rows, s.cols, s.rank, extent, s.rank));
  }
  return s;
}

void PowerSgdCodec::absorb_round(int round, std::span<const std::byte> reduced,
                                 const Context& ctx) {
  check_round(round, 1, "absorb_round");
  const FrameHeader peek = read_frame_header(reduced);
  FrameHeader h;
  const auto payload =
      check_frame(reduced, expectation(peek.elements, static_cast<uint8_t>(round)), &h);
  const Shape s = checked_shape(h, static_cast<size_t>(round));
  std::vector<float> values(payload.size() / 4);
  if (!payload.empty()) std::memcpy(values.data(), payload.data(), payload.size());
  if (round == 0) {  // P_hat for this step's last round and decode
    powersgd::orthonormalize(values.data(), s.rows, s.rank);
    p_ = std::move(values);
    p_shape_ = s;
    has_p_ = true;
  } else {  // the aggregated Q: next step's warm start
    q_ = std::move(values);
    q_shape_ = s;
    has_q_ = true;
    normalise_q(ctx);
  }
}

size_t PowerSgdCodec::encode(std::span<const float> input, std::span<std::byte> out,
                             const Context& ctx, std::span<float> residual) {
  const Shape s = shape(input.size());
  if (!has_p_ || p_shape_.n != s.n) {
    throw Error(
        fmt::format("codec 'powersgd': the last round of {} elements needs round 0 of "
                    "the same elements absorbed first (encode_round(0), allreduce, "
                    "absorb_round(0))",
                    s.n));
  }
  check_residual("powersgd", input, residual);
  scratch_.assign(s.rank * s.cols, 0.0f);
  powersgd::multiply_p(input, s, p_.data(), scratch_.data(), ctx.threads);
  const size_t size = write_frame(1, s.n, scratch_, out);
  // The residual pass: input - P_hat Q_i^T, over the input itself when they alias.
  if (!residual.empty()) {
    const bool in_place = residual.data() == input.data();
    powersgd::for_each_reconstructed_row(
        s, p_.data(), scratch_.data(), ctx.threads,
        [&](size_t begin, const float* row, size_t len) {
          if (in_place) {
            powersgd::subtract_row_in_place(residual.data() + begin, row, len);
          } else {
            powersgd::subtract_row(input.data() + begin, row, residual.data() + begin, len);
          }
        });
  }
  return size;
}

void PowerSgdCodec::decode_accumulate(std::span<const std::byte> frame, std::span<float> sum,
                                      const Context& ctx) const {
  FrameHeader h;
  const auto payload = check_frame(frame, expectation(sum.size(), 1), &h);
  const Shape s = checked_shape(h, 1);
  if (!has_p_ || p_shape_.n != s.n) {
    throw Error(
        fmt::format("codec 'powersgd': a last-round frame of {} elements decodes with "
                    "P_hat from round 0, and round 0 of {} elements was not absorbed",
                    s.n, s.n));
  }
  std::vector<float> q(s.rank * s.cols);  // the frame's Q, aligned for the kernels
  if (!payload.empty()) std::memcpy(q.data(), payload.data(), payload.size());
  powersgd::for_each_reconstructed_row(s, p_.data(), q.data(), ctx.threads,
                                       [&](size_t begin, const float* row, size_t len) {
                                         powersgd::add_row(row, sum.data() + begin, len);
                                       });
}

std::vector<std::byte> PowerSgdCodec::save_state() const {
  std::vector<std::byte> out;
  put(out, &kStateMagic, 4);
  put(out, &kStateVersion, 4);
  const uint8_t has = has_q_ ? 1 : 0;
  put(out, &has, 1);
  if (!has_q_) return out;
  for (uint64_t v : {uint64_t{q_shape_.n}, uint64_t{q_shape_.rows}, uint64_t{q_shape_.cols},
                     uint64_t{q_shape_.rank}}) {
    put(out, &v, 8);
  }
  put(out, q_.data(), 4 * q_.size());
  return out;
}

void PowerSgdCodec::discard() {
  if (!saved_.open) {
    throw Error("codec 'powersgd': discard() without a step to take back; call it once per "
                "step, after decode");
  }
  q_.swap(saved_.q);
  q_shape_ = saved_.shape;
  has_q_ = saved_.has;
  saved_.open = false;
}

void PowerSgdCodec::load_state(std::span<const std::byte> state) {
  saved_.open = false;  // the loaded state is not a step to take back
  StateReader in(state);
  const auto magic = in.get<uint32_t>();
  const auto version = in.get<uint32_t>();
  if (magic != kStateMagic || version != kStateVersion) {
    throw Error(
        fmt::format("codec 'powersgd': not a powersgd state (magic 0x{:08x}, version {}; "
                    "expected 0x{:08x}, version {})",
                    magic, version, kStateMagic, kStateVersion));
  }
  const auto has = in.get<uint8_t>();
  if (has > 1) throw Error("codec 'powersgd': state corrupted: has_q flag is neither 0 nor 1");
  if (has == 0) {
    if (in.left() != 0) throw Error("codec 'powersgd': state has trailing bytes");
    has_q_ = false;
    q_.clear();
    return;
  }
  const uint64_t n = in.get<uint64_t>(), rows = in.get<uint64_t>(), cols = in.get<uint64_t>(),
                 rank = in.get<uint64_t>();
  const Shape s = shape(n);
  if (rows != s.rows || cols != s.cols || rank != s.rank || in.left() != 4 * s.rank * s.cols) {
    throw Error(fmt::format(
        "codec 'powersgd': state holds a {} x {} rank-{} Q for {} elements with {} bytes of "
        "values; this codec ({}) views {} elements as {} x {} at rank {} ({} bytes)",
        rows, cols, rank, n, in.left(), spec(), n, s.rows, s.cols, s.rank, 4 * s.rank * s.cols));
  }
  std::vector<float> q(s.rank * s.cols);
  in.take(q.data(), 4 * q.size());
  q_ = std::move(q);
  q_shape_ = s;
  has_q_ = true;
}

}  // namespace

std::unique_ptr<Codec> make_powersgd(Spec& spec) {
  const auto rank = spec.get_int("rank", 1, 1, 1024);
  const auto cols = spec.get_int("cols", 0, 0, int64_t{1} << 30);
  const bool warm_start = spec.get_bool("warm_start", true);
  return std::make_unique<PowerSgdCodec>(static_cast<size_t>(rank), static_cast<size_t>(cols),
                                         warm_start);
}

}  // namespace gradcomp
