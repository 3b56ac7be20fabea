"""The PyTorch "Getting Started with Distributed Data Parallel" tutorial (ToyModel, demo_basic,
demo_checkpoint), with only what a user changes to run it under gradcomp instead of DDP (each
change is marked "gradcomp:"):

  - the processes come from a launcher (gradcomp launch, torchrun, mpirun) instead of
    mp.spawn, so rank and world size are read from the environment; setup() still initializes
    the gloo process group, and gradcomp exchanges over it;
  - the model is not wrapped in DDP; the optimizer is wrapped in
    gradcomp.torch.DistributedOptimizer (its construction copies rank 0's parameters, as DDP's
    does: ToyModel() is initialized unseeded, differently on each rank). ToyModel's tensors are
    tiny, so min_compress_elements is 0 (else nothing would be compressed);
  - demo_checkpoint saves the optimizer too, as docs/python.md says for one file written by
    rank 0: every rank calls optimizer.state_dict(all_ranks=True) (a collective gathering
    every rank's error-feedback state), rank 0 saves {"model", "optimizer"}, dist.barrier(),
    then every rank builds a fresh model and optimizer, loads the file (taking its own part of
    the compression state) and trains on; and it trains a few steps before saving, so that
    there is state to carry.

Kept from the tutorial: ToyModel (Linear(10, 10), ReLU, Linear(10, 5)), MSELoss, SGD(lr=0.001),
optimizer.zero_grad(); loss_fn(model(torch.randn(20, 10)), torch.randn(20, 5)).backward();
optimizer.step(); rank 0 saving, dist.barrier(), every rank loading with a map_location, the
barrier before rank 0 removes the file, and cleanup().

To check that the resumed run continues bit-exactly, a reference model and optimizer (built
last) start from the checkpointed run's initial parameters and train straight through on the
same batches (the batches are drawn from a generator of their own, keyed by rank and step, so
that both runs see the same ones). Every rank writes <out>/final.rank<r>.pt (the resumed model's
parameters and state_dict, and the reference's) and <out>/report.rank<r>.json.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

import gradcomp.torch as gc  # gradcomp:

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
import common  # noqa: E402 (the result files the test reads)


def setup():
    # gradcomp: the launcher sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return rank, world_size


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def wrap(optimizer, model, args):  # gradcomp:
    return gc.DistributedOptimizer(optimizer, model.named_parameters(),
                                   compression=args.compression,
                                   min_compress_elements=args.min_compress_elements)


def batch(rank, step):
    """torch.randn(20, 10), torch.randn(20, 5) as the tutorial draws them, from a generator
    keyed by (rank, step)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)


def train(model, optimizer, rank, steps, losses):
    loss_fn = nn.MSELoss()
    for step in steps:
        inputs, labels = batch(rank, step)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())


def demo_basic(rank, args):
    model = ToyModel()
    optimizer = wrap(optim.SGD(model.parameters(), lr=0.001), model, args)
    losses = []
    train(model, optimizer, rank, range(args.steps), losses)
    return losses


def demo_checkpoint(rank, args):
    model = ToyModel()
    optimizer = wrap(optim.SGD(model.parameters(), lr=0.001), model, args)
    initial = {k: v.clone() for k, v in model.state_dict().items()}  # for the reference
    losses = []
    train(model, optimizer, rank, range(args.steps), losses)

    CHECKPOINT_PATH = os.path.join(args.out, "model.checkpoint")
    state = {"model": model.state_dict(),
             "optimizer": optimizer.state_dict(all_ranks=True)}  # gradcomp: a collective
    if rank == 0:
        torch.save(state, CHECKPOINT_PATH)
    # Use a barrier() to make sure that process 1 loads the model after process 0 saves it.
    dist.barrier()

    model = ToyModel()
    optimizer = wrap(optim.SGD(model.parameters(), lr=0.001), model, args)
    checkpoint = torch.load(CHECKPOINT_PATH, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(model, optimizer, rank, range(args.steps, 2 * args.steps), losses)

    # Not necessary to use a dist.barrier() to guard the file deletion below, as the
    # AllReduce ops in the backward pass of DDP already served as a synchronization.
    dist.barrier()
    if rank == 0:
        os.remove(CHECKPOINT_PATH)
    return model, optimizer, initial, losses


def straight_through(rank, args, initial):
    """The reference: the same start, the same batches, no checkpoint."""
    model = ToyModel()
    optimizer = wrap(optim.SGD(model.parameters(), lr=0.001), model, args)
    model.load_state_dict(initial)
    losses = []
    train(model, optimizer, rank, range(2 * args.steps), losses)
    return model, losses


def main():
    parser = argparse.ArgumentParser(description="DDP tutorial under gradcomp")
    parser.add_argument("--out", required=True, help="directory for the result files")
    parser.add_argument("--steps", type=int, default=5, help="steps before and after the "
                        "checkpoint")
    parser.add_argument("--compression", default="topk:ratio=0.01|ef")  # gradcomp:
    parser.add_argument("--min-compress-elements", type=int, default=0)  # gradcomp:
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share a small machine
    rank, world_size = setup()
    basic_losses = demo_basic(rank, args)
    model, optimizer, initial, losses = demo_checkpoint(rank, args)
    codecs = [b["codec"] for b in optimizer.plan["buckets"]]
    reference, reference_losses = straight_through(rank, args, initial)
    cleanup()

    final = {"params": {n: p.detach() for n, p in model.named_parameters()},
             "state_dict": model.state_dict(), "reference_state_dict": reference.state_dict(),
             "loss": losses[-1], "losses": losses, "reference_losses": reference_losses}
    common.save(args.out, "final", rank, final)
    common.report(args.out, rank, {"basic_losses": basic_losses, "losses": losses,
                                   "reference_losses": reference_losses, "loss": losses[-1],
                                   "plan_codecs": codecs,
                                   "checkpoint_removed": not os.path.exists(
                                       os.path.join(args.out, "model.checkpoint"))})


if __name__ == "__main__":
    main()
