// `gradcomp plan`: the planner on a profile and a cluster; prints the plan, its predicted
// iteration time next to the best uncompressed plan, every single-codec plan and the
// compute-only bound, and the decision time; --json writes the plan for the engine.
#pragma once

#include <CLI/CLI.hpp>

namespace gradcomp::tools {

void add_plan_command(CLI::App& app, int& exit_code);

}  // namespace gradcomp::tools
