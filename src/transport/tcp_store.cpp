#include "transport/tcp_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>

#include "gradcomp/error.h"
#include "transport/seconds_text.h"

namespace gradcomp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSet = 'S', kGet = 'G', kWait = 'W', kCheck = 'C', kErase = 'E', kReply = 'R';
// Rendezvous data is a few hundred bytes per rank: anything far larger is not our protocol.
constexpr uint32_t kMaxString = 64u << 20;
constexpr uint32_t kMaxStrings = 1u << 20;

struct Message {
  char op = 0;
  std::vector<std::string> strings;
};

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string encode(char op, const std::vector<std::string>& strings) {
  std::string out(1, op);
  put_u32(out, static_cast<uint32_t>(strings.size()));
  for (const auto& s : strings) {
    put_u32(out, static_cast<uint32_t>(s.size()));
    out += s;
  }
  return out;
}

// One whole message from the front of `buf` (removing it), or nullopt when it has not all
// arrived yet. Throws Error on a message no client of ours would send.
std::optional<Message> parse(std::string& buf) {
  size_t at = 1 + 4;
  if (buf.size() < at) return std::nullopt;
  Message m;
  m.op = buf[0];
  const uint32_t count = get_u32(buf.data() + 1);
  if (count > kMaxStrings) throw Error("rendezvous store: malformed message (too many strings)");
  for (uint32_t i = 0; i < count; ++i) {
    if (buf.size() < at + 4) return std::nullopt;
    const uint32_t len = get_u32(buf.data() + at);
    if (len > kMaxString) throw Error("rendezvous store: malformed message (string too long)");
    at += 4;
    if (buf.size() < at + len) return std::nullopt;
    m.strings.emplace_back(buf, at, len);
    at += len;
  }
  buf.erase(0, at);
  return m;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

// Binds a listening socket on every interface: IPv6 with v4-mapped addresses when the host has
// IPv6, else IPv4 (network namespaces often have IPv6 disabled).
int listen_any(int port) {
  for (int family : {AF_INET6, AF_INET}) {
    const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (family == AF_INET6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_any;
      a->sin6_port = htons(static_cast<uint16_t>(port));
      len = sizeof *a;
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_ANY);
      a->sin_port = htons(static_cast<uint16_t>(port));
      len = sizeof *a;
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 && ::listen(fd, 1024) == 0) {
      return fd;
    }
    const int error = errno;
    ::close(fd);
    if (error == EADDRINUSE) {
      throw Error(
          fmt::format("rank 0 cannot serve the rendezvous store on port {}: the port is "
                      "in use (another job, a previous run still exiting, or torch.distributed's "
                      "own store on MASTER_PORT); choose another MASTER_PORT, or give gradcomp "
                      "a rendezvous of its own (GRADCOMP_STORE=tcp://host:port, "
                      "TransportOptions::store)",
                      port));
    }
  }
  throw Error(fmt::format("rank 0 cannot serve the rendezvous store on port {}: {}", port,
                          std::strerror(errno)));
}

int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

// ---- server ------------------------------------------------------------------------------

struct TcpStoreServer::State {
  struct Connection {
    int fd;
    std::string in, out;
    std::optional<Message> pending;  // a GET or WAIT whose keys do not exist yet
    bool closed = false;
  };
  std::map<std::string, std::string> data;
  std::vector<Connection> connections;

  // Answers `m` into c.out; false when its keys are missing (it stays pending).
  bool answer(Connection& c, const Message& m) {
    const bool known = (m.op == kSet && m.strings.size() == 2) ||
                       (m.op == kGet && m.strings.size() == 1) || m.op == kWait ||
                       m.op == kCheck || m.op == kErase;
    if (!known) throw Error("rendezvous store: unknown request");
    if (m.op == kCheck) {  // answered at once, never pending
      const bool all = std::all_of(m.strings.begin(), m.strings.end(),
                                   [&](const std::string& key) { return data.contains(key); });
      c.out += encode(kReply, {all ? "1" : "0"});
      return true;
    }
    if (m.op == kErase) {  // answered at once; keys that are not there are no error
      for (const auto& key : m.strings) data.erase(key);
      c.out += encode(kReply, {});
      return true;
    }
    if (m.op == kSet && m.strings.size() == 2) {
      data[m.strings[0]] = m.strings[1];
      c.out += encode(kReply, {});
      return true;
    }
    for (const auto& key : m.strings) {
      if (!data.contains(key)) return false;
    }
    if (m.op == kGet && m.strings.size() == 1) {
      c.out += encode(kReply, {data[m.strings[0]]});
    } else {
      c.out += encode(kReply, {});
    }
    return true;
  }

