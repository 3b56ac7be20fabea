// `gradcomp bench routes`: the time to exchange one bucket through each route and codec, on W
// real processes, next to the transport's own allreduce of the same float32 bytes measured in
// the same run. Started by mpirun or `gradcomp launch` it runs as one rank of that job; started
// alone it launches W copies of itself with `gradcomp launch` (Gloo).
#pragma once

#include <string>
#include <vector>

namespace gradcomp::tools {

struct BenchRoutesOptions {
  int processes = 4;                      // when not started by a launcher
  std::string transport;                  // "mpi", "gloo" or empty (from the launcher)
  std::vector<std::string> cases;         // "codec|feedback|route"; empty: the default set
  std::vector<int> log2_sizes = {20, 22, 24};
  int repeats = 5;                        // measured exchanges per case (after one warm-up)
  // Each size cut into this many equal buckets, exchanged in one step (the engine's streams
  // then overlap them, as a model's buckets are).
  int buckets = 1;
  int local_size = 2;                     // ranks per node for the hierarchical route
  int servers = 0;                        // when not started by a launcher: parameter servers
                                          // for route servers (gradcomp launch --servers)
  std::string json_path;
  // Measure the transport's allreduce of each size (the speedup column); off, only the cases
  // send bytes (a link counter then counts theirs alone).
  bool allreduce = true;
};

// The default cases: every route with the representative codecs it can carry.
std::vector<std::string> default_route_cases();

int bench_routes(const BenchRoutesOptions& options, const std::string& self_exe);

}  // namespace gradcomp::tools
