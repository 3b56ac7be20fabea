// compression="auto"'s settings read from a user's JSON object (Python's auto= dict, the
// examples' --auto): each known key sets its field, anything else is an error that names it.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"
#include "gradcomp/scheduler.h"

namespace gradcomp {
namespace {

using nlohmann::json;

std::string error_of(const json& given) {
  try {
    AutoSettings::from_json(given);
  } catch (const SpecError& e) {
    return e.what();
  }
  return "";
}

TEST(AutoSettings, EachKeySetsItsField) {
  const AutoSettings s = AutoSettings::from_json(json::parse(R"({
      "candidates": ["powersgd:rank=4|ef", "fp16"], "warmup_steps": 12, "profile_steps": 4,
      "trial_steps": 3, "stop_after": 0, "stop_margin": 0.5, "max_proposals": 2,
      "refine_proposals": 1, "runoff": 0, "drift": 0.3, "check_every": 7, "drift_checks": 2,
      "link_check_every": 0, "link_change": 3, "residual_growth": 5.5, "residual_checks": 4,
      "verbose": false})"));
  EXPECT_EQ(s.candidates, (std::vector<std::string>{"powersgd:rank=4|ef", "fp16"}));
  EXPECT_EQ(s.warmup_steps, 12u);
  EXPECT_EQ(s.profile_steps, 4u);
  EXPECT_EQ(s.trial_steps, 3u);
  EXPECT_EQ(s.stop_after, 0u);
  EXPECT_EQ(s.stop_margin, 0.5);
  EXPECT_EQ(s.max_proposals, 2u);
  EXPECT_EQ(s.refine_proposals, 1u);
  EXPECT_EQ(s.runoff, 0u);
  EXPECT_EQ(s.drift, 0.3);
  EXPECT_EQ(s.check_every, 7u);
  EXPECT_EQ(s.drift_checks, 2u);
  EXPECT_EQ(s.link_check_every, 0u);
  EXPECT_EQ(s.link_change, 3);
  EXPECT_EQ(s.residual_growth, 5.5);
  EXPECT_EQ(s.residual_checks, 4u);
  EXPECT_FALSE(s.verbose);
  EXPECT_EQ(AutoSettings::known_keys().size(), 17u);
}

TEST(AutoSettings, WhatIsNotGivenKeepsTheStartingValue) {
  AutoSettings start;
  start.candidates = {"fp16"};
  start.min_compress_elements = 10;
  const AutoSettings s = AutoSettings::from_json(json{{"trial_steps", 4}}, start);
  EXPECT_EQ(s.candidates, start.candidates);
  EXPECT_EQ(s.min_compress_elements, 10u);
  EXPECT_EQ(s.trial_steps, 4u);
  EXPECT_EQ(s.warmup_steps, AutoSettings{}.warmup_steps);
  EXPECT_EQ(AutoSettings::from_json(nullptr, start).candidates, start.candidates);
}

TEST(AutoSettings, AnUnknownKeyIsNamedWithTheKnownOnes) {
  const std::string error = error_of(json{{"warmup", 10}});
  EXPECT_NE(error.find("unknown setting 'warmup'"), std::string::npos) << error;
  EXPECT_NE(error.find("warmup_steps"), std::string::npos) << error;
  // The front end's own fields are not the user's to set here.
  EXPECT_NE(error_of(json{{"bucket_bytes", 1}}).find("unknown setting 'bucket_bytes'"),
            std::string::npos);
}

TEST(AutoSettings, AValueOfTheWrongTypeIsNamed) {
  EXPECT_NE(error_of(json{{"warmup_steps", "20"}}).find("warmup_steps is \"20\"; a whole number"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"warmup_steps", 20.5}}).find("warmup_steps is 20.5"), std::string::npos);
  EXPECT_NE(
      error_of(json{{"trial_steps", -3}}).find("trial_steps is -3; a whole number, 0 or more"),
      std::string::npos);
  EXPECT_NE(error_of(json{{"drift", "high"}}).find("drift is \"high\"; a number"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"verbose", 1}}).find("verbose is 1; true or false"), std::string::npos);
  // A string is not a list of options (in Python, list("fp16") would be four of them).
  EXPECT_NE(error_of(json{{"candidates", "fp16"}}).find("candidates is \"fp16\"; a list"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"candidates", json::array({"fp16", 3})}}).find("a list of options"),
            std::string::npos);
  EXPECT_NE(error_of(json::array({1, 2})).find("a JSON object of settings"), std::string::npos);
}

TEST(AutoSettings, TheResultIsValidated) {
  EXPECT_NE(error_of(json{{"candidates", {"nosuchcodec"}}}).find("nosuchcodec"), std::string::npos);
  EXPECT_NE(error_of(json{{"warmup_steps", 3}, {"profile_steps", 5}}).find("warmup_steps (3)"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"link_change", 1}}).find("link_change is 1"), std::string::npos);
}

}  // namespace
}  // namespace gradcomp
