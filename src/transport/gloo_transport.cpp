// The Gloo backend: a gloo::Context over TCP, connected through a rendezvous store (rank 0's
// TCP store, or a FileStore on a shared directory), collectives run by Gloo's algorithms on the
// transport's OpQueue thread with the transport's timeout, reductions by our own kernels
// (half_reduce.h) so Gloo gives the same bits as MPI.
//
// Failure handling: Gloo throws IoException for a closed connection or a timeout. We map it to
// CommError / TimeoutError, and close our connections right away, so the other survivors fail
// at once instead of waiting out their own timeouts, and a stopped peer that resumes later
// finds nothing to write into.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>

#include "common/environment.h"
#include "common/reduce.h"
#include "gradcomp/error.h"
#include "gradcomp/op_queue.h"
#include "gradcomp/roll_call.h"
#include "transport/backends.h"
#include "transport/local_address.h"
#include "transport/seconds_text.h"
#include "transport/tcp_store.h"

namespace gradcomp {
namespace {

using gloo::rendezvous::Store;
using Device = gloo::transport::Device;

// ---- rendezvous ----------------------------------------------------------------------------

struct StoreSpec {
  std::string text;  // as given, for messages
  std::string path;  // file store: the shared directory
  std::string host;  // tcp store
  int port = 0;
};

int parse_port(const std::string& text, const std::string& where) {
  char* end = nullptr;
  const long port = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || port < 1 || port > 65535) {
    throw Error(fmt::format("gloo: {} port '{}' must be a number in 1..65535", where, text));
  }
  return static_cast<int>(port);
}

StoreSpec parse_store_spec(const std::string& text, const std::string& where) {
  StoreSpec spec{text, {}, {}, 0};
  if (text.starts_with("file:")) {
    spec.path = text.substr(5);
    if (spec.path.starts_with("//")) spec.path = spec.path.substr(2);  // file:///dir
    if (spec.path.empty())
      throw Error(fmt::format("gloo: {} '{}' names no directory", where, text));
    return spec;
  }
  if (text.starts_with("tcp://")) {
    const std::string rest = text.substr(6);
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      throw Error(fmt::format("gloo: {} '{}' must be tcp://host:port", where, text));
    }
    spec.host = rest.substr(0, colon);
    if (spec.host.size() > 2 && spec.host.front() == '[' && spec.host.back() == ']') {
      spec.host = spec.host.substr(1, spec.host.size() - 2);  // [v6 address]
    }
    spec.port = parse_port(rest.substr(colon + 1), where);
    return spec;
  }
  throw Error(fmt::format("gloo: {} '{}' must be 'file:/shared/directory' or 'tcp://host:port'",
                          where, text));
}

// options.store, else GRADCOMP_STORE, else MASTER_ADDR + MASTER_PORT (as torchrun sets them).
StoreSpec choose_store(const TransportOptions& options) {
  if (!options.store.empty()) return parse_store_spec(options.store, "TransportOptions::store");
  if (auto store = env_text("GRADCOMP_STORE")) return parse_store_spec(*store, "GRADCOMP_STORE");
  const auto addr = env_text("MASTER_ADDR");
  const auto port = env_text("MASTER_PORT");
  if (addr && port) {
    StoreSpec spec{fmt::format("tcp://{}:{}", *addr, *port), {}, *addr, 0};
    spec.port = parse_port(*port, "MASTER_PORT");
    return spec;
  }
  const char* missing = addr   ? "MASTER_PORT is not set"
                        : port ? "MASTER_ADDR is not set"
                               : "no rendezvous is configured";
  throw Error(fmt::format(
      "gloo: {}; set MASTER_ADDR and MASTER_PORT (rank 0 serves a TCP store there, as under "
      "torchrun or `gradcomp launch`), or GRADCOMP_STORE=file:/shared/directory or "
      "tcp://host:port",
      missing));
}

