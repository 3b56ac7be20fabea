// The model commands (plan, simulate, utility), run as a user would: what they print, the files
// they write, and their errors. No assertion is about how long anything took.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "gradcomp/model/correction.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/plan.h"
#include "support/run_cli.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Result = gradcomp::testing::CliResult;

using gradcomp::testing::run_cli;

bool has(const Result& r, const std::string& text) {
  return r.output.find(text) != std::string::npos;
}

// A fresh directory per test, removed afterwards: tests may run side by side under ctest -j.
class ModelCli : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("gradcomp_model_cli_" + std::to_string(getpid()) + "_" + info->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write(const std::string& name, const json& doc) const {
    std::ofstream(path(name)) << doc.dump(2) << "\n";
    return path(name);
  }

  static json read(const std::string& file) {
    std::ifstream in(file);
    return json::parse(in);
  }

 private:
  fs::path dir_;
};

// A small model no shipped file describes: three tensors, one of them a bias.
json unseen_profile() {
  return {{"format", "gradcomp-profile"}, {"version", 1}, {"model", "unseen"},
          {"source", "written by model_cli_test"}, {"batch_size", 8},
          {"forward_ms", 20.0}, {"backward_ms", 40.0},
          {"tensors", json::array({{{"name", "head.bias"}, {"elements", 10}, {"ready_ms", 1.0}},
                                   {{"name", "head.weight"}, {"elements", 5000000}, {"ready_ms", 1.0}},
                                   {{"name", "body.weight"}, {"elements", 8000000}, {"ready_ms", 40.0}}})}};
}

const char* kResnet101 =
    "plan --profile resnet101 --workers 64 --per-node 8 --inter 25gbit "
    "--codecs none,fp16,topk:ratio=0.01,efsignsgd,randomk:ratio=0.01";

TEST_F(ModelCli, PlanPrintsThePlanAndWhatItIsComparedWith) {
  const Result r = run_cli(kResnet101);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r, "resnet101 (314 tensors")) << r.output;
  EXPECT_TRUE(has(r, "64 workers (8 nodes x 8)")) << r.output;
  EXPECT_TRUE(has(r, "predicted iteration time of this plan")) << r.output;
  EXPECT_TRUE(has(r, "best uncompressed plan")) << r.output;
  for (const char* codec : {"none", "fp16", "topk:ratio=0.01", "efsignsgd", "randomk:ratio=0.01"}) {
    EXPECT_TRUE(has(r, std::string("single-codec default plan: ") + codec)) << codec;
  }
  EXPECT_TRUE(has(r, "upper bound (free compression")) << r.output;
  EXPECT_TRUE(has(r, "decision time")) << r.output;
}

