#include "gradcomp/plan.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using nlohmann::json;
using testing::error_text;

// Three tensors in two buckets: a compressed one with every field set, and a plain one.
Plan sample_plan() {
  Plan plan;
  plan.tensors = {{"fc.weight", 40000}, {"fc.bias", 100}, {"conv.weight", 90000}};
  plan.buckets = {
      Bucket{{0, 2},
             Option{.codec = "topk:ratio=0.01", .feedback = "ef", .route = "allgather",
                    .encode_on = EncodeOn::kCaller}},
      Bucket{{1}, Option{}},
  };
  return plan;
}

std::filesystem::path temp_path(const std::string& name) {
  // One directory per process: ctest may run the tests of this file side by side.
  const auto dir = std::filesystem::temp_directory_path() /
                   ("gradcomp_plan_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

// Field by field: TensorInfo declares no operator==, so Plan's defaulted one is deleted.
void expect_same(const Plan& a, const Plan& b) {
  EXPECT_EQ(a.format_version(), b.format_version());
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t t = 0; t < a.tensors.size(); ++t) {
    EXPECT_EQ(a.tensors[t].name, b.tensors[t].name) << "tensors[" << t << "]";
    EXPECT_EQ(a.tensors[t].elements, b.tensors[t].elements) << "tensors[" << t << "]";
    EXPECT_EQ(a.tensors[t].shape, b.tensors[t].shape) << "tensors[" << t << "]";
    EXPECT_EQ(a.tensors[t].slices, b.tensors[t].slices) << "tensors[" << t << "]";
  }
  EXPECT_EQ(a.buckets, b.buckets);
}

// The from_json error for sample_plan's JSON after `edit`.
std::string from_json_error(const std::function<void(json&)>& edit) {
  json j = sample_plan().to_json();
  edit(j);
  return error_text([&] { Plan::from_json(j); });
}

// The validate() error for sample_plan after `edit`.
std::string validate_error(const std::function<void(Plan&)>& edit) {
  Plan plan = sample_plan();
  edit(plan);
  return error_text([&] { plan.validate(); });
}

TEST(Plan, BucketElements) {
  const Plan plan = sample_plan();
  EXPECT_EQ(plan.bucket_elements(0), 130000u);
  EXPECT_EQ(plan.bucket_elements(1), 100u);
  EXPECT_EQ(error_text([&] { plan.bucket_elements(2); }),
            "bucket 2 does not exist; the plan has 2 buckets");
}

TEST(Plan, ToJsonFollowsTheSchema) {
  const json j = sample_plan().to_json();
  EXPECT_EQ(j["format"], "gradcomp-plan");
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["tensors"][0], (json{{"name", "fc.weight"}, {"elements", 40000}}));
  EXPECT_EQ(j["buckets"][0], (json{{"tensors", {0, 2}},
                                   {"codec", "topk:ratio=0.01"},
                                   {"feedback", "ef"},
                                   {"route", "allgather"},
                                   {"encode_on", "caller"}}));
  EXPECT_EQ(j["buckets"][1]["encode_on"], "engine");
}

TEST(Plan, JsonRoundTrip) {
  const Plan plan = sample_plan();
  expect_same(Plan::from_json(plan.to_json()), plan);
  expect_same(Plan::from_json(json::parse(plan.to_json().dump())), plan);
  expect_same(Plan::from_json(Plan{}.to_json()), Plan{});
}

// Shapes need version 2; a plan without them is still written as version 1, byte for byte
// as before shapes existed (its hash is what checkpoints store).
TEST(Plan, ShapesTravelInVersion2) {
  Plan plan = sample_plan();
  const std::string without_shapes = plan.to_json().dump();
  EXPECT_EQ(plan.format_version(), 1);
  plan.tensors[0].shape = {200, 200};
  plan.tensors[2].shape = {10, 9, 1000};
  const json j = plan.to_json();
  EXPECT_EQ(j["version"], 2);
  EXPECT_EQ(j["tensors"][0]["shape"], json::array({200, 200}));
  EXPECT_FALSE(j["tensors"][1].contains("shape"));
  expect_same(Plan::parse(j.dump()), plan);
  plan.tensors[0].shape.clear();
  plan.tensors[2].shape.clear();
  EXPECT_EQ(plan.to_json().dump(), without_shapes);
  // A version-2 file without shapes reads as the same plan.
  json v2 = sample_plan().to_json();
  v2["version"] = 2;
  expect_same(Plan::from_json(v2), sample_plan());
  v2["tensors"][1]["shape"] = {"x"};
  EXPECT_EQ(error_text([&] { Plan::from_json(v2); }),
            "tensors[1].shape[0]: must be a non-negative integer");
  v2["tensors"][1]["shape"] = {99};
  EXPECT_EQ(error_text([&] { Plan::parse(v2.dump()); }),
            "plan: tensors[1].shape: [99] holds 99 elements, not the tensor's 100");
}

