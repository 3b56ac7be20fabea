// Cluster: the machines a plan runs on, in the alpha-beta model: W workers, `per_node` of them
// per node, an inter-node link (each node's NIC) and an intra-node link, each with a bandwidth
// and a per-message latency. From JSON or command-line flags ("--inter 25gbit").
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace gradcomp::model {

// What the model accepts: wide enough for any real network (a modem to beyond a NIC), narrow
// enough that every time it computes stays finite (a latency of 1e308 s would make inf ms).
inline constexpr int kMaxWorkers = 1 << 20;
inline constexpr double kMinBytesPerS = 1e3 / 8;   // 1 kbit/s
inline constexpr double kMaxBytesPerS = 1e15 / 8;  // 1 Pbit/s
inline constexpr double kMaxLatencyS = 60;

struct Link {
  double bytes_per_s = 0;  // > 0
  double latency_s = 0;    // alpha: per message (per ring step)
  bool operator==(const Link&) const = default;
};

struct Cluster {
  int workers = 1;
  int per_node = 1;           // workers divides into nodes of per_node
  Link inter{25e9 / 8, 10e-6};   // between nodes (per node NIC)
  Link intra{100e9 / 8, 5e-6};   // inside a node
  // Dedicated parameter servers (route servers), each on a host of its own with an `inter`
  // link. 0: the job has none, so the planner does not offer the route; a plan that names it
  // anyway is priced with as many as workers (BytePS's advice).
  int servers = 0;
  int nodes() const { return workers / per_node; }
  int server_count() const { return servers > 0 ? servers : workers; }
  bool operator==(const Cluster&) const = default;

  // Throws Error naming the field: workers outside 1 .. kMaxWorkers, per_node not dividing
  // workers, a bandwidth outside 1 kbit/s .. 1 Pbit/s, a latency outside 0 .. 60 s.
  void validate() const;
  static Cluster from_json(const nlohmann::json& json);
  nlohmann::json to_json() const;
};

// "25gbit", "100mbit", "1.5gbit", "10gbps" (bits per second), "3GB/s" (bytes): bytes per
// second. Throws Error saying what forms and values (1 kbit/s .. 1 Pbit/s) are allowed.
double parse_rate(const std::string& text);
// "10us", "1.5ms", "0": seconds, at most kMaxLatencyS.
double parse_duration(const std::string& text);
// For printing: "25 Gbit/s", "10 us".
std::string format_rate(double bytes_per_s);

}  // namespace gradcomp::model