TEST_F(ModelCli, PlanJsonIsAValidPlanOverTheProfilesTensors) {
  const std::string out = path("plan.json");
  const Result r = run_cli(std::string(kResnet101) + " --json " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const gradcomp::Plan plan = gradcomp::Plan::load(out);  // load validates too
  EXPECT_NO_THROW(plan.validate());
  EXPECT_EQ(plan.tensors, gradcomp::model::load_profile("resnet101").tensor_infos());
  const std::set<std::string> allowed{"none", "fp16", "topk:ratio=0.01", "efsignsgd",
                                      "randomk:ratio=0.01"};
  for (const auto& bucket : plan.buckets) EXPECT_TRUE(allowed.count(bucket.option.codec)) << bucket.option.codec;
  // The plan it wrote is one `simulate` runs.
  const Result sim =
      run_cli("simulate --profile resnet101 --workers 64 --per-node 8 --plan " + out);
  EXPECT_EQ(sim.exit_code, 0) << sim.output;
}

TEST_F(ModelCli, PlanStartStepWarmsTheCompressedBuckets) {
  const std::string out = path("warm_plan.json");
  const Result r = run_cli(std::string(kResnet101) + " --start-step 500 --json " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const gradcomp::Plan plan = gradcomp::Plan::load(out);
  size_t compressed = 0;
  for (const auto& bucket : plan.buckets) {
    const bool lossy = bucket.option.codec != "none";
    EXPECT_EQ(bucket.option.start_step, lossy ? 500u : 0u) << bucket.option.codec;
    compressed += lossy ? 1 : 0;
  }
  EXPECT_GT(compressed, 0u);
  EXPECT_NE(r.output.find("| from 500"), std::string::npos) << r.output;
  const Result bad = run_cli(std::string(kResnet101) + " --start-step -3");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--start-step"), std::string::npos) << bad.output;
}

// --servers S: the job has dedicated parameter servers, so the planner may route over them
// (here it does, where the model prices them cheaper); without it, never.
TEST_F(ModelCli, PlanRoutesOverServersOnlyWhenTheJobHasThem) {
  const std::string base =
      "plan --profile resnet50 --workers 4 --inter 1gbit --codecs "
      "'topk:ratio=0.01|ef' --json ";
  const auto routes = [&](const std::string& extra) {
    const std::string out = path("servers_plan.json");
    const Result r = run_cli(base + out + extra);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::set<std::string> names;
    for (const auto& b : gradcomp::Plan::load(out).buckets) names.insert(b.option.route);
    return names;
  };
  EXPECT_EQ(routes("").count("servers"), 0u);
  EXPECT_EQ(routes(" --servers 4").count("servers"), 1u);
  const Result bad = run_cli(base + path("x.json") + " --servers -2");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--servers"), std::string::npos) << bad.output;
}

// A plan whose buckets compress again on the way back (here over the servers) says so, and
// names --one-lossy-step, under which it has none.
TEST_F(ModelCli, PlanSaysWhenBucketsCompressTwice) {
  const std::string out = path("servers_twice.json");
  const std::string base =
      "plan --profile resnet50 --workers 4 --inter 1gbit --codecs 'topk:ratio=0.01|ef' "
      "--servers 4 --json " + out;
  const auto twice = [&] {
    size_t n = 0;
    for (const auto& b : gradcomp::Plan::load(out).buckets) {
      n += b.option.route == "servers" || b.option.route == "twoway" ? 1 : 0;
    }
    return n;
  };
  const Result r = run_cli(base);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t n = twice();
  ASSERT_GT(n, 0u) << r.output;
  EXPECT_NE(r.output.find(fmt::format("{} bucket{} compress", n, n == 1 ? "" : "s")),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--one-lossy-step"), std::string::npos) << r.output;
  const Result once = run_cli(base + " --one-lossy-step");
  ASSERT_EQ(once.exit_code, 0) << once.output;
  EXPECT_EQ(twice(), 0u);
  EXPECT_EQ(once.output.find("compress twice"), std::string::npos) << once.output;
}

TEST_F(ModelCli, PlanReadsAProfileItHasNeverSeen) {
  const std::string profile = write("unseen.json", unseen_profile());
  const std::string out = path("plan.json");
  const Result r = run_cli("plan --profile " + profile +
                           " --workers 4 --inter 1gbit --codecs fp16 --json " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r, "unseen (3 tensors")) << r.output;
  const gradcomp::Plan plan = gradcomp::Plan::load(out);
  ASSERT_EQ(plan.tensors.size(), 3u);
  EXPECT_EQ(plan.tensors[0].name, "head.bias");
  EXPECT_EQ(plan.tensors[2].name, "body.weight");
}

TEST_F(ModelCli, UnknownProfileListsTheShippedOnes) {
  const Result r = run_cli("plan --profile no-such-model --workers 8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r, "unknown profile 'no-such-model'")) << r.output;
  for (const auto& name : gradcomp::model::profile_names()) EXPECT_TRUE(has(r, name)) << name;
}

TEST_F(ModelCli, UnknownCodecListsTheCodecs) {
  const Result r = run_cli("plan --profile resnet50 --workers 8 --codecs none,zip");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r, "unknown codec 'zip'")) << r.output;
  EXPECT_TRUE(has(r, "available codecs: none, fp16")) << r.output;
}

TEST_F(ModelCli, PerNodeMustDivideWorkers) {
  const Result r = run_cli("plan --profile resnet50 --workers 64 --per-node 6");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r, "per_node = 6 must divide workers = 64")) << r.output;
}

