// Runs the built `gradcomp` command (its path comes from the GRADCOMP_CLI definition that
// tests/CMakeLists.txt gives the CLI tests) and captures what it printed.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace gradcomp::testing {

struct CliResult {
  int exit_code;       // -1 when it did not exit normally
  std::string output;  // stdout and stderr
};

inline CliResult run_cli(const std::string& args) {
  const std::string command = std::string(GRADCOMP_CLI) + " " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t got = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), got);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace gradcomp::testing
