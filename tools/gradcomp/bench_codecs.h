// `gradcomp bench codecs`: encode, decode-accumulate and decode-into throughput of every codec
// on one core, next to memcpy and a pure read of the same bytes measured in the same run.
#pragma once

#include <string>
#include <vector>

namespace gradcomp::tools {

struct BenchCodecsOptions {
  std::vector<std::string> specs;  // empty: the recommended spec of every codec
  std::vector<int> log2_sizes = {16, 18, 20, 22, 24, 26};
  double min_seconds = 0.2;        // per measurement: repeat until this much time has passed
  int min_repeats = 3;
  std::string json_path;           // empty: no JSON
};

// The spec `bench codecs` uses for each codec: the settings the docs recommend.
const std::vector<std::string>& recommended_bench_specs();

// Runs the benchmark, prints the table, writes JSON if asked. Returns a process exit code.
int bench_codecs(const BenchCodecsOptions& options);

}  // namespace gradcomp::tools