// Rank 0's store server lives as long as the process: transports made one after another (or
// side by side) share it under different key prefixes, and a peer that starts its next
// transport before rank 0 has closed its previous one still finds the same server.
std::shared_ptr<TcpStoreServer> serve_store(int port) {
  static std::mutex mutex;
  static std::map<int, std::shared_ptr<TcpStoreServer>> servers;
  std::lock_guard lock(mutex);
  auto& server = servers[port];
  if (!server) server = std::make_shared<TcpStoreServer>(port);
  return server;
}

// Gloo's FileStore can tell whether a key exists without waiting, and where a key's file is,
// but keeps both protected.
class FileStore final : public gloo::rendezvous::FileStore {
 public:
  using gloo::rendezvous::FileStore::FileStore;
  bool has(const std::string& key) { return check({key}); }
  void erase(const std::string& key) {
    std::error_code ignored;  // a key that is not there is no error
    std::filesystem::remove(objectPath(key), ignored);
  }
};

// Whether `key` exists now, without waiting: both stores gradcomp opens can tell.
bool store_has(Store& store, const std::string& key) {
  if (auto* tcp = dynamic_cast<TcpStore*>(&store)) return tcp->check({key});
  if (auto* file = dynamic_cast<FileStore*>(&store)) return file->has(key);
  throw Error("gloo: internal error: the rendezvous store cannot be asked for a key");
}

// Removes keys from either store gradcomp opens.
void store_erase(Store& store, const std::vector<std::string>& keys) {
  if (auto* tcp = dynamic_cast<TcpStore*>(&store)) return tcp->erase(keys);
  if (auto* file = dynamic_cast<FileStore*>(&store)) {
    for (const auto& key : keys) file->erase(key);
    return;
  }
  throw Error("gloo: internal error: the rendezvous store cannot erase a key");
}

std::shared_ptr<Store> open_store(const StoreSpec& spec, int rank, Milliseconds timeout) {
  if (!spec.path.empty()) {
    std::error_code error;
    std::filesystem::create_directories(spec.path, error);
    if (!std::filesystem::is_directory(spec.path)) {
      throw Error(fmt::format("gloo: the file store directory '{}' cannot be created{}{}",
                              spec.path, error ? ": " : "", error.message()));
    }
    return std::make_shared<FileStore>(spec.path);
  }
  auto server = rank == 0 ? serve_store(spec.port) : nullptr;
  return std::make_shared<TcpStore>(spec.host, spec.port, timeout, std::move(server));
}

// Keys under a prefix, with our timeout on every wait (gloo's own PrefixStore and FileStore
// fall back to a fixed 30 s), and a FileStore's timeout reported as our TimeoutError.
class PrefixedStore final : public Store {
 public:
  PrefixedStore(Store& base, std::string prefix, std::string where, Milliseconds timeout)
      : base_(base), prefix_(std::move(prefix)), where_(std::move(where)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    base_.set(full(key), data);
    written_.push_back(full(key));
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    return base_.get(full(key));
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  bool has(const std::string& key) { return store_has(base_, full(key)); }
  const std::string& where() const { return where_; }
  // Erases every key set through this object.
  void erase_written() {
    if (!written_.empty()) store_erase(base_, written_);
    written_.clear();
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    std::vector<std::string> full_keys;
    for (const auto& key : keys) full_keys.push_back(full(key));
    try {
      base_.wait(full_keys, timeout_);
    } catch (const gloo::Exception& e) {
      throw TimeoutError(fmt::format(
          "gloo: rendezvous through {} did not complete within {} s (waiting for {}): did every "
          "rank start, with the same WORLD_SIZE? ({})",
          where_, seconds_text(timeout_), fmt::join(full_keys, ", "), e.what()));
    }
  }

 private:
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  Store& base_;
  std::string prefix_, where_;
  Milliseconds timeout_;
  std::vector<std::string> written_;  // full keys set through this object
};

// ---- the world check: before Gloo connects, every process claims its rank ------------------
//
// Gloo's own rendezvous has no answer for ranks started inconsistently: a world-size mismatch
// ends in an address-size enforce ("136 vs 272") and a duplicate RANK in a timeout. So every
// process first publishes "world/rank/<r>" = "<world size> <host>:<pid>" and reads every other
// rank's claim, polling (the stores cannot wait for one of several keys) until all are there.
// A claim with another world size, or a second claim of its own rank (found already there, or
// replacing its own later), is an Error; the process that finds it also publishes the message
// as "world/abort", so every other rank waiting here fails with it at once, not at the timeout.
// A surplus process that claims a rank only after the others finished this check fails alone.

struct Claim {
  int size = 0;
  std::string process;  // host:pid
};

std::string this_process() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return fmt::format("{}:{}", host, ::getpid());
}

