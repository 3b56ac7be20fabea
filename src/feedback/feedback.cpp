// The registry of feedback kinds.
#include "gradcomp/feedback.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "feedback/factories.h"
#include "gradcomp/error.h"

namespace gradcomp {
namespace {

struct Entry {
  const char* name;
  std::unique_ptr<Feedback> (*make)(Spec&);
};

constexpr Entry kFeedbacks[] = {
    {"none", make_no_feedback},
    {"ef", make_error_feedback},
    {"dgc", make_dgc_feedback},
    {"nesterov", make_nesterov_feedback},
};

}  // namespace

namespace {

[[noreturn]] void no_parts(const Feedback& f) {
  throw Error(fmt::format("feedback '{}' cannot compensate in parts (Feedback::in_parts is false)",
                          f.spec()));
}

}  // namespace

void Feedback::begin_parts(size_t, const StepInfo&) { no_parts(*this); }
void Feedback::compensate_part(size_t, std::span<const float>) { no_parts(*this); }
std::span<const float> Feedback::end_parts() { no_parts(*this); }

const std::vector<std::string>& feedback_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& e : kFeedbacks) v.emplace_back(e.name);
    return v;
  }();
  return names;
}

std::unique_ptr<Feedback> make_feedback(const std::string& text) {
  Spec spec = Spec::parse(text, "feedback");
  for (const auto& e : kFeedbacks) {
    if (spec.name() == e.name) {
      auto feedback = e.make(spec);
      spec.finish();
      return feedback;
    }
  }
  throw SpecError(fmt::format("unknown feedback '{}'; available: {}", spec.name(),
                              fmt::join(feedback_names(), ", ")));
}

}  // namespace gradcomp
