// The address Gloo listens on, which every peer must be able to reach.
#pragma once

#include <string>

namespace gradcomp {

// `configured` (TransportOptions::hostname) when set, else GRADCOMP_GLOO_ADDR, else the local
// address of this host's route towards `store_host` (the rendezvous store; empty for a file
// store: then the default route), found by connecting a UDP socket (no packet is sent) and
// reading its local address, so it works in network namespaces and on multi-homed hosts.
// 127.0.0.1 when the store is on loopback or there is no route.
std::string gloo_listen_address(const std::string& configured, const std::string& store_host);

}  // namespace gradcomp