Claim parse_claim(const std::vector<char>& data) {
  const std::string text(data.begin(), data.end());
  const size_t space = text.find(' ');
  Claim claim;
  claim.size = std::atoi(text.substr(0, space).c_str());
  claim.process = space == std::string::npos ? "?" : text.substr(space + 1);
  return claim;
}

// False when a FileStore's rename failed: Gloo's FileStore writes every key through one
// temporary name, so two processes setting the same key at once make one of them fail. Here
// that happens only to keys that more than one process writes on purpose (the abort) or by
// mistake (a duplicate rank's claim), and the key then holds the other writer's value.
bool try_set(PrefixedStore& store, const std::string& key, const std::string& text) {
  try {
    store.set(key, std::vector<char>(text.begin(), text.end()));
    return true;
  } catch (const gloo::EnforceNotMet&) {  // FileStore's failed rename; our TcpStore never throws it
    return false;
  }
}

[[noreturn]] void abort_world(PrefixedStore& store, const std::string& message) {
  try_set(store, "world/abort", message);  // a concurrent abort may win: either message is true
  throw Error(message);
}

void check_claim(PrefixedStore& store, int rank, int size, int other_rank, const Claim& other) {
  if (other.size == size) return;
  const bool mine_first = rank < other_rank;
  abort_world(store, fmt::format("gloo: ranks disagree on the world size (rank {}: {}, rank {}: "
                                 "{}); start every rank with the same WORLD_SIZE",
                                 mine_first ? rank : other_rank, mine_first ? size : other.size,
                                 mine_first ? other_rank : rank, mine_first ? other.size : size));
}

[[noreturn]] void duplicate_rank(PrefixedStore& store, int rank, int size, const Claim& mine,
                                 const Claim& other) {
  abort_world(store, fmt::format("gloo: rank {} is claimed by two processes ({} and {}); every "
                                 "process needs its own RANK in 0..{} (a file store directory "
                                 "must also be fresh for each run)",
                                 rank, other.process, mine.process, size - 1));
}

void claim_rank(PrefixedStore& store, int rank, int size, Milliseconds timeout) {
  const Claim mine{size, this_process()};
  const std::string slot = fmt::format("world/rank/{}", rank);
  if (store.has(slot)) duplicate_rank(store, rank, size, mine, parse_claim(store.get(slot)));
  if (!try_set(store, slot, fmt::format("{} {}", size, mine.process))) {
    duplicate_rank(store, rank, size, mine, parse_claim(store.get(slot)));
  }

  std::vector<bool> seen(static_cast<size_t>(size), false);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (store.has("world/abort")) {
      const auto message = store.get("world/abort");
      throw Error(std::string(message.begin(), message.end()));
    }
    std::vector<int> missing;
    for (int q = 0; q < size; ++q) {
      const std::string key = fmt::format("world/rank/{}", q);
      if (!seen[q] && store.has(key)) {
        check_claim(store, rank, size, q, parse_claim(store.get(key)));
        seen[q] = true;
      }
      if (!seen[q]) missing.push_back(q);
    }
    // A later claim of our rank replaces ours: whoever finds its own claim gone reports both.
    const Claim own = parse_claim(store.get(slot));
    if (own.process != mine.process) duplicate_rank(store, rank, size, mine, own);
    if (missing.empty()) return;
    if (std::chrono::steady_clock::now() > deadline) {
      throw TimeoutError(fmt::format(
          "gloo: rendezvous through {} did not complete within {} s: rank{} {} of {} never "
          "started; did every rank start, with the same WORLD_SIZE?",
          store.where(), seconds_text(timeout), missing.size() == 1 ? "" : "s",
          fmt::join(missing, ", "), size));
    }
    // Polling a store on the rendezvous path only, at a rate that costs nothing.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void check_world(PrefixedStore& store, int rank, int size, Milliseconds timeout) {
  try {
    claim_rank(store, rank, size, timeout);
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error&) {
    // Rank 0 serves the TCP store, which ends with its process: stay a few polls longer, so
    // the ranks still waiting read the abort message rather than a lost connection.
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    throw;
  }
}