// sample_plan with fc.weight (200 x 200) cut into 3 slices and conv.weight (no shape) into 2:
// pieces fc.weight#0..2 (indices 0-2), fc.bias (3), conv.weight#0..1 (4, 5), spread over
// buckets so that slices of one tensor travel apart.
Plan sliced_plan() {
  Plan plan = sample_plan();
  plan.tensors[0].shape = {200, 200};
  plan.tensors[0].slices = 3;
  plan.tensors[2].slices = 2;
  plan.buckets = {
      Bucket{{0, 4}, plan.buckets[0].option},
      Bucket{{1}, plan.buckets[0].option},
      Bucket{{5, 2}, plan.buckets[0].option},
      Bucket{{3}, Option{}},
  };
  return plan;
}

// Rows for a tensor with a shape (the first slices one row more), elements otherwise; the
// pieces tile each tensor in order.
TEST(Plan, SlicesCutRowsOrElements) {
  const Plan plan = sliced_plan();
  const std::vector<TensorPiece> pieces = plan.pieces();
  ASSERT_EQ(pieces.size(), 6u);
  const std::vector<std::string> names = {"fc.weight#0", "fc.weight#1", "fc.weight#2",
                                          "fc.bias", "conv.weight#0", "conv.weight#1"};
  const std::vector<size_t> elements = {67 * 200, 67 * 200, 66 * 200, 100, 45000, 45000};
  const std::vector<size_t> offsets = {0, 67 * 200, 134 * 200, 0, 0, 45000};
  for (size_t p = 0; p < pieces.size(); ++p) {
    EXPECT_EQ(pieces[p].info.name, names[p]) << p;
    EXPECT_EQ(pieces[p].info.elements, elements[p]) << p;
    EXPECT_EQ(pieces[p].offset, offsets[p]) << p;
    EXPECT_EQ(pieces[p].info.slices, 1u) << p;
  }
  EXPECT_EQ(pieces[2].info.shape, (std::vector<size_t>{66, 200}));
  EXPECT_EQ(pieces[2].tensor, 0u);
  EXPECT_EQ(pieces[2].slice, 2u);
  EXPECT_TRUE(pieces[4].info.shape.empty());
  EXPECT_EQ(plan.bucket_elements(0), 67u * 200 + 45000);
  EXPECT_EQ(plan.bucket_elements(2), 45000u + 66 * 200);
  EXPECT_NO_THROW(plan.validate());
  // by_piece: the pieces as tensors, the buckets as they are.
  const Plan flat = plan.by_piece();
  EXPECT_FALSE(flat.sliced());
  EXPECT_EQ(flat.tensors.size(), 6u);
  EXPECT_EQ(flat.buckets, plan.buckets);
  EXPECT_NO_THROW(flat.validate());
  // 7 elements in 3 slices: 3, 2, 2.
  const auto seven = slice_tensor({"v", 7, {}, 3});
  ASSERT_EQ(seven.size(), 3u);
  EXPECT_EQ(seven[0].info.elements + seven[1].info.elements + seven[2].info.elements, 7u);
  EXPECT_EQ(seven[0].info.elements, 3u);
  EXPECT_EQ(seven[2].offset, 5u);
}

