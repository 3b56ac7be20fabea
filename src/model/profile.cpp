// Profile: the versioned JSON form (docs/simulation.md, "Profiles"), validation, and loading by
// name or path. JSON holds milliseconds, because profiles are read and written by people and by
// Python; the struct holds seconds, like every other time in the model.
#include "gradcomp/model/profile.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_map>

#include "common/environment.h"
#include "gradcomp/error.h"
#include "gradcomp/json_text.h"

#ifndef GRADCOMP_PROFILES_DIR
#error "GRADCOMP_PROFILES_DIR (the shipped profiles/ directory) is set by the top CMakeLists.txt"
#endif

namespace gradcomp::model {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr std::string_view kFormat = "gradcomp-profile";
constexpr int64_t kVersion = 1;
// The same bound plans put on a tensor: far beyond any model, and small enough that sums of
// element counts cannot overflow.
constexpr size_t kMaxElements = size_t{1} << 40;

// ---- Reading JSON: every error names the field path ("tensors[3].elements").

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

const json& field(const json& object, const std::string& path, std::string_view key) {
  const auto it = object.find(key);
  if (it == object.end()) throw Error(fmt::format("missing field '{}'", join(path, key)));
  return *it;
}

// Unknown keys are errors, so a misspelt field ("ready_s") is not silently ignored.
void check_keys(const json& object, const std::string& path,
                std::initializer_list<std::string_view> allowed) {
  for (const auto& item : object.items()) {
    if (std::find(allowed.begin(), allowed.end(), item.key()) == allowed.end()) {
      throw Error(fmt::format("unknown field '{}'; allowed: {}", join(path, item.key()),
                              fmt::join(allowed, ", ")));
    }
  }
}

std::string read_string(const json& value, const std::string& path) {
  if (!value.is_string()) throw Error(fmt::format("{} must be a string", path));
  return value.get<std::string>();
}

// Integers only: 3.0 is rejected, because a profile is written by programs and a float where a
// count belongs is a bug upstream.
size_t read_count(const json& value, const std::string& path) {
  const bool non_negative =
      value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
  if (!non_negative) throw Error(fmt::format("{} must be a non-negative integer", path));
  return value.get<size_t>();
}

int read_batch_size(const json& value, const std::string& path) {
  if (!value.is_number_integer() || value.get<int64_t>() <= 0 ||
      value.get<int64_t>() > std::numeric_limits<int>::max()) {
    throw Error(fmt::format("{} must be a positive integer", path));
  }
  return static_cast<int>(value.get<int64_t>());
}

// Milliseconds in the file, seconds in memory.
double read_ms(const json& value, const std::string& path) {
  if (!value.is_number() || value.get<double>() < 0) {
    throw Error(fmt::format("{} must be a non-negative number of milliseconds", path));
  }
  return value.get<double>() / 1e3;
}

// Written at nanosecond resolution: the text stays short and stable, and a file whose times
// have at most six decimals reads back and writes out byte for byte.
double to_ms(double seconds) { return std::round(seconds * 1e9) / 1e6; }

void check_header(const json& root) {
  const json& format = field(root, "", "format");
  if (!format.is_string() || format.get<std::string>() != kFormat) {
    throw Error(fmt::format("format must be '{}', not {}", kFormat, format.dump()));
  }
  const json& version = field(root, "", "version");
  if (!version.is_number_integer()) throw Error("version must be an integer");
  if (version.get<int64_t>() != kVersion) {
    throw Error(fmt::format("version {} is not supported; this gradcomp reads profile version {}",
                            version.get<int64_t>(), kVersion));
  }
}

ProfileTensor read_tensor(const json& value, const std::string& path) {
  if (!value.is_object()) throw Error(fmt::format("{} must be an object", path));
  check_keys(value, path, {"name", "elements", "ready_ms"});
  ProfileTensor tensor;
  tensor.name = read_string(field(value, path, "name"), join(path, "name"));
  tensor.elements = read_count(field(value, path, "elements"), join(path, "elements"));
  tensor.ready_s = read_ms(field(value, path, "ready_ms"), join(path, "ready_ms"));
  return tensor;
}

// ---- Validation of the struct (also for profiles built in code).

// A step of more than a day is a unit mistake (seconds written as milliseconds, or worse), and
// the bound keeps every time the simulator adds up finite.
constexpr double kMaxSeconds = 86400;

void check_time(double seconds, const std::string& path) {
  if (!(seconds >= 0 && seconds <= kMaxSeconds)) {  // also refuses NaN
    throw Error(fmt::format("{} must be a non-negative number of milliseconds up to {:.0f} (a "
                            "day), not {}",
                            path, kMaxSeconds * 1e3, seconds * 1e3));
  }
}

void check_tensor(const Profile& profile, size_t i,
                  std::unordered_map<std::string_view, size_t>& seen) {
  const ProfileTensor& t = profile.tensors[i];
  const std::string path = fmt::format("tensors[{}]", i);
  if (t.name.empty()) throw Error(fmt::format("{}.name must not be empty", path));
  if (const auto [it, fresh] = seen.emplace(t.name, i); !fresh) {
    throw Error(fmt::format("{}.name '{}' is also tensors[{}].name: names must be unique", path,
                            t.name, it->second));
  }
  if (t.elements > kMaxElements) {
    throw Error(fmt::format("{}.elements must be at most 2^40, not {}", path, t.elements));
  }
  check_time(t.ready_s, path + ".ready_ms");
  if (i > 0 && t.ready_s < profile.tensors[i - 1].ready_s) {
    throw Error(
        fmt::format("{}.ready_ms is before tensors[{}].ready_ms: ready times must not "
                    "decrease in backward order",
                    path, i - 1));
  }
}

// ---- Files.

bool looks_like_path(const std::string& text) {
  return text.find('/') != std::string::npos ||
         (text.size() >= 5 && text.compare(text.size() - 5, 5, ".json") == 0);
}

Profile read_profile_file(const fs::path& path) {
  const json root = read_json_file(path.string(), "profile");
  return with_context(fmt::format("profile '{}'", path.string()),
                      [&] { return Profile::from_json(root); });
}

// A listing must not fail on an unrelated or broken file (profiles/ also holds codec costs).
bool is_profile_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  const json root = json::parse(in, nullptr, /*allow_exceptions=*/false);
  const auto it = root.is_object() ? root.find("format") : root.end();
  return root.is_object() && it != root.end() && *it == kFormat;
}

}  // namespace

