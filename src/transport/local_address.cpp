#include "transport/local_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

namespace gradcomp {
namespace {

constexpr const char* kLoopback = "127.0.0.1";

bool is_loopback(const sockaddr* addr) {
  if (addr->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(addr);
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (addr->sa_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(addr);
    return IN6_IS_ADDR_LOOPBACK(&a->sin6_addr) != 0;
  }
  return false;
}

// The local address the kernel would use to send to `ai`, or "" when there is no route.
std::string route_source(const addrinfo& ai) {
  const int fd = ::socket(ai.ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  std::string result;
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  // connect() on a UDP socket only picks the route and source address; nothing is sent.
  if (::connect(fd, ai.ai_addr, ai.ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, raw, text, sizeof text) != nullptr) result = text;
  }
  ::close(fd);
  return result;
}

std::string towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* list = nullptr;
  // Any port will do: the socket is never used to send.
  if (::getaddrinfo(host.c_str(), "9", &hints, &list) != 0) return kLoopback;
  std::string result;
  for (addrinfo* ai = list; ai != nullptr && result.empty(); ai = ai->ai_next) {
    if (is_loopback(ai->ai_addr)) {
      result = kLoopback;
    } else {
      result = route_source(*ai);
    }
  }
  ::freeaddrinfo(list);
  return result.empty() ? kLoopback : result;
}

}  // namespace

std::string gloo_listen_address(const std::string& configured, const std::string& store_host) {
  if (!configured.empty()) return configured;
  if (const char* env = std::getenv("GRADCOMP_GLOO_ADDR"); env != nullptr && *env != '\0') {
    return env;
  }
  // A file store names no host: take the address of the default route (a documentation
  // address, never contacted), which peers on other hosts sharing the directory can reach.
  return towards(store_host.empty() ? "192.0.2.1" : store_host);
}

}  // namespace gradcomp
