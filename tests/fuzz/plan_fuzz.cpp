// libFuzzer target: arbitrary text read as a plan (Plan::parse: JSON syntax, from_json, then
// validate) must give a gradcomp::Error or a plan; a plan it accepts must survive its own
// canonical JSON unchanged (same plan, same hash), since ranks compare plans by that hash.
#include <nlohmann/json.hpp>

#include "fuzz_input.h"
#include "gradcomp/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradcomp;
  fuzz::expect_error_or_success([&] {
    const Plan plan = Plan::parse(fuzz::as_text(data, size));
    const Plan again = Plan::parse(plan.to_json().dump());
    if (!(again == plan) || again.hash() != plan.hash()) {
      fuzz::finding("an accepted plan does not read back the same from its own JSON");
    }
  });
  return 0;
}
