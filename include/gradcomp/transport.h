// Transport: the distributed engine underneath gradcomp (Open MPI, Gloo; torch.distributed comes
// with the front ends). Asynchronous collectives on byte buffers, each returning a Work handle,
// in the manner of c10d. A transport knows nothing of compression.
//
// Rules every backend keeps:
//  - Collectives run one at a time, in the order they were issued on this transport; every rank
//    must issue the same sequence (the engine guarantees it by issuing in plan order).
//  - Buffers (and count arrays) must stay valid until the Work completes; counts are copied.
//  - A collective that fails or exceeds the transport's timeout fails its Work with CommError
//    or TimeoutError, and breaks the transport: every later Work fails with the same error.
//    A dead peer is therefore an error within the timeout, never a hang.
//  - Issuing is thread-safe; waiting never busy-spins on the caller's thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "gradcomp/dtype.h"

namespace gradcomp {

using Milliseconds = std::chrono::milliseconds;

// One collective in flight.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished and rethrows its error. Throws TimeoutError when it
  // has not finished within `timeout` (the collective itself stays bounded by the transport's
  // own timeout).
  virtual void wait(Milliseconds timeout) = 0;
  // True once the collective finished, successfully or not.
  virtual bool done() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class Transport;

// The groups the routes over nodes run on (Transport::nodes): this rank's node, and the ranks
// of this rank's local index on every node.
struct NodeGroups {
  std::unique_ptr<Transport> intra;  // this node's ranks; intra rank 0 is the node's leader
  std::unique_ptr<Transport> cross;  // the ranks of this local index on every node
  // The node leaders' transport (the hierarchical route's): `cross` on leaders, else nullptr.
  Transport* leaders() const;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string name() const = 0;  // "mpi", "gloo"
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Each collective checks its arguments on the calling thread (throwing Error that says what
  // is wrong: sizes that do not match, a root out of range, ...) and then starts it.
  //
  // In place: buffer holds buffer.size() / dtype_size(type) elements of `type`; afterwards
  // every rank holds the element-wise reduction (sum or max) over ranks. Sums of float16 and
  // bfloat16 are accumulated as float32 per addition and rounded to nearest even; 8-bit and
  // 32-bit integer sums wrap around (two's complement); the same on every backend.
  WorkPtr allreduce(std::span<std::byte> buffer, DType type, ReduceOp op);
  // Every rank contributes in.size() bytes (the same on all ranks); out has size() * in.size()
  // bytes and receives rank r's input at offset r * in.size().
  WorkPtr allgather(std::span<const std::byte> in, std::span<std::byte> out);
  // Rank r contributes counts[r] bytes (in.size() == counts[rank()]); out receives them
  // concatenated in rank order (sum of counts bytes).
  WorkPtr allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                     std::span<const size_t> counts);
  // in holds size() equal blocks; block j goes to rank j. out block i came from rank i.
  WorkPtr alltoall(std::span<const std::byte> in, std::span<std::byte> out);
  // in holds size() consecutive blocks of in_counts[j] bytes (block j to rank j); out receives
  // out_counts[i] bytes from rank i, consecutive in rank order. out_counts[i] must equal what
  // rank i sends here.
  WorkPtr alltoallv(std::span<const std::byte> in, std::span<const size_t> in_counts,
                    std::span<std::byte> out, std::span<const size_t> out_counts);
  // Root's buffer is copied into every rank's buffer (all the same size).
  WorkPtr broadcast(std::span<std::byte> buffer, int root);
  // The same, bound by `timeout` instead of the transport's timeout(): a parameter server waits
  // this way for its workers' next operation, which comes whenever they take their next step.
  WorkPtr broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout);
  WorkPtr barrier();

  // Collective over every rank of this transport: ranks passing the same color >= 0 form a new
  // transport, ranked by (key, rank). A rank passing color < 0 gets nullptr. Used for the
  // hierarchical route (one group per node, one group of node leaders). Blocks.
  virtual std::unique_ptr<Transport> split(int color, int key) = 0;

  // Consecutive ranks grouped into nodes of `local_size` ranks (0: the launcher's, see
  // LaunchInfo), as launchers place them. Split from this transport by the first call for a
  // local size (a collective: every rank makes that call at the same point of its sequence)
  // and kept while this transport lives, so the engines built in turn on it (a resume, a
  // rebuilt plan) and the auto scheduler run on one set of node transports instead of a new
  // split each (new communicators, or new connections on Gloo). The groups inherit this
  // transport's rule: whoever issues on it in turn may issue on them. Throws Error when the
  // size is not a multiple of the local size, or the backend cannot split.
  std::shared_ptr<const NodeGroups> nodes(int local_size);