// A connected context over `store` under `prefix`: this rank of `size`.
std::shared_ptr<gloo::Context> connect(Store& store, const std::string& prefix,
                                       const std::string& where, std::shared_ptr<Device>& device,
                                       int rank, int size, Milliseconds timeout) {
  PrefixedStore prefixed(store, prefix, where, timeout);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  try {
    context->connectFullMesh(prefixed, device);
    // Once every member is connected nobody reads the addresses again: each rank erases its
    // own, so the store does not grow with every split (a plan change, a resume) of a long job.
    gloo::BarrierOptions everyone(context);
    everyone.setTimeout(timeout);
    gloo::barrier(everyone);
    prefixed.erase_written();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CommError(
        fmt::format("gloo: rank {} of {} could not connect to its peers through {} "
                    "within {} s: {}",
                    rank, size, where, seconds_text(timeout), e.what()));
  }
  return context;
}

// Gloo writes to sockets with writev(), which raises SIGPIPE when a peer has died: that would
// kill the process instead of failing the collective. Blocking it in the threads that talk to
// Gloo (the queue thread, and Gloo's event loop thread, which inherits the mask of the thread
// that creates the device) turns it into an EPIPE error, without touching the application's
// own signal dispositions.
void block_sigpipe() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// Gloo's teardown joins its threads and, after a failure, may wait on a dead peer: release the
// context on a helper thread and give up waiting after `limit`, since a hang at exit is worse
// than a leak.
void release_bounded(std::shared_ptr<gloo::Context> context, std::shared_ptr<Device> device,
                     Milliseconds limit) {
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  std::thread releaser([context = std::move(context), device = std::move(device), done]() mutable {
    context.reset();
    device.reset();
    std::lock_guard lock(done->mutex);
    done->done = true;
    done->cv.notify_all();
  });
  std::unique_lock lock(done->mutex);
  if (done->cv.wait_for(lock, limit, [&] { return done->done; })) {
    lock.unlock();
    releaser.join();
  } else {
    releaser.detach();
    fmt::print(stderr,
               "gradcomp: gloo: closing the connections took longer than {} s; leaving "
               "them to the process exit\n",
               seconds_text(limit));
  }
}

// ---- the transport -------------------------------------------------------------------------

// What a transport and the transports split from it share.
struct Shared {
  std::shared_ptr<Store> store;
  std::shared_ptr<Device> device;
  std::string where;  // the store, for messages
};

class GlooTransport final : public Transport {
 public:
  GlooTransport(Shared shared, std::shared_ptr<gloo::Context> context, std::string prefix,
                Milliseconds timeout)
      : shared_(std::move(shared)),
        context_(std::move(context)),
        prefix_(std::move(prefix)),
        rank_(context_->rank),
        size_(context_->size),
        timeout_(timeout),
        queue_(std::make_unique<OpQueue>("gloo")) {
    queue_->submit(block_sigpipe);  // first on the queue thread, before any gloo call
  }

