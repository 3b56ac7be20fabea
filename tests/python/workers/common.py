"""What every worker shares: its place in the job, deterministic data and models, and the
files it leaves for the test (JSON and torch.save files in the --out directory)."""
import argparse
import json
import os

import torch


def rank_and_size():
    """This process's rank and the world size, from torchrun's or Open MPI's variables."""
    for rank, size in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="directory for this run's result files")
    return p


def resumable_parser(description, steps):
    """parser() with the arguments of a run that saves a checkpoint and resumes from one: it
    trains steps [--begin, --steps), saves after step --save-at, or starts from --load."""
    p = parser(description)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--begin", type=int, default=0)
    p.add_argument("--save-at", type=int, default=0, help="save a checkpoint after this step")
    p.add_argument("--load", default="", help="checkpoint path prefix (.rank<r>.pt follows)")
    return p


def setup():
    # One intra-op thread: the machine is small and shared, and the same thread count in every
    # process keeps each gradient a deterministic function of (parameters, data).
    torch.set_num_threads(1)
    return rank_and_size()


def out_path(out, name, rank):
    return os.path.join(out, f"{name}.rank{rank}")


def save(out, name, rank, obj):
    torch.save(obj, out_path(out, name, rank) + ".pt")


def report(out, rank, record):
    """The JSON the test reads; written last, so its presence means the worker finished."""
    with open(out_path(out, "report", rank) + ".json", "w", encoding="utf-8") as f:
        json.dump(record, f)


def make_model(seed=0):
    """Two weights of 16384 elements (compressed under the default min_compress_elements,
    fused into one bucket) and small biases and a head (uncompressed, buckets of their own)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 8))


def batch(rank, step, micro=0, rows=16):
    """The data rank `rank` sees at `step` (micro-batch `micro`): a pure function of the three,
    so any process can recompute any rank's batch."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + micro + 17)
    return torch.randn(rows, 64, generator=g), torch.randn(rows, 8, generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def local_gradients(shadow, params, rank, step, micro_batches=1):
    """This rank's own (not yet averaged) gradients at `params`, computed on a separate copy of
    the model: the live model's .grad belongs to the engine between backward and
    synchronize(). Micro-batches accumulate in .grad as autograd does on the live model."""
    with torch.no_grad():
        for dst, src in zip(shadow.parameters(), params):
            dst.copy_(src)
    shadow.zero_grad(set_to_none=True)
    for micro in range(micro_batches):
        loss_of(shadow, *batch(rank, step, micro)).backward()
    return [p.grad.clone() for p in shadow.parameters()]


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def state_bytes(model):
    """Every parameter's raw bytes, for bit-exact comparison across processes."""
    return b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters())
