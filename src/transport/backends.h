// The backends make_transport can start; one file each.
#pragma once

#include <memory>

#include "gradcomp/transport.h"

namespace gradcomp {

// Open MPI over MPI_COMM_WORLD (initialising MPI if the process has not).
std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options,
                                              const LaunchInfo& launch);
// Gloo over TCP, rendezvous through options.store ("file:/path" or "tcp://host:port").
std::unique_ptr<Transport> make_gloo_transport(const TransportOptions& options,
                                               const LaunchInfo& launch);

}  // namespace gradcomp