  ~GlooTransport() override {
    queue_.reset();  // fails what is queued, waits for the running collective (bounded)
    release_bounded(std::move(context_), std::move(shared_.device), Milliseconds(10'000));
  }

  std::string name() const override { return "gloo"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<Transport> split(int color, int key) override;
  bool drain(Milliseconds timeout) override { return queue_->drain(timeout); }

 protected:
  WorkPtr start_allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) override;
  WorkPtr start_allgather(std::span<const std::byte> in, std::span<std::byte> out) override;
  WorkPtr start_allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                           std::span<const size_t> counts) override;
  WorkPtr start_alltoall(std::span<const std::byte> in, std::span<std::byte> out) override;
  WorkPtr start_alltoallv(std::span<const std::byte> in, std::span<const size_t> in_counts,
                          std::span<std::byte> out, std::span<const size_t> out_counts) override;
  WorkPtr start_broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout) override;
  WorkPtr start_barrier() override;

 private:
  // Queues `body(tag)` as collective `op` moving `bytes`, with gloo's errors mapped.
  template <typename Body>
  WorkPtr submit(const char* op, size_t bytes, Body body) {
    return queue_->submit([this, op, bytes, body = std::move(body)]() mutable {
      run(op, bytes, [&] { body(next_tag()); });
    });
  }
  void run(const char* op, size_t bytes, const std::function<void()>& body);
  [[noreturn]] void fail(const char* op, size_t bytes, const std::string& what, bool timed_out);
  // Every rank issues the same sequence, so the counters agree; a fresh tag per collective
  // keeps a late message of one collective from ever matching another.
  uint32_t next_tag() { return tag_++; }
  std::unique_ptr<Transport> split_on_queue(int color, int key);
  std::vector<int32_t> gather_pairs(int color, int key);
  std::string missing_peers();

  Shared shared_;
  std::shared_ptr<gloo::Context> context_;
  std::string prefix_;
  int rank_, size_;
  Milliseconds timeout_;
  uint32_t tag_ = 0;
  int splits_ = 0;
  std::optional<std::string> missing_;  // the roll call's verdict, once a collective failed
  std::unique_ptr<OpQueue> queue_;  // reset first in the destructor: its thread uses the rest
};

bool looks_like_timeout(const std::string& what) {
  return what.find("Timed out") != std::string::npos || what.find("timeout") != std::string::npos ||
         what.find("Timeout") != std::string::npos;
}

