// `gradcomp launch`: starts N local ranks of a command with the environment torchrun gives
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), and
// optionally S parameter servers, and supervises them: a rank or server that fails stops the
// others, and signals reach every one.
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace gradcomp::tools {

struct LaunchOptions {
  int ranks = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_seconds = 0;  // > 0: GRADCOMP_TIMEOUT for the ranks
  double grace_seconds = 5;    // SIGTERM to SIGKILL
  // After a rank fails, how long the others get to notice (a dead peer is an error for them)
  // and exit on their own, printing their error, before they are sent SIGTERM.
  double notice_seconds = 3;
  // Dedicated parameter servers (route 'servers'): `gradcomp server` processes beside the
  // ranks, which get GRADCOMP_SERVERS and GRADCOMP_SERVER_STORE (worker 0 serves that store at
  // master_addr:server_port; 0: master_port + 1).
  int servers = 0;
  int server_port = 0;
  double server_timeout_seconds = 0;  // > 0: the servers' --timeout; else their default
  std::vector<std::string> command;
};

// Runs the ranks to the end. Returns 0 when every rank exited 0; else the failing rank's exit
// code (128 + signal when it was killed by one, or when the launcher was interrupted).
int launch(const LaunchOptions& options);

// Registers `launch` on `app`; its exit code goes to `exit_code`.
void add_launch_command(CLI::App& app, int& exit_code);

}  // namespace gradcomp::tools
