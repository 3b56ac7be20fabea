// parse_option: the "codec|feedback|route|start=N" short form of an Option.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string_view>

#include "gradcomp/codec.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"
#include "gradcomp/plan.h"

namespace gradcomp {
namespace {

std::vector<std::string> split_bars(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t bar = text.find('|', start);
    parts.push_back(text.substr(start, bar == std::string::npos ? bar : bar - start));
    if (bar == std::string::npos) return parts;
    start = bar + 1;
  }
}

constexpr std::string_view kStartKey = "start=";

// The 4th field, "start=N": Option::start_step, a decimal step number.
uint64_t parse_start(const std::string& text, const std::string& field) {
  const auto fail = [&] {
    throw SpecError(fmt::format("compression '{}': the 4th field '{}' must be 'start=N' with N "
                                "the first compressed step, an integer from 0 to 2^40",
                                text, field));
  };
  if (field.rfind(kStartKey, 0) != 0) fail();
  const std::string digits = field.substr(kStartKey.size());
  if (digits.empty() || digits.size() > 13 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    fail();
  }
  const uint64_t step = std::stoull(digits);
  if (step > (uint64_t{1} << 40)) fail();
  return step;
}

}  // namespace

bool option_names_route(const std::string& text) {
  const auto parts = split_bars(text);
  return parts.size() > 2 && !parts[2].empty();
}

Option parse_option(const std::string& text) {
  const auto parts = split_bars(text);
  if (parts.size() > 4 || parts[0].empty()) {
    throw SpecError(fmt::format(
        "compression '{}' must be 'codec[|feedback[|route[|start=N]]]', e.g. 'fp16' or "
        "'topk:ratio=0.01|ef|allgather|start=500'; codecs: {}",
        text, fmt::join(codec_names(), ", ")));
  }
  Option option;
  option.codec = parts[0];
  const auto codec = make_codec(option.codec);  // SpecError listing the codecs
  if (parts.size() > 1 && !parts[1].empty()) option.feedback = parts[1];
  if (parts.size() > 2 && !parts[2].empty()) {
    option.route = parts[2];
  } else {
    option.route = codec->traits().summable ? "allreduce" : "allgather";
  }
  if (parts.size() > 3) option.start_step = parse_start(text, parts[3]);
  // The feedback and route are checked with the whole option; what is wrong is said of the
  // text the user wrote (SpecError, listing what is available), not of a plan's bucket.
  try {
    make_feedback(option.feedback);
    check_route(option);
  } catch (const Error& e) {
    throw SpecError(fmt::format("compression '{}': {}", text, e.what()));
  }
  return option;
}

}  // namespace gradcomp