// Slices need version 3; a plan without them is written as before, byte for byte.
TEST(Plan, SlicesTravelInVersion3) {
  const Plan plan = sliced_plan();
  const json j = plan.to_json();
  EXPECT_EQ(j["version"], 3);
  EXPECT_EQ(j["tensors"][0]["slices"], 3);
  EXPECT_FALSE(j["tensors"][1].contains("slices"));
  expect_same(Plan::parse(j.dump()), plan);
  EXPECT_EQ(Plan::parse(j.dump()).hash(), plan.hash());
  Plan whole = sample_plan();
  whole.tensors[0].shape = {200, 200};
  EXPECT_EQ(whole.to_json()["version"], 2);
  // A version-2 plan with slices is refused by name: an older writer did not mean them.
  json v2 = j;
  v2["version"] = 2;
  EXPECT_EQ(error_text([&] { Plan::from_json(v2); }),
            "tensors[0]: unknown field 'slices'; allowed: name, elements, shape");
}

TEST(Plan, BadSlicesAreClearErrors) {
  const auto error = [](const std::function<void(Plan&)>& edit) {
    Plan plan = sliced_plan();
    edit(plan);
    return error_text([&] { plan.validate(); });
  };
  EXPECT_EQ(error([](Plan& p) { p.tensors[0].slices = 0; }),
            "tensors[0].slices: 0 slices of tensor 'fc.weight': allowed 1 to 4096");
  EXPECT_EQ(error([](Plan& p) { p.tensors[2].slices = 5000; }),
            "tensors[2].slices: 5000 slices of tensor 'conv.weight': allowed 1 to 4096");
  EXPECT_EQ(error([](Plan& p) { p.tensors[0].shape = {2, 20000}; }),
            "tensors[0].slices: 3 slices of tensor 'fc.weight': it has 2 rows, and every slice "
            "needs one");
  EXPECT_EQ(error([](Plan& p) { p.buckets[2].tensors = {5}; }),
            "slice 2 of tensor 'fc.weight' (tensors[0]) is in no bucket; each tensor or slice "
            "must be in exactly one bucket");
  EXPECT_EQ(error([](Plan& p) { p.buckets[1].tensors = {1, 4}; }),
            "slice 0 of tensor 'conv.weight' (tensors[2]) is in buckets[0] and again in "
            "buckets[1]; each tensor or slice must be in exactly one bucket");
  EXPECT_EQ(error([](Plan& p) { p.buckets[3].tensors = {3, 6}; }),
            "buckets[3].tensors[1]: index 6 is out of range; the plan has 6 pieces (tensors "
            "and slices)");
  // The plan's tensors without slices: the old indices do not cover the slices.
  EXPECT_EQ(error([](Plan& p) { p.tensors[0].slices = 1; }),
            "buckets[0].tensors[1]: index 4 is out of range; the plan has 4 pieces (tensors "
            "and slices)");
}

TEST(Plan, SpecsAreKeptAsWritten) {
  Plan plan = sample_plan();
  plan.buckets[0].option.codec = "topk: ratio = 0.010";
  EXPECT_EQ(Plan::from_json(plan.to_json()).buckets[0].option.codec, "topk: ratio = 0.010");
}

TEST(Plan, OptionalBucketFieldsTakeTheirDefaults) {
  json j = sample_plan().to_json();
  for (const char* key : {"feedback", "route", "encode_on"}) j["buckets"][0].erase(key);
  const Option option = Plan::from_json(j).buckets[0].option;
  EXPECT_EQ(option, (Option{.codec = "topk:ratio=0.01"}));
}

// Option::start_step: written only when set, read back, absent in older plans (which keep
// their JSON and hash), and part of the hash when set.
TEST(Plan, StartStepRoundTripsAndOldPlansStillRead) {
  Plan plan = sample_plan();
  const json old_json = plan.to_json();
  const uint64_t old_hash = plan.hash();
  EXPECT_FALSE(old_json["buckets"][0].contains("start_step"));
  expect_same(Plan::from_json(old_json), plan);  // a plan written before start_step existed
  EXPECT_EQ(Plan::from_json(old_json).buckets[0].option.start_step, 0u);

  plan.buckets[0].option.start_step = 500;
  const json j = plan.to_json();
  EXPECT_EQ(j["buckets"][0]["start_step"], 500);
  EXPECT_FALSE(j["buckets"][1].contains("start_step"));
  expect_same(Plan::from_json(j), plan);
  expect_same(Plan::parse(j.dump(2)), plan);
  EXPECT_EQ(Plan::from_json(j).buckets[0].option.start_step, 500u);
  EXPECT_NE(plan.hash(), old_hash);
  EXPECT_EQ(sample_plan().hash(), old_hash);
}

