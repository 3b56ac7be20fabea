// The torch.distributed transport across real processes: a c10d::ProcessGroupGloo built in C++
// from a c10d::FileStore, wrapped by make_process_group_transport, gives the same bytes as
// gradcomp's own transport (MPI or Gloo, whichever the launcher chose) in every collective;
// split is a clear error; an Engine runs over it on the allreduce, allgather and two-way routes
// with bit-identical results on every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/error.h"
#include "gradcomp/torch/process_group_transport.h"
#include "support/codec_testing.h"
#include "support/mp_test.h"

namespace gradcomp::torch {
namespace {

using testing::gather_bytes;
using testing::world;

// ---- the process group, made once for the whole program ----------------------------------

c10::intrusive_ptr<c10d::ProcessGroupGloo> g_group;
std::shared_ptr<Transport> g_transport;
std::string g_dir;

void wait(const WorkPtr& work) { work->wait(world()->timeout()); }

// A fresh directory that every rank knows: rank 0 makes it and broadcasts its path.
std::string shared_temp_dir() {
  std::array<char, 256> path{};
  if (world()->rank() == 0) {
    std::strcpy(path.data(), "/tmp/gradcomp-pg-XXXXXX");
    if (mkdtemp(path.data()) == nullptr) path[0] = '\0';
  }
  wait(world()->broadcast(std::as_writable_bytes(std::span(path)), 0));
  return path.data();
}

class ProcessGroupEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    g_dir = shared_temp_dir();
    ASSERT_FALSE(g_dir.empty()) << "rank 0 could not make a temporary directory";
    auto store = c10::make_intrusive<c10d::FileStore>(g_dir + "/store", world()->size());
    auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    g_group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, world()->rank(),
                                                          world()->size(), options);
    g_transport = make_process_group_transport(g_group);
  }
  void TearDown() override {
    g_transport.reset();
    g_group.reset();
    wait(world()->barrier());  // nobody still uses the store's file
    if (world()->rank() == 0 && !g_dir.empty()) std::filesystem::remove_all(g_dir);
  }
};
[[maybe_unused]] ::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new ProcessGroupEnvironment);

Transport& pg() { return *g_transport; }

// ---- data ------------------------------------------------------------------------------------

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 random(seed * 7919 + static_cast<uint64_t>(world()->rank()));
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(random() & 0xff);
  return out;
}

// `n` elements of `type` that differ by rank: finite values for the float types (a NaN's
// payload under max is a matter of convention), any bit pattern for the integers (sums wrap).
std::vector<std::byte> elements(DType type, size_t n, uint64_t seed) {
  if (type == DType::kI8 || type == DType::kU8 || type == DType::kI32) {
    return random_bytes(n * dtype_size(type), seed);
  }
  const auto values = testing::gradient(n, seed * 31 + world()->rank() + 1, 100.0f);
  at::Tensor t = at::from_blob(const_cast<float*>(values.data()), {static_cast<int64_t>(n)},
                               at::kFloat);
  if (type == DType::kF16) t = t.to(at::kHalf);
  if (type == DType::kBF16) t = t.to(at::kBFloat16);
  t = t.contiguous();
  const auto* data = static_cast<const std::byte*>(t.data_ptr());
  return {data, data + n * dtype_size(type)};
}

// ---- collectives -----------------------------------------------------------------------------

TEST(ProcessGroupTransport, DescribesTheGroup) {
  EXPECT_EQ(pg().rank(), world()->rank());
  EXPECT_EQ(pg().size(), world()->size());
  EXPECT_NE(pg().name().find("gloo"), std::string::npos) << pg().name();
}

at::ScalarType scalar_type(DType type) {
  switch (type) {
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
    case DType::kI8: return at::kChar;
    case DType::kU8: return at::kByte;
    case DType::kI32: return at::kInt;
    default: return at::kFloat;
  }
}

// The elements of `type` in `bytes`, as float64 (exact for every type here).
at::Tensor as_doubles(const std::vector<std::byte>& bytes, DType type) {
  const auto n = static_cast<int64_t>(bytes.size() / dtype_size(type));
  return at::from_blob(const_cast<std::byte*>(bytes.data()), {n}, scalar_type(type))
      .to(at::kDouble);
}

// "" when equal, else where and how they first differ (readable, unlike a byte dump).
std::string difference(const std::vector<std::byte>& ours, const std::vector<std::byte>& theirs,
                       DType type) {
  if (ours == theirs) return "";
  if (ours.size() != theirs.size()) return fmt::format("{} vs {} bytes", ours.size(), theirs.size());
  const at::Tensor a = as_doubles(ours, type), b = as_doubles(theirs, type);
  const int64_t i = a.ne(b).nonzero()[0][0].item<int64_t>();
  return fmt::format("element {}: {} here, {} from gradcomp's transport", i,
                     a[i].item<double>(), b[i].item<double>());
}