  // Reads what arrived and answers every complete request, one at a time per connection.
  void receive(Connection& c) {
    char buf[65536];
    for (;;) {
      const ssize_t got = ::recv(c.fd, buf, sizeof buf, 0);
      if (got > 0) {
        c.in.append(buf, static_cast<size_t>(got));
        continue;
      }
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) break;
      c.closed = true;  // the client left (or a reset): its pending request goes with it
      return;
    }
    serve(c);
  }

  void serve(Connection& c) {
    try {
      while (!c.pending) {
        auto m = parse(c.in);
        if (!m) return;
        if (!answer(c, *m)) c.pending = std::move(m);
      }
    } catch (const Error&) {
      c.closed = true;  // not a client of ours: drop it
    }
  }

  void flush(Connection& c) {
    while (!c.out.empty()) {
      const ssize_t sent = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno != EAGAIN && errno != EINTR) c.closed = true;
        return;
      }
      c.out.erase(0, static_cast<size_t>(sent));
    }
  }

  // After a SET, a pending GET or WAIT may be answerable.
  // Repeats until nothing changes, since an answered request may unblock a SET behind it.
  void retry_pending() {
    for (bool progress = true; progress;) {
      progress = false;
      for (auto& c : connections) {
        if (!c.closed && c.pending && answer(c, *c.pending)) {
          c.pending.reset();
          serve(c);
          progress = true;
        }
      }
    }
  }

  void drop_closed() {
    std::erase_if(connections, [](const Connection& c) {
      if (c.closed) ::close(c.fd);
      return c.closed;
    });
  }
};

