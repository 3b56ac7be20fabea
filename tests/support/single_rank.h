// A real transport of one rank (Gloo over a fresh file store), for single-process tests of the
// engine and the routes: W = 1 through the same code paths as a job.
#pragma once

#include <memory>

#include "gradcomp/transport.h"

namespace gradcomp::testing {

std::shared_ptr<Transport> single_rank_transport();

}  // namespace gradcomp::testing
