// libFuzzer target: arbitrary text read as codec costs (CodecCosts::from_json, as --codec-costs
// FILE does) and as `gradcomp bench codecs --json` output (CodecCosts::fit_bench) must give a
// gradcomp::Error or costs; costs from_json accepts must read back from their own to_json.
#include <nlohmann/json.hpp>

#include "gradcomp/json_text.h"
#include "fuzz_input.h"
#include "gradcomp/model/cost_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradcomp;
  nlohmann::json root;
  try {
    root = parse_json_text(fuzz::as_text(data, size), "codec costs");
  } catch (const Error&) {
    return 0;
  }
  fuzz::expect_error_or_success([&] {
    const auto costs = model::CodecCosts::from_json(root);
    try {
      (void)model::CodecCosts::from_json(costs.to_json());
    } catch (const Error&) {
      fuzz::finding("accepted codec costs are rejected when read back from their own JSON");
    }
  });
  fuzz::expect_error_or_success([&] { (void)model::CodecCosts::fit_bench(root); });
  return 0;
}
