// The contract every Transport backend keeps (include/gradcomp/transport.h), run as W real
// processes under mpirun and under `gradcomp launch` (Gloo). Nothing here depends on the backend.
//
// Every rank runs every test in the same order and issues the same collectives whatever it
// finds, so a failed expectation on one rank never leaves the others waiting: results are
// checked with EXPECT after all collectives of a test were issued and waited for.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/half.h"
#include "gradcomp/error.h"
#include "gradcomp/transport.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"

namespace gradcomp {
namespace {

using testing::error_text;
using testing::gather_bytes;
using Bytes = std::vector<std::byte>;

Transport& world() { return *testing::world(); }
void finish(const WorkPtr& work, const Transport& t) { work->wait(t.timeout()); }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The first byte where two buffers differ, to say where a result went wrong.
::testing::AssertionResult same_bytes(const Bytes& actual, const Bytes& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "size " << actual.size() << " bytes, expected " << expected.size();
  }
  const auto diff = std::mismatch(actual.begin(), actual.end(), expected.begin());
  if (diff.first == actual.end()) return ::testing::AssertionSuccess();
  const auto at = static_cast<size_t>(diff.first - actual.begin());
  return ::testing::AssertionFailure()
         << fmt::format("byte {} of {} is 0x{:02x}, expected 0x{:02x}", at, actual.size(),
                        static_cast<unsigned>(*diff.first), static_cast<unsigned>(*diff.second));
}

// Every rank's `local` equal to rank 0's, byte for byte.
::testing::AssertionResult same_on_all_ranks(const Bytes& local) {
  const Bytes all = gather_bytes(local);
  for (int r = 1; r < world().size(); ++r) {
    const Bytes theirs(all.begin() + static_cast<ptrdiff_t>(r * local.size()),
                       all.begin() + static_cast<ptrdiff_t>((r + 1) * local.size()));
    const Bytes ours(all.begin(), all.begin() + static_cast<ptrdiff_t>(local.size()));
    if (auto same = same_bytes(theirs, ours); !same) return same << " (rank " << r << " vs 0)";
  }
  return ::testing::AssertionSuccess();
}

template <typename T>
void put(Bytes& bytes, size_t i, T value) {
  std::memcpy(bytes.data() + i * sizeof(T), &value, sizeof(T));
}

// A byte that says where it came from, so misplaced data is caught.
std::byte pattern(int from, int to, size_t i) {
  return static_cast<std::byte>(
      (static_cast<size_t>(from) * 131 + static_cast<size_t>(to) * 71 + i * 7 + i / 251) & 0xff);
}

// ---- allreduce -------------------------------------------------------------------------------

const char* type_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kI8:
      return "i8";
    case DType::kU8:
      return "u8";
    case DType::kI32:
      return "i32";
    case DType::kNone:
      break;
  }
  return "none";
}

// Rank r's element i. Floats: multiples of 0.5 in [-10, 10], so every partial sum of up to 16
// ranks is exact even in bfloat16 and the order of additions does not matter. Integers: raw
// 32-bit patterns that overflow when added, to check wrap-around.
double float_value(int r, size_t i) {
  return static_cast<double>((i * 7 + static_cast<size_t>(r) * 13) % 41) * 0.5 - 10.0;
}
uint32_t int_value(int r, size_t i) {
  return static_cast<uint32_t>(i * 2654435761u + static_cast<uint32_t>(r) * 0x9e3779b9u +
                               0x7ffffff0u);
}

void store(Bytes& bytes, DType t, size_t i, double f, uint32_t raw) {
  switch (t) {
    case DType::kF32:
      put(bytes, i, static_cast<float>(f));
      break;
    case DType::kF16:
      put(bytes, i, float_to_half(static_cast<float>(f)));
      break;
    case DType::kBF16:
      put(bytes, i, float_to_bf16(static_cast<float>(f)));
      break;
    case DType::kI8:
      put(bytes, i, static_cast<int8_t>(raw & 0xff));
      break;
    case DType::kU8:
      put(bytes, i, static_cast<uint8_t>(raw & 0xff));
      break;
    case DType::kI32:
      put(bytes, i, static_cast<int32_t>(raw));
      break;
    case DType::kNone:
      break;
  }
}

