// Timeline: a Chrome-trace JSON file (opens in Perfetto and chrome://tracing) with one lane per
// bucket: ready, encode, each communication phase, decode. One file per rank. Events are
// streamed to the file as they are recorded (bounded memory over any number of steps); the file
// is valid JSON once the timeline is closed, and readable by both viewers before that.
// Timestamps are microseconds of the steady clock (CLOCK_MONOTONIC, shared by the processes of
// one host), so the files of several ranks line up when loaded together.
#pragma once

#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace gradcomp {

using Clock = std::chrono::steady_clock;

class Timeline {
 public:
  // Opens `path` for writing; throws Error when it cannot. `rank` becomes the process id, so
  // the files of several ranks can be loaded side by side. When another open timeline of this
  // process writes `path` (two engines under one GRADCOMP_TIMELINE), this one writes
  // "<stem>-2<ext>" (then -3, ...) instead: path() says which.
  Timeline(const std::string& path, int rank);
  ~Timeline();  // closes the file
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Names lane `lane` (a bucket) in the viewer, e.g. "bucket 3: 12 tensors, 4.2 MB, topk".
  void name_lane(int lane, std::string_view name);
  // A complete event [start, end) on `lane`; `args` (a JSON object or null) shows on click.
  // Thread-safe.
  void span(int lane, std::string_view name, Clock::time_point start, Clock::time_point end,
            const nlohmann::json& args);
  void span(int lane, std::string_view name, Clock::time_point start, Clock::time_point end);
  // Writes buffered events to the file.
  void flush();
  // Finishes the JSON array and closes the file; later calls do nothing.
  void close();

  const std::string& path() const { return path_; }

 private:
  void write_event(const nlohmann::json& event);

  std::string path_;
  int rank_;
  std::mutex mutex_;
  std::FILE* file_ = nullptr;
  bool first_ = true;
};

}  // namespace gradcomp
