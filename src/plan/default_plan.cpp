// make_default_plan: DDP-style fusion buckets, with large tensors compressed and small ones not;
// make_bucketed_plan: buckets made elsewhere (DDP's), compressed by the same rules.
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "gradcomp/error.h"
#include "gradcomp/plan.h"

namespace gradcomp {
namespace {

constexpr size_t kBytesPerElement = sizeof(float);

// Fills buckets of one kind (compressed or not) in backward order; a bucket is closed when the
// next tensor would take it over the byte limit. A first bucket with a cap of its own (DDP's)
// is also closed as soon as it holds that many bytes, the tensor that reached it included.
class BucketFiller {
 public:
  // first_bucket_bytes 0 (or not below bucket_bytes): the first bucket is as any other.
  BucketFiller(Option option, size_t bucket_bytes, size_t first_bucket_bytes,
               std::vector<Bucket>& done)
      : option_(std::move(option)),
        max_elements_(bucket_bytes / kBytesPerElement),
        first_elements_(first_bucket_bytes / kBytesPerElement),
        first_(first_bucket_bytes != 0 && first_bucket_bytes < bucket_bytes),
        done_(done) {}

  void add(size_t tensor, size_t elements) {
    // A tensor larger than the limit is not split: it closes the open bucket and gets one of
    // its own (the next tensor closes that).
    if (!open_.tensors.empty() && elements > max_elements_ - std::min(max_elements_, elements_)) {
      close();
    }
    open_.tensors.push_back(tensor);
    elements_ += elements;
    if (first_ && elements_ >= first_elements_) close();
  }

  void close() {
    if (open_.tensors.empty()) return;
    done_.push_back(std::move(open_));
    open_ = Bucket{{}, option_};
    elements_ = 0;
    first_ = false;
  }

 private:
  Option option_;
  size_t max_elements_;
  size_t first_elements_;
  bool first_;  // the open bucket is the first
  std::vector<Bucket>& done_;
  Bucket open_{{}, option_};
  size_t elements_ = 0;
};

void check_compressed(const DefaultPlanSettings& settings) {
  try {
    check_route(settings.compressed);
  } catch (const SpecError& e) {
    throw SpecError(fmt::format("default plan: settings.compressed: {}", e.what()));
  } catch (const Error& e) {
    throw Error(fmt::format("default plan: settings.compressed: {}", e.what()));
  }
}

void check_settings(const DefaultPlanSettings& settings) {
  if (settings.bucket_bytes == 0) {
    throw Error("default plan: bucket_bytes must be > 0 (the size limit of a fusion bucket in "
                "bytes; DDP uses 25 MB)");
  }
  check_compressed(settings);
}

// The option of the buckets of large tensors.
Option compressed_option(const DefaultPlanSettings& settings) {
  Option compressed = settings.compressed;
  if (settings.start_step != 0) compressed.start_step = settings.start_step;
  return compressed;
}

}  // namespace

Plan make_default_plan(std::vector<TensorInfo> tensors, const DefaultPlanSettings& settings) {
  check_settings(settings);
  Plan plan;
  plan.tensors = std::move(tensors);
  for (TensorInfo& t : plan.tensors) t.slices = 1;  // a default plan keeps tensors whole

  // Small tensors (biases, norms) gain little from compression and would pay its fixed costs
  // (headers, scales, a second pass), so they travel uncompressed over a plain allreduce.
  // Uncompressed, every tensor shares one sequence of buckets with DDP's small first bucket:
  // the classifier's gradients leave while backward goes on (measured 4% faster than two
  // sequences on the main job's CNN, docs/plan-format.md). A compressed plan keeps whole
  // buckets: there three buckets measured slower than two.
  const Option uncompressed{};  // codec none, feedback none, allreduce
  const Option compressed = compressed_option(settings);
  const bool lossless = compressed == uncompressed;
  BucketFiller large(compressed, settings.bucket_bytes, lossless ? settings.first_bucket_bytes : 0,
                     plan.buckets);
  BucketFiller small(uncompressed, settings.bucket_bytes, 0, plan.buckets);
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    const size_t n = plan.tensors[t].elements;
    (lossless || n >= settings.min_compress_elements ? large : small).add(t, n);
  }
  large.close();
  small.close();

  // A bucket can be sent once its last tensor is ready, and tensors become ready in backward
  // order, so launching in order of the last tensor's position never waits on a later bucket.
  // Last positions are distinct (each tensor is in one bucket), so the order is total.
  std::sort(plan.buckets.begin(), plan.buckets.end(),
            [](const Bucket& a, const Bucket& b) { return a.tensors.back() < b.tensors.back(); });
  plan.validate();  // duplicate or empty names
  return plan;
}

Plan make_bucketed_plan(const std::vector<std::vector<TensorInfo>>& buckets,
                        const DefaultPlanSettings& settings) {
  check_compressed(settings);
  const Option compressed = compressed_option(settings);
  Plan plan;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (buckets[b].empty()) {
      throw Error(fmt::format("bucketed plan: bucket {} holds no tensor", b));
    }
    Bucket bucket;
    size_t elements = 0;
    for (const TensorInfo& t : buckets[b]) {
      bucket.tensors.push_back(plan.tensors.size());
      plan.tensors.push_back(t);
      plan.tensors.back().slices = 1;
      elements += t.elements;
    }
    bucket.option = elements >= settings.min_compress_elements ? compressed : Option{};
    plan.buckets.push_back(std::move(bucket));
  }
  plan.validate();
  return plan;
}

}  // namespace gradcomp