float element_as_float(const Bytes& bytes, DType t, size_t i) {
  uint16_t h = 0;
  float f = 0;
  if (t == DType::kF32) {
    std::memcpy(&f, bytes.data() + i * 4, 4);
    return f;
  }
  std::memcpy(&h, bytes.data() + i * 2, 2);
  return t == DType::kF16 ? half_to_float(h) : bf16_to_float(h);
}

Bytes reduce_input(DType t, int rank, size_t count) {
  Bytes bytes(count * dtype_size(t));
  for (size_t i = 0; i < count; ++i) store(bytes, t, i, float_value(rank, i), int_value(rank, i));
  return bytes;
}

// The integer max in the type's own signedness and width.
int64_t as_signed_value(DType t, uint32_t raw) {
  switch (t) {
    case DType::kI8:
      return static_cast<int8_t>(raw & 0xff);
    case DType::kU8:
      return raw & 0xff;
    default:
      return static_cast<int32_t>(raw);
  }
}

Bytes reduce_expected(DType t, ReduceOp op, int ranks, size_t count) {
  Bytes bytes(count * dtype_size(t));
  for (size_t i = 0; i < count; ++i) {
    double f = float_value(0, i);
    uint32_t raw = int_value(0, i);
    for (int r = 1; r < ranks; ++r) {
      const uint32_t v = int_value(r, i);
      if (op == ReduceOp::kSum) {
        f += float_value(r, i);
        raw += v;  // unsigned: wraps like the transport must; store() keeps the low bits
      } else {
        f = std::max(f, float_value(r, i));
        if (as_signed_value(t, v) > as_signed_value(t, raw)) raw = v;
      }
    }
    store(bytes, t, i, f, raw);
  }
  return bytes;
}

struct ReduceCase {
  DType type;
  ReduceOp op;
  size_t count;
};

class AllreduceTest : public ::testing::TestWithParam<ReduceCase> {};

TEST_P(AllreduceTest, ExactResultOnEveryRank) {
  const auto [type, op, count] = GetParam();
  Transport& t = world();
  Bytes buffer = reduce_input(type, t.rank(), count);
  finish(t.allreduce(buffer, type, op), t);
  EXPECT_TRUE(same_bytes(buffer, reduce_expected(type, op, t.size(), count)));
  EXPECT_TRUE(same_on_all_ranks(buffer));
}

std::vector<ReduceCase> reduce_cases() {
  std::vector<ReduceCase> cases;
  for (DType type : {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kU8, DType::kI32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      // Empty, one element, odd, and a few MiB (several segments of any algorithm).
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1001},
                           (size_t{3} << 20) / dtype_size(type) + 3}) {
        cases.push_back({type, op, count});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Transport, AllreduceTest, ::testing::ValuesIn(reduce_cases()),
                         [](const ::testing::TestParamInfo<ReduceCase>& info) {
                           return fmt::format("{}_{}_{}", type_name(info.param.type),
                                              info.param.op == ReduceOp::kSum ? "sum" : "max",
                                              info.param.count);
                         });

// Half-precision sums round to nearest even after each float32 addition. Only ranks 0 and 1
// contribute non-zero values, so whatever the order, exactly one rounding addition happens.
TEST(Transport, HalfSumsRoundToNearestEven) {
  Transport& t = world();
  // f16 spacing at 2048 is 2: 2048+1 ties to 2048, 2048+3 ties to 2052. bf16 spacing at 256 is
  // 2: 256+1 ties to 256, 256+3 ties to 260.
  const float f16_in[2][2] = {{2048, 2048}, {1, 3}};
  const float bf16_in[2][2] = {{256, 256}, {1, 3}};
  std::vector<uint16_t> f16(2, 0), bf16(2, 0);
  if (t.rank() < 2) {
    for (size_t i = 0; i < 2; ++i) {
      f16[i] = float_to_half(f16_in[t.rank()][i]);
      bf16[i] = float_to_bf16(bf16_in[t.rank()][i]);
    }
  }
  finish(t.allreduce(std::as_writable_bytes(std::span(f16)), DType::kF16, ReduceOp::kSum), t);
  finish(t.allreduce(std::as_writable_bytes(std::span(bf16)), DType::kBF16, ReduceOp::kSum), t);
  EXPECT_EQ(half_to_float(f16[0]), 2048.0f);
  EXPECT_EQ(half_to_float(f16[1]), 2052.0f);
  EXPECT_EQ(bf16_to_float(bf16[0]), 256.0f);
  EXPECT_EQ(bf16_to_float(bf16[1]), 260.0f);
}

