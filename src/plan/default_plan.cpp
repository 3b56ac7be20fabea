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
// next tensor would take it over the byte limit.
class BucketFiller {
 public:
  BucketFiller(Option option, size_t bucket_bytes, std::vector<Bucket>& done)
      : option_(std::move(option)), max_elements_(bucket_bytes / kBytesPerElement), done_(done) {}

  void add(size_t tensor, size_t elements) {
    // A tensor larger than the limit is not split: it closes the open bucket and gets one of
    // its own (the next tensor closes that).
    if (!open_.tensors.empty() && elements > max_elements_ - std::min(max_elements_, elements_)) {
      close();
    }
    open_.tensors.push_back(tensor);
    elements_ += elements;
  }

  void close() {
    if (open_.tensors.empty()) return;
    done_.push_back(std::move(open_));
    open_ = Bucket{{}, option_};
    elements_ = 0;
  }

 private:
  Option option_;
  size_t max_elements_;
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
  const Option uncompressed{};  // codec none, feedback none, allreduce
  const Option compressed = compressed_option(settings);
  BucketFiller large(compressed, settings.bucket_bytes, plan.buckets);
  BucketFiller small(uncompressed, settings.bucket_bytes, plan.buckets);
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    const size_t n = plan.tensors[t].elements;
    (n >= settings.min_compress_elements ? large : small).add(t, n);
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
