// libFuzzer target: arbitrary text read as a profile (the JSON syntax, then Profile::from_json,
// as load_profile does) must give a gradcomp::Error or a profile; a profile it accepts must be
// readable again from its own to_json (the planner saves and reloads profiles).
#include <nlohmann/json.hpp>

#include "gradcomp/json_text.h"
#include "fuzz_input.h"
#include "gradcomp/model/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradcomp;
  fuzz::expect_error_or_success([&] {
    const auto profile = model::Profile::from_json(parse_json_text(fuzz::as_text(data, size), "profile"));
    try {
      (void)model::Profile::from_json(profile.to_json());
    } catch (const Error&) {
      fuzz::finding("an accepted profile is rejected when read back from its own JSON");
    }
  });
  return 0;
}
