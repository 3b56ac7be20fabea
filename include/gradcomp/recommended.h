// Which compression options the accuracy tables back, and for which optimizers
// (docs/recommended.md). Evidence under SGD: within 0.5 pp of the uncompressed test accuracy on
// the Fashion-MNIST CNN (5 epochs, seed 0 and the mean over three seeds, docs/accuracy.md);
// under Adam-family optimizers: within 2% of the uncompressed validation loss on the small
// language model under AdamW at 2 ranks (docs/accuracy-lm.md) and at 4 ranks, on seed 0 and
// the mean over five seeds (docs/accuracy-lm-4ranks.md). An option is *recommended* only with
// both, and only those are defaults (the planner's, the main job's, the examples').
// tests/python/test_recommended.py checks the table against those documents, so neither can
// change without the other.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace gradcomp {

struct Option;  // gradcomp/plan.h

// The optimizers a recommendation is measured under.
enum class OptimizerFamily {
  kSgd,   // SGD with or without momentum (the CNN's table)
  kAdam,  // Adam, AdamW and their kin: a per-coordinate normalised step (the language model's)
  // LANS (gradcomp's): Adam's moments and a layer-wise trust ratio. What held under Adam-family
  // optimizers holds for it, and so do the CLAN recipes measured with it
  // (docs/optimizers-accuracy.md). LAMB counts as Adam-family: it has no such evidence.
  kLans,
};

struct Recommendation {
  std::string codec;   // the codec's name: "topk"
  std::string option;  // the option measured: "topk:ratio=0.01|ef"
  bool sgd = false;    // held under SGD
  bool adam = false;   // held under AdamW (at 2 and 4 ranks)
  // Its SGD row changed the optimizer (signsgd, signum: learning rate 0.001, no momentum):
  // recommended with that change only, so never a default candidate.
  bool changes_optimizer = false;
  // The option that held under LANS (a CLAN recipe) when the codec lost under AdamW, or "".
  std::string lans = {};
};

// One entry per codec other than none, in the codec table's order.
const std::vector<Recommendation>& recommendations();

// Whether r held under `family` (under kLans: under Adam-family optimizers, or as r.lans).
bool held_under(const Recommendation& r, OptimizerFamily family);

// Whether r is recommended: it held under SGD and under Adam-family optimizers, with the
// optimizer unchanged. Those that held under one family only are used under it without a
// warning, but never as a default.
bool recommended(const Recommendation& r);

// The entry of option's codec ("topk:ratio=0.05|ef" -> topk's), or nullptr for none.
const Recommendation* recommendation_for(std::string_view option);

// What to tell someone who compresses with `option` under an optimizer of `family` (named
// `optimizer`, e.g. "AdamW"): "" when the tables back it; otherwise why not, naming the table
// and what held. Not backed: the codec lost under that family, it held with another kind of
// feedback than `option`'s (dgc held with ef, not with DGC's own momentum), or only after an
// uncompressed warm-up (a start=N field) that `option` lacks. Throws SpecError for a bad option.
std::string recommendation_warning(std::string_view option, OptimizerFamily family,
                                   std::string_view optimizer);
// The same for a parsed option (a plan's bucket), written out in full in the message.
std::string recommendation_warning(const Option& option, OptimizerFamily family,
                                   std::string_view optimizer);

// The options that held under every one of `families` and need no change of the optimizer,
// "none" first (the planner's default candidates): {kSgd, kAdam} for a plan that must suit both.
std::vector<std::string> recommended_options(std::initializer_list<OptimizerFamily> families);

}  // namespace gradcomp