TcpStoreServer::TcpStoreServer(int port) : state_(std::make_unique<State>()) {
  listen_fd_ = listen_any(port);
  port_ = bound_port(listen_fd_);
  set_nonblocking(listen_fd_);
  if (::pipe2(wake_pipe_, O_CLOEXEC) != 0) {
    ::close(listen_fd_);
    throw Error(fmt::format("rendezvous store: pipe failed: {}", std::strerror(errno)));
  }
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  const char byte = 0;
  (void)!::write(wake_pipe_[1], &byte, 1);
  thread_.join();
  for (auto& c : state_->connections) ::close(c.fd);
  ::close(listen_fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

void TcpStoreServer::run() {
  auto& s = *state_;
  std::vector<pollfd> fds;
  for (;;) {
    fds.assign({{wake_pipe_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    for (const auto& c : s.connections) {
      fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
    }
    if (::poll(fds.data(), fds.size(), -1) < 0) continue;  // EINTR
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) {
      while (true) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        s.connections.push_back({fd, {}, {}, {}, false});
      }
    }
    // Connections accepted just now have no poll entry yet; they are polled next round.
    for (size_t i = 2; i < fds.size(); ++i) {
      auto& c = s.connections[i - 2];
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) s.receive(c);
    }
    s.retry_pending();
    for (auto& c : s.connections) {
      if (!c.closed) s.flush(c);
    }
    s.drop_closed();
  }
}

// ---- client ------------------------------------------------------------------------------

TcpStore::TcpStore(std::string host, int port, Milliseconds timeout,
                   std::shared_ptr<TcpStoreServer> server)
    : host_(std::move(host)), port_(port), timeout_(timeout), server_(std::move(server)) {}

TcpStore::~TcpStore() {
  for (const int fd : idle_) ::close(fd);
}

int TcpStore::take_connection() {
  {
    std::lock_guard lock(mutex_);
    if (!idle_.empty()) {
      const int fd = idle_.back();
      idle_.pop_back();
      return fd;
    }
  }
  return connect_until(Clock::now() + timeout_);
}

void TcpStore::give_back(int fd) {
  std::lock_guard lock(mutex_);
  idle_.push_back(fd);
}

namespace {

// One non-blocking connect to `ai`, bounded by `deadline`; the connected fd or -1.
int try_connect(const addrinfo& ai, Clock::time_point deadline) {
  const int fd =
      ::socket(ai.ai_family, ai.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai.ai_protocol);
  if (fd < 0) return -1;
  int rc = ::connect(fd, ai.ai_addr, ai.ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int error = 0;
    socklen_t len = sizeof error;
    if (::poll(&p, 1, remaining_ms(deadline)) == 1 &&
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0) {
      rc = 0;
    }
  }
  if (rc != 0) {
    ::close(fd);
    return -1;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

}  // namespace

int TcpStore::connect_until(Clock::time_point deadline) const {
  // Rank 0 may not be listening yet: retry with a growing pause (a sleep, not a spin).
  auto pause = Milliseconds(20);
  const std::string port = std::to_string(port_);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    int fd = -1;
    if (::getaddrinfo(host_.c_str(), port.c_str(), &hints, &list) == 0) {
      for (addrinfo* ai = list; ai != nullptr && fd < 0; ai = ai->ai_next) {
        fd = try_connect(*ai, deadline);
      }
      ::freeaddrinfo(list);
    }
    if (fd >= 0) return fd;
    if (Clock::now() + pause >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, Milliseconds(1000));
  }
  throw CommError(fmt::format(
      "could not reach the rendezvous store at {}:{} within {} s; is MASTER_ADDR/MASTER_PORT "
      "(or GRADCOMP_STORE) right and rank 0 running?",
      host_, port_, seconds_text(timeout_)));
}

namespace {

// Reads exactly n bytes by `deadline`: 1 on success, 0 on timeout, -1 when the server left.
int read_exact(int fd, char* out, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (ready == 0) return 0;
    if (ready < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    const ssize_t got = ::recv(fd, out, n, 0);
    if (got <= 0) {
      if (got < 0 && errno == EINTR) continue;
      return -1;
    }
    out += got;
    n -= static_cast<size_t>(got);
  }
  return 1;
}

bool send_all(int fd, const std::string& data) {
  size_t at = 0;
  while (at < data.size()) {
    const ssize_t sent = ::send(fd, data.data() + at, data.size() - at, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    at += static_cast<size_t>(sent);
  }
  return true;
}

}  // namespace

std::vector<std::string> TcpStore::request(char op, const std::vector<std::string>& args,
                                           Milliseconds timeout, const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  // Given back once the answer is read; closed otherwise (a failure, a timeout, an exception):
  // an answer may still come on it, out of step with the next request.
  struct Connection {
    TcpStore& store;
    const int fd;
    bool in_step = false;
    ~Connection() { in_step ? store.give_back(fd) : static_cast<void>(::close(fd)); }
  } connection{*this, take_connection()};
  const int fd = connection.fd;
  const auto lost = [&] {
    return CommError(
        fmt::format("rendezvous store at {}:{}: the connection was lost during {}; "
                    "rank 0 (which serves the store) probably exited",
                    host_, port_, what));
  };
  if (!send_all(fd, encode(op, args))) throw lost();
  std::string reply;
  char header[5];
  int rc = read_exact(fd, header, sizeof header, deadline);
  for (uint32_t i = 0, n = rc == 1 ? get_u32(header + 1) : 0; rc == 1 && i < n; ++i) {
    char len[4];
    rc = read_exact(fd, len, 4, deadline);
    if (rc != 1) break;
    std::string s(get_u32(len), '\0');
    rc = read_exact(fd, s.data(), s.size(), deadline);
    reply = std::move(s);
  }
  if (rc == -1 || (rc == 1 && header[0] != kReply)) throw lost();
  if (rc == 0) {
    throw TimeoutError(
        fmt::format("rendezvous store at {}:{}: {} did not complete within {} s; "
                    "did every rank start (WORLD_SIZE, GRADCOMP_TIMEOUT)?",
                    host_, port_, what, seconds_text(timeout)));
  }
  connection.in_step = true;
  return op == kGet || op == kCheck ? std::vector<std::string>{std::move(reply)}
                                     : std::vector<std::string>{};
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  request(kSet, {key, std::string(data.begin(), data.end())}, timeout_,
          fmt::format("setting key '{}'", key));
}

std::vector<char> TcpStore::get(const std::string& key) {
  auto reply = request(kGet, {key}, timeout_, fmt::format("waiting for key '{}'", key));
  return std::vector<char>(reply[0].begin(), reply[0].end());
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  return request(kCheck, keys, timeout_, fmt::format("checking key{} '{}'",
                                                     keys.size() == 1 ? "" : "s",
                                                     fmt::join(keys, "', '")))[0] == "1";
}

void TcpStore::erase(const std::vector<std::string>& keys) {
  request(kErase, keys, timeout_, fmt::format("erasing key{} '{}'", keys.size() == 1 ? "" : "s",
                                              fmt::join(keys, "', '")));
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) {
  const auto t = timeout.count() > 0 ? timeout : timeout_;
  request(
      kWait, keys, t,
      fmt::format("waiting for key{} '{}'", keys.size() == 1 ? "" : "s", fmt::join(keys, "', '")));
}

}  // namespace gradcomp