TEST(Plan, StartStepErrorsNameTheField) {
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["start_step"] = -1; }),
            "buckets[0].start_step: must be a non-negative integer");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["start_step"] = "5"; }),
            "buckets[0].start_step: must be a non-negative integer");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["start_step"] = 2.0; }),
            "buckets[0].start_step: must be a non-negative integer");
  EXPECT_EQ(validate_error([](Plan& p) { p.buckets[1].option.start_step = (1ull << 40) + 1; }),
            "buckets[1].start_step: must be at most 2^40, not 1099511627777");
}

TEST(Plan, ShortFormTakesAStartField) {
  EXPECT_EQ(parse_option("topk:ratio=0.01|ef||start=500"),
            (Option{.codec = "topk:ratio=0.01", .feedback = "ef", .route = "allgather",
                    .start_step = 500}));
  EXPECT_EQ(parse_option("fp16|||start=0"), (Option{.codec = "fp16"}));
  EXPECT_EQ(parse_option("fp16").start_step, 0u);
  for (const char* bad : {"fp16|||500", "fp16|||start=", "fp16|||start=-1", "fp16|||start=1e3",
                          "fp16|||begin=5", "fp16|||start=1099511627777"}) {
    const std::string text = error_text([&] { parse_option(bad); });
    EXPECT_NE(text.find("the 4th field"), std::string::npos) << bad << ": " << text;
    EXPECT_NE(text.find("must be 'start=N'"), std::string::npos) << bad << ": " << text;
  }
  const std::string five = error_text([] { parse_option("fp16|||start=1|x"); });
  EXPECT_NE(five.find("must be 'codec[|feedback[|route[|start=N]]]'"), std::string::npos) << five;
}

TEST(Plan, OptionNamesItsRouteOnlyInANonEmptyThirdField) {
  for (const char* named : {"qsgd||twoway", "topk|ef|allgather", "fp16||allreduce|start=5"}) {
    EXPECT_TRUE(option_names_route(named)) << named;
  }
  for (const char* unnamed : {"qsgd", "topk|ef", "topk|ef|", "efsignsgd|ef||start=469"}) {
    EXPECT_FALSE(option_names_route(unnamed)) << unnamed;
  }
}

TEST(Plan, SaveLoadRoundTrip) {
  const auto path = temp_path("plan.json");
  const Plan plan = sample_plan();
  plan.save(path.string());
  expect_same(Plan::load(path.string()), plan);
  EXPECT_EQ(Plan::load(path.string()).hash(), plan.hash());

  // Pretty-printed with an indent of 2, and no temporary file left beside it.
  std::ifstream in(path);
  std::string first, second;
  std::getline(in, first);
  std::getline(in, second);
  EXPECT_EQ(first, "{");
  EXPECT_EQ(second.substr(0, 3), "  \"");
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos);
  }

  // Saving again replaces the file.
  Plan other = plan;
  other.tensors[0].elements = 7;
  other.save(path.string());
  expect_same(Plan::load(path.string()), other);
  std::filesystem::remove_all(path.parent_path());
}

TEST(Plan, FileErrorsNameTheFile) {
  EXPECT_EQ(error_text([] { Plan::load("/nonexistent/plan.json"); }),
            "cannot open plan file '/nonexistent/plan.json': No such file or directory");
  EXPECT_EQ(error_text([] { sample_plan().save("/nonexistent/dir/plan.json"); })
                .find("cannot write plan file '/nonexistent/dir/plan.json' (creating "
                      "'/nonexistent/dir/plan.json.tmp."),
            0u);

  const auto path = temp_path("broken.json");
  std::ofstream(path) << "{\"format\": ";
  EXPECT_EQ(error_text([&] { Plan::load(path.string()); })
                .find("plan file '" + path.string() + "': not valid JSON: parse error at line 1, column "),
            0u);
  std::ofstream(path) << R"({"format": "gradcomp-plan", "version": 4})";
  EXPECT_EQ(error_text([&] { Plan::load(path.string()); }),
            "plan file '" + path.string() +
                "': version 4 is not supported; this gradcomp reads versions 1 to 3");
  std::filesystem::remove_all(path.parent_path());
}

