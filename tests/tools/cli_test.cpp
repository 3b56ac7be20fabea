// The gradcomp command, run as a user would: its output, its JSON and its errors.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <sys/wait.h>

#include "gradcomp/codec.h"
#include "support/run_cli.h"

namespace {

using Result = gradcomp::testing::CliResult;
using gradcomp::testing::run_cli;

TEST(Cli, ListsEveryCodec) {
  const Result r = run_cli("codecs");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto& name : gradcomp::codec_names()) {
    EXPECT_NE(r.output.find("\n" + name + " "), std::string::npos) << name;
  }
}

TEST(Cli, BenchWritesJsonWithMemcpyBaseline) {
  const auto path = std::filesystem::temp_directory_path() / "gradcomp_cli_test.json";
  const Result r =
      run_cli("bench codecs --codecs 'none;topk:ratio=0.01' --sizes 10,12 --min-time 0 --json " +
              path.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("memcpy"), std::string::npos);
  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  ASSERT_EQ(doc["results"].size(), 4u);
  ASSERT_EQ(doc["baselines"].size(), 2u);
  for (const auto& row : doc["results"]) {
    EXPECT_GT(row["encode_gbps"].get<double>(), 0);
    EXPECT_GT(row["decode_gbps"].get<double>(), 0);
    EXPECT_GT(row["fill_decode_gbps"].get<double>(), 0);
    EXPECT_GT(row["decode_into_gbps"].get<double>(), 0);
    EXPECT_GT(row["memcpy_gbps"].get<double>(), 0);
  }
  EXPECT_EQ(doc["results"][1]["spec"], "topk:ratio=0.01");
  EXPECT_GT(doc["results"][1]["compression_ratio"].get<double>(), 10);
  std::filesystem::remove(path);
}

TEST(Cli, BadSpecIsAClearError) {
  const Result r = run_cli("bench codecs --codecs 'topk:ratio=1.5' --sizes 10");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("codec 'topk': parameter 'ratio' = 1.5 is out of range"),
            std::string::npos)
      << r.output;
  const Result unknown = run_cli("bench codecs --codecs zip --sizes 10");
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.output.find("available codecs: none, fp16"), std::string::npos)
      << unknown.output;
}

TEST(Cli, BadOptionIsRejected) {
  const Result r = run_cli("bench codecs --sizes 99");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--sizes"), std::string::npos) << r.output;
}

// CLI11 drops empty list items, so an empty list once took the next flag as its value
// ("unknown codec '--sizes'"). Every list option now refuses an empty list or item by name.
TEST(Cli, EmptyListItemsAreRefusedAndNoFlagIsSwallowed) {
  for (const char* args : {"bench codecs --codecs ';' --sizes 10",
                           "bench codecs --codecs 'none;;fp16' --sizes 10",
                           "bench codecs --codecs '' --sizes 10"}) {
    const Result r = run_cli(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.output.find("--codecs: item "), std::string::npos) << args << ": " << r.output;
    EXPECT_NE(r.output.find("is empty"), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find("unknown codec"), std::string::npos) << args << ": " << r.output;
  }
  const Result sizes = run_cli("bench codecs --sizes , --codecs none");
  EXPECT_NE(sizes.exit_code, 0);
  EXPECT_NE(sizes.output.find("--sizes: item 1 of ',' is empty"), std::string::npos)
      << sizes.output;
  // Several arguments still make one list, and the flag after them is not one of them.
  const Result two = run_cli("bench codecs --codecs none zip --sizes 10");
  EXPECT_NE(two.output.find("unknown codec 'zip'"), std::string::npos) << two.output;
  const Result cases = run_cli("bench routes --cases ';' --sizes 10");
  EXPECT_NE(cases.exit_code, 0);
  EXPECT_NE(cases.output.find("--cases: item 1"), std::string::npos) << cases.output;
}

TEST(Cli, NumberOptionsMustBeFinite) {
  for (const char* value : {"nan", "inf", "-1"}) {
    const Result r =
        run_cli(std::string("bench codecs --codecs none --sizes 10 --min-time ") + value);
    EXPECT_NE(r.exit_code, 0) << value;
    EXPECT_NE(r.output.find("--min-time: " + std::string(value) + " is not allowed; allowed: "
                            "a finite number in 0 .. 60"),
              std::string::npos)
        << r.output;
  }
}

}  // namespace
