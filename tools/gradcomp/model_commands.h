// The model commands: `utility` (the utility study's model), `simulate` (the timeline of a plan
// on a profile and a cluster), `costs` (codec costs: show, or fit a `bench codecs` report),
// `correct` (the auto scheduler's model correction, refitted to a saved report's trials).
#pragma once

namespace CLI {
class App;
}

namespace gradcomp::tools {

void add_utility_command(CLI::App& app, int& exit_code);
void add_simulate_command(CLI::App& app, int& exit_code);
void add_costs_command(CLI::App& app, int& exit_code);
void add_correct_command(CLI::App& app, int& exit_code);

// All four.
inline void add_model_commands(CLI::App& app, int& exit_code) {
  add_utility_command(app, exit_code);
  add_simulate_command(app, exit_code);
  add_costs_command(app, exit_code);
  add_correct_command(app, exit_code);
}

}  // namespace gradcomp::tools
