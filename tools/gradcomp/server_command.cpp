#include "server_command.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <memory>

#include "cli_checks.h"
#include "gradcomp/error.h"
#include "gradcomp/server.h"

namespace gradcomp::tools {

void add_server_command(CLI::App& app, int& exit_code) {
  struct Settings {
    ServerOptions server;
    double timeout_s = 3600;
  };
  auto s = std::make_shared<Settings>();
  auto* cmd = app.add_subcommand(
      "server",
      "Run one dedicated parameter server of a job whose workers use route 'servers' "
      "(docs/servers.md); it ends when the workers stop. `gradcomp launch --servers S` starts "
      "them for you.");
  cmd->add_option("--index", s->server.index, "This server: 0 .. servers - 1")
      ->required()
      ->check(CLI::Range(0, 4095));
  cmd->add_option("--servers", s->server.servers, "Number of servers (the workers' GRADCOMP_SERVERS)")
      ->required()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--workers", s->server.workers, "Number of workers (their world size)")
      ->required()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--store", s->server.store,
                  "The workers' rendezvous store, tcp://host:port (worker 0 serves it) or "
                  "file:/shared/directory; default: GRADCOMP_SERVER_STORE");
  cmd->add_option("--timeout", s->timeout_s,
                  "Seconds a collective with the workers may take once under way, and the "
                  "rendezvous with them (between steps a server waits for the workers "
                  "without a limit)")
      ->check(finite_range(1e-3, 7 * 86400.0))
      ->capture_default_str();
  cmd->callback([s, &exit_code] {
    ServerOptions o = s->server;
    if (const char* store = std::getenv("GRADCOMP_SERVER_STORE"); o.store.empty() && store) {
      o.store = store;
    }
    o.timeout = Milliseconds(static_cast<long>(s->timeout_s * 1000));
    try {
      run_server(o);
      exit_code = 0;
    } catch (const Error& e) {
      fmt::print(stderr, "gradcomp server {}: {}\n", o.index, e.what());
      exit_code = 1;
    }
  });
}

}  // namespace gradcomp::tools
