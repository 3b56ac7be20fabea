// Plan: the registered tensors in backward order, cut into buckets, each with an Option that
// says how the bucket is compressed and how it travels. Versioned JSON; identical on every rank
// (checked by hash when the engine is constructed). The planner (cost model) produces plans; the engine
// executes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/option.h"

namespace gradcomp {

// The newest plan format: version 2 added tensor shapes, version 3 slices. A plan is written in
// the lowest version that holds it (1 when no tensor has a shape or slices), so a plan keeps
// the JSON, and hence the hash checkpoints store, it always had; every version is read.
inline constexpr int kPlanVersion = 3;

// At most this many slices per tensor (a slice of a 100M-element layer is then 25k elements).
inline constexpr size_t kMaxSlices = 4096;

// A gradient the engine will receive every step.
struct TensorInfo {
  std::string name;
  size_t elements = 0;
  // Dimensions, outermost first (their product is `elements`); empty when not known. Codecs
  // that compress each tensor on its own use them (powersgd: one matrix per tensor of two or
  // more dimensions, a convolution's output channels as rows).
  std::vector<size_t> shape;
  // A plan may cut a large tensor into this many slices (1: whole), so that its parts travel
  // in different buckets and pipeline like several tensors (HiPress, BytePS). Slices are
  // contiguous: with a shape, blocks of whole rows of shape[0] (so a slice of a matrix is a
  // matrix); without, nearly equal runs of elements. Part of the plan, not of the gradient:
  // the caller still hands over the whole tensor.
  size_t slices = 1;

  TensorInfo() = default;
  TensorInfo(std::string name_in, size_t elements_in, std::vector<size_t> shape_in = {},
             size_t slices_in = 1)
      : name(std::move(name_in)), elements(elements_in), shape(std::move(shape_in)),
        slices(slices_in) {}

  bool operator==(const TensorInfo&) const = default;
  // The same gradient (name, elements, shape), however the plans slice it.
  bool same_gradient(const TensorInfo& other) const {
    return name == other.name && elements == other.elements && shape == other.shape;
  }
};

// What a bucket holds: a whole tensor, or one slice of it.
struct TensorPiece {
  size_t tensor = 0;    // index into Plan::tensors
  size_t slice = 0;     // 0 .. slices-1
  size_t offset = 0;    // first element within the tensor
  TensorInfo info;      // elements and shape of the piece; named "<tensor>#<slice>" when sliced
};

// The pieces of one tensor, in order (one piece, the tensor itself, when slices is 1). Throws
// Error when the tensor cannot be cut so (slices 0, above kMaxSlices, or above its rows).
std::vector<TensorPiece> slice_tensor(const TensorInfo& tensor, size_t index = 0);

// A group of tensors fused into one buffer, in the order listed, and sent together.
struct Bucket {
  // Indices of pieces, in fusion order: the plan's tensors with every sliced tensor replaced by
  // its slices (Plan::pieces). Without slices they are indices into Plan::tensors.
  std::vector<size_t> tensors;
  Option option;

  bool operator==(const Bucket&) const = default;
};

// Settings of the default plan.
struct DefaultPlanSettings {
  size_t bucket_bytes = 25u << 20;     // fusion buffer size, as DDP's 25 MB buckets
  // Uncompressed plans: the first bucket (the gradients ready first) is closed once it holds
  // this many bytes, as DDP's 1 MiB first bucket, so the exchange starts early in backward;
  // 0: as any other. Compressed plans keep whole buckets (measured faster).
  size_t first_bucket_bytes = 1u << 20;
  size_t min_compress_elements = 16384;  // smaller tensors (biases, norms) stay uncompressed
  Option compressed{};                  // the option of buckets of large tensors
  // When not 0, the start_step of the buckets of large tensors (it overrides
  // compressed.start_step): they travel uncompressed before this engine step.
  uint64_t start_step = 0;
};

struct Plan {
  std::vector<TensorInfo> tensors;  // backward order: the order gradients usually become ready
  // Launch order: the engine sends bucket i only after bucket i-1 (every rank the same order).
  std::vector<Bucket> buckets;

  bool operator==(const Plan&) const = default;

  // Elements of one bucket (sum over its pieces).
  size_t bucket_elements(size_t bucket) const;
  // The format version to_json writes: 3 when any tensor is sliced, else 2 when any has a
  // shape, else 1.
  int format_version() const;

  // Some tensor is cut into slices.
  bool sliced() const;
  // Some bucket's codec is not "none": the plan loses information (feedback alone does not).
  bool compressed() const;
  // Every tensor's pieces, in tensor order: what bucket indices refer to.
  std::vector<TensorPiece> pieces() const;
  // The same plan with every piece as a tensor of its own (no slices): the buckets unchanged.
  // What the cost model, the simulator and the engine's routes work on.
  Plan by_piece() const;

  // Throws Error naming the first problem: a tensor (or slice) in no bucket or in two, bad
  // slices, an index out of range, an empty or duplicate name, a bad codec, feedback or route
  // spec, or a codec the route cannot carry (allreduce needs summable, twoway needs shardable single-round codecs).
  // Returns every bucket's option parsed, in bucket order (what the engine builds routes from).
  std::vector<BucketOption> validate() const;

  // FNV-1a 64 of the canonical JSON: ranks compare it when the engine is constructed.
  uint64_t hash() const;

  nlohmann::json to_json() const;
  // Throws Error naming the field that is missing or malformed, or an unsupported version.
  static Plan from_json(const nlohmann::json& json);
  void save(const std::string& path) const;
  // Reads a plan from JSON text (from_json, then validate()). Every error starts with `where`
  // ("plan"), then the parse position of bad syntax or the path of the offending field:
  // "plan: buckets[1].codec: unknown codec 'x'; ...".
  static Plan parse(std::string_view text, std::string_view where = "plan");
  // parse() of a file's text; errors start with "plan file '<path>'".
  static Plan load(const std::string& path);
};

// The default plan (whole tensors: any slices given are dropped): large tensors fused into buckets of at most bucket_bytes with
// settings.compressed, tensors under min_compress_elements fused into uncompressed allreduce
// buckets; buckets ordered by when their last tensor becomes ready (backward order).
Plan make_default_plan(std::vector<TensorInfo> tensors, const DefaultPlanSettings& settings = {});

// The plan of buckets made elsewhere (DDP's, for the communication hook): bucket b fuses the
// tensors of buckets[b] in the order given, and travels with settings.compressed (and its
// start_step) when it holds at least settings.min_compress_elements elements, else as an
// uncompressed allreduce, as in the default plan (bucket_bytes is not used). Throws as
// make_default_plan does, and Error on an empty bucket.
Plan make_bucketed_plan(const std::vector<std::vector<TensorInfo>>& buckets,
                        const DefaultPlanSettings& settings = {});

}  // namespace gradcomp
