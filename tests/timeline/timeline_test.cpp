#include "gradcomp/timeline.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

class TimelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One directory per process: ctest may run the tests of this file side by side.
    dir_ = std::filesystem::temp_directory_path() /
           ("gradcomp_timeline_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "trace.json").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string read() const {
    std::ifstream in(path_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::filesystem::path dir_;
  std::string path_;
};

// The events named `name` with phase `ph`.
std::vector<json> events(const json& trace, const std::string& ph, const std::string& name = {}) {
  std::vector<json> out;
  for (const auto& e : trace) {
    if (e["ph"] == ph && (name.empty() || e["name"] == name)) out.push_back(e);
  }
  return out;
}

TEST_F(TimelineTest, WritesMetadataAndSpans) {
  const auto t0 = Clock::now();
  {
    Timeline timeline(path_, 3);
    EXPECT_EQ(timeline.path(), path_);
    timeline.name_lane(0, "bucket 0: 2 tensors, 4.2 MB, topk");
    timeline.name_lane(1, "bucket 1");
    timeline.span(0, "encode", t0, t0 + 1500us, {{"bytes", 1234}});
    timeline.span(1, "allreduce", t0 + 2ms, t0 + 2ms + 250ns);
    timeline.close();
  }
  const json trace = json::parse(read());
  ASSERT_TRUE(trace.is_array());

  const auto process = events(trace, "M", "process_name");
  ASSERT_EQ(process.size(), 1u);
  EXPECT_EQ(process[0]["pid"], 3);
  EXPECT_EQ(process[0]["args"]["name"], "rank 3");
  const auto lanes = events(trace, "M", "thread_name");
  ASSERT_EQ(lanes.size(), 2u);
  EXPECT_EQ(lanes[0]["tid"], 0);
  EXPECT_EQ(lanes[0]["pid"], 3);
  EXPECT_EQ(lanes[0]["args"]["name"], "bucket 0: 2 tensors, 4.2 MB, topk");
  EXPECT_EQ(lanes[1]["tid"], 1);

  const auto spans = events(trace, "X");
  ASSERT_EQ(spans.size(), 2u);
  const double t0_us = std::chrono::duration<double, std::micro>(t0.time_since_epoch()).count();
  EXPECT_EQ(spans[0]["name"], "encode");
  EXPECT_EQ(spans[0]["pid"], 3);
  EXPECT_EQ(spans[0]["tid"], 0);
  EXPECT_DOUBLE_EQ(spans[0]["ts"].get<double>(), t0_us);
  EXPECT_DOUBLE_EQ(spans[0]["dur"].get<double>(), 1500.0);
  EXPECT_EQ(spans[0]["args"], (json{{"bytes", 1234}}));
  EXPECT_EQ(spans[1]["name"], "allreduce");
  EXPECT_EQ(spans[1]["tid"], 1);
  EXPECT_DOUBLE_EQ(spans[1]["dur"].get<double>(), 0.25);  // fractional microseconds
  EXPECT_FALSE(spans[1].contains("args"));
}

TEST_F(TimelineTest, TimestampsAreSteadyClockMicroseconds) {
  // The steady clock's epoch is shared by the processes of one host, which is what lets the
  // files of several ranks line up: ts is that clock's reading, not time since the file opened.
  Timeline timeline(path_, 0);
  const auto before = Clock::now();
  timeline.span(0, "x", before, before + 1us);
  timeline.close();
  const double ts = events(json::parse(read()), "X")[0]["ts"].get<double>();
  using Micros = std::chrono::duration<double, std::micro>;
  EXPECT_DOUBLE_EQ(ts, Micros(before.time_since_epoch()).count());
}

TEST_F(TimelineTest, ReadableBeforeCloseAfterFlush) {
  Timeline timeline(path_, 0);
  const auto t = Clock::now();
  timeline.span(0, "decode", t, t + 1us);
  timeline.flush();
  // The viewers accept the array without its "]"; here we close it ourselves to parse it.
  const json trace = json::parse(read() + "]");
  EXPECT_EQ(events(trace, "X").size(), 1u);
}

TEST_F(TimelineTest, CloseTwiceAndSpansAfterCloseAreHarmless) {
  Timeline timeline(path_, 0);
  timeline.close();
  timeline.close();
  timeline.span(0, "late", Clock::now(), Clock::now());
  timeline.flush();
  const json trace = json::parse(read());
  EXPECT_TRUE(events(trace, "X").empty());
}

TEST_F(TimelineTest, DestructorClosesTheFile) {
  { Timeline timeline(path_, 1); }
  EXPECT_TRUE(json::parse(read()).is_array());
}

TEST_F(TimelineTest, OddArgumentsAndNames) {
  Timeline timeline(path_, 0);
  const auto t = Clock::now();
  timeline.span(0, "reversed", t + 5us, t);         // ends swapped: drawn with zero width
  timeline.span(0, "scalar", t, t + 1us, json(7));  // viewers only show objects
  timeline.span(0, "bad\xff utf8", t, t + 1us);     // user-supplied names need not be UTF-8
  timeline.close();
  const auto spans = events(json::parse(read()), "X");
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0]["dur"].get<double>(), 0.0);
  EXPECT_EQ(spans[1]["args"], (json{{"value", 7}}));
  EXPECT_EQ(spans[2]["name"].get<std::string>().substr(0, 3), "bad");
}

