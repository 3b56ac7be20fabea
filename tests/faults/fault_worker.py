"""One rank of a fault-injection job: trains a small model with gradcomp's DistributedOptimizer
or its DDP communication hook, over gradcomp's Gloo, Open MPI, or a torch.distributed group.

It writes its pid to `<out>/rank<r>.pid` and prints `STEP r k` when step k ends, so the driver can pick its moment, and leaves
`<out>/rank<r>.json` behind: {"steps": n, "digest": ...} when it finished, or the error it
raised ({"error_type", "message", "is_gradcomp_error", "is_comm_error", "phase", "step"}).
An error ends the process with exit code 3, as an uncaught exception would.

--variant makes rank --vary-rank disagree with the others (the job must then fail on every
rank, clearly): extra (one more parameter), shape (a layer of another size), order (its
parameters named in another order), plan (another compression), seed (another codec seed),
world (a checkpoint saved by a job of another world size is loaded by every rank)."""
import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import gradcomp
import gradcomp.torch as gc

COMPRESSION = "topk:ratio=0.05|ef"


def arguments():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--frontend", choices=["optimizer", "hook"], default="optimizer")
    p.add_argument("--transport", choices=["gloo", "mpi", "pg"], default="gloo")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--compression", default=COMPRESSION)
    p.add_argument("--variant", default="",
                   choices=["", "extra", "shape", "order", "plan", "seed", "world"])
    p.add_argument("--vary-rank", type=int, default=1)
    p.add_argument("--checkpoint", default="", help="save (variant world's first job) or load")
    return p.parse_args()


def rank_and_world():
    for rank, size in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def make_model(variant):
    """Two weights large enough to compress (16,384 elements) and small uncompressed ones."""
    torch.manual_seed(0)
    hidden = 257 if variant == "shape" else 256
    layers = [torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 64),
              torch.nn.ReLU(), torch.nn.Linear(64, 8)]
    if variant == "extra":
        layers += [torch.nn.ReLU(), torch.nn.Linear(8, 8)]
    return torch.nn.Sequential(*layers)


def batch(rank, step):
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + 17)
    return torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)


def init_process_group(args, rank, world):
    """torch.distributed, for the `pg` transport and for DDP: a file store in the job's
    directory works under every launcher (mpirun sets no MASTER_ADDR)."""
    dist.init_process_group("gloo", init_method=f"file://{args.out}/torch_store", rank=rank,
                            world_size=world)


def transport_kind(args):
    return None if args.transport == "pg" else args.transport


def optimizer_step_fn(args, rank, model, variant):
    named = list(model.named_parameters())
    if variant == "order":
        named = named[::-1]
    compression = "fp16" if variant == "plan" else args.compression
    seed = 1 if variant == "seed" else 0
    sgd = torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)
    opt = gc.DistributedOptimizer(sgd, named, compression=compression, seed=seed,
                                  transport=transport_kind(args))
    if args.checkpoint:
        world_checkpoint(args, rank, opt)

    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return step


def world_checkpoint(args, rank, opt):
    """Variant `world`: the first job (of another world size) saves one file from rank 0;
    this job loads it on every rank."""
    if os.path.exists(args.checkpoint):
        opt.load_state_dict(torch.load(args.checkpoint))
        return
    state = opt.state_dict(all_ranks=True)
    if rank == 0:
        torch.save(state, args.checkpoint)


def hook_step_fn(args, model, variant):
    compression = "fp16" if variant == "plan" else args.compression
    seed = 1 if variant == "seed" else 0
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, gc.comm_hook(compression, transport=transport_kind(args),
                                              seed=seed))
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        sgd.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        sgd.step()
    return step


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def describe(error):
    message = str(error)
    return {"error_type": type(error).__name__, "message": message,
            "is_gradcomp_error": isinstance(error, gradcomp.Error),
            "is_comm_error": isinstance(error, (gradcomp.CommError, gradcomp.TimeoutError))}


def main():
    args = arguments()
    torch.set_num_threads(1)
    rank, world = rank_and_world()
    variant = args.variant if rank == args.vary_rank else ""
    report_path = os.path.join(args.out, f"rank{rank}.json")
    with open(os.path.join(args.out, f"rank{rank}.pid"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))  # the driver signals the victim by pid (under mpirun too)
    step_no = -1
    try:
        if args.transport == "pg" or args.frontend == "hook":
            init_process_group(args, rank, world)
        model = make_model(variant)
        step = (optimizer_step_fn(args, rank, model, variant) if args.frontend == "optimizer"
                else hook_step_fn(args, model, variant))
        for step_no in range(args.steps):
            step(*batch(rank, step_no))
            print(f"STEP {rank} {step_no}", flush=True)
        result = {"steps": args.steps, "digest": digest(model)}
    except Exception as e:  # noqa: BLE001 (what arrived is what the test checks)
        result = {"step": step_no + 1, "at": time.time(), **describe(e)}
        print(f"ERROR {result['error_type']}: {result['message']}", file=sys.stderr, flush=True)
    with open(report_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    sys.exit(3 if "error_type" in result else 0)


if __name__ == "__main__":
    main()
