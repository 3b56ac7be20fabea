// The recommended column: which options the accuracy tables back (gradcomp/recommended.h).
#include "gradcomp/recommended.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradcomp/plan.h"

namespace gradcomp {

const std::vector<Recommendation>& recommendations() {
  // codec, option as measured, SGD (Fashion-MNIST, 5 epochs), AdamW (language model at 2 and 4
  // ranks), whether the SGD row changed the optimizer, the option that held under LANS where
  // AdamW lost. Update together with docs/accuracy.md, docs/accuracy-lm.md,
  // docs/accuracy-lm-4ranks.md and docs/optimizers-accuracy.md (a test compares).
  static const std::vector<Recommendation> table = {
      {"fp16", "fp16", true, true},
      {"bf16", "bf16", true, true},
      {"qsgd", "qsgd:levels=15,block=512", true, true},
      {"terngrad", "terngrad", false, false},
      {"natural", "natural", true, true},
      {"dither", "dither", true, true},
      {"signsgd", "signsgd", false, false, true},
      {"efsignsgd", "efsignsgd|ef||start=469", true, false},
      {"signum", "signum:momentum=0.9", false, false, true},
      {"onebit", "onebit|ef||start=469", true, false, false, "onebit:block=256|ef|twoway"},
      {"topk", "topk:ratio=0.01|ef", true, false},
      {"randomk", "randomk:ratio=0.01|ef", false, false},
      {"dgc", "dgc:ratio=0.001,stage_steps=117|ef", true, false},
      {"threshold", "threshold:tau=0.01|ef", true, false},
      {"powersgd", "powersgd:rank=4|ef", true, false},  // held at 2 ranks, not at 4
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
  switch (family) {
    case OptimizerFamily::kSgd: return r.sgd;
    case OptimizerFamily::kAdam: return r.adam;
    case OptimizerFamily::kLans: return r.adam || !r.lans.empty();
  }
  return false;
}

bool recommended(const Recommendation& r) {
  return r.sgd && r.adam && !r.changes_optimizer;
}

namespace {

// An option as it would be written: "topk:ratio=0.01|ef|allgather|start=500".
std::string option_text(const Option& o) {
  return fmt::format("{}|{}|{}{}", o.codec, o.feedback, o.route,
                     o.start_step > 0 ? fmt::format("|start={}", o.start_step) : "");
}

// "dgc:momentum=0.5" -> "dgc": the kind of feedback, whatever its settings.
std::string feedback_name(const std::string& spec) { return spec.substr(0, spec.find(':')); }

// "twoway:server_feedback=ef" -> "twoway".
std::string route_name(const std::string& spec) { return spec.substr(0, spec.find(':')); }

// Under LANS, a codec that lost under AdamW but held in a CLAN recipe: "" when `used` is that
// recipe (codec with its parameters, kind of feedback, route), else why not.
std::string lans_recipe_warning(std::string_view option, const Option& used,
                                const Recommendation& r, std::string_view optimizer) {
  const Option recipe = parse_option(r.lans);
  if (used.codec == recipe.codec && feedback_name(used.feedback) == feedback_name(recipe.feedback) &&
      route_name(used.route) == route_name(recipe.route)) {
    return "";
  }
  return fmt::format(
      "compression '{}' is not recommended with {} as written: {} lost accuracy under "
      "Adam-family optimizers (docs/accuracy-lm.md) and held under LANS only as '{}' (CLAN, "
      "docs/optimizers-accuracy.md)",
      option, optimizer, r.codec, r.lans);
}

std::string warning_for(std::string_view option, const Option& used, OptimizerFamily family,
                        std::string_view optimizer) {
  const Recommendation* r = recommendation_for(used.codec);
  if (r == nullptr) return "";
  if (family == OptimizerFamily::kLans) {
    if (!r->adam && !r->lans.empty()) return lans_recipe_warning(option, used, *r, optimizer);
    family = OptimizerFamily::kAdam;  // otherwise Adam-family evidence decides
  }
  const bool sgd = family == OptimizerFamily::kSgd;
  const char* kind = sgd ? "SGD" : "Adam-family optimizers";
  const char* table =
      sgd ? "docs/accuracy.md" : "docs/accuracy-lm.md at 2 ranks, docs/accuracy-lm-4ranks.md at 4";
  const std::string held = fmt::format("{}", fmt::join(recommended_options({family}), ", "));
  if (!held_under(*r, family)) {
    return fmt::format(
        "compression '{}' is not recommended with {}: {} ({}) lost accuracy under {} in "
        "gradcomp's accuracy tables ({}); these held: {}",
        option, optimizer, r->codec, r->option, kind, table, held);
  }
  const Option measured = parse_option(r->option);
  if (feedback_name(measured.feedback) != feedback_name(used.feedback)) {
    return fmt::format(
        "compression '{}' is not recommended with {} as written: {} held under {} with "
        "feedback '{}' ({} in {}), and feedback '{}' has no such evidence; these held: {}",
        option, optimizer, r->codec, kind, feedback_name(measured.feedback), r->option, table,
        feedback_name(used.feedback), held);
  }
  const uint64_t warm_up = measured.start_step;
  if (warm_up > 0 && used.start_step == 0) {
    return fmt::format(
        "compression '{}' is not recommended with {} as written: {} held under {} only after "
        "an uncompressed warm-up ({}: the first {} steps, a fifth of the run, in {}); add a "
        "4th field 'start=N' with N about a fifth of your steps, e.g. '{}|{}|{}|start=1000'",
        option, optimizer, r->codec, kind, r->option, warm_up, table, used.codec, used.feedback,
        used.route);
  }
  return "";
}

}  // namespace

std::string recommendation_warning(std::string_view option, OptimizerFamily family,
                                   std::string_view optimizer) {
  return warning_for(option, parse_option(std::string(option)), family, optimizer);
}

std::string recommendation_warning(const Option& option, OptimizerFamily family,
                                   std::string_view optimizer) {
  return warning_for(option_text(option), option, family, optimizer);
}

std::vector<std::string> recommended_options(std::initializer_list<OptimizerFamily> families) {
  std::vector<std::string> options{"none"};
  for (const auto& r : recommendations()) {
    const bool held = std::all_of(families.begin(), families.end(),
                                  [&](OptimizerFamily f) { return held_under(r, f); });
    if (!held || r.changes_optimizer) continue;
    // Held under LANS but not under AdamW: only as its CLAN recipe.
    const bool as_recipe = !r.adam && std::find(families.begin(), families.end(),
                                                OptimizerFamily::kLans) != families.end();
    options.push_back(as_recipe ? r.lans : r.option);
  }
  return options;
}

}  // namespace gradcomp
