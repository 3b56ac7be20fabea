#include "gradcomp/model/profile.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp::model {
namespace {

using testing::contains;

using nlohmann::json;
using testing::error_text;

// Times that are whole nanoseconds, so seconds -> ms -> seconds is exact.
Profile sample_profile() {
  Profile p;
  p.model = "tiny";
  p.source = "hand-written";
  p.batch_size = 8;
  p.forward_s = 0.0125;
  p.backward_s = 0.025;
  p.tensors = {{"fc.bias", 10, 0.001}, {"fc.weight", 1000, 0.001}, {"conv.weight", 4608, 0.025}};
  return p;
}

json sample_json() { return sample_profile().to_json(); }

std::string profile_error(const json& j) {
  return error_text([&] { Profile::from_json(j); });
}

// One directory per process (ctest may run these tests side by side), removed at exit.
std::filesystem::path temp_dir() {
  struct Dir {
    std::filesystem::path path = std::filesystem::temp_directory_path() /
                                 ("gradcomp_profile_test_" + std::to_string(::getpid()));
    Dir() { std::filesystem::create_directories(path); }
    ~Dir() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Dir dir;
  return dir.path;
}

void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

// Points GRADCOMP_PROFILES somewhere for one test, then restores it.
class ProfilesDir {
 public:
  explicit ProfilesDir(const std::filesystem::path& dir) {
    if (const char* old = std::getenv("GRADCOMP_PROFILES")) old_ = old;
    ::setenv("GRADCOMP_PROFILES", dir.c_str(), 1);
  }
  ~ProfilesDir() {
    if (old_.empty()) {
      ::unsetenv("GRADCOMP_PROFILES");
    } else {
      ::setenv("GRADCOMP_PROFILES", old_.c_str(), 1);
    }
  }

 private:
  std::string old_;
};

TEST(Profile, JsonIsInMilliseconds) {
  const json j = sample_json();
  EXPECT_EQ(j["format"], "gradcomp-profile");
  EXPECT_EQ(j["version"], 1);
  EXPECT_DOUBLE_EQ(j["forward_ms"].get<double>(), 12.5);
  EXPECT_DOUBLE_EQ(j["backward_ms"].get<double>(), 25.0);
  EXPECT_DOUBLE_EQ(j["tensors"][2]["ready_ms"].get<double>(), 25.0);
  EXPECT_EQ(j["tensors"][1]["elements"], 1000);
}

TEST(Profile, RoundTrip) {
  const Profile p = sample_profile();
  EXPECT_EQ(Profile::from_json(p.to_json()), p);
  // And through text, as a file would go.
  EXPECT_EQ(Profile::from_json(json::parse(p.to_json().dump())), p);
}

TEST(Profile, FileTextRoundTripsExactly) {
  // Six decimals of milliseconds survive reading and writing unchanged.
  json j = sample_json();
  j["forward_ms"] = 59.931835;
  j["tensors"][0]["ready_ms"] = 0.060123;
  EXPECT_EQ(Profile::from_json(j).to_json(), j);
}

TEST(Profile, TotalsAndTensorInfos) {
  const Profile p = sample_profile();
  EXPECT_EQ(p.total_elements(), 5618u);
  const auto infos = p.tensor_infos();
  ASSERT_EQ(infos.size(), 3u);
  EXPECT_EQ(infos[2], (TensorInfo{"conv.weight", 4608}));
}

TEST(Profile, EveryShippedProfileLoadsAndValidates) {
  const auto names = profile_names();
  for (const char* expected :
       {"resnet50", "resnet101", "vgg16", "bert-base", "gpt2-small", "lstm"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const Profile p = load_profile(name);
    EXPECT_NO_THROW(p.validate());
    EXPECT_EQ(p.model, name);
    EXPECT_FALSE(p.source.empty());
    EXPECT_GT(p.forward_s, 0);
    EXPECT_LE(p.tensors.back().ready_s, p.backward_s);
  }
}

TEST(Profile, ShippedShapesMatchThePublishedTotals) {
  struct Expected {
    const char* name;
    size_t tensors;
    size_t elements;
  };
  for (const Expected& e :
       {Expected{"resnet50", 161, 25557032}, Expected{"resnet101", 314, 44549160},
        Expected{"vgg16", 32, 138357544}, Expected{"bert-base", 199, 109482240},
        Expected{"gpt2-small", 148, 124439808}, Expected{"lstm", 10, 85974278}}) {
    SCOPED_TRACE(e.name);
    const Profile p = load_profile(e.name);
    EXPECT_EQ(p.tensors.size(), e.tensors);
    EXPECT_EQ(p.total_elements(), e.elements);
  }
}

TEST(Profile, LoadsByPath) {
  const auto path = temp_dir() / "mine.json";
  write(path, sample_json().dump());
  EXPECT_EQ(load_profile(path.string()), sample_profile());
}

TEST(Profile, UnknownNameListsTheProfiles) {
  const std::string text = error_text([] { load_profile("resnet5000"); });
  EXPECT_TRUE(contains(text, "unknown profile 'resnet5000'"));
  EXPECT_TRUE(contains(text, "resnet50"));
  EXPECT_TRUE(contains(text, "gpt2-small"));
}

TEST(Profile, EnvironmentChoosesTheDirectoryAndListsOnlyProfiles) {
  const auto dir = temp_dir() / "env";
  std::filesystem::create_directories(dir);
  write(dir / "tiny.json", sample_json().dump());
  write(dir / "codec-costs.json", R"({"topk": {}})");  // not a profile: not listed
  write(dir / "broken.json", "{");
  const ProfilesDir scope(dir);
  EXPECT_EQ(profile_names(), std::vector<std::string>{"tiny"});
  EXPECT_EQ(load_profile("tiny"), sample_profile());
  EXPECT_TRUE(contains(error_text([] { load_profile("resnet50"); }), "are: tiny"));
}

TEST(Profile, FileErrorsNameTheFile) {
  const auto path = temp_dir() / "bad.json";
  write(path, "{\"format\": ");
  EXPECT_TRUE(contains(error_text([&] { load_profile(path.string()); }), "not valid JSON"));
  json j = sample_json();
  j["tensors"][1]["elements"] = -4;
  write(path, j.dump());
  const std::string text = error_text([&] { load_profile(path.string()); });
  EXPECT_TRUE(contains(text, path.string()));
  EXPECT_TRUE(contains(text, "tensors[1].elements must be a non-negative integer"));
  EXPECT_TRUE(contains(error_text([] { load_profile("/nonexistent/x.json"); }),
                       "cannot open profile '/nonexistent/x.json'"));
}

TEST(Profile, NegativeSizesAndTimesNameTheField) {
  json j = sample_json();
  j["tensors"][1]["elements"] = -1;
  EXPECT_EQ(profile_error(j), "tensors[1].elements must be a non-negative integer");
  j = sample_json();
  j["tensors"][2]["ready_ms"] = -0.5;
  EXPECT_EQ(profile_error(j), "tensors[2].ready_ms must be a non-negative number of milliseconds");
  j = sample_json();
  j["forward_ms"] = -3;
  EXPECT_EQ(profile_error(j), "forward_ms must be a non-negative number of milliseconds");
  j = sample_json();
  j["batch_size"] = 0;
  EXPECT_EQ(profile_error(j), "batch_size must be a positive integer");
}

TEST(Profile, MissingFieldsAreNamed) {
  for (const char* key : {"format", "version", "model", "source", "batch_size", "forward_ms",
                          "backward_ms", "tensors"}) {
    json j = sample_json();
    j.erase(key);
    EXPECT_EQ(profile_error(j), std::string("missing field '") + key + "'");
  }
  for (const char* key : {"name", "elements", "ready_ms"}) {
    json j = sample_json();
    j["tensors"][2].erase(key);
    EXPECT_EQ(profile_error(j), std::string("missing field 'tensors[2].") + key + "'");
  }
}

TEST(Profile, WrongTypesAreNamed) {
  json j = sample_json();
  j["tensors"][0]["elements"] = 10.0;  // a float where a count belongs
  EXPECT_EQ(profile_error(j), "tensors[0].elements must be a non-negative integer");
  j = sample_json();
  j["tensors"][0]["elements"] = "10";
  EXPECT_EQ(profile_error(j), "tensors[0].elements must be a non-negative integer");
  j = sample_json();
  j["tensors"][1]["name"] = 7;
  EXPECT_EQ(profile_error(j), "tensors[1].name must be a string");
  j = sample_json();
  j["backward_ms"] = "25";
  EXPECT_EQ(profile_error(j), "backward_ms must be a non-negative number of milliseconds");
  j = sample_json();
  j["tensors"] = json::object();
  EXPECT_EQ(profile_error(j), "tensors must be an array");
  j = sample_json();
  j["tensors"][0] = 3;
  EXPECT_EQ(profile_error(j), "tensors[0] must be an object");
  EXPECT_EQ(profile_error(json::array()), "a profile must be a JSON object");
}

TEST(Profile, DecreasingReadyTimesAreNamed) {
  json j = sample_json();
  j["tensors"][1]["ready_ms"] = 0.5;  // tensors[0] is ready at 1 ms
  EXPECT_EQ(profile_error(j),
            "tensors[1].ready_ms is before tensors[0].ready_ms: ready times "
            "must not decrease in backward order");
  j = sample_json();
  j["backward_ms"] = 20;  // the last gradient is ready at 25 ms
  EXPECT_TRUE(contains(profile_error(j), "backward_ms is before tensors[2].ready_ms"));
}

TEST(Profile, FormatAndVersionAreChecked) {
  json j = sample_json();
  j["version"] = 2;
  EXPECT_EQ(profile_error(j), "version 2 is not supported; this gradcomp reads profile version 1");
  j = sample_json();
  j["version"] = "1";
  EXPECT_EQ(profile_error(j), "version must be an integer");
  j = sample_json();
  j["format"] = "gradcomp-plan";
  EXPECT_EQ(profile_error(j), "format must be 'gradcomp-profile', not \"gradcomp-plan\"");
}

TEST(Profile, UnknownFieldsAreNamed) {
  json j = sample_json();
  j["tensors"][1]["ready_s"] = 1;
  EXPECT_TRUE(contains(profile_error(j), "unknown field 'tensors[1].ready_s'"));
  j = sample_json();
  j["device"] = "v100";
  EXPECT_TRUE(contains(profile_error(j), "unknown field 'device'"));
}

TEST(Profile, ValidateChecksProfilesBuiltInCode) {
  Profile p = sample_profile();
  p.tensors[2].name = "fc.bias";
  EXPECT_EQ(error_text([&] { p.validate(); }),
            "tensors[2].name 'fc.bias' is also tensors[0].name: names must be unique");
  p = sample_profile();
  p.tensors[1].name.clear();
  EXPECT_EQ(error_text([&] { p.validate(); }), "tensors[1].name must not be empty");
  p = sample_profile();
  p.tensors.clear();
  EXPECT_TRUE(contains(error_text([&] { p.validate(); }), "tensors must not be empty"));
  p = sample_profile();
  p.tensors[0].elements = (size_t{1} << 40) + 1;
  EXPECT_TRUE(contains(error_text([&] { p.validate(); }), "tensors[0].elements must be at most"));
  p = sample_profile();
  p.model.clear();
  EXPECT_EQ(error_text([&] { p.validate(); }), "model must not be empty");
  p = sample_profile();
  p.forward_s = std::nan("");
  EXPECT_EQ(error_text([&] { p.validate(); }),
            "forward_ms must be a non-negative number of milliseconds up to 86400000 (a day), "
            "not nan");
}

// A time of 1e308 ms is finite, but every sum the simulator makes of it is not.
TEST(Profile, TimesBeyondADayAreRefused) {
  json j = sample_json();
  j["backward_ms"] = 1e308;
  EXPECT_EQ(error_text([&] { Profile::from_json(j); }),
            "backward_ms must be a non-negative number of milliseconds up to 86400000 (a day), "
            "not 1e+308");
  j = sample_json();
  j["tensors"][0]["ready_ms"] = 86400001;
  EXPECT_TRUE(contains(error_text([&] { Profile::from_json(j); }), "tensors[0].ready_ms must be"));
}

}  // namespace
}  // namespace gradcomp::model