TEST_F(ModelCli, ZeroBandwidthIsRefused) {
  const Result flag = run_cli("plan --profile resnet50 --workers 8 --inter 0gbit");
  EXPECT_NE(flag.exit_code, 0);
  EXPECT_TRUE(has(flag, "inter")) << flag.output;
  EXPECT_TRUE(has(flag, "is out of range; allowed: 1 kbit/s .. 1 Pbit/s")) << flag.output;
  const std::string cluster = write("cluster.json", {{"workers", 8}, {"inter", {{"bandwidth", "0gbit"}, {"latency", "10us"}}}});
  const Result file = run_cli("plan --profile resnet50 --cluster " + cluster);
  EXPECT_NE(file.exit_code, 0);
  EXPECT_TRUE(has(file, "inter.bandwidth")) << file.output;
}

TEST_F(ModelCli, NegativeTensorSizeNamesTheField) {
  json profile = unseen_profile();
  profile["tensors"][1]["elements"] = -5000;
  const Result r = run_cli("plan --profile " + write("negative.json", profile) + " --workers 4");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r, "tensors[1].elements")) << r.output;
}

TEST_F(ModelCli, SimulateWritesRowsAndATrace) {
  const std::string out = path("sim.json"), trace = path("trace.json");
  const Result r = run_cli("simulate --profile resnet50 --workers 8 --codecs 'none;fp16' --json " +
                           out + " --trace " + trace);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r, "compute bound")) << r.output;
  const json doc = read(out);
  ASSERT_EQ(doc["rows"].size(), 2u);
  EXPECT_EQ(doc["rows"][0]["plan"], "none");
  EXPECT_EQ(doc["rows"][1]["plan"], "fp16");
  for (const auto& row : doc["rows"]) {
    EXPECT_EQ(row["workers"], 8);
    EXPECT_GE(row["iteration_s"].get<double>(), row["compute_bound_s"].get<double>());
  }
  EXPECT_TRUE(read(trace).is_array());
}

TEST_F(ModelCli, SimulateSweepsWorkersAndBandwidths) {
  const std::string out = path("sweep.json");
  const Result r = run_cli(
      "simulate --profile bert-base --per-node 4 --codecs 'none;fp16' "
      "--sweep-workers 8,16 --sweep-bandwidth 1gbit,10gbit,100gbit --json " +
      out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read(out)["rows"].size(), 2u * 3u * 2u);
}

