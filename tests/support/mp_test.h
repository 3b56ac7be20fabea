// Helpers for multi-process tests (*_mptest.cpp): each test body runs on every rank, with the
// transport that mp_main.cpp connected from the launcher's environment (mpirun or gradcomp
// launch).
#pragma once

#include <memory>

#include "gradcomp/transport.h"

namespace gradcomp::testing {

// The transport of this process (the world of the job).
std::shared_ptr<Transport> world();

// Every rank's value of `local`, gathered over world() (to compare results across ranks).
std::vector<std::byte> gather_bytes(std::span<const std::byte> local);

}  // namespace gradcomp::testing