// The Python front end hands plans over as JSON text: every error says it is about the plan, where
// the syntax broke, or which field is wrong; never a bare nlohmann message.
TEST(Plan, ParseErrorsSayWhereAndWhichField) {
  expect_same(Plan::parse(sample_plan().to_json().dump()), sample_plan());
  const std::string syntax = error_text([] { Plan::parse("{\"format\": \n  ]"); });
  EXPECT_EQ(syntax.find("plan: not valid JSON: parse error at line 2, column 3: "), 0u) << syntax;
  EXPECT_EQ(syntax.find("json.exception"), std::string::npos) << syntax;
  // Found by the JSON fuzz targets: a number overflowing a double is nlohmann's out_of_range,
  // which escaped as a non-gradcomp exception.
  const std::string overflow = error_text([] { Plan::parse("{\"version\": 1e9999}"); });
  EXPECT_EQ(overflow, "plan: not valid JSON: number overflow parsing '1e9999'");

  json j = sample_plan().to_json();
  j["buckets"][1]["codec"] = 5;
  EXPECT_EQ(error_text([&] { Plan::parse(j.dump()); }), "plan: buckets[1].codec: expected a string");
  j = sample_plan().to_json();
  j["buckets"][0]["codec"] = "nosuch";
  EXPECT_THROW(Plan::parse(j.dump()), SpecError);  // validated, and still a SpecError
  EXPECT_EQ(error_text([&] { Plan::parse(j.dump(), "plan 'mine'"); })
                .find("plan 'mine': buckets[0].codec: unknown codec 'nosuch'"),
            0u);
}

TEST(Plan, HashIsStableAndCanonical) {
  const Plan plan = sample_plan();
  EXPECT_EQ(plan.hash(), sample_plan().hash());
  EXPECT_EQ(plan.hash(), Plan::from_json(json::parse(plan.to_json().dump(2))).hash());
  // A fixed value: the hash must not change between builds, or ranks built differently would
  // disagree. FNV-1a 64 of the canonical dump.
  const std::string canonical = plan.to_json().dump();
  uint64_t h = 1469598103934665603ull;
  for (const char c : canonical) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  EXPECT_EQ(plan.hash(), h);
  EXPECT_EQ(canonical.substr(0, 11), "{\"buckets\":");  // keys sorted
}

TEST(Plan, HashChangesWithAnyField) {
  const std::vector<std::function<void(Plan&)>> edits = {
      [](Plan& p) { p.tensors[0].name = "fc.weights"; },
      [](Plan& p) { p.tensors[1].elements += 1; },
      [](Plan& p) { std::swap(p.tensors[0], p.tensors[1]); },
      [](Plan& p) { p.tensors.push_back({"extra", 1}); },
      [](Plan& p) { std::swap(p.buckets[0].tensors[0], p.buckets[0].tensors[1]); },
      [](Plan& p) { std::swap(p.buckets[0], p.buckets[1]); },
      [](Plan& p) { p.buckets[0].option.codec = "topk:ratio=0.02"; },
      [](Plan& p) { p.buckets[0].option.feedback = "none"; },
      [](Plan& p) { p.buckets[0].option.route = "allreduce"; },
      [](Plan& p) { p.buckets[0].option.encode_on = EncodeOn::kEngine; },
      [](Plan& p) { p.buckets[0].option.start_step = 1; },
      [](Plan& p) { p.tensors[0].shape = {p.tensors[0].elements}; },
  };
  std::set<uint64_t> hashes = {sample_plan().hash()};
  for (const auto& edit : edits) {
    Plan plan = sample_plan();
    edit(plan);
    EXPECT_TRUE(hashes.insert(plan.hash()).second) << plan.to_json().dump();
  }
}

