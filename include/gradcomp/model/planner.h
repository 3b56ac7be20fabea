// Planner: the Plan with the least simulated iteration time. It cuts the tensors, in backward
// order, into contiguous buckets and gives each bucket an Option (codec from an allowed set,
// always including none; a route the codec can travel on; where encoding runs), jointly, by
// dynamic programming over split points: the simulator's lanes advance bucket by bucket, so a
// prefix of buckets is summarised by the times its lanes become free, and only prefixes that
// are not dominated on every lane are kept. Espresso's observations prune the search first:
// tensors whose uncompressed exchange ends before the last bubble of the uncompressed plan
// (the exchange lane waits for compute) gain nothing from compression and stay uncompressed;
// larger and later buckets are tried compressed first. The best uncompressed plan is always a
// candidate, so the result never predicts worse than it. Very large tensors may be cut into
// slices first (PlannerSettings::slice_from_elements), each slice then placed like a tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/model/simulator.h"
#include "gradcomp/plan.h"

namespace gradcomp::model {

struct PlannerSettings {
  // Compression choices, "codec[|feedback[|route]]" each ("none" is always added). Without a
  // route, every route the codec can take is tried (allreduce if summable; allgather; twoway
  // if shardable, and servers when the cluster has dedicated servers; hierarchical when there
  // are several nodes of several workers).
  std::vector<std::string> codecs{"none"};
  bool try_caller_encoding = true;   // also consider encoding on the compute thread
  bool one_lossy_step = false;       // forbid twoway and lossy-inside-the-node hierarchical
  size_t min_compress_elements = 0;  // smaller buckets stay uncompressed
  // When not 0, tensors under this many elements (biases, norms) never travel compressed:
  // the others are planned as a model of their own, and these join one uncompressed bucket,
  // sent once its last tensor is ready, as in the default plan. Quantizing them gains few bytes
  // and, under Adam-family optimizers, costs accuracy (docs/auto.md, "Small tensors").
  size_t small_tensor_elements = 0;
  size_t max_bucket_bytes = 256u << 20;  // no bucket larger than this (bounds the search)
  // When not 0, the Option::start_step of every bucket the plan compresses (codec other than
  // none): they travel uncompressed before this engine step. The search prices the steady
  // state, after the warm-up, so it does not change which plan is chosen.
  uint64_t start_step = 0;
  // Tensors of at least this many elements may be cut into slices (Plan format 3; 0: never),
  // so that one large layer pipelines through encode, exchange and decode like several
  // buckets. The planner searches with pieces of at most 1/2, 1/4, 1/8 and 1/16 of the largest
  // tensor too, and keeps a slicing only if its plan is predicted at least kSliceGain faster
  // than the plan with fewer slices (each message has costs the model may miss). Off by
  // default: slices gain in simulation (docs/simulation.md) but no gain has been measured yet
  // (docs/cluster-benchmark.md, "Slices on the replay"), and a plan is judged by the clock.
  size_t slice_from_elements = 0;
  SimulatorSettings simulator{};
};

inline constexpr double kSliceGain = 0.01;

struct PlanResult {
  Plan plan;
  SimResult predicted;                  // of `plan`
  double uncompressed_s = 0;            // the best uncompressed plan's iteration time
  Plan uncompressed_plan;
  double decision_s = 0;                // wall time the search took
  size_t options_considered = 0;        // bucket options the search evaluated
};

PlanResult make_plan(const Profile& profile, const CostModel& cost,
                     const PlannerSettings& settings = {});

// The same objective by brute force over every contiguous partition and every option per
// bucket: for tests and small instances only (Error above `max_tensors` tensors).
PlanResult exhaustive_plan(const Profile& profile, const CostModel& cost,
                           const PlannerSettings& settings = {}, size_t max_tensors = 14);

// The candidate bucket options the settings allow on this cluster, "none" first.
std::vector<Option> candidate_options(const PlannerSettings& settings, const Cluster& cluster);

}  // namespace gradcomp::model
