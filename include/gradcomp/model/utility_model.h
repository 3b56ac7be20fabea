// The iteration-time model of "On the Utility of Gradient Compression in Distributed Training
// Systems" (Agarwal et al., MLSys 2022), for uncompressed DDP and for compressed methods.
//
// Uncompressed DDP: k buckets of the bucket cap (the last one smaller, b_last) overlap backward:
//   overlapped (the form the paper prints):  T = max(lambda T_comp, (k-1) T_ar(b) + T_ar(b_last))
//   strict tail (the last bucket waits):     T = max(lambda T_comp, (k-1) T_ar(b)) + T_ar(b_last)
// with T_ar the ring allreduce. Compressed methods, with ratio c, encode + decode time T_ed and
// the collective they need (allreduce, or allgather whose cost grows with p):
//   serial:      T = T_comp + T_enc + T_coll(M / c) + T_dec
//   overlapped:  per bucket as above, with lambda' T_comp + encode time on the compute side.
#pragma once

#include <string>
#include <vector>

#include "gradcomp/model/cluster.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/model/profile.h"

namespace gradcomp::model {

enum class Collective { kAllreduce, kAllgather };
enum class Schedule { kSerial, kOverlapped };
enum class TailForm { kOverlapped, kStrict };

struct UtilityMethod {
  std::string name = "syncSGD";   // for printing
  double ratio = 1;               // compression ratio c (>= 1); 1: uncompressed
  Collective collective = Collective::kAllreduce;
  int rounds = 1;                 // dependent collectives (PowerSGD: 2), each paying latency
  Schedule schedule = Schedule::kOverlapped;
  double encode_s = 0;            // for the whole gradient, per step
  double decode_s = 0;            // decode of one worker's message (allgather: paid p times)
  double lambda = 1.05;           // compute slow-down while communicating
};

struct UtilitySettings {
  double bucket_bytes = 25.0 * (1 << 20);
  TailForm tail = TailForm::kOverlapped;
};

// Iteration time of the backward pass plus gradient exchange (the paper's T_obs; forward and
// optimizer excluded, as in its harness).
double utility_iteration_time(double gradient_bytes, double backward_s, const Cluster& cluster,
                              const UtilityMethod& method, const UtilitySettings& settings = {});

// A method for a codec spec with costs from `codecs` (ratio from its traits; allreduce if its
// frames are summable, else allgather; rounds from its traits).
UtilityMethod utility_method(const std::string& codec_spec, double gradient_elements,
                             const CodecCosts& codecs, Schedule schedule, double lambda);

// The largest bandwidth (bytes/s) in [low, high] at which `method` is faster than `baseline`,
// by bisection on the model; 0 if it is never faster there.
double crossover_bandwidth(double gradient_bytes, double backward_s, Cluster cluster,
                           const UtilityMethod& method, const UtilityMethod& baseline,
                           double low, double high, const UtilitySettings& settings = {});

}  // namespace gradcomp::model