// Sums that are not exact (random values) and non-finite values still give the same bits on
// every rank.
TEST(Transport, InexactAndNonFiniteResultsAreIdenticalOnAllRanks) {
  Transport& t = world();
  const size_t n = 100'003;
  std::vector<float> values = testing::gradient(n, 17 + static_cast<uint64_t>(t.rank()));
  if (t.rank() == 0) {
    values[0] = std::numeric_limits<float>::quiet_NaN();
    values[1] = std::numeric_limits<float>::infinity();
    values[2] = -0.0f;
  }
  for (DType type : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      Bytes buffer(n * dtype_size(type));
      for (size_t i = 0; i < n; ++i) store(buffer, type, i, values[i], 0);
      finish(t.allreduce(buffer, type, op), t);
      EXPECT_TRUE(same_on_all_ranks(buffer)) << type_name(type);
      EXPECT_TRUE(std::isnan(element_as_float(buffer, type, 0))) << type_name(type);
      EXPECT_EQ(element_as_float(buffer, type, 1), std::numeric_limits<float>::infinity());
    }
  }
}

TEST(Transport, FloatConvenienceOverload) {
  Transport& t = world();
  std::vector<float> v = {1.0f, static_cast<float>(t.rank())};
  finish(t.allreduce(std::span<float>(v)), t);
  const int w = t.size();
  EXPECT_EQ(v[0], static_cast<float>(w));
  EXPECT_EQ(v[1], static_cast<float>(w * (w - 1) / 2));
}

// ---- allgather, allgatherv -------------------------------------------------------------------

class AllgatherTest : public ::testing::TestWithParam<size_t> {};

TEST_P(AllgatherTest, RankBlocksInRankOrder) {
  Transport& t = world();
  const size_t n = GetParam();
  Bytes in(n), out(n * static_cast<size_t>(t.size()), std::byte{0xee});
  for (size_t i = 0; i < n; ++i) in[i] = pattern(t.rank(), 0, i);
  finish(t.allgather(in, out), t);
  Bytes expected(out.size());
  for (int r = 0; r < t.size(); ++r) {
    for (size_t i = 0; i < n; ++i) expected[static_cast<size_t>(r) * n + i] = pattern(r, 0, i);
  }
  EXPECT_TRUE(same_bytes(out, expected));
}

INSTANTIATE_TEST_SUITE_P(Transport, AllgatherTest,
                         ::testing::Values(0, 1, 7, 4096, (size_t{3} << 20) + 1));

// counts[r] for a few layouts: uneven, zeros in between, all zero, one large.
size_t gatherv_count(int layout, int r) {
  switch (layout) {
    case 0:
      return static_cast<size_t>(r) * 37 + 3;
    case 1:
      return r % 2 == 0 ? 0 : static_cast<size_t>(r) * 1000 + 1;
    case 2:
      return 0;
    default:
      return r == 0 ? (size_t{2} << 20) + 5 : static_cast<size_t>(r);
  }
}

class AllgathervTest : public ::testing::TestWithParam<int> {};

