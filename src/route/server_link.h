// The link between the workers and their dedicated parameter servers (route 'servers',
// `gradcomp server`): Gloo communicators over the W workers (ranks 0..W-1, their ranks in the
// job) and the S servers (ranks W..W+S-1), and the control messages that tell the servers what
// comes next.
//
// Channels. The link's first communicator (control) carries only the making of channels and
// the stop. Each live engine of the process that routes over servers claims a channel of its
// own (a GAN's two optimizers: two channels), so two engines never issue on one communicator
// from two threads; a channel freed by an engine that is gone serves the next claim. The
// channels are numbered in the order the workers make them, which every worker does in the
// same order (its engines are made in program order); the servers serve each on a thread.
//
// On a channel, worker 0 broadcasts a header before every operation of a bucket; every worker
// issues the same sequence (the engine exchanges the buckets of a servers route on its first
// stream, in plan order), so each header is a collective all W + S ranks take part in, and a
// dead worker or server is an error on every peer within the link's timeout. A channel has two
// communicators: the first carries the headers, the pushes and the state operations; its pull
// stream (split from it) carries the servers' results, in the same bucket order. A worker pulls
// bucket b when it decodes it (the engine's decode stage) while its exchange stage already
// pushes bucket b + 1; each server pulls on a thread of its own, so the two directions of every
// NIC are busy at once.
//
// The link is made by the first engine of the process that needs it (the rendezvous with the
// servers) and kept for the life of the process: at exit the workers tell the servers to stop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "gradcomp/transport.h"
#include "route/frames.h"
#include "route/route.h"

namespace gradcomp::route {

enum class ServerOp : uint32_t {
  kOpen = 1,      // a new bucket: its configuration follows (ServerBucketSpec as JSON)
  kExchange = 2,  // one step of a bucket: shard frames in, the servers' frames out
  kRetire = 3,    // a bucket leaves the plan: the servers hand back what they hold, and drop it
  kStop = 4,      // the workers are done
  kSave = 5,      // each server sends its state of the bucket to its keeper (checkpoints)
  kRestore = 6,   // each server gets its state of the bucket back from its keeper
  kChannel = 7,   // control: an engine claims channel `id` (a new one is split from control)
};

// How the servers settle the previous step of a bucket before its next operation (Route::settle
// on the workers; the servers learn it with the next header).
enum class ServerSettle : uint32_t { kNone = 0, kKeep = 1, kRollBack = 2 };

// Broadcast as bytes: trivially copyable, the same layout on every rank of a job.
struct ServerHeader {
  static constexpr uint32_t kMagic = 0x53524556;  // "SERV"
  uint32_t magic = kMagic;
  ServerOp op = ServerOp::kStop;
  uint64_t id = 0;       // the bucket's id on the link
  uint64_t payload = 0;  // open: bytes of the configuration broadcast next
  StepState step{};      // exchange: the step
  ServerSettle settle = ServerSettle::kNone;
  uint32_t reserved = 0;
  StepState settled{};  // the step `settle` applies to
};
// No padding: the workers compare headers byte by byte. (The cost model prices its 112 bytes.)
static_assert(sizeof(ServerHeader) == 3 * 8 + 2 * sizeof(StepState) + 8);
static_assert(sizeof(ServerHeader) == 112);

// What a server needs to serve its shard of one bucket.
struct ServerBucketSpec {
  std::string codec;            // codec spec (the workers' frames and the servers' own)
  std::string server_feedback;  // the servers' feedback spec
  uint64_t elements = 0;        // the whole bucket's
  uint64_t key = 0;             // the randomness key (RouteConfig::key)
  uint64_t seed = 0;
  int threads = 1;
  std::vector<uint64_t> live;   // the ids the workers still use (the servers drop the others)
  std::string to_json() const;
  static ServerBucketSpec from_json(std::string_view text);  // Error on a malformed one
};

// For messages naming the link's ranks: "(on the server link, ranks 0..1 are the workers and
// ranks 2..3 servers 0..1)".
std::string link_ranks(uint32_t workers, uint32_t servers);

// `e` (a CommError or TimeoutError of the link's transport) again, its type kept, with
// link_ranks after its message.
[[noreturn]] void rethrow_with_link_ranks(const CommError& e, uint32_t workers, uint32_t servers);

// The servers' element ranges of a bucket: contiguous shards, server s holds shard s.
std::vector<Range> server_shards(size_t elements, uint32_t servers);

// The worker that keeps server s's state of every bucket in checkpoints (kSave, kRestore):
// the servers' states spread over the workers' files.
inline uint32_t state_keeper(uint32_t server, uint32_t workers) { return server % workers; }

// A server's state of a bucket in checkpoints: save_parts of its coder's two parts under this
// name, shaped by its shard and the worker count.
inline constexpr const char* kServerStateName = "servers (server side)";
// The largest server state a peer may announce (a codec and a feedback keep a few values per
// element).
inline size_t server_state_limit(size_t elements) { return 64 * elements + (size_t{1} << 20); }

// Sends out[r] to link rank r (empty: nothing) and returns what every rank sent this one, sizes
// first: a collective every link rank calls. A size above `limit` is an Error (a corrupted or
// foreign size must not make us allocate it). Waits up to the transport's timeout.
std::vector<std::vector<std::byte>> swap_blobs(Transport& wire,
                                               const std::vector<std::vector<std::byte>>& out,
                                               size_t limit);

// Where the servers are, for the workers: GRADCOMP_SERVERS (their count) and
// GRADCOMP_SERVER_STORE (tcp://host:port: the rendezvous store worker 0 serves there, or
// file:/shared/directory). `gradcomp launch --servers S` sets both.
struct ServerSetting {
  int servers = 0;
  std::string store;
};
// Error when unset or malformed, saying how to start servers.
ServerSetting server_setting_from_environment();

// The rendezvous name of a job's link (TransportOptions::rendezvous), the same on workers and
// servers.
inline constexpr const char* kServerRendezvous = "servers";

// One channel of the link (see the top of this file), claimed by one live engine at a time.
class ServerLink {
 public:
  // A channel of this process's link for an engine on `workers` (its transport: the worker's
  // rank and count): the first free one, or a new one. A collective of the workers, in the same
  // order on each (engines are made in program order); the first call makes the link (the
  // servers' rendezvous) from the environment. The claim is released when the returned pointer
  // is. Throws Error when no servers are configured, when `workers` differs from the transport
  // the link was made for, or when the workers would claim different channels.
  static std::shared_ptr<ServerLink> claim(const Transport& workers);

