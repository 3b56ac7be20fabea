// The recommended column: which options the accuracy tables back (gradcomp/recommended.h).
#include "gradcomp/recommended.h"

#include <algorithm>

#include "gradcomp/plan.h"

namespace gradcomp {

const std::vector<Recommendation>& recommendations() {
  // codec, option as measured, SGD (Fashion-MNIST, 5 epochs), AdamW (language model), whether
  // the SGD row changed the optimizer.
  // Update together with docs/accuracy-5-epochs.md and docs/accuracy-lm.md (a test compares).
  static const std::vector<Recommendation> table = {
      {"fp16", "fp16", true, true},
      {"bf16", "bf16", true, true},
      {"qsgd", "qsgd:levels=15,block=512", true, true},
      {"terngrad", "terngrad", false, false},
      {"natural", "natural", true, true},
      {"dither", "dither", true, true},
      {"signsgd", "signsgd", false, false, true},
      {"efsignsgd", "efsignsgd|ef", false, false},
      {"signum", "signum:momentum=0.9", false, false, true},
      {"onebit", "onebit|ef", false, false},
      {"topk", "topk:ratio=0.01|ef", true, false},
      {"randomk", "randomk:ratio=0.01|ef", false, false},
      {"dgc", "dgc:ratio=0.001,stage_steps=117|dgc", false, false, true},
      {"threshold", "threshold:tau=0.01|ef", true, false},
      {"powersgd", "powersgd:rank=4|ef", true, true},
      {"intq", "intq:bits=8", true, true},
  };
  return table;
}

const Recommendation* recommendation_for(std::string_view option) {
  const std::string codec = parse_option(std::string(option)).codec;
  const std::string name = codec.substr(0, codec.find(':'));
  for (const auto& r : recommendations()) {
    if (r.codec == name) return &r;
  }
  return nullptr;
}

bool held_under(const Recommendation& r, OptimizerFamily family) {
  return family == OptimizerFamily::kSgd ? r.sgd : r.adam;
}

std::vector<std::string> recommended_options(std::initializer_list<OptimizerFamily> families) {
  std::vector<std::string> options{"none"};
  for (const auto& r : recommendations()) {
    const bool held = std::all_of(families.begin(), families.end(),
                                  [&](OptimizerFamily f) { return held_under(r, f); });
    if (held && !r.changes_optimizer) options.push_back(r.option);
  }
  return options;
}

}  // namespace gradcomp