TEST_P(AllgathervTest, ConcatenatesUnevenCounts) {
  Transport& t = world();
  std::vector<size_t> counts;
  for (int r = 0; r < t.size(); ++r) counts.push_back(gatherv_count(GetParam(), r));
  Bytes in(counts[static_cast<size_t>(t.rank())]);
  for (size_t i = 0; i < in.size(); ++i) in[i] = pattern(t.rank(), 1, i);
  Bytes expected;
  for (int r = 0; r < t.size(); ++r) {
    for (size_t i = 0; i < counts[static_cast<size_t>(r)]; ++i) {
      expected.push_back(pattern(r, 1, i));
    }
  }
  Bytes out(expected.size(), std::byte{0xee});
  std::vector<size_t> scratch = counts;
  WorkPtr work = t.allgatherv(in, out, scratch);
  std::fill(scratch.begin(), scratch.end(), 0);  // counts are copied at issue time
  finish(work, t);
  EXPECT_TRUE(same_bytes(out, expected));
}

INSTANTIATE_TEST_SUITE_P(Transport, AllgathervTest, ::testing::Values(0, 1, 2, 3));

// ---- alltoall, alltoallv ---------------------------------------------------------------------

class AlltoallTest : public ::testing::TestWithParam<size_t> {};

TEST_P(AlltoallTest, BlockJGoesToRankJ) {
  Transport& t = world();
  const size_t block = GetParam();
  const auto w = static_cast<size_t>(t.size());
  Bytes in(block * w), out(block * w, std::byte{0xee}), expected(block * w);
  for (size_t j = 0; j < w; ++j) {
    for (size_t i = 0; i < block; ++i) {
      in[j * block + i] = pattern(t.rank(), static_cast<int>(j), i);
      expected[j * block + i] = pattern(static_cast<int>(j), t.rank(), i);
    }
  }
  finish(t.alltoall(in, out), t);
  EXPECT_TRUE(same_bytes(out, expected));
}

INSTANTIATE_TEST_SUITE_P(Transport, AlltoallTest,
                         ::testing::Values(0, 1, 13, 4096, (size_t{1} << 20) + 3));

// Bytes rank `from` sends to rank `to` in layout `layout` (zeros included, never symmetric).
size_t alltoallv_count(int layout, int from, int to, int size) {
  const auto f = static_cast<size_t>(from), d = static_cast<size_t>(to);
  switch (layout) {
    case 0:
      return (f * 3 + d * 5) % 7;
    case 1:
      return from == to ? 0 : f * 1000 + d * 10 + 1;
    case 2:
      return 0;
    case 3:  // only the last rank sends, to itself: the others have nothing to send or receive
      return from == to && to == size - 1 ? 64 : 0;
    default:
      return from == 0 ? (size_t{1} << 20) + d : (f + d) % 3;
  }
}

class AlltoallvTest : public ::testing::TestWithParam<int> {};

TEST_P(AlltoallvTest, UnevenAndZeroCounts) {
  Transport& t = world();
  const int layout = GetParam();
  std::vector<size_t> in_counts, out_counts;
  Bytes in, expected;
  for (int j = 0; j < t.size(); ++j) {
    in_counts.push_back(alltoallv_count(layout, t.rank(), j, t.size()));
    out_counts.push_back(alltoallv_count(layout, j, t.rank(), t.size()));
    for (size_t i = 0; i < in_counts.back(); ++i) in.push_back(pattern(t.rank(), j, i));
    for (size_t i = 0; i < out_counts.back(); ++i) expected.push_back(pattern(j, t.rank(), i));
  }
  Bytes out(expected.size(), std::byte{0xee});
  finish(t.alltoallv(in, in_counts, out, out_counts), t);
  EXPECT_TRUE(same_bytes(out, expected));
  // The ranks are still in step: a broadcast from each root arrives (it hung after layout 3
  // when Open MPI took an empty rank's alltoallv as in place).
  for (int root = 0; root < t.size(); ++root) {
    Bytes value(100, std::byte{static_cast<unsigned char>(t.rank())});
    finish(t.broadcast(value, root), t);
    EXPECT_EQ(value, Bytes(100, std::byte{static_cast<unsigned char>(root)})) << "root " << root;
  }
}

