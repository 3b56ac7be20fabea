// The TCP rendezvous store of the Gloo backend, in the manner of torch's TCPStore: rank 0 serves
// a key-value map at MASTER_ADDR:MASTER_PORT, and every rank (rank 0 included) is a client that
// sets its address and waits for the others'. Gloo sees it as a gloo::rendezvous::Store.
//
// Wire protocol (both directions): a request is one op byte, then a u32 count of strings, then
// each string as a u32 length and its bytes (all integers little-endian). SET [key, value] and
// WAIT [keys...] answer with an empty list once done; GET [key] answers [value] once the key
// exists; CHECK [keys...] answers ["1"] or ["0"] at once (whether all exist); ERASE [keys...]
// removes them and answers an empty list at once (a job that connects and splits for days
// must not grow rank 0's map with every rendezvous). The server
// answers a GET or WAIT only when its keys exist, so waiting costs nothing;
// the client bounds every answer with its timeout.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/transport.h"

namespace gradcomp {

// Serves the store on one port of every interface, on its own thread (poll(), no busy loop).
class TcpStoreServer {
 public:
  // Binds and listens on `port` (0: any free port). Throws Error when the port is taken.
  explicit TcpStoreServer(int port);
  // Stops the thread and closes every connection.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }

 private:
  struct State;
  void run();

  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};  // written by the destructor to stop the thread
  int port_ = 0;
  std::unique_ptr<State> state_;
  std::thread thread_;
};

// A client of a TcpStoreServer; every request bounded by the timeout. Requests made at once from
// several threads each go over a connection of their own: a WAIT or GET holds its connection
// until its keys exist, and a SET queued behind it on the same connection could be the one
// that writes them (two transports of a process connecting at once, each waiting for an
// address of the other's peers). One thread's requests reuse one connection.
class TcpStore : public gloo::rendezvous::Store {
 public:
  // Connects lazily, at the first request; retries until the timeout, since rank 0 (the
  // server) may start after the other ranks. `server`, when given, is kept alive with it.
  TcpStore(std::string host, int port, Milliseconds timeout,
           std::shared_ptr<TcpStoreServer> server = nullptr);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits (up to the timeout) for the key to exist.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  // Whether every key exists now; the server answers at once.
  bool check(const std::vector<std::string>& keys);
  // Removes the keys (those that exist); the server answers at once.
  void erase(const std::vector<std::string>& keys);

  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  std::vector<std::string> request(char op, const std::vector<std::string>& args,
                                   Milliseconds timeout, const std::string& what);
  // A connected socket: an idle one, or a new one (retried until the timeout).
  int take_connection();
  void give_back(int fd);
  int connect_until(std::chrono::steady_clock::time_point deadline) const;

  std::string host_;
  int port_;
  Milliseconds timeout_;
  std::shared_ptr<TcpStoreServer> server_;
  std::mutex mutex_;
  std::vector<int> idle_;  // connections no request uses now (under mutex_)
};

}  // namespace gradcomp
