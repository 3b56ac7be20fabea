// `gradcomp server`: one dedicated parameter server of a job whose workers route buckets over
// 'servers' (gradcomp/server.h, docs/servers.md). `gradcomp launch --servers S` starts them.
#pragma once

namespace CLI {
class App;
}

namespace gradcomp::tools {

// Registers `server` on `app`; its exit code goes to `exit_code`.
void add_server_command(CLI::App& app, int& exit_code);

}  // namespace gradcomp::tools