// A correction's step overhead adds to every plan's step and nothing else; its other terms make
// the step slower, in a sweep too; the file's errors name the file and the field.
TEST_F(ModelCli, SimulateAppliesACorrection) {
  const std::string plain = path("plain.json"), shifted = path("shifted.json"),
                    slower = path("slower.json"), swept = path("swept.json");
  const std::string codecs = " --profile resnet50 --workers 4 --codecs 'none;topk:ratio=0.01|ef' ";
  ASSERT_EQ(run_cli("simulate" + codecs + "--lambda 1 --json " + plain).exit_code, 0);
  const json overhead = {{"extra_latency_s", 0}, {"lambda", 1},        {"bandwidth_scale", 1},
                         {"cost_scale", 1},      {"codec_lambdas", json::object()},
                         {"step_overhead_s", 0.01}, {"error_before", 0.2}, {"error_after", 0.1}};
  const Result r = run_cli("simulate" + codecs + "--correction " +
                           write("overhead.json", overhead) + " --json " + shifted);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r, "corrected by")) << r.output;
  EXPECT_EQ(read(shifted)["correction"], overhead);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(read(shifted)["rows"][i]["iteration_s"].get<double>(),
                read(plain)["rows"][i]["iteration_s"].get<double>() + 0.01, 1e-9);
  }
  json slow = overhead;
  slow["extra_latency_s"] = 1e-3;
  slow["lambda"] = 1.2;
  slow["cost_scale"] = 3;
  const std::string slow_file = write("slow.json", slow);
  ASSERT_EQ(
      run_cli("simulate" + codecs + "--correction " + slow_file + " --json " + slower).exit_code,
      0);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(read(slower)["rows"][i]["iteration_s"].get<double>(),
              read(shifted)["rows"][i]["iteration_s"].get<double>());
  }
  ASSERT_EQ(run_cli("simulate" + codecs + "--sweep-bandwidth 25gbit --correction " + slow_file +
                    " --json " + swept)
                .exit_code,
            0);
  EXPECT_EQ(read(swept)["rows"], read(slower)["rows"]);
  // A codec's own slow-down slows the plans of that codec only.
  json topk_slow = overhead;
  topk_slow["codec_lambdas"] = {{"topk", 2}};
  const std::string own = path("own.json");
  const Result by_codec = run_cli("simulate" + codecs + "--correction " +
                                  write("topk.json", topk_slow) + " --json " + own);
  ASSERT_EQ(by_codec.exit_code, 0) << by_codec.output;
  EXPECT_EQ(read(own)["rows"][0]["iteration_s"], read(shifted)["rows"][0]["iteration_s"]);
  EXPECT_GT(read(own)["rows"][1]["iteration_s"].get<double>(),
            read(shifted)["rows"][1]["iteration_s"].get<double>());
  // Each row says the slow-down its plan was simulated with: the uncompressed plan none, the
  // top-k plan top-k's for its compressed buckets (weighed by their elements: between 1 and 2).
  EXPECT_EQ(read(own)["rows"][0]["lambda"], 1.0);
  EXPECT_GT(read(own)["rows"][1]["lambda"].get<double>(), 1.5);
  EXPECT_LE(read(own)["rows"][1]["lambda"].get<double>(), 2.0);
  EXPECT_TRUE(has(by_codec, "lambda 1, for a codec's buckets its own")) << by_codec.output;

  json bad = overhead;
  bad["lambda"] = 0.5;
  const Result refused = run_cli("simulate" + codecs + "--correction " + write("bad.json", bad));
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_TRUE(has(refused, "bad.json': model correction: 'lambda' = 0.5 must be from 1"))
      << refused.output;
  const Result both = run_cli("simulate" + codecs + "--lambda 1.1 --correction " + slow_file);
  EXPECT_NE(both.exit_code, 0);
  EXPECT_TRUE(has(both, "--lambda excludes --correction")) << both.output;
}