size_t Profile::total_elements() const {
  size_t sum = 0;
  for (const ProfileTensor& t : tensors) sum += t.elements;
  return sum;
}

std::vector<TensorInfo> Profile::tensor_infos() const {
  std::vector<TensorInfo> infos;
  infos.reserve(tensors.size());
  for (const ProfileTensor& t : tensors) infos.push_back({t.name, t.elements});
  return infos;
}

Profile Profile::by_piece(const std::vector<TensorPiece>& pieces) const {
  Profile sliced = *this;
  sliced.tensors.clear();
  for (const TensorPiece& p : pieces) {
    if (p.tensor >= tensors.size()) {
      throw Error(fmt::format("profile '{}': a piece of tensor {}, but the profile has {} tensors",
                              model, p.tensor, tensors.size()));
    }
    sliced.tensors.push_back({p.info.name, p.info.elements, tensors[p.tensor].ready_s});
  }
  return sliced;
}

Profile Profile::from_json(const json& root) {
  if (!root.is_object()) throw Error("a profile must be a JSON object");
  check_header(root);
  check_keys(root, "",
             {"format", "version", "model", "source", "batch_size", "forward_ms", "backward_ms",
              "tensors"});
  Profile profile;
  profile.model = read_string(field(root, "", "model"), "model");
  profile.source = read_string(field(root, "", "source"), "source");
  profile.batch_size = read_batch_size(field(root, "", "batch_size"), "batch_size");
  profile.forward_s = read_ms(field(root, "", "forward_ms"), "forward_ms");
  profile.backward_s = read_ms(field(root, "", "backward_ms"), "backward_ms");
  const json& tensors = field(root, "", "tensors");
  if (!tensors.is_array()) throw Error("tensors must be an array");
  profile.tensors.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    profile.tensors.push_back(read_tensor(tensors[i], fmt::format("tensors[{}]", i)));
  }
  profile.validate();
  return profile;
}

json Profile::to_json() const {
  json tensor_list = json::array();
  for (const ProfileTensor& t : tensors) {
    tensor_list.push_back(
        {{"name", t.name}, {"elements", t.elements}, {"ready_ms", to_ms(t.ready_s)}});
  }
  return {{"format", kFormat},
          {"version", kVersion},
          {"model", model},
          {"source", source},
          {"batch_size", batch_size},
          {"forward_ms", to_ms(forward_s)},
          {"backward_ms", to_ms(backward_s)},
          {"tensors", std::move(tensor_list)}};
}

void Profile::validate() const {
  if (model.empty()) throw Error("model must not be empty");
  if (batch_size <= 0) throw Error("batch_size must be a positive integer");
  check_time(forward_s, "forward_ms");
  check_time(backward_s, "backward_ms");
  if (tensors.empty())
    throw Error("tensors must not be empty: a profile has at least one gradient");
  std::unordered_map<std::string_view, size_t> seen;
  for (size_t i = 0; i < tensors.size(); ++i) check_tensor(*this, i, seen);
  if (backward_s < tensors.back().ready_s) {
    throw Error(
        fmt::format("backward_ms is before tensors[{}].ready_ms: backward ends when its "
                    "last gradient is ready or later",
                    tensors.size() - 1));
  }
}

Profile load_profile(const std::string& name_or_path) {
  if (looks_like_path(name_or_path)) return read_profile_file(name_or_path);
  const fs::path dir = profiles_directory();
  const fs::path file = dir / (name_or_path + ".json");
  if (name_or_path.empty() || !fs::is_regular_file(file)) {
    const std::vector<std::string> names = profile_names();
    throw Error(fmt::format(
        "unknown profile '{}'; the profiles in {} are: {}; or give the path "
        "of a profile JSON file",
        name_or_path, dir.string(),
        names.empty() ? std::string("(none)") : fmt::format("{}", fmt::join(names, ", "))));
  }
  return read_profile_file(file);
}

std::vector<std::string> profile_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(profiles_directory(), ec)) {
    const fs::path& path = entry.path();
    if (entry.is_regular_file() && path.extension() == ".json" && is_profile_file(path)) {
      names.push_back(path.stem().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string profiles_directory() {
  return env_text("GRADCOMP_PROFILES").value_or(GRADCOMP_PROFILES_DIR);
}

}  // namespace gradcomp::model
