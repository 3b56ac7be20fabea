// A Transport over a torch.distributed process group (c10d::ProcessGroup): gradcomp's routes
// then run on the communicator the user's training script already set up (gloo on CPU; NCCL
// on GPUs, with buffers staged through the group's device).
//
// Collectives run one at a time on the transport's own thread, in issue order, and each waits
// for its c10d Work with the transport's timeout, so the engine's ordering guarantees hold as
// with gradcomp's own backends. c10d gathers only equal-sized blocks: allgatherv is an allgather
// of blocks padded to the largest. A process group cannot be split from here: the hierarchical
// route needs gradcomp's own transports.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "gradcomp/transport.h"

namespace gradcomp::torch {

// `device`: where the group's collectives expect tensors (kCPU for gloo and MPI groups, a CUDA
// device for NCCL). `timeout`: per collective; 0: GRADCOMP_TIMEOUT (default 300 s). `store`:
// the job's c10d store (torch.distributed's default store), optional: through it, a failed
// collective's error names the peers that are gone (a roll call among the survivors).
std::shared_ptr<Transport> make_process_group_transport(
    c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device = c10::kCPU,
    Milliseconds timeout = Milliseconds{0}, c10::intrusive_ptr<c10d::Store> store = {});

}  // namespace gradcomp::torch
