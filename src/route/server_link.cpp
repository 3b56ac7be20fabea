// The workers' side of the link to the parameter servers: its making and claim, the control
// headers, and the stop at exit.
#include "route/server_link.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <numeric>

#include "common/environment.h"
#include "gradcomp/error.h"
#include "gradcomp/json_text.h"

namespace gradcomp::route {

std::string ServerBucketSpec::to_json() const {
  return nlohmann::json{{"codec", codec},
                        {"server_feedback", server_feedback},
                        {"elements", elements},
                        {"key", key},
                        {"seed", seed},
                        {"threads", threads},
                        {"live", live}}
      .dump();
}

ServerBucketSpec ServerBucketSpec::from_json(std::string_view text) {
  const nlohmann::json j = parse_json_text(text, "a bucket's server configuration");
  try {
    ServerBucketSpec s;
    s.codec = j.at("codec").get<std::string>();
    s.server_feedback = j.at("server_feedback").get<std::string>();
    s.elements = j.at("elements").get<uint64_t>();
    s.key = j.at("key").get<uint64_t>();
    s.seed = j.at("seed").get<uint64_t>();
    s.threads = j.at("threads").get<int>();
    s.live = j.at("live").get<std::vector<uint64_t>>();
    if (s.threads < 1) throw Error(fmt::format("threads is {}", s.threads));
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("a bucket's server configuration is malformed: {}", e.what()));
  }
}

std::string link_ranks(uint32_t workers, uint32_t servers) {
  return fmt::format(" (on the server link, ranks 0..{} are the workers and ranks {}..{} servers "
                     "0..{})",
                     workers - 1, workers, workers + servers - 1, servers - 1);
}

void rethrow_with_link_ranks(const CommError& e, uint32_t workers, uint32_t servers) {
  const std::string message = e.what() + link_ranks(workers, servers);
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr) throw TimeoutError(message);
  throw CommError(message);
}

std::vector<Range> server_shards(size_t elements, uint32_t servers) {
  std::vector<Range> shards;
  for (uint32_t s = 0; s < servers; ++s) shards.push_back(shard_range(elements, s, servers));
  return shards;
}

std::vector<std::vector<std::byte>> swap_blobs(Transport& wire,
                                               const std::vector<std::vector<std::byte>>& out,
                                               size_t limit) {
  const auto ranks = static_cast<size_t>(wire.size());
  const Milliseconds wait = wire.timeout() + Milliseconds(1000);
  std::vector<uint64_t> sizes_out(ranks, 0), sizes_in(ranks, 0);
  std::vector<size_t> out_counts(ranks, 0), in_counts(ranks, 0);
  std::vector<std::byte> sent;
  for (size_t r = 0; r < ranks; ++r) {
    sizes_out[r] = out_counts[r] = out[r].size();
    sent.insert(sent.end(), out[r].begin(), out[r].end());
  }
  wire.alltoall(bytes_of(sizes_out), bytes_of(sizes_in))->wait(wait);
  for (size_t r = 0; r < ranks; ++r) {
    in_counts[r] = checked_size(sizes_in[r], limit, static_cast<int>(r), "state size");
  }
  std::vector<std::byte> received(std::accumulate(in_counts.begin(), in_counts.end(), size_t{0}));
  wire.alltoallv(sent, out_counts, received, in_counts)->wait(wait);
  std::vector<std::vector<std::byte>> in(ranks);
  size_t at = 0;
  for (size_t r = 0; r < ranks; ++r) {
    const auto begin = received.begin() + static_cast<std::ptrdiff_t>(at);
    in[r].assign(begin, begin + static_cast<std::ptrdiff_t>(in_counts[r]));
    at += in_counts[r];
  }
  return in;
}

ServerSetting server_setting_from_environment() {
  constexpr const char* kHow =
      "start them with `gradcomp launch -n W --servers S -- ...`, or by hand with `gradcomp "
      "server` and GRADCOMP_SERVERS=S GRADCOMP_SERVER_STORE=tcp://host:port on every worker "
      "(docs/servers.md)";
  const auto count = env_int("GRADCOMP_SERVERS", 1, 4096, "parameter servers of the job");
  if (!count) throw Error(fmt::format("route 'servers': GRADCOMP_SERVERS is not set; {}", kHow));
  const auto store = env_text("GRADCOMP_SERVER_STORE");
  if (!store) {
    throw Error(fmt::format("route 'servers': GRADCOMP_SERVER_STORE is not set; {}", kHow));
  }
  return {static_cast<int>(*count), *store};
}

namespace {

std::mutex g_link_mutex;
ServerLink* g_link = nullptr;  // never deleted: see claim

}  // namespace