// `gradcomp correct` refits an auto report's trials: here trials made by the model with a known
// correction (a slower link, top-k slowing the backward pass), which it gives back, and prints
// each trial; a report without trials is an error naming the decision.
TEST_F(ModelCli, CorrectRefitsAnAutoReport) {
  namespace model = gradcomp::model;
  const model::Profile profile = model::load_profile("resnet50");
  model::Cluster cluster;
  cluster.workers = 4;
  cluster.inter = cluster.intra = {1e9 / 8, 1e-4};
  const model::CodecCosts costs = model::CodecCosts::shipped();
  const model::Correction truth{.bandwidth_scale = 0.8, .codec_lambdas = {{"topk", 2}}};
  json candidates = json::array();
  for (const char* option : {"none", "topk:ratio=0.01|ef", "fp16"}) {
    gradcomp::DefaultPlanSettings settings;
    settings.compressed = gradcomp::parse_option(option);
    const gradcomp::Plan plan = gradcomp::make_default_plan(profile.tensor_infos(), settings);
    const double seconds = model::simulate(profile, plan, truth.cost_model(cluster, costs),
                                           truth.simulator(plan)).iteration_s;
    candidates.push_back(
        {{"name", option}, {"plan", plan.to_json()}, {"measured_ms", 1e3 * seconds}});
  }
  json report = {{"profile", profile.to_json()}, {"cluster", cluster.to_json()},
                 {"codec_costs", costs.to_json()},
                 {"decisions", json::array({{{"candidates", candidates}}})}};
  const std::string fitted = path("correction.json");
  const Result r =
      run_cli("correct --report " + write("report.json", report) + " --json " + fitted);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r, "topk:ratio=0.01|ef")) << r.output;
  const model::Correction fit = model::Correction::from_json(read(fitted));
  EXPECT_EQ(fit.bandwidth_scale, 0.8);
  EXPECT_EQ(fit.codec_lambdas, truth.codec_lambdas);
  EXPECT_LT(fit.error_after, 1e-6);

  report["decisions"][0]["candidates"] = json::array();
  const Result empty = run_cli("correct --report " + write("empty.json", report));
  EXPECT_NE(empty.exit_code, 0);
  EXPECT_TRUE(has(empty, "decisions[0]: no measured trial to fit")) << empty.output;
  report["decisions"][0]["candidates"] = candidates;
  report["decisions"][0]["candidates"][1]["measured_ms"] = "fast";
  const Result typed = run_cli("correct --report " + write("typed.json", report));
  EXPECT_EQ(typed.exit_code, 2) << typed.output;  // an Error, not an internal error
  EXPECT_TRUE(has(typed, "candidates[1]: 'measured_ms' must be a number, not \"fast\""))
      << typed.output;
  const Result beyond = run_cli("correct --report " + path("report.json") + " --decision 3");
  EXPECT_NE(beyond.exit_code, 0);
  EXPECT_TRUE(has(beyond, "--decision 3 but the report has 1 decisions")) << beyond.output;
}

TEST_F(ModelCli, SimulateRefusesABadBandwidthAndAnUnknownFlag) {
  const Result unit = run_cli("simulate --profile resnet50 --sweep-bandwidth 10furlongs");
  EXPECT_NE(unit.exit_code, 0);
  EXPECT_TRUE(has(unit, "--sweep-bandwidth")) << unit.output;
  EXPECT_TRUE(has(unit, "furlongs")) << unit.output;
  const Result flag = run_cli("simulate --profile resnet50 --no-such-flag");
  EXPECT_NE(flag.exit_code, 0);
  EXPECT_TRUE(has(flag, "--no-such-flag")) << flag.output;
}

// docs/plan-format.md: a plan's errors name the file and the field path, and a plan read from a
// file is validated, so simulate reports a bad bucket by its path rather than from deep in the
// model ("unknown codec 'nosuch'" alone, or "simulate: bucket 1 lists tensor 0").
TEST_F(ModelCli, SimulatePlanErrorsNameTheFileAndTheField) {
  const std::string good = path("plan.json");
  ASSERT_EQ(run_cli("plan --profile resnet50 --workers 4 --json " + good).exit_code, 0);
  json plan = read(good);
  ASSERT_GE(plan["buckets"].size(), 2u);
  plan["buckets"][1]["codec"] = "nosuch";
  const std::string codec = write("codec.json", plan);
  const Result r = run_cli("simulate --profile resnet50 --plan " + codec);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r, "plan file '" + codec + "': buckets[1].codec: unknown codec 'nosuch'"))
      << r.output;

  plan = read(good);
  plan["buckets"][1]["tensors"] = plan["buckets"][0]["tensors"];
  const std::string twice = write("twice.json", plan);
  const Result t = run_cli("simulate --profile resnet50 --plan " + twice);
  EXPECT_TRUE(has(t, "plan file '" + twice + "': tensor ")) << t.output;
  EXPECT_TRUE(has(t, "is in buckets[0] and again in buckets[1]")) << t.output;

  const std::string broken = path("broken.json");
  std::ofstream(broken) << "{\"format\": \"gradcomp-plan\",\n  \"version\": 1,,}";
  const Result b = run_cli("simulate --profile resnet50 --plan " + broken);
  EXPECT_TRUE(has(b, "plan file '" + broken + "': not valid JSON: parse error at line 2, column"))
      << b.output;
  EXPECT_FALSE(has(b, "json.exception")) << b.output;
}

