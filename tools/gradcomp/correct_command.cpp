// `gradcomp correct`: the auto scheduler's fit replayed offline. It reads a report auto wrote
// (`auto_report()` as JSON: the calibrated profile, link and codec costs, and each search's
// trials), fits the model::Correction to one search's trials as auto does, and prints each
// trial's predicted step before and after the correction against the one measured. With the
// same code as the run, it gives back the run's correction; with newer code, what the newer fit
// would have learnt from the same steps.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "gradcomp/error.h"
#include "gradcomp/json_text.h"
#include "gradcomp/model/correction.h"
#include "gradcomp/model/profile.h"
#include "gradcomp/model/simulator.h"
#include "model_commands.h"
#include "model_options.h"

namespace gradcomp::tools {
namespace {

using nlohmann::json;

struct CorrectOptions {
  std::string report_path;
  int decision = 0;
  std::string json_path;
};

struct Report {
  model::Profile profile;
  model::Cluster cluster;
  model::CodecCosts codecs;
  std::vector<std::string> names;            // each trial's
  std::vector<std::pair<Plan, double>> trials;  // plan, measured seconds
};

// doc[key], which must be there and hold what `is_kind` accepts (`kind` names it for the error).
const json& field(const json& doc, const std::string& key, const std::string& where,
                  bool (json::*is_kind)() const noexcept, const char* kind) {
  if (!doc.is_object() || !doc.contains(key)) {
    throw Error(fmt::format("{}: '{}' is missing", where, key));
  }
  const json& value = doc.at(key);
  if (!(value.*is_kind)()) {
    throw Error(fmt::format("{}: '{}' must be {}, not {}", where, key, kind, value.dump()));
  }
  return value;
}

const json& object(const json& doc, const std::string& key, const std::string& where) {
  return field(doc, key, where, &json::is_object, "an object");
}

Report read_report(const CorrectOptions& o) {
  const std::string where = fmt::format("auto report '{}'", o.report_path);
  const json doc = read_json_file(o.report_path, "auto report");
  Report r;
  r.profile = with_context(where + ": profile", [&] {
    return model::Profile::from_json(object(doc, "profile", where));
  });
  r.cluster = with_context(where + ": cluster", [&] {
    return model::Cluster::from_json(object(doc, "cluster", where));
  });
  r.codecs = with_context(where + ": codec_costs", [&] {
    return model::CodecCosts::from_json(object(doc, "codec_costs", where));
  });
  const json& decisions = field(doc, "decisions", where, &json::is_array, "an array");
  if (o.decision >= static_cast<int>(decisions.size())) {
    throw Error(fmt::format("{}: --decision {} but the report has {} decisions", where,
                            o.decision, decisions.size()));
  }
  const std::string at = fmt::format("{}: decisions[{}]", where, o.decision);
  const json& candidates =
      field(decisions[o.decision], "candidates", at, &json::is_array, "an array");
  for (size_t i = 0; i < candidates.size(); ++i) {
    const std::string here = fmt::format("{}.candidates[{}]", at, i);
    const json& c = candidates[i];
    const double ms = field(c, "measured_ms", here, &json::is_number, "a number").get<double>();
    if (!(ms > 0)) continue;  // proposed but not measured
    r.names.push_back(field(c, "name", here, &json::is_string, "a string").get<std::string>());
    r.trials.emplace_back(
        with_context(here + ".plan", [&] { return Plan::from_json(object(c, "plan", here)); }),
        ms / 1e3);
  }
  if (r.trials.empty()) throw Error(fmt::format("{}: no measured trial to fit", at));
  return r;
}

double predicted(const Report& r, const model::Correction& c, const Plan& plan) {
  return model::simulate(c.applied(r.profile), plan, c.cost_model(r.cluster, r.codecs),
                         c.simulator(plan))
      .iteration_s;
}

int run_correct(const CorrectOptions& o) {
  const Report r = read_report(o);
  const model::Correction fit = model::fit_correction(r.profile, r.cluster, r.codecs, r.trials);
  fmt::print("{} trials of decision {}\ncorrection: {}\n", r.trials.size(), o.decision,
             fit.summary());
  fmt::print("{:<40} {:>11} {:>11} {:>11}\n", "trial", "measured", "uncorrected", "corrected");
  for (size_t i = 0; i < r.trials.size(); ++i) {
    const auto& [plan, seconds] = r.trials[i];
    fmt::print("{:<40} {:>11} {:>11} {:>11}\n", r.names[i], format_ms(seconds),
               format_ms(predicted(r, {}, plan)), format_ms(predicted(r, fit, plan)));
  }
  if (!o.json_path.empty()) write_json_file(o.json_path, fit.to_json());
  return 0;
}

}  // namespace

void add_correct_command(CLI::App& app, int& exit_code) {
  static CorrectOptions o;
  auto* cmd = app.add_subcommand(
      "correct", "Fit the cost model's correction to the trials of an auto report, as "
                 "compression=\"auto\" does, and show each trial predicted before and after");
  cmd->add_option("--report", o.report_path, "An auto report (auto_report() as JSON)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--decision", o.decision, "Which decision's trials (0: the first search)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--json", o.json_path,
                  "Write the correction to this file (`gradcomp simulate --correction` reads it)");
  cmd->callback([&exit_code] { exit_code = run_correct(o); });
}

}  // namespace gradcomp::tools
