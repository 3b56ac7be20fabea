// Dedicated parameter servers for multi-process tests of route 'servers': each worker process
// runs one server (run_server) on a thread of its own for the whole run, reached over the
// server link exactly as separate `gradcomp server` processes are. Register it with
// `::testing::AddGlobalTestEnvironment(new ServerThreads)`; it sets GRADCOMP_SERVERS and
// GRADCOMP_SERVER_STORE, which the engine reads, and stops the servers at the end.
#pragma once

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "gradcomp/error.h"
#include "gradcomp/server.h"
#include "support/mp_test.h"

namespace gradcomp::testing {

// A port free now on the loopback.
inline int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  if (fd >= 0) ::close(fd);
  if (!ok) throw Error("free_loopback_port: no socket");
  return ntohs(addr.sin_port);
}

// As many servers as workers: server s in worker process s.
class ServerThreads : public ::testing::Environment {
 public:
  void SetUp() override {
    const int rank = world()->rank(), size = world()->size();
    int port = rank == 0 ? free_loopback_port() : 0;  // rank 0's, broadcast to the others
    world()->broadcast(std::as_writable_bytes(std::span(&port, 1)), 0)->wait(world()->timeout());
    const std::string store = fmt::format("tcp://127.0.0.1:{}", port);
    ::setenv("GRADCOMP_SERVERS", std::to_string(size).c_str(), 1);
    ::setenv("GRADCOMP_SERVER_STORE", store.c_str(), 1);
    ServerOptions o;
    o.index = rank;
    o.servers = size;
    o.workers = size;
    o.store = store;
    o.timeout = world()->timeout();
    thread_ = std::thread([this, o] {
      try {
        run_server(o);
      } catch (...) {
        error_ = std::current_exception();
      }
    });
  }
  void TearDown() override {
    stop_servers();
    thread_.join();
    if (!error_) return;
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "server " << world()->rank() << ": " << e.what();
    }
  }

 private:
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace gradcomp::testing