void GlooTransport::run(const char* op, size_t bytes, const std::function<void()>& body) {
  try {
    body();
  } catch (const Error&) {
    throw;
  } catch (const gloo::IoException& e) {
    fail(op, bytes, e.what(), looks_like_timeout(e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    fail(op, bytes, e.what(), false);
  } catch (const std::exception& e) {
    fail(op, bytes, e.what(), looks_like_timeout(e.what()));
  }
}

void GlooTransport::fail(const char* op, size_t bytes, const std::string& what, bool timed_out) {
  try {
    context_->closeConnections();  // the transport is broken: let the peers know now
  } catch (const std::exception&) {
    // Already closing because of the failure we report.
  }
  if (!missing_) missing_ = missing_peers();
  if (timed_out) {
    throw TimeoutError(fmt::format(
        "gloo: {} of {} bytes (rank {} of {}) did not finish within {} s (GRADCOMP_TIMEOUT); {} "
        "[{}]",
        op, bytes, rank_, size_, seconds_text(timeout_), *missing_, what));
  }
  throw CommError(fmt::format("gloo: {} of {} bytes (rank {} of {}) failed; {} [{}]", op, bytes,
                              rank_, size_, *missing_, what));
}

// The rendezvous store as the roll call's board, under the transport's prefix.
class StoreAttendance final : public Attendance {
 public:
  StoreAttendance(std::shared_ptr<Store> store, const std::string& prefix, std::string where,
                  Milliseconds timeout)
      : store_(std::move(store)), prefixed_(*store_, prefix, std::move(where), timeout) {}
  void sign(int rank) override { try_set(prefixed_, key(rank), "1"); }
  bool signed_by(int rank) override { return prefixed_.has(key(rank)); }
  std::string where() const override { return prefixed_.where(); }

 private:
  static std::string key(int rank) { return fmt::format("failed/{}", rank); }
  std::shared_ptr<Store> store_;  // kept alive by the board: the roll call may outlive us
  PrefixedStore prefixed_;
};

std::string GlooTransport::missing_peers() {
  const Milliseconds grace = roll_call_grace(timeout_);
  return roll_call(std::make_shared<StoreAttendance>(shared_.store, prefix_ + "/rollcall",
                                                     shared_.where, grace),
                   rank_, size_, grace);
}

// Empty spans may hold a null pointer; gloo wants an address even for zero bytes.
uint8_t g_empty[8];
uint8_t* gloo_address(std::span<const std::byte> s) {
  return s.empty() ? g_empty : reinterpret_cast<uint8_t*>(const_cast<std::byte*>(s.data()));
}

template <typename T>
void allreduce_typed(const std::shared_ptr<gloo::Context>& context, std::span<std::byte> buffer,
                     DType type, ReduceOp op, uint32_t tag, Milliseconds timeout) {
  gloo::AllreduceOptions opts(context);
  opts.setOutput(reinterpret_cast<T*>(buffer.data()), buffer.size() / sizeof(T));
  // Gloo passes (out, a, b) with out possibly equal to a or b; our kernels reduce in place
  // and are exactly commutative, so out (op)= the other operand.
  opts.setReduceFunction([type, op](void* out, const void* a, const void* b, size_t n) {
    if (out == b) std::swap(a, b);
    if (out != a) std::memmove(out, a, n * sizeof(T));
    reduce_into(out, b, n, type, op);
  });
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
}

WorkPtr GlooTransport::start_allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) {
  return submit("allreduce", buffer.size(), [=, this](uint32_t tag) {
    if (size_ == 1 || buffer.empty()) return;
    switch (dtype_size(type)) {
      case 1:
        return allreduce_typed<uint8_t>(context_, buffer, type, op, tag, timeout_);
      case 2:
        return allreduce_typed<uint16_t>(context_, buffer, type, op, tag, timeout_);
      default:
        return allreduce_typed<uint32_t>(context_, buffer, type, op, tag, timeout_);
    }
  });
}

WorkPtr GlooTransport::start_allgather(std::span<const std::byte> in, std::span<std::byte> out) {
  return submit("allgather", out.size(), [=, this](uint32_t tag) {
    if (size_ == 1 || in.empty()) {
      if (!in.empty()) std::memmove(out.data(), in.data(), in.size());
      return;
    }
    gloo::AllgatherOptions opts(context_);
    opts.setInput(gloo_address(in), in.size());
    opts.setOutput(gloo_address(out), out.size());
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::allgather(opts);
  });
}

WorkPtr GlooTransport::start_allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                                        std::span<const size_t> counts) {
  std::vector<size_t> sizes(counts.begin(), counts.end());
  return submit("allgatherv", out.size(), [=, this, sizes = std::move(sizes)](uint32_t tag) {
    if (size_ == 1 || out.empty()) {
      if (!in.empty()) std::memmove(out.data(), in.data(), in.size());
      return;
    }
    gloo::AllgathervOptions opts(context_);
    opts.setInput(gloo_address(in), in.size());
    opts.setOutput(gloo_address(out), sizes);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::allgatherv(opts);
  });
}

WorkPtr GlooTransport::start_alltoall(std::span<const std::byte> in, std::span<std::byte> out) {
  return submit("alltoall", in.size(), [=, this](uint32_t tag) {
    if (size_ == 1 || in.empty()) {
      if (!in.empty()) std::memmove(out.data(), in.data(), in.size());
      return;
    }
    gloo::AlltoallOptions opts(context_);
    opts.setInput(gloo_address(in), in.size());
    opts.setOutput(gloo_address(out), out.size());
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::alltoall(opts);
  });
}