INSTANTIATE_TEST_SUITE_P(Transport, AlltoallvTest, ::testing::Values(0, 1, 2, 3, 4));

// ---- broadcast, barrier ----------------------------------------------------------------------

class BroadcastTest : public ::testing::TestWithParam<size_t> {};

TEST_P(BroadcastTest, FromEveryRoot) {
  Transport& t = world();
  const size_t n = GetParam();
  for (int root = 0; root < t.size(); ++root) {
    Bytes buffer(n, std::byte{0xee}), expected(n);
    for (size_t i = 0; i < n; ++i) expected[i] = pattern(root, 2, i);
    if (t.rank() == root) buffer = expected;
    finish(t.broadcast(buffer, root), t);
    EXPECT_TRUE(same_bytes(buffer, expected)) << "root " << root;
  }
}

INSTANTIATE_TEST_SUITE_P(Transport, BroadcastTest,
                         ::testing::Values(0, 1, 1001, (size_t{4} << 20) + 1));

// Rank 0 arrives late; nobody leaves the barrier before it arrives.
TEST(Transport, BarrierWaitsForTheLastRank) {
  Transport& t = world();
  using Clock = std::chrono::steady_clock;
  constexpr auto kDelay = std::chrono::milliseconds(300);
  finish(t.barrier(), t);  // start together
  const auto start = Clock::now();
  if (t.rank() == 0) std::this_thread::sleep_for(kDelay);
  finish(t.barrier(), t);
  EXPECT_GE(Clock::now() - start, kDelay - std::chrono::milliseconds(50));
}