  Transport& transport() { return *transport_; }
  Transport& pull_transport() { return *pull_; }
  // Waits until both communicators' queued collectives are done (Transport::drain).
  bool drain(Milliseconds limit) {
    const bool pushed = transport_->drain(limit);
    return pull_->drain(limit) && pushed;
  }
  uint32_t workers() const { return workers_; }
  uint32_t servers() const { return servers_; }
  uint32_t rank() const { return rank_; }  // this worker's
  // The link's rank of server s.
  int server_rank(uint32_t s) const { return static_cast<int>(workers_ + s); }

  // Sends `header` (worker 0's copy is the one the servers read) and, for an open, `payload`;
  // throws Error when the workers' headers differ (they would issue different operations).
  // Waits with `p` when given (a bucket's phase), else up to the link's timeout.
  void send(const ServerHeader& header, std::span<const std::byte> payload, const Phases* p);

  // A new bucket: its id (the same on every worker: buckets are opened in plan order), which
  // stays live until forget(id). Sends kOpen with `spec` (its live list filled in here).
  uint64_t open(ServerBucketSpec spec);
  // The bucket's route is gone (no message: the next open tells the servers).
  void forget(uint64_t id);

  // Sends the stop on every channel and then on control (every worker: a collective), waiting
  // at most `limit` for each; later claims fail. Error when an engine holds a channel. Nothing
  // when the link was never made or stopped.
  static void stop(Milliseconds limit);

  ~ServerLink() = delete;  // kept for the life of the process (see claim)

 private:
  friend struct ServerLinks;
  // Channel `channel`, split from `control` (the servers split it on the kChannel header).
  ServerLink(Transport& control, uint32_t servers);
  void release();

  std::unique_ptr<Transport> transport_;
  Transport* pull_ = nullptr;  // transport_->stream(1)
  uint32_t workers_ = 0;
  uint32_t servers_ = 0;
  uint32_t rank_ = 0;
  std::mutex mutex_;
  bool claimed_ = false;  // under the links' mutex
  uint64_t next_id_ = 1;
  std::set<uint64_t> live_;
  // What the broadcasts write into (members: a collective the link stopped waiting for may
  // still write).
  ServerHeader received_;
  std::vector<std::byte> payload_;
};

}  // namespace gradcomp::route
