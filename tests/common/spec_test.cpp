#include "gradcomp/spec.h"

#include <gtest/gtest.h>

#include <limits>

#include "gradcomp/error.h"
#include "support/codec_testing.h"

namespace gradcomp {
namespace {

using testing::error_text;

TEST(Spec, ParsesNameAndParameters) {
  Spec s = Spec::parse("topk: ratio = 0.01 ,k=5");
  EXPECT_EQ(s.name(), "topk");
  EXPECT_TRUE(s.has("ratio"));
  EXPECT_DOUBLE_EQ(s.get_double("ratio", 1, 0, 1, true), 0.01);
  EXPECT_EQ(s.get_int("k", 0, 0, 100), 5);
  s.finish();
}

TEST(Spec, NameOnlyAndDefaults) {
  Spec s = Spec::parse("qsgd");
  EXPECT_EQ(s.get_int("levels", 16, 1, 1000), 16);
  EXPECT_TRUE(s.get_bool("flag", true));
  EXPECT_EQ(s.get_choice("norm", "max", {"max", "l2"}), "max");
  s.finish();
}

TEST(Spec, RangeErrorsNameCodecParameterAndAllowedRange) {
  Spec s = Spec::parse("topk:ratio=1.5");
  const auto msg = error_text([&] { s.get_double("ratio", 0.01, 0, 1, true, false); });
  EXPECT_EQ(msg, "codec 'topk': parameter 'ratio' = 1.5 is out of range; allowed: (0, 1]");
  Spec zero = Spec::parse("topk:ratio=0");
  EXPECT_NE(error_text([&] { zero.get_double("ratio", 0.01, 0, 1, true); }).find("(0, 1]"),
            std::string::npos);
  Spec lv = Spec::parse("qsgd:levels=0");
  EXPECT_EQ(error_text([&] { lv.get_int("levels", 16, 1, 32767); }),
            "codec 'qsgd': parameter 'levels' = 0 is out of range; allowed: an integer in [1, 32767]");
}

TEST(Spec, NotANumber) {
  Spec s = Spec::parse("qsgd:levels=abc");
  EXPECT_NE(error_text([&] { s.get_int("levels", 16, 1, 100); }).find("is not an integer"),
            std::string::npos);
  Spec f = Spec::parse("topk:ratio=0.1x");
  EXPECT_NE(error_text([&] { f.get_double("ratio", 0.1, 0, 1); }).find("is not a number"),
            std::string::npos);
  Spec nan = Spec::parse("topk:ratio=nan");
  EXPECT_NE(error_text([&] { nan.get_double("ratio", 0.1, 0, 1); }).find("is not a number"),
            std::string::npos);
}

TEST(Spec, UnknownKeyListsAllowedOnes) {
  Spec s = Spec::parse("qsgd:levels=4,bogus=1");
  s.get_int("levels", 16, 1, 100);
  s.get_choice("norm", "l2", {"l2"});
  EXPECT_EQ(error_text([&] { s.finish(); }),
            "codec 'qsgd': unknown parameter 'bogus'; allowed: levels, norm");
}

TEST(Spec, Choices) {
  Spec s = Spec::parse("dither:partition=cubic", "codec");
  EXPECT_EQ(error_text([&] { s.get_choice("partition", "linear", {"linear", "natural"}); }),
            "codec 'dither': parameter 'partition' = 'cubic' is not allowed; allowed: linear, natural");
  Spec b = Spec::parse("ef:lr_correction=yes", "feedback");
  EXPECT_NE(error_text([&] { b.get_bool("lr_correction", false); }).find("feedback 'ef'"),
            std::string::npos);
  Spec one = Spec::parse("ef:lr_correction=1", "feedback");
  EXPECT_TRUE(one.get_bool("lr_correction", false));
}

TEST(Spec, MalformedText) {
  EXPECT_THROW(Spec::parse(""), SpecError);
  EXPECT_THROW(Spec::parse(":a=1"), SpecError);
  EXPECT_THROW(Spec::parse("topk:ratio"), SpecError);
  EXPECT_THROW(Spec::parse("topk:=3"), SpecError);
  EXPECT_THROW(Spec::parse("topk:ratio=0.1,ratio=0.2"), SpecError);
  EXPECT_THROW(Spec::parse("topk:ratio=0.1,,"), SpecError);
}

TEST(Spec, FormatNumberRoundTrips) {
  EXPECT_EQ(format_number(0.01), "0.01");
  EXPECT_EQ(format_number(16), "16");
  EXPECT_EQ(format_number(1e6), "1000000");
  EXPECT_EQ(format_number(-3), "-3");
  EXPECT_EQ(format_number(1e-7), "1e-07");
  EXPECT_EQ(format_number(0.1 + 0.2), "0.30000000000000004");
}

}  // namespace
}  // namespace gradcomp