TEST(Plan, FromJsonErrorsNameTheField) {
  EXPECT_EQ(error_text([] { Plan::from_json(json::array()); }), "plan: expected a JSON object");
  EXPECT_EQ(from_json_error([](json& j) { j.erase("format"); }),
            "format: missing; expected \"gradcomp-plan\"");
  EXPECT_EQ(from_json_error([](json& j) { j["format"] = 3; }), "format: expected a string");
  EXPECT_EQ(from_json_error([](json& j) { j["format"] = "other"; }),
            "format: 'other' is not a gradcomp plan; expected \"gradcomp-plan\"");
  EXPECT_EQ(from_json_error([](json& j) { j.erase("version"); }),
            "version: missing; expected the integer 3");
  EXPECT_EQ(from_json_error([](json& j) { j["version"] = "1"; }), "version: must be an integer");
  EXPECT_EQ(from_json_error([](json& j) { j["version"] = 4; }),
            "version 4 is not supported; this gradcomp reads versions 1 to 3");
  EXPECT_EQ(from_json_error([](json& j) { j["version"] = 0; }),
            "version 0 is not supported; this gradcomp reads versions 1 to 3");
  // Shapes came with version 2: a version-1 plan holding one is refused, by name.
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"][0]["shape"] = {4}; }),
            "tensors[0]: unknown field 'shape'; allowed: name, elements");
  EXPECT_EQ(from_json_error([](json& j) { j["extra"] = 1; }),
            "plan: unknown field 'extra'; allowed: format, version, tensors, buckets");
}

TEST(Plan, FromJsonTensorErrors) {
  EXPECT_EQ(from_json_error([](json& j) { j.erase("tensors"); }),
            "tensors: missing; expected an array of tensors");
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"] = json::object(); }),
            "tensors: expected an array");
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"][1] = "fc.bias"; }),
            "tensors[1]: expected an object");
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"][2].erase("name"); }),
            "tensors[2].name: missing; expected a string");
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"][2]["name"] = 5; }),
            "tensors[2].name: expected a string");
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"][0].erase("elements"); }),
            "tensors[0].elements: missing; expected a non-negative integer");
  for (const json& bad : {json(-1), json(1.5), json(3.0), json("10"), json(nullptr)}) {
    EXPECT_EQ(from_json_error([&](json& j) { j["tensors"][1]["elements"] = bad; }),
              "tensors[1].elements: must be a non-negative integer")
        << bad.dump();
  }
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"][0]["size"] = 1; }),
            "tensors[0]: unknown field 'size'; allowed: name, elements");
  // Sizes far beyond any model are refused, so bucket sums and frame sizes cannot overflow.
  EXPECT_EQ(from_json_error([](json& j) { j["tensors"][1]["elements"] = (1ull << 40) + 1; }),
            "tensors[1].elements: must be at most 2^40, not 1099511627777");
}

TEST(Plan, FromJsonBucketErrors) {
  EXPECT_EQ(from_json_error([](json& j) { j.erase("buckets"); }),
            "buckets: missing; expected an array of buckets");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"] = 1; }), "buckets: expected an array");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][1] = json::array(); }),
            "buckets[1]: expected an object");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][1].erase("tensors"); }),
            "buckets[1].tensors: missing; expected an array of tensor indices");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][1]["tensors"] = 1; }),
            "buckets[1].tensors: expected an array");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["tensors"][1] = -2; }),
            "buckets[0].tensors[1]: must be a non-negative integer");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][1].erase("codec"); }),
            "buckets[1].codec: missing; expected a codec spec string");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][1]["codec"] = json::object(); }),
            "buckets[1].codec: expected a string");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["feedback"] = true; }),
            "buckets[0].feedback: expected a string");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["route"] = 1; }),
            "buckets[0].route: expected a string");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["encode_on"] = "gpu"; }),
            "buckets[0].encode_on: 'gpu' is not allowed; allowed: engine, caller");
  EXPECT_EQ(from_json_error([](json& j) { j["buckets"][0]["feedbak"] = "ef"; }),
            "buckets[0]: unknown field 'feedbak'; allowed: tensors, codec, feedback, route, "
            "encode_on, start_step");
}

TEST(Plan, ValidAndEmptyPlansPass) {
  sample_plan().validate();
  Plan{}.validate();
}