// A latency of 1e308 s once printed "inf ms (-nan)": every number entering the model is checked
// against a finite range, named by its flag or JSON field.
TEST_F(ModelCli, AbsurdModelInputsAreRefusedByName) {
  const std::pair<std::string, std::string> cases[] = {
      {"--inter-latency 1e308s", "--inter-latency: duration '1e308s' = 1e+308 seconds is out of "
                                 "range; allowed: 0 .. 60 s"},
      {"--inter 1e30gbit", "--inter: rate '1e30gbit'"},
      {"--intra 1bit", "allowed: 1 kbit/s .. 1 Pbit/s"},
      {"--sweep-bandwidth 1gbit,1e20gbit", "--sweep-bandwidth: rate '1e20gbit'"},
      {"--lambda nan", "--lambda: nan is not allowed; allowed: a finite number in 1 .. 10"},
      {"--bucket-mb inf", "--bucket-mb: inf is not allowed"},
      {"--cost-scale inf", "--cost-scale: inf is not allowed"},
      {"--cost-scale nan", "--cost-scale: nan is not allowed"},
      {"--workers 2000000", "--workers"},
  };
  for (const auto& [flags, message] : cases) {
    const Result r = run_cli("simulate --profile resnet50 " + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_TRUE(has(r, message)) << flags << ": " << r.output;
    EXPECT_FALSE(has(r, "inf ms")) << flags << ": " << r.output;
  }

  json cluster = {{"workers", 4}, {"inter", {{"bandwidth", "1gbit"}, {"latency", "1e308s"}}}};
  std::string file = write("latency.json", cluster);
  Result r = run_cli("simulate --profile resnet50 --cluster " + file);
  EXPECT_TRUE(has(r, "cluster file '" + file + "': cluster: inter.latency: duration '1e308s'"))
      << r.output;
  cluster["inter"]["latency"] = 1e308;  // a plain number of seconds
  file = write("number.json", cluster);
  r = run_cli("simulate --profile resnet50 --cluster " + file);
  EXPECT_TRUE(has(r, "inter.latency = 1e+308 seconds is out of range")) << r.output;

  json profile = unseen_profile();
  profile["backward_ms"] = 1e308;
  r = run_cli("simulate --profile " + write("slow.json", profile));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r, "backward_ms must be a non-negative number of milliseconds up to 86400000"))
      << r.output;
}

TEST_F(ModelCli, EmptyCodecListItemsAreRefused) {
  for (const std::string command : {"plan --workers 4", "simulate", "utility"}) {
    const Result r = run_cli(command + " --profile resnet50 --codecs 'fp16,,none'");
    EXPECT_NE(r.exit_code, 0) << command;
    EXPECT_TRUE(has(r, "--codecs: 'fp16,,none' has an empty item")) << command << ": " << r.output;
  }
}

TEST_F(ModelCli, UtilityPrintsTimesAndCrossovers) {
  const std::string out = path("utility.json");
  const Result r = run_cli(
      "utility --profile resnet50 --workers 8 --bandwidths 1gbit,100gbit "
      "--codecs fp16,signsgd --json " +
      out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r, "syncSGD")) << r.output;
  const json doc = read(out);
  EXPECT_EQ(doc["rows"].size(), 2u * 2u * 2u);  // bandwidths x methods x (serial, overlapped)
  EXPECT_EQ(doc["crossovers"].size(), 2u * 2u);
}

TEST_F(ModelCli, UtilityRefusesABadTail) {
  const Result r = run_cli("utility --profile resnet50 --tail sideways");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r, "--tail")) << r.output;
}

}  // namespace