ServerLink::ServerLink(const Transport& workers, const ServerSetting& setting)
    : workers_(static_cast<uint32_t>(workers.size())),
      servers_(static_cast<uint32_t>(setting.servers)),
      rank_(static_cast<uint32_t>(workers.rank())) {
  TransportOptions options;
  options.backend = "gloo";
  options.rank = workers.rank();
  options.world_size = workers.size() + setting.servers;
  options.store = setting.store;
  options.timeout = workers.timeout();
  options.rendezvous = kServerRendezvous;
  // The servers' failures to appear read as such, not as a bare rendezvous error.
  const auto where = [&](const std::exception& e) {
    return fmt::format("route 'servers': reaching the {} parameter servers through {}: {}",
                       setting.servers, setting.store, e.what());
  };
  try {
    transport_ = make_transport(options);
    pull_ = &transport_->stream(1);  // the servers split it right after their rendezvous too
  } catch (const TimeoutError& e) {
    throw TimeoutError(where(e));
  } catch (const CommError& e) {
    throw CommError(where(e));
  } catch (const Error& e) {
    throw Error(where(e));
  }
}

std::shared_ptr<ServerLink> ServerLink::claim(const Transport& workers) {
  std::lock_guard lock(g_link_mutex);
  if (g_link == nullptr) {
    // Kept for the process: its transport's thread may be blocked in a collective of a failed
    // job at exit, which a destructor would wait for.
    g_link = new ServerLink(workers, server_setting_from_environment());
    std::atexit(stop_at_exit);
  } else if (g_link->workers_ != static_cast<uint32_t>(workers.size()) ||
             g_link->rank_ != static_cast<uint32_t>(workers.rank())) {
    throw Error(fmt::format(
        "route 'servers': this process reaches its servers as worker {} of {}; an engine of "
        "worker {} of {} cannot use them",
        g_link->rank_, g_link->workers_, workers.rank(), workers.size()));
  }
  if (g_link->stopped_) {
    throw Error("route 'servers': this process stopped its parameter servers (stop_servers)");
  }
  if (g_link->claimed_) {
    throw Error(
        "route 'servers': another live engine of this process uses the parameter servers; "
        "one engine at a time may (use route 'twoway' for the other)");
  }
  g_link->claimed_ = true;
  return std::shared_ptr<ServerLink>(g_link, [](ServerLink* link) { link->release(); });
}

void ServerLink::release() {
  std::lock_guard lock(g_link_mutex);
  claimed_ = false;
}

void ServerLink::send(const ServerHeader& header, std::span<const std::byte> payload,
                      const Phases* p) {
  received_ = header;
  const auto issued = Clock::now();
  auto bytes = std::as_writable_bytes(std::span(&received_, 1));
  WorkPtr work = transport_->broadcast(bytes, 0);
  if (p != nullptr) {
    p->wait(work, "control", issued);
  } else {
    work->wait(transport_->timeout() + Milliseconds(1000));
  }
  if (std::memcmp(&received_, &header, sizeof(header)) != 0) {
    throw Error(fmt::format(
        "route 'servers': worker {} was to send operation {} of bucket id {} to the servers, "
        "worker 0 operation {} of id {}: the workers disagree on the sequence",
        rank_, static_cast<uint32_t>(header.op), header.id, static_cast<uint32_t>(received_.op),
        received_.id));
  }
  if (payload.empty()) return;
  payload_.assign(payload.begin(), payload.end());
  work = transport_->broadcast(payload_, 0);
  work->wait(transport_->timeout() + Milliseconds(1000));
  if (!std::equal(payload_.begin(), payload_.end(), payload.begin())) {
    throw Error("route 'servers': the workers disagree on a bucket's server configuration");
  }
}

uint64_t ServerLink::open(ServerBucketSpec spec) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mutex_);
    id = next_id_++;
    live_.insert(id);
    spec.live.assign(live_.begin(), live_.end());
  }
  const std::string text = spec.to_json();
  ServerHeader header;
  header.op = ServerOp::kOpen;
  header.id = id;
  header.payload = text.size();
  send(header, std::as_bytes(std::span(text.data(), text.size())), nullptr);
  return id;
}

void ServerLink::forget(uint64_t id) {
  std::lock_guard lock(mutex_);
  live_.erase(id);
}

void ServerLink::stop(Milliseconds limit) {
  ServerLink* link = nullptr;
  {
    std::lock_guard lock(g_link_mutex);
    if (g_link == nullptr || g_link->stopped_) return;
    if (g_link->claimed_) {
      throw Error("stop_servers: a live engine still uses the parameter servers");
    }
    g_link->stopped_ = true;
    link = g_link;
  }
  ServerHeader header;
  header.op = ServerOp::kStop;
  link->received_ = header;
  auto bytes = std::as_writable_bytes(std::span(&link->received_, 1));
  link->transport_->broadcast(bytes, 0)->wait(std::min(link->transport_->timeout(), limit));
}

// Every worker sends the stop, a collective like the others; a job that failed has a broken
// link, and a worker that stopped early makes the others wait no longer than a short bound.
void ServerLink::stop_at_exit() {
  try {
    {
      std::lock_guard lock(g_link_mutex);
      if (g_link != nullptr) g_link->claimed_ = false;  // an engine never destroyed
    }
    stop(Milliseconds(30'000));
  } catch (const std::exception&) {
    // The servers see the workers leave instead.
  }
}

}  // namespace gradcomp::route
