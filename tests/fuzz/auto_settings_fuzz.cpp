// libFuzzer target: arbitrary text read as compression="auto"'s settings (the JSON syntax, then
// AutoSettings::from_json, as the C++ example's --auto and Python's auto= dict are read) must
// give a gradcomp::Error or settings, which from_json has validated (a wrong type included:
// nlohmann's own type_error is not one, and would escape as a finding).
#include <nlohmann/json.hpp>

#include "fuzz_input.h"
#include "gradcomp/json_text.h"
#include "gradcomp/scheduler.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradcomp;
  fuzz::expect_error_or_success([&] {
    const nlohmann::json given = parse_json_text(fuzz::as_text(data, size), "auto settings");
    (void)AutoSettings::from_json(given);
  });
  return 0;
}