// The slot prefix of our own alltoallv, apart from gloo's collectives' (gloo/types.h: 0x01 to
// 0x08); each operation has a tag of its own, so its slots are its own.
constexpr uint8_t kSparseAlltoallvSlotPrefix = 0x47;

// An alltoallv that moves only the blocks holding bytes. gloo::alltoallv sends a message to
// every peer and waits for one from every peer, empty or not; on the link between W workers
// and S servers most blocks are empty (a worker pushes to the servers only), and each empty
// message costs both ends a wake-up. The counts of a pair agree at its two ends (the
// collective's contract), so both skip the same pairs.
void sparse_alltoallv(gloo::Context& context, std::span<const std::byte> in,
                      std::span<const size_t> in_counts, std::span<std::byte> out,
                      std::span<const size_t> out_counts, uint32_t tag, Milliseconds timeout) {
  const int rank = context.rank, size = context.size;
  std::vector<size_t> in_at(static_cast<size_t>(size)), out_at(static_cast<size_t>(size));
  std::exclusive_scan(in_counts.begin(), in_counts.end(), in_at.begin(), size_t{0});
  std::exclusive_scan(out_counts.begin(), out_counts.end(), out_at.begin(), size_t{0});
  const auto me = static_cast<size_t>(rank);
  if (in_counts[me] > 0) std::memcpy(out.data() + out_at[me], in.data() + in_at[me], in_counts[me]);
  auto send = context.createUnboundBuffer(gloo_address(in), in.size());
  auto recv = context.createUnboundBuffer(gloo_address(out), out.size());
  const auto slot = gloo::Slot::build(kSparseAlltoallvSlotPrefix, tag);
  int sends = 0, recvs = 0;
  for (int i = 1; i < size; ++i) {  // the same order as gloo's: rank + i, rank - i
    const auto to = static_cast<size_t>((rank + i) % size);
    const auto from = static_cast<size_t>((rank + size - i) % size);
    if (in_counts[to] > 0) {
      send->send(static_cast<int>(to), slot, in_at[to], in_counts[to]);
      ++sends;
    }
    if (out_counts[from] > 0) {
      recv->recv(static_cast<int>(from), slot, out_at[from], out_counts[from]);
      ++recvs;
    }
  }
  for (; sends > 0; --sends) send->waitSend(timeout);
  for (; recvs > 0; --recvs) recv->waitRecv(timeout);
}

WorkPtr GlooTransport::start_alltoallv(std::span<const std::byte> in,
                                       std::span<const size_t> in_counts, std::span<std::byte> out,
                                       std::span<const size_t> out_counts) {
  std::vector<size_t> ins(in_counts.begin(), in_counts.end());
  std::vector<size_t> outs(out_counts.begin(), out_counts.end());
  return submit("alltoallv", in.size() + out.size(),
                [=, this, ins = std::move(ins), outs = std::move(outs)](uint32_t tag) {
                  sparse_alltoallv(*context_, in, ins, out, outs, tag, timeout_);
                });
}

WorkPtr GlooTransport::start_broadcast(std::span<std::byte> buffer, int root,
                                       Milliseconds timeout) {
  return submit("broadcast", buffer.size(), [=, this](uint32_t tag) {
    if (size_ == 1 || buffer.empty()) return;
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(gloo_address(buffer), buffer.size());
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::broadcast(opts);
  });
}

WorkPtr GlooTransport::start_barrier() {
  return submit("barrier", 0, [this](uint32_t tag) {
    if (size_ == 1) return;
    gloo::BarrierOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
  });
}

// Every rank's (color, key), in rank order; runs on the queue thread.
std::vector<int32_t> GlooTransport::gather_pairs(int color, int key) {
  std::vector<int32_t> mine{color, key};
  std::vector<int32_t> all(2 * static_cast<size_t>(size_));
  if (size_ == 1) return mine;
  run("split (exchanging colors)", all.size() * sizeof(int32_t), [&] {
    gloo::AllgatherOptions opts(context_);
    opts.setInput(mine.data(), mine.size());
    opts.setOutput(all.data(), all.size());
    opts.setTag(next_tag());
    opts.setTimeout(timeout_);
    gloo::allgather(opts);
  });
  return all;
}