  // Stream `index` of this transport: 0 is this transport itself; stream i >= 1 is another
  // communicator over the same ranks, split from this one by the first call for i (a
  // collective: every rank makes that call at the same point of its sequence) and kept while
  // this transport lives. Collectives on different streams run at the same time, each stream's
  // in its own order: the engine exchanges its buckets on several, so a small bucket does not
  // wait behind a large one (c10d's Gloo process group runs two collectives at once too).
  // Throws Error when the backend cannot split (can_split()).
  Transport& stream(size_t index);
  // Whether split() can make new communicators (a torch.distributed group cannot).
  virtual bool can_split() const { return true; }

  // The timeout of one collective.
  virtual Milliseconds timeout() const = 0;

  // Waits until every collective issued so far has finished, successfully or not, without
  // starting one: buffers handed to collectives whose Work was abandoned may be freed after it.
  // Returns false when that did not happen within `timeout`.
  virtual bool drain(Milliseconds timeout) = 0;

  // Convenience for float32 buffers.
  WorkPtr allreduce(std::span<float> buffer, ReduceOp op = ReduceOp::kSum);

 protected:
  // The backend's collectives, called with arguments already checked (counts copied by the
  // backend if it needs them after returning).
  virtual WorkPtr start_allreduce(std::span<std::byte> buffer, DType type, ReduceOp op) = 0;
  virtual WorkPtr start_allgather(std::span<const std::byte> in, std::span<std::byte> out) = 0;
  virtual WorkPtr start_allgatherv(std::span<const std::byte> in, std::span<std::byte> out,
                                   std::span<const size_t> counts) = 0;
  virtual WorkPtr start_alltoall(std::span<const std::byte> in, std::span<std::byte> out) = 0;
  virtual WorkPtr start_alltoallv(std::span<const std::byte> in,
                                  std::span<const size_t> in_counts, std::span<std::byte> out,
                                  std::span<const size_t> out_counts) = 0;
  virtual WorkPtr start_broadcast(std::span<std::byte> buffer, int root, Milliseconds timeout) = 0;
  virtual WorkPtr start_barrier() = 0;

 private:
  // Destroyed after the backend's own members (the world's communicator or Gloo context): a
  // node group does not need its parent alive (an MPI communicator, a Gloo context of its own).
  std::mutex nodes_mutex_;
  std::map<int, std::shared_ptr<const NodeGroups>> nodes_;  // by local size
  std::mutex streams_mutex_;
  std::vector<std::unique_ptr<Transport>> streams_;  // stream i + 1 at index i
};

// How to start a transport. Fields left at their defaults come from the environment, so a job
// starts the same way under mpirun, torchrun, or gradcomp's own launcher:
//   rank / world size:  RANK, WORLD_SIZE (torchrun), else OMPI_COMM_WORLD_RANK / _SIZE (mpirun)
//   local rank / size:  LOCAL_RANK, LOCAL_WORLD_SIZE, else OMPI_COMM_WORLD_LOCAL_RANK / _SIZE,
//                       else GRADCOMP_LOCAL_SIZE
//   rendezvous (gloo):  GRADCOMP_STORE ("file:/shared/path" or "tcp://host:port"), else
//                       MASTER_ADDR + MASTER_PORT (rank 0 serves a TCP store there)
//   timeout:            GRADCOMP_TIMEOUT in seconds (default 300)
//   backend:            GRADCOMP_TRANSPORT ("mpi" or "gloo"); default: mpi under mpirun, else gloo
struct TransportOptions {
  std::string backend{};   // "mpi", "gloo", or empty
  int rank = -1;           // -1: from the environment
  int world_size = -1;     // -1: from the environment
  std::string store{};     // gloo rendezvous; empty: from the environment
  std::string hostname{};  // gloo: the address to listen on; empty: the one that reaches the store
  Milliseconds timeout{0};  // 0: from the environment
  // gloo: the name the ranks meet under in the store; empty: one per transport this process
  // has made, in order (ranks that make their transports in the same order meet). A process
  // that makes other transports first (a worker reaching its parameter servers) names it.
  std::string rendezvous{};
};

// Where this process sits, read from the environment as described above.
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  bool under_mpirun = false;
};
LaunchInfo launch_info_from_environment();
// GRADCOMP_TIMEOUT, or 300 s. A malformed value is an Error.
Milliseconds timeout_from_environment();

// Starts the transport (a collective: every rank calls it). Throws Error with what is missing
// or wrong in the options or environment, CommError when the peers cannot be reached in time.
std::unique_ptr<Transport> make_transport(TransportOptions options = {});
// The backends built into this library.
std::vector<std::string> transport_names();

}  // namespace gradcomp
