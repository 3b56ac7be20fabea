// make_transport: reads the launcher's environment and starts a backend.
#include "gradcomp/transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <optional>
#include <string>

#include "common/environment.h"
#include "gradcomp/error.h"
#include "transport/backends.h"

namespace gradcomp {
namespace {

// The first of the variables that is set.
// INT_MAX keeps the int casts below exact.
std::optional<long> first_int(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (auto value = env_int(name, 0, INT_MAX, "a rank or a count of ranks")) return value;
  }
  return std::nullopt;
}

}  // namespace

WorkPtr Transport::allreduce(std::span<float> buffer, ReduceOp op) {
  return allreduce(std::as_writable_bytes(buffer), DType::kF32, op);
}

LaunchInfo launch_info_from_environment() {
  LaunchInfo info;
  info.under_mpirun = env_text("OMPI_COMM_WORLD_SIZE").has_value();
  info.rank = static_cast<int>(first_int({"RANK", "OMPI_COMM_WORLD_RANK"}).value_or(0));
  info.world_size =
      static_cast<int>(first_int({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"}).value_or(1));
  info.local_rank = static_cast<int>(
      first_int({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}).value_or(info.rank));
  info.local_size = static_cast<int>(
      first_int({"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "GRADCOMP_LOCAL_SIZE"})
          .value_or(info.world_size));
  if (info.world_size < 1 || info.rank >= info.world_size) {
    throw Error(fmt::format("rank {} is not within world size {} (RANK / WORLD_SIZE or mpirun)",
                            info.rank, info.world_size));
  }
  if (info.local_size < 1 || info.local_rank >= info.local_size) {
    throw Error(fmt::format("local rank {} is not within local size {} (LOCAL_RANK / "
                            "LOCAL_WORLD_SIZE, mpirun, or GRADCOMP_LOCAL_SIZE)",
                            info.local_rank, info.local_size));
  }
  return info;
}

Milliseconds timeout_from_environment() {
  auto text = env_text("GRADCOMP_TIMEOUT");
  if (!text) return Milliseconds(300'000);
  char* end = nullptr;
  const double seconds = std::strtod(text->c_str(), &end);
  if (*end != '\0' || !(seconds > 0) || seconds > 1e7) {
    throw Error(fmt::format(
        "GRADCOMP_TIMEOUT='{}' must be a positive number of seconds (default 300)", *text));
  }
  // At least 1 ms: a tiny positive value must not round to 0, which means "unset" elsewhere.
  return Milliseconds(std::max(1LL, static_cast<long long>(seconds * 1000 + 0.5)));
}

std::vector<std::string> transport_names() { return {"mpi", "gloo"}; }

std::unique_ptr<Transport> make_transport(TransportOptions options) {
  LaunchInfo launch = launch_info_from_environment();
  if (options.rank >= 0) launch.rank = options.rank;
  if (options.world_size > 0) launch.world_size = options.world_size;
  // Checked after the override: an explicit rank must also fit the environment's world size.
  if (launch.rank >= launch.world_size) {
    throw Error(fmt::format("rank {} is not within world size {} (options or RANK / WORLD_SIZE)",
                            launch.rank, launch.world_size));
  }
  if (options.timeout.count() <= 0) options.timeout = timeout_from_environment();
  if (options.backend.empty()) {
    options.backend = env_text("GRADCOMP_TRANSPORT").value_or(launch.under_mpirun ? "mpi" : "gloo");
  }
  if (options.backend == "mpi") return make_mpi_transport(options, launch);
  if (options.backend == "gloo") return make_gloo_transport(options, launch);
  throw Error(fmt::format("unknown transport '{}'; available: mpi, gloo", options.backend));
}

}  // namespace gradcomp
