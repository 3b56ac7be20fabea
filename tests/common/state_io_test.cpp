#include "common/state_io.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace gradcomp {
namespace {

constexpr StateKind kKind{"TEST", 2, 3};

std::vector<std::byte> sample(uint32_t version = 3) {
  StateWriter out(kKind, version);
  const std::vector<std::byte> part = {std::byte{7}, std::byte{8}};
  const std::vector<float> values = {1.5f, -2.0f};
  out.put(uint64_t{42}).put(2.5).blob(part).floats(values);
  return std::move(out).finish();
}

std::string state_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(StateIo, WritesTheMagicTheVersionAndTheFieldsInOrder) {
  const auto bytes = sample();
  ASSERT_EQ(bytes.size(), 4u + 4 + 8 + 8 + 8 + 2 + 8);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), 4), "TEST");
  StateReader in("test state", bytes, kKind);
  EXPECT_EQ(in.version(), 3u);
  EXPECT_EQ(in.get<uint64_t>("a count"), 42u);
  EXPECT_EQ(in.get<double>("a scale"), 2.5);
  const auto part = in.blob("a part");
  ASSERT_EQ(part.size(), 2u);
  EXPECT_EQ(part[1], std::byte{8});
  std::vector<float> values(2);
  in.floats(values, "values");
  EXPECT_EQ(values, (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(in.left(), 0u);
  EXPECT_NO_THROW(in.expect_end("the values"));
}

TEST(StateIo, AForeignStateIsAnErrorThatShowsItsMagic) {
  auto bytes = sample();
  bytes[0] = std::byte{'X'};
  const auto text = state_error_of([&] { StateReader("test state", bytes, kKind); });
  EXPECT_NE(text.find("test state: not a \"TEST\" state: its magic is \"XEST\""),
            std::string::npos)
      << text;
  const std::vector<std::byte> two = {std::byte{'T'}, std::byte{1}};
  EXPECT_NE(state_error_of([&] {
              StateReader("test state", two, kKind);
            }).find("\"T\\x01\" (only 2 bytes)"),
            std::string::npos);
}

TEST(StateIo, VersionsOutsideTheReadRangeAreRefused) {
  EXPECT_EQ(StateReader("s", sample(2), kKind).version(), 2u);
  for (uint32_t version : {1u, 4u, 99u}) {
    const auto text = state_error_of([&] { StateReader("s", sample(version), kKind); });
    EXPECT_NE(text.find(fmt::format("version {} is not supported; this build reads versions 2 "
                                    "to 3",
                                    version)),
              std::string::npos)
        << text;
  }
}

TEST(StateIo, EveryTruncationIsAnErrorNamingTheField) {
  const auto bytes = sample();
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    const std::span<const std::byte> part(bytes.data(), cut);
    const auto text = state_error_of([&] {
      StateReader in("s", part, kKind);
      in.get<uint64_t>("a count");
      in.get<double>("a scale");
      in.blob("a part");
      std::vector<float> values(2);
      in.floats(values, "values");
    });
    EXPECT_NE(text.find(cut < 8 ? "s: " : "truncated"), std::string::npos) << cut << ": " << text;
  }
}

TEST(StateIo, ABlobLongerThanTheStateIsAnErrorNotAnOverread) {
  StateWriter out(kKind, 3);
  out.put(uint64_t{1} << 62);  // a blob length far beyond the bytes that follow
  const auto bytes = std::move(out).finish();
  StateReader in("s", bytes, kKind);
  EXPECT_NE(state_error_of([&] { in.blob("a part"); }).find("truncated: a part needs"),
            std::string::npos);
}

TEST(StateIo, TrailingBytesAreAnError) {
  auto bytes = sample();
  bytes.push_back(std::byte{0});
  StateReader in("s", bytes, kKind);
  in.take(bytes.size() - 9, "the fields");
  EXPECT_NE(
      state_error_of([&] { in.expect_end("the values"); }).find("s: 1 bytes after the values"),
      std::string::npos);
}

}  // namespace
}  // namespace gradcomp
