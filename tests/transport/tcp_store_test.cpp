// The TCP rendezvous store: a server and clients in threads on loopback.
#include "transport/tcp_store.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/error.h"

namespace gradcomp {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<char>& v) { return {v.begin(), v.end()}; }

TEST(TcpStore, SetGetWaitAcrossClients) {
  auto server = std::make_shared<TcpStoreServer>(0);
  TcpStore a("127.0.0.1", server->port(), 5000ms, server);
  TcpStore b("127.0.0.1", server->port(), 5000ms);
  a.set("x", bytes("hello"));
  EXPECT_EQ(text(b.get("x")), "hello");
  a.set("x", bytes("again"));  // overwrite
  EXPECT_EQ(text(b.get("x")), "again");
  a.set("empty", {});
  EXPECT_TRUE(b.get("empty").empty());
  std::string big(1 << 20, 'z');
  b.set("big", bytes(big));
  EXPECT_EQ(text(a.get("big")), big);
  b.wait({"x", "empty", "big"});
}

// CHECK never waits: the world check polls with it while ranks join.
TEST(TcpStore, CheckAnswersAtOnce) {
  auto server = std::make_shared<TcpStoreServer>(0);
  TcpStore a("127.0.0.1", server->port(), 5000ms, server);
  TcpStore b("127.0.0.1", server->port(), 5000ms);
  const auto start = Clock::now();
  EXPECT_FALSE(b.check({"x"}));
  a.set("x", bytes("1"));
  EXPECT_TRUE(b.check({"x"}));
  EXPECT_FALSE(b.check({"x", "y"}));
  EXPECT_LT(Clock::now() - start, 2000ms);
  EXPECT_EQ(text(b.get("x")), "1");  // the connection is still in step
}

// ERASE removes keys for every client (missing ones are no error); a GET waits again after.
TEST(TcpStore, EraseRemovesKeysForEveryClient) {
  auto server = std::make_shared<TcpStoreServer>(0);
  TcpStore a("127.0.0.1", server->port(), 1000ms, server);
  TcpStore b("127.0.0.1", server->port(), 1000ms);
  a.set("split/0/rank_0", bytes("addr0"));
  a.set("split/0/rank_1", bytes("addr1"));
  a.set("keep", bytes("k"));
  b.erase({"split/0/rank_0", "split/0/rank_1", "never-set"});
  EXPECT_FALSE(a.check({"split/0/rank_0"}));
  EXPECT_FALSE(b.check({"split/0/rank_1"}));
  EXPECT_TRUE(b.check({"keep"}));
  EXPECT_THROW(b.get("split/0/rank_0"), TimeoutError);  // waits for it again
  TcpStore c("127.0.0.1", server->port(), 1000ms);
  c.set("split/0/rank_0", bytes("again"));
  EXPECT_EQ(text(c.get("split/0/rank_0")), "again");
}

TEST(TcpStore, GetAndWaitBlockUntilAnotherClientSets) {
  auto server = std::make_shared<TcpStoreServer>(0);
  std::vector<std::thread> waiters;
  std::vector<std::string> got(4);
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&, i] {
      TcpStore client("127.0.0.1", server->port(), 5000ms);
      if (i % 2 == 0) {
        got[i] = text(client.get("late"));
      } else {
        client.wait({"late", "later"});
        got[i] = "waited";
      }
    });
  }
  std::this_thread::sleep_for(100ms);
  TcpStore setter("127.0.0.1", server->port(), 5000ms);
  setter.set("late", bytes("value"));
  setter.set("later", bytes("v2"));
  for (auto& t : waiters) t.join();
  EXPECT_EQ(got[0], "value");
  EXPECT_EQ(got[1], "waited");
  EXPECT_EQ(got[2], "value");
}

// One client used from two threads at once, as two transports of a process connecting side by
// side do: a GET waiting on one thread does not hold back the SET, on another, that it waits
// for (each request in flight has a connection of its own), and the client's requests reuse
// its connections afterwards.
TEST(TcpStore, AWaitOnOneThreadDoesNotHoldBackAnotherThreadsSet) {
  auto server = std::make_shared<TcpStoreServer>(0);
  TcpStore client("127.0.0.1", server->port(), 5000ms, server);
  std::string got, error;
  std::thread waiter([&] {
    try {
      got = text(client.get("address"));
    } catch (const Error& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);  // the GET is waiting on its connection
  client.set("address", bytes("peer:1234"));
  waiter.join();
  EXPECT_EQ(got, "peer:1234") << error;
  client.set("next", bytes("v"));
  EXPECT_EQ(text(client.get("next")), "v");
}

TEST(TcpStore, ClientRetriesUntilTheServerStarts) {
  // Find a free port, then start the server there a little after the client begins.
  int port = 0;
  { port = TcpStoreServer(0).port(); }
  std::shared_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_shared<TcpStoreServer>(port);
    TcpStore("127.0.0.1", port, 5000ms).set("k", bytes("v"));
  });
  TcpStore client("127.0.0.1", port, 5000ms);
  EXPECT_EQ(text(client.get("k")), "v");
  starter.join();
}

TEST(TcpStore, WaitTimesOutWithAClearError) {
  auto server = std::make_shared<TcpStoreServer>(0);
  TcpStore client("127.0.0.1", server->port(), 5000ms);
  const auto start = Clock::now();
  try {
    client.wait({"never"}, 300ms);
    FAIL() << "wait returned";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("0.3 s"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 2s);
  // The client recovers: it reconnects for the next request.
  client.set("k", bytes("v"));
  EXPECT_EQ(text(client.get("k")), "v");
}

TEST(TcpStore, UnreachableStoreIsAClearErrorWithinTheTimeout) {
  int port = 0;
  { port = TcpStoreServer(0).port(); }  // nobody listens there now
  TcpStore client("127.0.0.1", port, 500ms);
  const auto start = Clock::now();
  try {
    client.set("k", bytes("v"));
    FAIL() << "set succeeded without a server";
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(
        what.find("could not reach the rendezvous store at 127.0.0.1:" + std::to_string(port)),
        std::string::npos)
        << what;
    EXPECT_NE(what.find("MASTER_ADDR/MASTER_PORT"), std::string::npos) << what;
  }
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST(TcpStore, ServerGoneIsACommError) {
  auto server = std::make_shared<TcpStoreServer>(0);
  TcpStore client("127.0.0.1", server->port(), 1000ms);
  client.set("k", bytes("v"));
  server.reset();
  EXPECT_THROW(client.get("k"), CommError);
}

TEST(TcpStore, PortInUseIsAClearError) {
  TcpStoreServer first(0);
  try {
    TcpStoreServer second(first.port());
    FAIL() << "two servers on one port";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_PORT"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("GRADCOMP_STORE"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