TEST_F(TimelineTest, ConcurrentSpansAreAllWrittenWhole) {
  constexpr int kThreads = 8;
  constexpr int kSpans = 2000;
  {
    Timeline timeline(path_, 2);
    std::vector<std::thread> threads;
    for (int lane = 0; lane < kThreads; ++lane) {
      threads.emplace_back([&timeline, lane] {
        timeline.name_lane(lane, "lane " + std::to_string(lane));
        for (int i = 0; i < kSpans; ++i) {
          const auto t = Clock::now();
          timeline.span(lane, "work", t, t + std::chrono::microseconds(i), {{"i", i}});
          if (i % 500 == 0) timeline.flush();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  const json trace = json::parse(read());
  const auto spans = events(trace, "X");
  ASSERT_EQ(spans.size(), size_t{kThreads} * kSpans);
  EXPECT_EQ(events(trace, "M", "thread_name").size(), size_t{kThreads});
  // Each lane's spans arrive in the order its thread recorded them, with the right duration.
  std::vector<int> next(kThreads, 0);
  for (const auto& s : spans) {
    const int lane = s["tid"].get<int>();
    ASSERT_GE(lane, 0);
    ASSERT_LT(lane, kThreads);
    EXPECT_EQ(s["pid"], 2);
    EXPECT_EQ(s["args"]["i"], next[lane]);
    EXPECT_DOUBLE_EQ(s["dur"].get<double>(), next[lane]);
    ++next[lane];
  }
}

// Two engines of one process under one GRADCOMP_TIMELINE: the second writes beside the first,
// not over it; a path is free again once its timeline is closed.
TEST_F(TimelineTest, ASecondOpenTimelineOnOnePathWritesBesideIt) {
  const std::string second = (dir_ / "trace-2.json").string();
  const std::string third = (dir_ / "trace-3.json").string();
  {
    Timeline first(path_, 0);
    Timeline other(path_, 0);
    Timeline another(path_, 0);
    EXPECT_EQ(first.path(), path_);
    EXPECT_EQ(other.path(), second);
    EXPECT_EQ(another.path(), third);
    first.name_lane(0, "first");
    other.name_lane(0, "second");
    other.close();
    Timeline reused(path_, 0);  // "-2" is free again
    EXPECT_EQ(reused.path(), second);
  }
  const json trace = json::parse(read());
  ASSERT_EQ(events(trace, "M", "thread_name").size(), 1u);
  EXPECT_EQ(events(trace, "M", "thread_name")[0]["args"]["name"], "first");
  Timeline after(path_, 0);  // all closed: the path itself is free
  EXPECT_EQ(after.path(), path_);
}

TEST(Timeline, BadPathNamesThePathAndTheReason) {
  EXPECT_EQ(testing::error_text([] { Timeline t("/nonexistent/dir/trace.json", 0); }),
            "cannot open timeline file '/nonexistent/dir/trace.json': No such file or directory");
}

}  // namespace
}  // namespace gradcomp