// Work::wait with a short timeout throws TimeoutError but leaves the collective running, and
// the transport usable.
TEST(Transport, ShortWaitTimesOutWithoutBreakingTheTransport) {
  Transport& t = world();
  finish(t.barrier(), t);
  if (t.rank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  WorkPtr work = t.barrier();
  if (t.rank() == 0 && t.size() > 1) {
    EXPECT_THROW(work->wait(std::chrono::milliseconds(20)), TimeoutError);
    EXPECT_FALSE(work->done());
  }
  finish(work, t);
  EXPECT_TRUE(work->done());
  std::vector<float> one = {1.0f};
  finish(t.allreduce(std::span<float>(one)), t);
  EXPECT_EQ(one[0], static_cast<float>(t.size()));
}

// ---- many in flight --------------------------------------------------------------------------

// Collectives issued back to back complete in issue order whatever order they are waited in.
TEST(Transport, ManyAsyncCollectivesWaitedInReverse) {
  Transport& t = world();
  const DType types[] = {DType::kF32, DType::kF16, DType::kBF16,
                         DType::kI8,  DType::kU8,  DType::kI32};
  struct Pending {
    WorkPtr work;
    Bytes in, out, expected;  // allreduce works on `out` in place
  };
  std::vector<Pending> pending(60);  // never resized: the buffers must not move while in flight
  for (size_t k = 0; k < pending.size(); ++k) {
    Pending& p = pending[k];
    const size_t count = (k * 997) % 5000 + k % 3;
    if (k % 4 == 3) {  // interleave allgathers with the allreduces
      p.in.assign(count, pattern(t.rank(), 3, k));
      p.out.resize(count * static_cast<size_t>(t.size()));
      for (int r = 0; r < t.size(); ++r)
        p.expected.insert(p.expected.end(), count, pattern(r, 3, k));
      p.work = t.allgather(p.in, p.out);
      continue;
    }
    const DType type = types[k % 6];
    const ReduceOp op = k % 2 == 0 ? ReduceOp::kSum : ReduceOp::kMax;
    p.out = reduce_input(type, t.rank(), count);
    p.expected = reduce_expected(type, op, t.size(), count);
    p.work = t.allreduce(p.out, type, op);
  }
  for (auto it = pending.rbegin(); it != pending.rend(); ++it) finish(it->work, t);
  for (size_t k = 0; k < pending.size(); ++k) {
    EXPECT_TRUE(pending[k].work->done());
    EXPECT_TRUE(same_bytes(pending[k].out, pending[k].expected)) << "collective " << k;
  }
}

// ---- split -----------------------------------------------------------------------------------

// Even and odd ranks, ranked by descending world rank (key = -rank), then collectives on the
// groups and on the world interleaved.
TEST(Transport, SplitEvenOddWithKeyOrdering) {
  Transport& t = world();
  auto sub = t.split(t.rank() % 2, -t.rank());
  ASSERT_NE(sub, nullptr);   // a rank stopping here fails anyway; the others time out
  std::vector<int> members;  // world ranks of my group, in sub-rank order
  for (int r = t.size() - 1; r >= 0; --r) {
    if (r % 2 == t.rank() % 2) members.push_back(r);
  }
  EXPECT_EQ(sub->name(), t.name());
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  const auto me = std::find(members.begin(), members.end(), t.rank()) - members.begin();
  EXPECT_EQ(sub->rank(), static_cast<int>(me));
  EXPECT_EQ(sub->timeout(), t.timeout());

  std::vector<int32_t> sum = {t.rank(), 1};
  WorkPtr group_sum =
      sub->allreduce(std::as_writable_bytes(std::span(sum)), DType::kI32, ReduceOp::kSum);
  std::vector<float> world_sum = {1.0f};
  WorkPtr world_work = t.allreduce(std::span<float>(world_sum));
  const int32_t mine = t.rank();
  std::vector<int32_t> gathered(members.size(), -1);
  WorkPtr gather = sub->allgather(std::as_bytes(std::span(&mine, 1)),
                                  std::as_writable_bytes(std::span(gathered)));
  finish(gather, *sub);
  finish(world_work, t);
  finish(group_sum, *sub);
  int32_t expected_sum = 0;
  for (int r : members) expected_sum += r;
  EXPECT_EQ(sum[0], expected_sum);
  EXPECT_EQ(sum[1], static_cast<int32_t>(members.size()));
  EXPECT_EQ(world_sum[0], static_cast<float>(t.size()));
  EXPECT_EQ(gathered, std::vector<int32_t>(members.begin(), members.end()));
  finish(sub->barrier(), *sub);
}

// Rank 0 opts out (color < 0) and gets nullptr; the rest form one group ranked by world rank
// (equal keys), and can split again.
TEST(Transport, SplitNegativeColorGivesNull) {
  Transport& t = world();
  auto sub = t.split(t.rank() == 0 ? -1 : 7, 0);
  if (t.rank() == 0) {
    EXPECT_EQ(sub, nullptr);
  } else {
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), t.size() - 1);
    EXPECT_EQ(sub->rank(), t.rank() - 1);
    Bytes buffer(1001), expected(1001);
    for (size_t i = 0; i < expected.size(); ++i) expected[i] = pattern(1, 4, i);
    if (sub->rank() == 0) buffer = expected;
    finish(sub->broadcast(buffer, 0), *sub);
    EXPECT_TRUE(same_bytes(buffer, expected));
    auto single = sub->split(sub->rank(), 0);  // a group of one: collectives are local copies
    ASSERT_NE(single, nullptr);
    EXPECT_EQ(single->size(), 1);
    std::vector<float> v = {2.5f};
    finish(single->allreduce(std::span<float>(v)), *single);
    EXPECT_EQ(v[0], 2.5f);
  }
  finish(t.barrier(), t);  // the world still works after the groups are gone
}

