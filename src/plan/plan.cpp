// Plan: validation, the canonical hash, and the versioned JSON form (docs/plan-format.md).
#include "gradcomp/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string_view>
#include <unistd.h>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/frame.h"
#include "gradcomp/feedback.h"
#include "gradcomp/json_text.h"

namespace gradcomp {
namespace {

using nlohmann::json;

constexpr std::string_view kFormat = "gradcomp-plan";

// ---- JSON reading: every error names the field path ("buckets[3].codec") and what is wrong.

[[noreturn]] void field_error(const std::string& path, std::string_view what) {
  throw Error(fmt::format("{}: {}", path, what));
}

// Rejects keys the schema does not have, so a misspelt optional field ("feedbak") is an error
// rather than silently taking its default.
void check_keys(const json& object, const std::string& path,
                std::initializer_list<std::string_view> allowed) {
  for (const auto& item : object.items()) {
    bool known = false;
    for (std::string_view key : allowed) known = known || item.key() == key;
    if (!known) {
      const std::string where = path.empty() ? "plan" : path;
      throw Error(fmt::format("{}: unknown field '{}'; allowed: {}", where, item.key(),
                              fmt::join(allowed, ", ")));
    }
  }
}

std::string join_path(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

const json& required(const json& object, const std::string& path, std::string_view key,
                     std::string_view expected) {
  const auto it = object.find(key);
  if (it == object.end()) field_error(join_path(path, key), fmt::format("missing; expected {}", expected));
  return *it;
}

std::string read_string(const json& value, const std::string& path) {
  if (!value.is_string()) field_error(path, "expected a string");
  return value.get<std::string>();
}

// An optional string field: `fallback` when absent.
std::string optional_string(const json& object, const std::string& path, std::string_view key,
                            const std::string& fallback) {
  const auto it = object.find(key);
  return it == object.end() ? fallback : read_string(*it, join_path(path, key));
}

// Element counts and indices: JSON numbers that are integers >= 0. A float such as 3.0 is
// rejected too, because a plan is written by programs and a float there is a bug upstream.
constexpr size_t kMaxCount = size_t{1} << 40;

size_t read_count(const json& value, const std::string& path) {
  if (value.is_number_unsigned() ||
      (value.is_number_integer() && value.get<int64_t>() >= 0)) {
    const auto count = value.get<size_t>();
    // Far beyond any model, and small enough that sums and frame sizes cannot overflow.
    if (count > kMaxCount) field_error(path, fmt::format("must be at most 2^40, not {}", count));
    return count;
  }
  field_error(path, "must be a non-negative integer");
}

const json& read_array(const json& value, const std::string& path) {
  if (!value.is_array()) field_error(path, "expected an array");
  return value;
}

void check_object(const json& value, const std::string& path) {
  if (!value.is_object()) field_error(path, "expected an object");
}

const char* encode_on_name(EncodeOn where) {
  return where == EncodeOn::kCaller ? "caller" : "engine";
}

EncodeOn read_encode_on(const json& bucket, const std::string& path) {
  const std::string text = optional_string(bucket, path, "encode_on", "engine");
  if (text == "engine") return EncodeOn::kEngine;
  if (text == "caller") return EncodeOn::kCaller;
  field_error(join_path(path, "encode_on"),
              fmt::format("'{}' is not allowed; allowed: engine, caller", text));
}

int read_version(const json& root) {
  const json& value = required(root, "", "version", fmt::format("the integer {}", kPlanVersion));
  if (!value.is_number_integer()) field_error("version", "must be an integer");
  const int64_t version = value.get<int64_t>();
  if (version < 1 || version > kPlanVersion) {
    throw Error(fmt::format("version {} is not supported; this gradcomp reads versions 1 to {}",
                            version, kPlanVersion));
  }
  return static_cast<int>(version);
}

TensorInfo read_tensor(const json& value, const std::string& path, int version) {
  check_object(value, path);
  if (version >= 3) {
    check_keys(value, path, {"name", "elements", "shape", "slices"});
  } else if (version == 2) {
    check_keys(value, path, {"name", "elements", "shape"});
  } else {
    check_keys(value, path, {"name", "elements"});
  }
  TensorInfo tensor;
  tensor.name = read_string(required(value, path, "name", "a string"), path + ".name");
  tensor.elements = read_count(required(value, path, "elements", "a non-negative integer"),
                               path + ".elements");
  if (const auto it = value.find("shape"); it != value.end()) {
    const json& dims = read_array(*it, path + ".shape");
    for (size_t d = 0; d < dims.size(); ++d) {
      tensor.shape.push_back(read_count(dims[d], fmt::format("{}.shape[{}]", path, d)));
    }
  }
  if (const auto it = value.find("slices"); it != value.end()) {
    tensor.slices = read_count(*it, path + ".slices");
  }
  return tensor;
}

Bucket read_bucket(const json& value, const std::string& path) {
  check_object(value, path);
  check_keys(value, path, {"tensors", "codec", "feedback", "route", "encode_on", "start_step"});
  Bucket bucket;
  const std::string tensors_path = path + ".tensors";
  const json& tensors = read_array(
      required(value, path, "tensors", "an array of tensor indices"), tensors_path);
  for (size_t i = 0; i < tensors.size(); ++i) {
    bucket.tensors.push_back(read_count(tensors[i], fmt::format("{}[{}]", tensors_path, i)));
  }
  bucket.option.codec = read_string(required(value, path, "codec", "a codec spec string"),
                                    path + ".codec");
  const Option defaults;
  bucket.option.feedback = optional_string(value, path, "feedback", defaults.feedback);
  bucket.option.route = optional_string(value, path, "route", defaults.route);
  bucket.option.encode_on = read_encode_on(value, path);
  // Absent in plans written before warm-up existed: compress from the first step.
  if (const auto it = value.find("start_step"); it != value.end()) {
    bucket.option.start_step = read_count(*it, path + ".start_step");
  }
  return bucket;
}

// ---- validation

// A shape must hold exactly the tensor's elements (no overflow on the way).
void check_shape(const TensorInfo& tensor, size_t t) {
  if (tensor.shape.empty()) return;
  uint64_t product = 1;
  bool overflow = false;
  for (size_t d : tensor.shape) overflow = overflow || __builtin_mul_overflow(product, d, &product);
  if (overflow || product != tensor.elements) {
    throw Error(fmt::format("tensors[{}].shape: [{}] holds {} elements, not the tensor's {}", t,
                            fmt::join(tensor.shape, ", "),
                            overflow ? std::string("more than 2^64") : std::to_string(product),
                            tensor.elements));
  }
}

std::string tensor_label(const Plan& plan, size_t t) {
  return fmt::format("tensor '{}' (tensors[{}])", plan.tensors[t].name, t);
}

void validate_tensors(const Plan& plan) {
  std::unordered_map<std::string_view, size_t> first_with_name;
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    const std::string& name = plan.tensors[t].name;
    if (name.empty()) {
      throw Error(fmt::format("tensors[{}]: the name is empty; every tensor needs a unique, "
                              "non-empty name", t));
    }
    if (plan.tensors[t].elements > kMaxCount) {
      throw Error(fmt::format("tensors[{}].elements: must be at most 2^40, not {}", t,
                              plan.tensors[t].elements));
    }
    check_shape(plan.tensors[t], t);
    with_context(fmt::format("tensors[{}].slices", t), [&] { slice_tensor(plan.tensors[t], t); });
    const auto [it, inserted] = first_with_name.emplace(name, t);
    if (!inserted) {
      throw Error(fmt::format("tensors[{}]: the name '{}' is already used by tensors[{}]; "
                              "tensor names must be unique", t, name, it->second));
    }
  }
}

// What a bucket index names in messages: the tensor, or the slice of it.
std::string piece_label(const Plan& plan, const TensorPiece& piece) {
  const TensorInfo& tensor = plan.tensors[piece.tensor];
  if (tensor.slices == 1) return tensor_label(plan, piece.tensor);
  return fmt::format("slice {} of {}", piece.slice, tensor_label(plan, piece.tensor));
}

// Each piece index in range and in exactly one bucket.
void validate_membership(const Plan& plan) {
  constexpr size_t kNone = std::numeric_limits<size_t>::max();
  const std::vector<TensorPiece> pieces = plan.pieces();
  const std::string unit = plan.sliced() ? "pieces (tensors and slices)" : "tensors";
  std::vector<size_t> owner(pieces.size(), kNone);
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& tensors = plan.buckets[b].tensors;
    if (tensors.empty()) {
      throw Error(fmt::format("buckets[{}]: has no tensors; every bucket needs at least one", b));
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t t = tensors[i];
      if (t >= pieces.size()) {
        throw Error(fmt::format("buckets[{}].tensors[{}]: index {} is out of range; the plan has "
                                "{} {}", b, i, t, pieces.size(), unit));
      }
      if (owner[t] != kNone) {
        throw Error(fmt::format("{} is in buckets[{}] and again in buckets[{}]; each {} must be "
                                "in exactly one bucket", piece_label(plan, pieces[t]), owner[t], b,
                                plan.sliced() ? "tensor or slice" : "tensor"));
      }
      owner[t] = b;
    }
  }
  for (size_t t = 0; t < owner.size(); ++t) {
    if (owner[t] == kNone) {
      throw Error(fmt::format("{} is in no bucket; each {} must be in exactly one bucket",
                              piece_label(plan, pieces[t]),
                              plan.sliced() ? "tensor or slice" : "tensor"));
    }
  }
}

BucketOption validate_option(const Option& option, size_t b) {
  const std::string path = fmt::format("buckets[{}]", b);
  if (option.start_step > kMaxCount) {
    throw Error(fmt::format("{}.start_step: must be at most 2^40, not {}", path,
                            option.start_step));
  }
  with_context(path + ".codec", [&] { make_codec(option.codec); });
  with_context(path + ".feedback", [&] { make_feedback(option.feedback); });
  // parse_bucket_option re-checks codec and feedback, which passed above, so what it reports
  // is about the route spec or whether this codec can travel over it.
  BucketOption parsed;
  with_context(path + ".route", [&] { parsed = parse_bucket_option(option); });
  return parsed;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::vector<TensorPiece> slice_tensor(const TensorInfo& tensor, size_t index) {
  const size_t k = tensor.slices;
  const bool by_rows = !tensor.shape.empty();
  const size_t units = by_rows ? tensor.shape.front() : tensor.elements;
  if (k == 0 || k > kMaxSlices) {
    throw Error(fmt::format("{} slices of tensor '{}': allowed 1 to {}", k, tensor.name,
                            kMaxSlices));
  }
  if (k == 1) return {TensorPiece{.tensor = index, .info = {tensor.name, tensor.elements, tensor.shape}}};
  if (k > units) {
    throw Error(fmt::format("{} slices of tensor '{}': it has {} {}, and every slice needs one",
                            k, tensor.name, units, by_rows ? "rows" : "elements"));
  }
  const size_t row = by_rows ? tensor.elements / units : 1;  // elements per unit
  std::vector<TensorPiece> pieces;
  size_t first = 0;
  for (size_t i = 0; i < k; ++i) {
    const size_t count = units / k + (i < units % k ? 1 : 0);  // the first slices one more
    TensorPiece piece{.tensor = index, .slice = i, .offset = first * row, .info = {}};
    piece.info.name = fmt::format("{}#{}", tensor.name, i);
    piece.info.elements = count * row;
    if (by_rows) {
      piece.info.shape = tensor.shape;
      piece.info.shape.front() = count;
    }
    pieces.push_back(std::move(piece));
    first += count;
  }
  return pieces;
}

size_t Plan::bucket_elements(size_t bucket) const {
  if (bucket >= buckets.size()) {
    throw Error(fmt::format("bucket {} does not exist; the plan has {} buckets", bucket,
                            buckets.size()));
  }
  const std::vector<TensorPiece> all = pieces();
  size_t sum = 0;
  for (const size_t t : buckets[bucket].tensors) {
    if (t >= all.size()) {
      throw Error(fmt::format("buckets[{}]: tensor index {} is out of range; the plan has {} "
                              "{}", bucket, t, all.size(), sliced() ? "pieces" : "tensors"));
    }
    sum += all[t].info.elements;
  }
  return sum;
}

int Plan::format_version() const {
  if (sliced()) return 3;
  const bool shapes = std::any_of(tensors.begin(), tensors.end(),
                                  [](const TensorInfo& t) { return !t.shape.empty(); });
  return shapes ? 2 : 1;
}

bool Plan::sliced() const {
  return std::any_of(tensors.begin(), tensors.end(),
                     [](const TensorInfo& t) { return t.slices != 1; });
}

bool Plan::compressed() const {
  return std::any_of(buckets.begin(), buckets.end(),
                     [](const Bucket& b) { return b.option.codec != "none"; });
}

std::vector<TensorPiece> Plan::pieces() const {
  std::vector<TensorPiece> all;
  all.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (TensorPiece& p : slice_tensor(tensors[t], t)) all.push_back(std::move(p));
  }
  return all;
}

Plan Plan::by_piece() const {
  if (!sliced()) return *this;
  Plan plan;
  for (TensorPiece& p : pieces()) plan.tensors.push_back(std::move(p.info));
  plan.buckets = buckets;
  return plan;
}

std::vector<BucketOption> Plan::validate() const {
  validate_tensors(*this);
  validate_membership(*this);
  std::vector<BucketOption> options;
  for (size_t b = 0; b < buckets.size(); ++b) options.push_back(validate_option(buckets[b].option, b));
  return options;
}

uint64_t Plan::hash() const {
  // nlohmann's default json keeps object keys sorted, so dump() is canonical: the same plan
  // gives the same bytes on every rank and in every run.
  return fnv1a64(to_json().dump());
}

nlohmann::json Plan::to_json() const {
  json tensor_list = json::array();
  for (const TensorInfo& t : tensors) {
    json tensor = {{"name", t.name}, {"elements", t.elements}};
    if (!t.shape.empty()) tensor["shape"] = t.shape;
    if (t.slices != 1) tensor["slices"] = t.slices;
    tensor_list.push_back(std::move(tensor));
  }
  json bucket_list = json::array();
  for (const Bucket& b : buckets) {
    json bucket = {{"tensors", b.tensors},
                   {"codec", b.option.codec},
                   {"feedback", b.option.feedback},
                   {"route", b.option.route},
                   {"encode_on", encode_on_name(b.option.encode_on)}};
    // Written only when set, so a plan without warm-up keeps the JSON, and hence the hash
    // (which checkpoints store), it had before start_step existed.
    if (b.option.start_step != 0) bucket["start_step"] = b.option.start_step;
    bucket_list.push_back(std::move(bucket));
  }
  return {{"format", kFormat},
          {"version", format_version()},
          {"tensors", std::move(tensor_list)},
          {"buckets", std::move(bucket_list)}};
}

Plan Plan::from_json(const nlohmann::json& root) {
  if (!root.is_object()) throw Error("plan: expected a JSON object");
  check_keys(root, "", {"format", "version", "tensors", "buckets"});
  const std::string format =
      read_string(required(root, "", "format", fmt::format("\"{}\"", kFormat)), "format");
  if (format != kFormat) {
    field_error("format", fmt::format("'{}' is not a gradcomp plan; expected \"{}\"", format,
                                      kFormat));
  }
  const int version = read_version(root);

  Plan plan;
  const json& tensors =
      read_array(required(root, "", "tensors", "an array of tensors"), "tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    plan.tensors.push_back(read_tensor(tensors[i], fmt::format("tensors[{}]", i), version));
  }
  const json& buckets =
      read_array(required(root, "", "buckets", "an array of buckets"), "buckets");
  for (size_t i = 0; i < buckets.size(); ++i) {
    plan.buckets.push_back(read_bucket(buckets[i], fmt::format("buckets[{}]", i)));
  }
  return plan;
}

void Plan::save(const std::string& path) const {
  const std::string text = to_json().dump(2) + "\n";
  // Write a temporary file beside the target and rename it over the target, so a reader (or a
  // crash) never sees a half-written plan. The pid keeps concurrent writers apart.
  const std::string temp = fmt::format("{}.tmp.{}", path, ::getpid());
  std::FILE* file = std::fopen(temp.c_str(), "wb");
  if (file == nullptr) {
    throw Error(fmt::format("cannot write plan file '{}' (creating '{}'): {}", path, temp,
                            errno_text()));
  }
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  const int write_errno = errno;
  if (std::fclose(file) != 0 || !written) {
    const std::string why = written ? errno_text() : std::strerror(write_errno);
    std::remove(temp.c_str());
    throw Error(fmt::format("cannot write plan file '{}' (writing '{}'): {}", path, temp, why));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    std::remove(temp.c_str());
    throw Error(fmt::format("cannot write plan file '{}' (renaming '{}'): {}", path, temp, why));
  }
}

namespace {

// Both ways of reading a plan validate it too: what a reader hands over is ready for the engine,
// and every problem is reported with where the plan came from.
Plan read_plan(const json& root, std::string_view where) {
  return with_context(where, [&] {
    Plan plan = Plan::from_json(root);
    plan.validate();
    return plan;
  });
}

}  // namespace

Plan Plan::parse(std::string_view text, std::string_view where) {
  return read_plan(parse_json_text(text, where), where);
}

Plan Plan::load(const std::string& path) {
  return read_plan(read_json_file(path, "plan file"), fmt::format("plan file '{}'", path));
}

}  // namespace gradcomp