// With two ranks a float sum is one addition, the same on every backend; with more, each
// backend's ring adds in its own order, and the roundings may differ (by a few units in the
// last place of the partial sums, which reach W * 400 here).
bool order_may_round_differently(DType type, ReduceOp op) {
  const bool floats = type == DType::kF32 || type == DType::kF16 || type == DType::kBF16;
  return floats && op == ReduceOp::kSum && world()->size() > 2;
}
double rounding_tolerance(DType type) {
  const double eps = type == DType::kF32 ? 0x1p-23 : type == DType::kF16 ? 0x1p-10 : 0x1p-7;
  const double W = world()->size();
  return W * eps * W * 400;
}

TEST(ProcessGroupTransport, AllreduceOfEveryTypeMatchesGradcompsTransport) {
  for (DType type : {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kU8,
                     DType::kI32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (size_t n : {size_t{1}, size_t{1001}, size_t{70000}}) {
        const std::string what = fmt::format("{} {} of {} elements", dtype_name(type),
                                             op == ReduceOp::kSum ? "sum" : "max", n);
        const auto input = elements(type, n, n);
        auto ours = input;
        auto theirs = input;
        wait(pg().allreduce(ours, type, op));
        wait(world()->allreduce(theirs, type, op));
        if (order_may_round_differently(type, op)) {
          const double gap = (as_doubles(ours, type) - as_doubles(theirs, type)).abs().max()
                                 .item<double>();
          EXPECT_LE(gap, rounding_tolerance(type)) << what;
        } else {
          EXPECT_EQ(difference(ours, theirs, type), "") << what;
        }
        // (A single element may well be this rank's own maximum.)
        if (world()->size() > 1 && n > 1) {
          EXPECT_NE(ours, input) << what << " changed nothing";
        }
      }
    }
  }
}

TEST(ProcessGroupTransport, AllgatherMatches) {
  for (size_t n : {size_t{777}, size_t{1}, size_t{0}}) {
    const auto in = random_bytes(n, 1);
    std::vector<std::byte> ours(in.size() * world()->size());
    auto theirs = ours;
    wait(pg().allgather(in, ours));
    wait(world()->allgather(in, theirs));
    EXPECT_EQ(ours, theirs) << n << " bytes";
    EXPECT_TRUE(std::equal(in.begin(), in.end(), ours.begin() + world()->rank() * in.size()));
  }
}

// Collectives of nothing complete and leave the transport working.
TEST(ProcessGroupTransport, EmptyBuffersAreNoOps) {
  std::vector<std::byte> none;
  wait(pg().allreduce(none, DType::kF32, ReduceOp::kSum));
  wait(pg().broadcast(none, 0));
  wait(pg().alltoall(none, none));
  auto bytes = random_bytes(16, 9);
  auto theirs = bytes;
  wait(pg().allreduce(bytes, DType::kU8, ReduceOp::kMax));
  wait(world()->allreduce(theirs, DType::kU8, ReduceOp::kMax));
  EXPECT_EQ(bytes, theirs);
}

// Rank r contributes counts[r] bytes; unequal, with zeros among them.
void expect_allgatherv_matches(const std::vector<size_t>& counts, const std::string& what) {
  const auto in = random_bytes(counts[world()->rank()], 2);
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::vector<std::byte> ours(total, std::byte{0xee});
  auto theirs = ours;
  wait(pg().allgatherv(in, ours, counts));
  wait(world()->allgatherv(in, theirs, counts));
  EXPECT_EQ(ours, theirs) << what;
}

TEST(ProcessGroupTransport, AllgathervWithUnequalAndZeroCounts) {
  const int W = world()->size();
  std::vector<size_t> counts;
  for (int r = 0; r < W; ++r) counts.push_back(static_cast<size_t>(r) * 301);  // rank 0: none
  expect_allgatherv_matches(counts, "counts r * 301");
  counts.assign(W, 0);
  counts.back() = 5;
  expect_allgatherv_matches(counts, "only the last rank sends");
  counts.assign(W, 0);
  expect_allgatherv_matches(counts, "nobody sends");
}

TEST(ProcessGroupTransport, AlltoallMatches) {
  const size_t block = 123;
  const auto in = random_bytes(block * world()->size(), 3);
  std::vector<std::byte> ours(in.size());
  auto theirs = ours;
  wait(pg().alltoall(in, ours));
  wait(world()->alltoall(in, theirs));
  EXPECT_EQ(ours, theirs);
}