// Node groups of consecutive ranks: this node's (node leader first) and this local index's on
// every node; split by the first call for a local size and the same groups after.
TEST(Transport, NodeGroupsAreSplitOnceAndKept) {
  Transport& t = world();
  const int local = t.size() % 2 == 0 ? 2 : 1;
  const auto groups = t.nodes(local);
  ASSERT_NE(groups, nullptr);
  ASSERT_NE(groups->intra, nullptr);
  ASSERT_NE(groups->cross, nullptr);
  EXPECT_EQ(groups->intra->size(), local);
  EXPECT_EQ(groups->intra->rank(), t.rank() % local);
  EXPECT_EQ(groups->cross->size(), t.size() / local);
  EXPECT_EQ(groups->cross->rank(), t.rank() / local);
  EXPECT_EQ(groups->leaders(), t.rank() % local == 0 ? groups->cross.get() : nullptr);
  // The members of each group, gathered there: this node's ranks, then this index's.
  const int32_t mine = t.rank();
  std::vector<int32_t> node(local, -1), index(t.size() / local, -1);
  finish(groups->intra->allgather(std::as_bytes(std::span(&mine, 1)),
                                  std::as_writable_bytes(std::span(node))),
         *groups->intra);
  finish(groups->cross->allgather(std::as_bytes(std::span(&mine, 1)),
                                  std::as_writable_bytes(std::span(index))),
         *groups->cross);
  for (int i = 0; i < local; ++i) EXPECT_EQ(node[i], t.rank() / local * local + i);
  for (int n = 0; n < t.size() / local; ++n) EXPECT_EQ(index[n], n * local + t.rank() % local);
  EXPECT_EQ(t.nodes(local), groups);  // no second split: a split would be a collective
  const std::string error = error_text([&] { t.nodes(t.size() + 1); });
  EXPECT_NE(error.find(fmt::format("{} ranks cannot be grouped into nodes of {}", t.size(),
                                   t.size() + 1)),
            std::string::npos)
      << error;
}

// Stream 1 is a communicator of its own, split once and kept: its collectives complete while
// stream 0 holds one that cannot finish yet (rank 0 waits in a barrier the other ranks join
// only after the stream-1 allreduce). On one queue, rank 0's allreduce would wait behind its
// barrier, and the barrier for the allreduce: a deadlock.
TEST(Transport, StreamsRunSideBySide) {
  Transport& t = world();
  EXPECT_EQ(&t.stream(0), &t);
  Transport& s1 = t.stream(1);
  EXPECT_NE(&s1, &t);
  EXPECT_EQ(&t.stream(1), &s1);  // kept: a second split would be a collective
  EXPECT_EQ(s1.rank(), t.rank());
  EXPECT_EQ(s1.size(), t.size());
  WorkPtr held;
  if (t.rank() == 0) held = t.barrier();
  std::vector<float> x{static_cast<float>(t.rank() + 1)};
  finish(s1.allreduce(x), s1);
  const int w = t.size();
  EXPECT_EQ(x[0], static_cast<float>(w * (w + 1) / 2));
  if (t.rank() != 0) held = t.barrier();
  finish(held, t);
  // Stream 2 is split after stream 1 (streams are made in order), and differs from both.
  Transport& s2 = t.stream(2);
  EXPECT_NE(&s2, &s1);
  EXPECT_NE(&s2, &t);
  finish(s2.barrier(), s2);
}

// Two streams split from two threads, stream 1 first on even ranks and stream 2 first on odd
// ones: each split waits only for its own communicator's ranks, so neither order blocks the
// other. MPI's one driver thread serves both streams, and must not make the blocking
// MPI_Comm_split itself: each rank would sit inside the split the others have not reached.
// Gloo's two splits meet through the one rendezvous store client of the process at once: a
// rank's wait for a peer's address must not hold back its own address for the other split.
TEST(Transport, SplitsOfTwoStreamsInEitherOrderOnDifferentRanks) {
  Transport& t = world();
  Transport& s1 = t.stream(1);
  Transport& s2 = t.stream(2);
  const bool even = t.rank() % 2 == 0;
  std::unique_ptr<Transport> sub1, sub2;
  std::thread first([&] {
    if (!even) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    sub1 = s1.split(0, t.rank());
  });
  std::thread second([&] {
    if (even) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    sub2 = s2.split(0, -t.rank());
  });
  first.join();
  second.join();
  ASSERT_NE(sub1, nullptr);
  ASSERT_NE(sub2, nullptr);
  EXPECT_EQ(sub1->rank(), t.rank());
  EXPECT_EQ(sub2->rank(), t.size() - 1 - t.rank());
  std::vector<float> x{1.0f}, y{static_cast<float>(t.rank())};
  WorkPtr a = sub1->allreduce(x);
  WorkPtr b = sub2->allreduce(y);
  finish(b, *sub2);
  finish(a, *sub1);
  const int w = t.size();
  EXPECT_EQ(x[0], static_cast<float>(w));
  EXPECT_EQ(y[0], static_cast<float>(w * (w - 1) / 2));
}

