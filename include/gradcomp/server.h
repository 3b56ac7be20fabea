// A dedicated parameter server (BytePS): `gradcomp server` runs one. It holds shard `index` of
// every bucket the workers route over 'servers', sums the workers' compressed pushes, applies
// the server-side error feedback and sends its compressed result back to every worker
// (route/servers_route.cpp is the workers' side, route/server_link.h the protocol).
#pragma once

#include <string>

#include "gradcomp/transport.h"

namespace gradcomp {

struct ServerOptions {
  int index = -1;     // this server: 0 .. servers - 1
  int servers = 0;    // S, as the workers' GRADCOMP_SERVERS
  int workers = 0;    // W, the workers' world size
  std::string store;  // the workers' GRADCOMP_SERVER_STORE (worker 0 serves a tcp:// one)
  // The timeout of a collective under way (and of the rendezvous with the workers). Between
  // operations a server waits for the workers' next one without a limit: they evaluate and
  // checkpoint between steps; a worker that dies closes its connections, which ends the
  // server at once.
  Milliseconds timeout{3'600'000};
};

// Serves until the workers send their stop (returns) or fail (throws CommError or
// TimeoutError naming the server). Throws Error on bad options or a malformed message.
void run_server(const ServerOptions& options);

// On the workers: tells the job's servers to end now (a collective of the workers, between
// steps, no engine using route servers alive). It happens by itself at exit; afterwards no
// engine of this process can reach servers. Does nothing when no engine ever reached them.
void stop_servers();

}  // namespace gradcomp
