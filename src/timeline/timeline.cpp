// Timeline: Chrome trace events ("JSON Array Format") streamed to one file per rank.
//
// The file is "[" then one event per line, separated by commas, and "]" on close. Both
// Perfetto and chrome://tracing accept the array without its closing bracket, so a trace of a
// job that crashed still loads.
#include "gradcomp/timeline.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"

namespace gradcomp {
namespace {

// stdio's buffer holds the events between flushes; a large one keeps the recording threads
// from making a system call per event.
constexpr size_t kFileBuffer = 1 << 20;

// Microseconds of the steady clock since its epoch (boot on Linux), the unit of trace
// timestamps. Fractional: phases of small buckets last a few microseconds.
double micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// The paths the open timelines of this process write. Two engines of one process (a GAN's two
// optimizers under one GRADCOMP_TIMELINE) would otherwise truncate and interleave one file.
std::mutex open_paths_mutex;
std::set<std::string>& open_paths() {
  static std::set<std::string> paths;
  return paths;
}

// `path`, or when another open timeline of this process writes it, "<stem>-2<ext>", "-3", ...
std::string claim_path(const std::string& path) {
  std::lock_guard lock(open_paths_mutex);
  std::string candidate = path;
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  const bool has_extension = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  const std::string stem = has_extension ? path.substr(0, dot) : path;
  const std::string extension = has_extension ? path.substr(dot) : "";
  for (int k = 2; open_paths().count(candidate) > 0; ++k) {
    candidate = fmt::format("{}-{}{}", stem, k, extension);
  }
  open_paths().insert(candidate);
  return candidate;
}

void release_path(const std::string& path) {
  std::lock_guard lock(open_paths_mutex);
  open_paths().erase(path);
}

}  // namespace

Timeline::Timeline(const std::string& path, int rank) : path_(claim_path(path)), rank_(rank) {
  file_ = std::fopen(path_.c_str(), "w");
  if (file_ == nullptr) {
    const int error = errno;
    release_path(path_);
    throw Error(fmt::format("cannot open timeline file '{}': {}", path_, std::strerror(error)));
  }
  std::setvbuf(file_, nullptr, _IOFBF, kFileBuffer);
  std::fputs("[\n", file_);
  write_event({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 0},
               {"args", {{"name", fmt::format("rank {}", rank_)}}}});
  // Viewers sort processes by this index: ranks appear in order when several files are loaded.
  write_event({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank_}, {"tid", 0},
               {"args", {{"sort_index", rank_}}}});
}

Timeline::~Timeline() {
  try {
    close();
  } catch (const Error&) {  // a destructor must not throw; close() reports to callers who ask
  }
}

void Timeline::name_lane(int lane, std::string_view name) {
  write_event({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", lane},
               {"args", {{"name", name}}}});
  // Lanes (buckets) in bucket order, not in the order their names were recorded.
  write_event({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", rank_}, {"tid", lane},
               {"args", {{"sort_index", lane}}}});
}

void Timeline::span(int lane, std::string_view name, Clock::time_point start,
                    Clock::time_point end, const nlohmann::json& args) {
  // A span recorded with its ends swapped would draw with a negative width; clamp it.
  const Clock::duration length = end > start ? end - start : Clock::duration::zero();
  nlohmann::json event = {{"name", name}, {"ph", "X"},  {"ts", micros(start.time_since_epoch())},
                          {"dur", micros(length)}, {"pid", rank_}, {"tid", lane}};
  if (args.is_object()) {
    event["args"] = args;
  } else if (!args.is_null()) {
    event["args"] = {{"value", args}};  // viewers show only objects
  }
  write_event(event);
}

void Timeline::span(int lane, std::string_view name, Clock::time_point start,
                    Clock::time_point end) {
  span(lane, name, start, end, nullptr);
}

void Timeline::write_event(const nlohmann::json& event) {
  // Serialised before taking the lock, so threads contend only for the copy into the buffer.
  // Names come from users (tensor names): invalid UTF-8 is replaced rather than thrown on.
  const std::string text =
      event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::lock_guard lock(mutex_);
  if (file_ == nullptr) return;  // closed: late spans of a shutting-down engine are dropped
  if (!first_) std::fputs(",\n", file_);
  first_ = false;
  std::fputs(text.c_str(), file_);
}

void Timeline::flush() {
  std::lock_guard lock(mutex_);
  if (file_ != nullptr) std::fflush(file_);
}

void Timeline::close() {
  std::lock_guard lock(mutex_);
  if (file_ == nullptr) return;
  std::fputs("\n]\n", file_);
  // A write that failed earlier (disk full) leaves the error flag set; report it once, here,
  // rather than failing a training step for a diagnostics file.
  const bool failed = std::ferror(file_) != 0;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  release_path(path_);
  if (failed || !closed) {
    throw Error(fmt::format("error writing timeline file '{}': {}", path_,
                            failed ? "a write failed (disk full?)" : std::strerror(errno)));
  }
}

}  // namespace gradcomp
