#include "engine/consistency.h"

#include <array>
#include <cstring>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "gradcomp/frame.h"

namespace gradcomp {
namespace {

constexpr size_t kSummaryWords = 6;  // plan hash, tensors, buckets, seed, local size, streams

uint64_t tensor_hash(const TensorInfo& t) {
  return fnv1a64(t.name + '\0' + std::to_string(t.elements));
}

// Every rank's `local` words, gathered (each rank sends the same number of words).
std::vector<uint64_t> gather_words(Transport& world, std::span<const uint64_t> local,
                                   Milliseconds timeout) {
  std::vector<uint64_t> all(local.size() * static_cast<size_t>(world.size()));
  world.allgather(std::as_bytes(local), std::as_writable_bytes(std::span(all)))->wait(timeout);
  return all;
}

// Every rank's list of words (lists of different lengths), gathered.
std::vector<std::vector<uint64_t>> gather_lists(Transport& world,
                                                const std::vector<uint64_t>& local,
                                                std::span<const uint64_t> lengths,
                                                Milliseconds timeout) {
  std::vector<size_t> counts;
  size_t total = 0;
  for (uint64_t n : lengths) {
    counts.push_back(n * sizeof(uint64_t));
    total += n;
  }
  std::vector<uint64_t> flat(total);
  world.allgatherv(std::as_bytes(std::span(local)), std::as_writable_bytes(std::span(flat)),
                   counts)->wait(timeout);
  std::vector<std::vector<uint64_t>> lists;
  size_t at = 0;
  for (uint64_t n : lengths) {
    lists.emplace_back(flat.begin() + static_cast<ptrdiff_t>(at),
                       flat.begin() + static_cast<ptrdiff_t>(at + n));
    at += n;
  }
  return lists;
}

// The first index where `mine` and `theirs` differ (their common length if one is a prefix).
size_t first_difference(const std::vector<uint64_t>& mine, const std::vector<uint64_t>& theirs) {
  size_t i = 0;
  while (i < mine.size() && i < theirs.size() && mine[i] == theirs[i]) ++i;
  return i;
}

// The first rank whose list differs from this rank's.
int other_rank(const std::vector<std::vector<uint64_t>>& lists, int rank) {
  const auto& mine = lists[static_cast<size_t>(rank)];
  for (size_t r = 0; r < lists.size(); ++r) {
    if (lists[r] != mine) return static_cast<int>(r);
  }
  return rank;  // not reached: the lists are known to differ somewhere
}

[[noreturn]] void tensors_differ(Transport& world, const Plan& plan,
                                 const std::vector<uint64_t>& mine,
                                 const std::vector<std::vector<uint64_t>>& lists) {
  const int rank = world.rank();
  const int other = other_rank(lists, rank);
  const auto& theirs = lists[static_cast<size_t>(other)];
  const size_t i = first_difference(mine, theirs);
  const std::string here =
      i < plan.tensors.size()
          ? fmt::format("'{}' ({} elements)", plan.tensors[i].name, plan.tensors[i].elements)
          : std::string("missing (this rank registered only ") +
                std::to_string(plan.tensors.size()) + " tensors)";
  throw CommError(fmt::format(
      "the ranks registered different tensors: tensor {} is {} on rank {}, but rank {} has {} "
      "there (it registered {} tensors); every rank must register the same parameters, with "
      "the same sizes, in the same order",
      i, here, rank, other, i < theirs.size() ? "a different name or size" : "no tensor",
      theirs.size()));
}

[[noreturn]] void plans_differ(Transport& world, const Plan& plan,
                               const std::vector<uint64_t>& mine,
                               const std::vector<std::vector<uint64_t>>& lists) {
  const int rank = world.rank();
  const int other = other_rank(lists, rank);
  const size_t b = first_difference(mine, lists[static_cast<size_t>(other)]);
  const std::string here =
      b < plan.buckets.size() ? plan.to_json()["buckets"][b].dump() : std::string("missing");
  throw CommError(fmt::format(
      "the ranks run different plans over the same tensors: bucket {} is {} on rank {} and "
      "differs on rank {}; load the same plan on every rank",
      b, here, rank, other));
}

}  // namespace

namespace {

[[noreturn]] void settings_differ(const char* what, uint64_t mine, int rank,
                                  const std::vector<uint64_t>& all, size_t word) {
  const size_t words = kSummaryWords;
  for (size_t r = 0; r < all.size() / words; ++r) {
    if (all[r * words + word] != mine) {
      throw CommError(fmt::format("the ranks use different {}: {} on rank {}, {} on rank {}; "
                                  "every rank must use the same",
                                  what, mine, rank, all[r * words + word], r));
    }
  }
  throw CommError("the ranks disagree");  // not reached: a difference was seen
}

}  // namespace

void check_consistency(Transport& world, const Plan& plan, const SharedSettings& settings,
                       Milliseconds timeout) {
  std::vector<uint64_t> tensors, buckets;
  for (const TensorInfo& t : plan.tensors) tensors.push_back(tensor_hash(t));
  const nlohmann::json json = plan.to_json();
  for (const auto& b : json["buckets"]) buckets.push_back(fnv1a64(b.dump()));

  const std::array<uint64_t, kSummaryWords> summary = {plan.hash(),         tensors.size(),
                                                       buckets.size(),      settings.seed,
                                                       settings.local_size, settings.streams};
  const auto all = gather_words(world, summary, timeout);
  const auto ranks = static_cast<size_t>(world.size());
  bool same_plan = true, same_seed = true, same_local = true, same_streams = true;
  std::vector<uint64_t> tensor_counts, bucket_counts;
  for (size_t r = 0; r < ranks; ++r) {
    const uint64_t* theirs = &all[r * kSummaryWords];
    same_plan = same_plan && theirs[0] == summary[0];
    same_seed = same_seed && theirs[3] == summary[3];
    same_local = same_local && theirs[4] == summary[4];
    same_streams = same_streams && theirs[5] == summary[5];
    tensor_counts.push_back(theirs[1]);
    bucket_counts.push_back(theirs[2]);
  }
  // Every rank sees the same gathered words, so all take the same branch below.
  if (!same_plan) {
    const auto tensor_lists = gather_lists(world, tensors, tensor_counts, timeout);
    bool same_tensors = true;
    for (const auto& list : tensor_lists) same_tensors = same_tensors && list == tensor_lists[0];
    if (!same_tensors) tensors_differ(world, plan, tensors, tensor_lists);
    const auto bucket_lists = gather_lists(world, buckets, bucket_counts, timeout);
    plans_differ(world, plan, buckets, bucket_lists);
  }
  if (!same_seed) settings_differ("seeds", settings.seed, world.rank(), all, 3);
  if (!same_local) {
    settings_differ("local sizes (ranks per node)", settings.local_size, world.rank(), all, 4);
  }
  if (!same_streams) {
    settings_differ("stream counts (EngineOptions::streams, GRADCOMP_STREAMS)", settings.streams,
                    world.rank(), all, 5);
  }
}

}  // namespace gradcomp