// ---- argument errors, thrown on the calling thread before anything starts -------------------

TEST(Transport, ArgumentErrorsAtIssueTime) {
  Transport& t = world();
  const auto w = static_cast<size_t>(t.size());
  Bytes seven(7), in(8), out(8 * w), small(3);
  std::vector<size_t> counts(w, 8), short_counts(w + 1, 8);

  auto text = [](auto fn) { return error_text([&] { fn(); }); };
  EXPECT_TRUE(contains(text([&] { t.allreduce(seven, DType::kF32, ReduceOp::kSum); }),
                       "7 bytes is not a whole number of 4-byte elements"));
  EXPECT_TRUE(
      contains(text([&] { t.allreduce(in, DType::kNone, ReduceOp::kSum); }), "element type"));
  EXPECT_TRUE(contains(text([&] { t.allgather(in, std::span(out).first(8 * w - 1)); }),
                       "allgather: output has"));
  EXPECT_TRUE(contains(text([&] { t.allgatherv(in, out, short_counts); }), "one per rank"));
  EXPECT_TRUE(
      contains(text([&] { t.allgatherv(seven, out, counts); }), "input has 7 bytes but counts"));
  EXPECT_TRUE(contains(text([&] { t.allgatherv(in, small, counts); }), "the counts add up to"));
  EXPECT_TRUE(contains(text([&] { t.alltoall(in, small); }), "alltoall: input"));
  EXPECT_TRUE(contains(text([&] { t.alltoallv(in, short_counts, out, counts); }), "in_counts has"));
  EXPECT_TRUE(
      contains(text([&] { t.alltoallv(small, counts, out, counts); }), "in_counts add up to"));
  EXPECT_TRUE(
      contains(text([&] { t.alltoallv(out, counts, small, counts); }), "out_counts add up to"));
  std::vector<size_t> more_from_self = counts;
  more_from_self[static_cast<size_t>(t.rank())] += 1;
  Bytes wider(8 * w + 1);
  EXPECT_TRUE(contains(text([&] { t.alltoallv(out, counts, wider, more_from_self); }),
                       "receives 9 from itself"));
  EXPECT_TRUE(contains(text([&] { t.broadcast(in, -1); }), "root -1 is not a rank"));
  EXPECT_TRUE(contains(text([&] { t.broadcast(in, t.size()); }),
                       fmt::format("root {} is not a rank", t.size())));
  if (w > 1) {
    Bytes odd(w * 2 + 1);
    EXPECT_TRUE(contains(text([&] { t.alltoall(odd, odd); }), "equal blocks"));
  }

  // Nothing was started, so the transport is in step and healthy.
  std::vector<float> one = {1.0f};
  finish(t.allreduce(std::span<float>(one)), t);
  EXPECT_EQ(one[0], static_cast<float>(t.size()));
}

TEST(Transport, NameAndRanks) {
  Transport& t = world();
  const auto names = transport_names();
  EXPECT_NE(std::find(names.begin(), names.end(), t.name()), names.end()) << t.name();
  EXPECT_GE(t.rank(), 0);
  EXPECT_LT(t.rank(), t.size());
  EXPECT_GT(t.timeout().count(), 0);
  const int32_t rank = t.rank();
  const Bytes all = gather_bytes(std::as_bytes(std::span(&rank, 1)));
  for (int r = 0; r < t.size(); ++r) {
    int32_t theirs = -1;
    std::memcpy(&theirs, all.data() + r * 4, 4);
    EXPECT_EQ(theirs, r);  // every rank has a distinct rank, in order
  }
}

}  // namespace
}  // namespace gradcomp
