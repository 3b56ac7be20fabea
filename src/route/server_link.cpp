// The workers' side of the link to the parameter servers: its making, its channels and their
// claims, the control headers, and the stop at exit.
#include "route/server_link.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
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

// The process's link: its control communicator and its channels, made by the first claim and
// never deleted (a communicator's thread may be blocked in a collective of a failed job at
// exit, which a destructor would wait for).
struct ServerLinks {
  ServerLinks(const Transport& workers, const ServerSetting& setting);
  ServerLink& claim(const Transport& workers);
  void stop(Milliseconds limit);
  static void stop_at_exit();

  std::unique_ptr<Transport> control;
  uint32_t workers = 0;
  uint32_t servers = 0;
  uint32_t rank = 0;
  std::vector<ServerLink*> channels;  // channel k at index k
  bool stopped = false;
  ServerHeader received;  // what control's broadcasts write into
};

namespace {

std::mutex g_links_mutex;
ServerLinks* g_links = nullptr;

// Starts the broadcast of worker 0's `header` into `slot` (a member: a broadcast the caller
// stopped waiting for may still write).
WorkPtr start_header(Transport& wire, ServerHeader& slot, const ServerHeader& header) {
  slot = header;
  return wire.broadcast(std::as_writable_bytes(std::span(&slot, 1)), 0);
}

// Broadcasts the header, waiting with `p` when given, else up to the transport's timeout.
void broadcast_header(Transport& wire, ServerHeader& slot, const ServerHeader& header,
                      const Phases* p) {
  const auto issued = Clock::now();
  WorkPtr work = start_header(wire, slot, header);
  if (p != nullptr) {
    p->wait(work, "control", issued);
  } else {
    work->wait(wire.timeout() + Milliseconds(1000));
  }
}

}  // namespace

ServerLinks::ServerLinks(const Transport& workers_transport, const ServerSetting& setting)
    : workers(static_cast<uint32_t>(workers_transport.size())),
      servers(static_cast<uint32_t>(setting.servers)),
      rank(static_cast<uint32_t>(workers_transport.rank())) {
  TransportOptions options;
  options.backend = "gloo";
  options.rank = workers_transport.rank();
  options.world_size = workers_transport.size() + setting.servers;
  options.store = setting.store;
  options.timeout = workers_transport.timeout();
  options.rendezvous = kServerRendezvous;
  // The servers' failures to appear read as such, not as a bare rendezvous error.
  const auto where = [&](const std::exception& e) {
    return fmt::format("route 'servers': reaching the {} parameter servers through {}: {}",
                       setting.servers, setting.store, e.what());
  };
  try {
    control = make_transport(options);
  } catch (const TimeoutError& e) {
    throw TimeoutError(where(e));
  } catch (const CommError& e) {
    throw CommError(where(e));
  } catch (const Error& e) {
    throw Error(where(e));
  }
}

// Under g_links_mutex. The workers agree on the channel by worker 0's header.
ServerLink& ServerLinks::claim(const Transport& workers_transport) {
  if (workers != static_cast<uint32_t>(workers_transport.size()) ||
      rank != static_cast<uint32_t>(workers_transport.rank())) {
    throw Error(fmt::format(
        "route 'servers': this process reaches its servers as worker {} of {}; an engine of "
        "worker {} of {} cannot use them",
        rank, workers, workers_transport.rank(), workers_transport.size()));
  }
  if (stopped) {
    throw Error("route 'servers': this process stopped its parameter servers (stop_servers)");
  }
  const auto free = std::find_if(channels.begin(), channels.end(),
                                 [](const ServerLink* c) { return !c->claimed_; });
  const auto channel = static_cast<uint64_t>(free - channels.begin());
  ServerHeader header;
  header.op = ServerOp::kChannel;
  header.id = channel;
  broadcast_header(*control, received, header, nullptr);
  if (received.id != channel) {
    throw Error(fmt::format(
        "route 'servers': worker {} would use channel {} of the link to the servers, worker 0 "
        "channel {}: the workers made or freed their engines over servers in different orders",
        rank, channel, received.id));
  }
  if (channel == channels.size()) channels.push_back(new ServerLink(*control, servers));
  channels[channel]->claimed_ = true;
  return *channels[channel];
}

void ServerLinks::stop(Milliseconds limit) {
  if (stopped) return;
  if (std::any_of(channels.begin(), channels.end(),
                  [](const ServerLink* c) { return c->claimed_; })) {
    throw Error("stop_servers: a live engine still uses the parameter servers");
  }
  stopped = true;
  ServerHeader header;
  header.op = ServerOp::kStop;
  std::exception_ptr first;
  const auto send_stop = [&](Transport& wire, ServerHeader& slot) {
    try {
      start_header(wire, slot, header)->wait(std::min(wire.timeout(), limit));
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  };
  for (ServerLink* c : channels) send_stop(*c->transport_, c->received_);
  send_stop(*control, received);  // last: the servers wait for their channels' ends after it
  if (first) std::rethrow_exception(first);
}

// Every worker sends the stop, a collective like the others; a job that failed has a broken
// link, and a worker that stopped early makes the others wait no longer than a short bound.
void ServerLinks::stop_at_exit() {
  try {
    std::lock_guard lock(g_links_mutex);
    if (g_links == nullptr) return;
    for (ServerLink* c : g_links->channels) c->claimed_ = false;  // engines never destroyed
    g_links->stop(Milliseconds(30'000));
  } catch (const std::exception&) {
    // The servers see the workers leave instead.
  }
}

ServerLink::ServerLink(Transport& control, uint32_t servers)
    : transport_(control.split(0, control.rank())),
      pull_(&transport_->stream(1)),  // the servers split it as they start serving the channel
      workers_(static_cast<uint32_t>(control.size()) - servers),
      servers_(servers),
      rank_(static_cast<uint32_t>(control.rank())) {}

std::shared_ptr<ServerLink> ServerLink::claim(const Transport& workers) {
  std::lock_guard lock(g_links_mutex);
  if (g_links == nullptr) {
    g_links = new ServerLinks(workers, server_setting_from_environment());
    std::atexit(ServerLinks::stop_at_exit);
  }
  ServerLink& channel = g_links->claim(workers);
  return std::shared_ptr<ServerLink>(&channel, [](ServerLink* link) { link->release(); });
}

void ServerLink::release() {
  std::lock_guard lock(g_links_mutex);
  claimed_ = false;
}

void ServerLink::send(const ServerHeader& header, std::span<const std::byte> payload,
                      const Phases* p) {
  broadcast_header(*transport_, received_, header, p);
  if (std::memcmp(&received_, &header, sizeof(header)) != 0) {
    throw Error(fmt::format(
        "route 'servers': worker {} was to send operation {} of bucket id {} to the servers, "
        "worker 0 operation {} of id {}: the workers disagree on the sequence",
        rank_, static_cast<uint32_t>(header.op), header.id, static_cast<uint32_t>(received_.op),
        received_.id));
  }
  if (payload.empty()) return;
  payload_.assign(payload.begin(), payload.end());
  WorkPtr work = transport_->broadcast(payload_, 0);
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
  std::lock_guard lock(g_links_mutex);
  if (g_links != nullptr) g_links->stop(limit);
}

}  // namespace gradcomp::route