std::unique_ptr<Transport> GlooTransport::split_on_queue(int color, int key) {
  const auto pairs = gather_pairs(color, key);
  const int split = splits_++;
  if (color < 0) return nullptr;
  // Members ranked by (key, old rank).
  std::vector<std::pair<int32_t, int>> members;
  for (int r = 0; r < size_; ++r) {
    if (pairs[2 * r] == color) members.emplace_back(pairs[2 * r + 1], r);
  }
  std::sort(members.begin(), members.end());
  const auto me = std::find(members.begin(), members.end(), std::pair<int32_t, int>{key, rank_});
  const int new_rank = static_cast<int>(me - members.begin());
  const std::string prefix = fmt::format("{}/split/{}/{}", prefix_, split, color);
  auto context = connect(*shared_.store, prefix, shared_.where, shared_.device, new_rank,
                         static_cast<int>(members.size()), timeout_);
  return std::make_unique<GlooTransport>(shared_, std::move(context), prefix, timeout_);
}

std::unique_ptr<Transport> GlooTransport::split(int color, int key) {
  // The result travels through shared state: if our wait gives up, the queue thread may still
  // finish the split later and must not write into this frame.
  auto result = std::make_shared<std::unique_ptr<Transport>>();
  queue_->call([this, color, key, result] { *result = split_on_queue(color, key); },
               3 * timeout_ + Milliseconds(10'000));
  return std::move(*result);
}

// Distinguishes the transports a process makes one after another over the same store (every
// rank makes the same sequence), and runs sharing a file store directory when the launcher
// gives a run id.
std::string world_prefix() {
  static std::atomic<int> instances{0};
  const auto run =
      env_text("GRADCOMP_RUN_ID").value_or(env_text("TORCHELASTIC_RUN_ID").value_or("run"));
  return fmt::format("gradcomp/{}/{}", run, instances++);
}

}  // namespace

std::unique_ptr<Transport> make_gloo_transport(const TransportOptions& options,
                                               const LaunchInfo& launch) {
  const StoreSpec spec = choose_store(options);
  const Milliseconds timeout = options.timeout;
  const std::string where = spec.path.empty()
                                ? fmt::format("the TCP store at {}:{}", spec.host, spec.port)
                                : fmt::format("the file store in {}", spec.path);
  Shared shared{open_store(spec, launch.rank, timeout), nullptr, where};
  const std::string address = gloo_listen_address(options.hostname, spec.host);
  const std::string prefix =
      options.rendezvous.empty() ? world_prefix() : "gradcomp/" + options.rendezvous;

  // The device and the connections are made on a thread that blocks SIGPIPE (Gloo's event loop
  // thread inherits its mask); a plain thread, since the transport does not exist yet.
  std::shared_ptr<gloo::Context> context;
  std::exception_ptr error;
  std::thread([&] {
    block_sigpipe();
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = address;
      shared.device = gloo::transport::tcp::CreateDevice(attr);
      PrefixedStore world(*shared.store, prefix, where, timeout);
      check_world(world, launch.rank, launch.world_size, timeout);
      context = connect(*shared.store, prefix, where, shared.device, launch.rank, launch.world_size,
                        timeout);
    } catch (const Error&) {
      error = std::current_exception();
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(CommError(
          fmt::format("gloo: cannot listen on address '{}' (set GRADCOMP_GLOO_ADDR or "
                      "TransportOptions::hostname to an address of this host that peers reach): {}",
                      address, e.what())));
    }
  }).join();
  if (error) std::rethrow_exception(error);
  return std::make_unique<GlooTransport>(std::move(shared), std::move(context), prefix, timeout);
}

}  // namespace gradcomp