TEST(Plan, ValidateTensorErrors) {
  EXPECT_EQ(validate_error([](Plan& p) { p.tensors[1].name = ""; }),
            "tensors[1]: the name is empty; every tensor needs a unique, non-empty name");
  EXPECT_EQ(validate_error([](Plan& p) { p.tensors[2].name = "fc.weight"; }),
            "tensors[2]: the name 'fc.weight' is already used by tensors[0]; tensor names must "
            "be unique");
  EXPECT_EQ(validate_error([](Plan& p) { p.tensors[0].shape = {3, 7}; }),
            fmt::format("tensors[0].shape: [3, 7] holds 21 elements, not the tensor's {}",
                        sample_plan().tensors[0].elements));
  EXPECT_EQ(validate_error([](Plan& p) { p.tensors[0].shape = {size_t{1} << 40, 1u << 30}; }),
            fmt::format("tensors[0].shape: [{}, {}] holds more than 2^64 elements, not the "
                        "tensor's {}",
                        size_t{1} << 40, 1u << 30, sample_plan().tensors[0].elements));
}

TEST(Plan, ValidateMembershipErrors) {
  EXPECT_EQ(validate_error([](Plan& p) { p.buckets[0].tensors = {0}; }),
            "tensor 'conv.weight' (tensors[2]) is in no bucket; each tensor must be in exactly "
            "one bucket");
  EXPECT_EQ(validate_error([](Plan& p) { p.buckets[1].tensors.push_back(2); }),
            "tensor 'conv.weight' (tensors[2]) is in buckets[0] and again in buckets[1]; each "
            "tensor must be in exactly one bucket");
  EXPECT_EQ(validate_error([](Plan& p) { p.buckets[0].tensors = {0, 2, 0}; }),
            "tensor 'fc.weight' (tensors[0]) is in buckets[0] and again in buckets[0]; each "
            "tensor must be in exactly one bucket");
  EXPECT_EQ(validate_error([](Plan& p) { p.buckets[1].tensors = {1, 3}; }),
            "buckets[1].tensors[1]: index 3 is out of range; the plan has 3 tensors");
  EXPECT_EQ(validate_error([](Plan& p) { p.buckets.push_back(Bucket{}); }),
            "buckets[2]: has no tensors; every bucket needs at least one");
}

TEST(Plan, ValidateOptionErrorsNameTheBucketAndField) {
  const std::string codec = validate_error([](Plan& p) { p.buckets[1].option.codec = "zip"; });
  EXPECT_EQ(codec.find("buckets[1].codec: "), 0u) << codec;
  EXPECT_NE(codec.find("zip"), std::string::npos) << codec;
  const std::string param =
      validate_error([](Plan& p) { p.buckets[0].option.codec = "topk:ratio=2"; });
  EXPECT_EQ(param.find("buckets[0].codec: "), 0u) << param;
  EXPECT_NE(param.find("ratio"), std::string::npos) << param;
  const std::string feedback =
      validate_error([](Plan& p) { p.buckets[0].option.feedback = "memory"; });
  EXPECT_EQ(feedback.find("buckets[0].feedback: "), 0u) << feedback;
  EXPECT_NE(feedback.find("memory"), std::string::npos) << feedback;
  const std::string route = validate_error([](Plan& p) { p.buckets[0].option.route = "ring"; });
  EXPECT_EQ(route.find("buckets[0].route: "), 0u) << route;
  EXPECT_NE(route.find("ring"), std::string::npos) << route;
  // topk is not summable, so it cannot travel by allreduce.
  const std::string fit =
      validate_error([](Plan& p) { p.buckets[0].option.route = "allreduce"; });
  EXPECT_EQ(fit.find("buckets[0].route: "), 0u) << fit;
  EXPECT_NE(fit.find("topk"), std::string::npos) << fit;
  EXPECT_NE(fit.find("summable"), std::string::npos) << fit;
  // A bad spec keeps its type.
  Plan plan = sample_plan();
  plan.buckets[1].option.codec = "zip";
  EXPECT_THROW(plan.validate(), SpecError);
}

}  // namespace
}  // namespace gradcomp