// Rank `me` sends sent(me, j) bytes to rank j and receives sent(i, me) from rank i.
void expect_alltoallv_matches(const std::function<size_t(int, int)>& sent,
                              const std::string& what) {
  const int W = world()->size();
  const int me = world()->rank();
  std::vector<size_t> in_counts, out_counts;
  size_t in_total = 0, out_total = 0;
  for (int r = 0; r < W; ++r) {
    in_counts.push_back(sent(me, r));
    out_counts.push_back(sent(r, me));
    in_total += in_counts.back();
    out_total += out_counts.back();
  }
  const auto in = random_bytes(in_total, 4);
  std::vector<std::byte> ours(out_total, std::byte{0xee});
  auto theirs = ours;
  wait(pg().alltoallv(in, in_counts, ours, out_counts));
  wait(world()->alltoallv(in, in_counts, theirs, out_counts));
  EXPECT_EQ(ours, theirs) << what;
}

TEST(ProcessGroupTransport, AlltoallvWithUnequalCounts) {
  expect_alltoallv_matches(
      [](int from, int to) { return static_cast<size_t>((from + 2 * to) % 3) * 50; },
      "unequal counts, some zero");
}

TEST(ProcessGroupTransport, AlltoallvWhereOnlyTheLastRankSendsToItself) {
  const int last = world()->size() - 1;
  expect_alltoallv_matches(
      [last](int from, int to) { return from == last && to == last ? size_t{64} : 0; },
      "only the last rank sends, to itself");
}

TEST(ProcessGroupTransport, AlltoallvWhereNobodySends) {
  expect_alltoallv_matches([](int, int) { return size_t{0}; }, "nobody sends");
}

TEST(ProcessGroupTransport, BroadcastFromEveryRoot) {
  for (int root = 0; root < world()->size(); ++root) {
    auto ours = random_bytes(1000, 5);
    auto theirs = ours;
    wait(pg().broadcast(ours, root));
    wait(world()->broadcast(theirs, root));
    EXPECT_EQ(ours, theirs) << "root " << root;
  }
}

TEST(ProcessGroupTransport, Barrier) {
  for (int i = 0; i < 3; ++i) EXPECT_NO_THROW(wait(pg().barrier()));
}

TEST(ProcessGroupTransport, SplitIsAClearError) {
  const std::string message = testing::error_text([] { pg().split(0, world()->rank()); });
  EXPECT_NE(message.find("cannot be split"), std::string::npos) << message;
  EXPECT_NE(message.find("hierarchical"), std::string::npos) << message;
}

// ---- the engine over the process group -------------------------------------------------------

Plan routes_plan() {
  Plan plan;
  plan.tensors = {{"a", 3000}, {"b", 5000}, {"c", 20000}, {"d", 10}, {"e", 8000}};
  plan.buckets = {
      {{0}, {.codec = "none"}},                                          // in-place allreduce
      {{1, 3}, {.codec = "intq", .feedback = "ef"}},                     // two-round allreduce
      {{2}, {.codec = "topk:ratio=0.05", .feedback = "ef", .route = "allgather"}},
      {{4}, {.codec = "efsignsgd", .feedback = "ef", .route = "twoway"}},
  };
  return plan;
}

std::vector<std::vector<float>> run_step(Engine& engine, uint64_t step) {
  std::vector<std::vector<float>> g;
  const auto& tensors = engine.plan().tensors;
  for (size_t t = 0; t < tensors.size(); ++t) {
    g.push_back(testing::gradient(tensors[t].elements, 1000 * step + 17 * t + world()->rank()));
  }
  for (size_t t = tensors.size(); t-- > 0;) engine.ready(t, g[t]);
  engine.synchronize();
  return g;
}

std::vector<std::byte> flatten(const std::vector<std::vector<float>>& g) {
  std::vector<std::byte> out;
  for (const auto& v : g) {
    auto b = std::as_bytes(std::span(v));
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

TEST(ProcessGroupTransport, EngineRunsEveryRouteBitIdenticalOnEveryRank) {
  Engine over_pg(g_transport, routes_plan(), EngineOptions{.seed = 11});
  Engine over_own(world(), routes_plan(), EngineOptions{.seed = 11});
  for (uint64_t step = 0; step < 4; ++step) {
    const auto ours = flatten(run_step(over_pg, step));
    const auto theirs = flatten(run_step(over_own, step));
    const auto all = gather_bytes(ours);
    for (int r = 0; r < world()->size(); ++r) {
      EXPECT_TRUE(std::equal(ours.begin(), ours.end(), all.begin() + r * ours.size()))
          << "step " << step << ": rank " << world()->rank() << " differs from rank " << r;
    }
    // With two ranks every float sum has one order, so the backends agree bit for bit; with
    // more, the ring order of each backend may round differently.
    if (world()->size() <= 2) {
      EXPECT_EQ(ours, theirs) << "step " << step;
    }
  }
  EXPECT_LT(over_pg.last_step().bytes_sent, over_pg.last_step().uncompressed_bytes);
  EXPECT_EQ(over_pg.last_step().bytes_sent, over_own.last_step().bytes_sent);
}

}  // namespace
}  // namespace gradcomp::torch
