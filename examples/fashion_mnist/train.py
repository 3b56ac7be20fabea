"""Data-parallel Fashion-MNIST training with compressed gradient exchange.

Start W ranks with a launcher, e.g.

    build/bin/gradcomp launch -n 4 -- /usr/bin/python3 examples/fashion_mnist/train.py \
        --compression "powersgd:rank=4|ef"
    mpirun --allow-run-as-root --oversubscribe -np 4 /usr/bin/python3 \
        examples/fashion_mnist/train.py

Every rank trains on its own shard of the 60k training images (a seeded shuffle per epoch, the
same permutation on every rank, rank r takes positions r, r+W, ...). Gradients are averaged over
ranks by gradcomp.torch.DistributedOptimizer around plain SGD with momentum (or AdamW or
gradcomp's LANS with --optimizer; or by gradcomp's 1-bit Adam, which exchanges by itself). At
the end the ranks check that they hold identical parameters, evaluate on the 10k test images and
rank 0 prints a summary (and writes it as JSON with --json).
"""
import argparse
import gzip
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# Mean and standard deviation of the training images' pixels (scaled to [0, 1]).
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530


class TrainError(Exception):
    """A failure the user can act on (missing data, divergence, ranks out of step): printed as
    one line, without a traceback."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="none",
                   help='gradcomp option "codec[|feedback[|route]]", e.g. "topk:ratio=0.01|ef" '
                        '(default: none)')
    p.add_argument("--plan", metavar="PATH",
                   help="a gradcomp plan file (docs/plan-format.md; its tensors are the "
                        "parameter names) to run instead of --compression; plans/ has two")
    p.add_argument("--auto", type=json.loads, default=None, metavar="JSON",
                   help='with --compression auto: its settings, e.g. \'{"candidates": '
                        '["powersgd:rank=4|ef"]}\' (docs/auto.md)')
    p.add_argument("--epochs", type=float, default=1.0,
                   help="passes over the training set; a fraction stops early (default: 1)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank and step (32)")
    p.add_argument("--optimizer", default="sgd",
                   choices=["sgd", "adamw", "lans", "lamb", "onebitadam", "onebitlamb"],
                   help="sgd (momentum, the default), adamw (torch's), lans or lamb (gradcomp's; "
                        "lans with --compression 'onebit|ef|twoway' is CLAN), onebitadam "
                        "(gradcomp's 1-bit Adam: its own exchange, --compression is the "
                        "momentum's on compressed steps), onebitlamb (1-bit LAMB, likewise)")
    p.add_argument("--onebit-warmup", type=float, default=0.15,
                   help="onebitlamb, onebitadam --onebit-variance freeze: fraction of the steps "
                        "before the variance freezes (0.15)")
    p.add_argument("--onebit-variance", default="freeze", choices=["freeze", "doubling"],
                   help="onebitadam: which steps exchange exactly and update the variance: "
                        "freeze (after --onebit-warmup, the default) or doubling (0/1 Adam's "
                        "schedule)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (sgd 0.05, adamw and onebitadam 1e-3, lans, lamb "
                        "and onebitlamb 1e-2)")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "constant"],
                   help="learning rate over the run: cosine decay from --lr to 0 at the last "
                        "step, or constant (default: cosine)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (0.9; use 0 with the dgc or nesterov feedback, which "
                        "move the momentum before compression)")
    p.add_argument("--weight-decay", type=float, default=1e-4,
                   help="weight decay (1e-4; decoupled for the Adam family)")
    p.add_argument("--seed", type=int, default=0,
                   help="model initialisation, shuffling and the codecs' randomness (0)")
    p.add_argument("--transport", default="auto", choices=["auto", "gloo", "mpi", "torch"],
                   help="auto: MPI under mpirun, else Gloo; torch: a torch.distributed gloo "
                        "process group (default: auto)")
    p.add_argument("--local-size", type=int, default=0,
                   help="ranks per node for the node routes (hierarchical, sharded); "
                        "0: from the launcher (LOCAL_WORLD_SIZE or mpirun)")
    p.add_argument("--min-compress-elements", type=int, default=16384,
                   help="smaller tensors travel uncompressed (16384)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradients are fused into buckets of up to this many MiB (25)")
    p.add_argument("--timeline", metavar="PATH",
                   help="Chrome-trace timeline per rank: trace.json becomes trace.rank0.json, "
                        "...; a '{rank}' in PATH is replaced instead")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the summary here")
    p.add_argument("--data", default=DEFAULT_DATA, help=f"dataset directory ({DEFAULT_DATA})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (1: ranks usually share the cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if args.epochs <= 0 or args.batch_size <= 0 or args.lr <= 0:
        p.error("--epochs, --batch-size and --lr must be positive")
    if args.plan and (args.optimizer.startswith("onebit") or args.compression != "none"):
        p.error("--plan is for DistributedOptimizer's optimizers (not 1-bit Adam or LAMB), "
                "instead of --compression")
    return args


# ---------------------------------------------------------------------------- data

def read_idx(path, dims):
    """An idx file (the MNIST format): big-endian magic, dims sizes, then uint8 values."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    if magic != 0x0800 + dims:
        raise ValueError(f"{path}: not an idx file of {dims} dimension(s) (magic {magic:#x})")
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} values, the header says {shape}")
    return data.reshape(shape)


def load_split(directory, split):
    """(images N x 1 x 28 x 28 float32 normalized, labels N int64) of 'train' or 'test'."""
    image_file, label_file = (os.path.join(directory, name) for name in FILES[split])
    for path in (image_file, label_file):
        if not os.path.exists(path):
            raise TrainError(
                f"Fashion-MNIST file {path} is missing. Install the Debian package "
                f"dataset-fashion-mnist (apt-get install dataset-fashion-mnist; scripts/setup.sh "
                f"does), or point --data at a directory holding {', '.join(FILES[split])}.")
    images = read_idx(image_file, 3).astype(np.float32) / 255.0
    images = (images - PIXEL_MEAN) / PIXEL_STD
    labels = read_idx(label_file, 1).astype(np.int64)
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels)


def shard_indices(n, rank, world, seed, epoch):
    """This rank's sample order for one epoch: one seeded permutation shared by all ranks, and
    rank r takes every W-th position from r. Shards are cut to the same length so every rank
    runs the same number of steps (each step is a collective)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    per_rank = n // world
    return torch.from_numpy(order[rank::world][:per_rank])


# ---------------------------------------------------------------------------- model

class Net(nn.Module):
    """Two 3x3 conv layers with max pooling, then two fully connected layers: 421,642
    parameters, 95% of them in fc1's weight (3136 x 128), the tensor compression is for."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


# ---------------------------------------------------------------------------- collectives

class Collectives:
    """The few small collectives the script needs besides the gradient exchange, on the same
    transport the optimizer uses (gradcomp's transports offer a float32 sum)."""

    def __init__(self, transport):
        self.transport = transport
        self.rank = transport.rank
        self.world = transport.size

    def sum(self, values):
        t = torch.tensor(values, dtype=torch.float32)
        self.transport.allreduce_(t)
        return t.tolist()

    def gather_words(self, words):
        """Allgather of small non-negative integers (< 2^24, exact in float32): every rank
        fills its own slot of a zero tensor and the sum is the gathered table."""
        table = torch.zeros(self.world, len(words), dtype=torch.float32)
        table[self.rank] = torch.tensor(words, dtype=torch.float32)
        self.transport.allreduce_(table)
        return [[int(v) for v in row] for row in table.tolist()]


def make_transport(kind):
    import gradcomp.torch as gct
    if kind == "torch":
        import torch.distributed as dist
        if not dist.is_initialized():
            # Debian's torch: the env:// rendezvous reads what `gradcomp launch` sets.
            dist.init_process_group("gloo", init_method="env://")
        return gct.get_transport(dist.distributed_c10d._get_default_group())
    return gct.get_transport(None if kind == "auto" else kind)


def parameter_hash(model):
    """A 64-bit BLAKE2 digest of every parameter's bytes, as four 16-bit words."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    digest = h.digest()
    return [int.from_bytes(digest[i:i + 2], "little") for i in range(0, 8, 2)]


def check_identical(model, comm):
    """Fails loudly if any rank's parameters differ from rank 0's."""
    table = comm.gather_words(parameter_hash(model))
    differing = [r for r, words in enumerate(table) if words != table[0]]
    if differing:
        raise TrainError(f"parameters differ between ranks after training: ranks {differing} "
                           f"disagree with rank 0 (hashes {table})")
    return "".join(f"{w:04x}" for w in table[0])


# ---------------------------------------------------------------------------- training

def evaluate(model, images, labels, comm, batch=128):
    """Test accuracy: the ranks hold identical models, so each scores a slice of the test set
    and the counts are summed. In batches of 128: at 1,000 each batch's activations (about 300
    MB) are mapped afresh from the system and faulted in page by page (one rank's 5,000 images
    on one thread: 9.5 s against 1.2 s here, the same predictions)."""
    model.eval()
    mine = torch.arange(comm.rank, len(labels), comm.world)
    correct = 0
    with torch.no_grad():
        for start in range(0, len(mine), batch):
            idx = mine[start:start + batch]
            correct += int((model(images[idx]).argmax(1) == labels[idx]).sum())
    model.train()
    total_correct, = comm.sum([correct])
    return total_correct / len(labels)


class StepTotals:
    """Per-step figures of this rank, summed over the run."""

    def __init__(self):
        self.steps = 0
        self.bytes_sent = 0
        self.uncompressed_bytes = 0
        self.step_seconds = 0.0
        self.exchange_seconds = 0.0
        self.bytes_curve = []  # bytes sent at each step (1-bit Adam's fall after its warm-up)

    def add(self, last):
        self.steps += 1
        self.bytes_curve.append(last["bytes_sent"])
        self.bytes_sent += last["bytes_sent"]
        self.uncompressed_bytes += last["uncompressed_bytes"]
        self.step_seconds += last["step_seconds"]
        self.exchange_seconds += last["exchange_seconds"]


def exchange_summary(comm, totals, train_seconds):
    """Time and bytes per step: means over the steps and the ranks of what each rank's engine
    reported."""
    sent, raw, step_s, exch_s = (v / (comm.world * totals.steps) for v in comm.sum(
        [totals.bytes_sent, totals.uncompressed_bytes, totals.step_seconds,
         totals.exchange_seconds]))
    return {
        "train_seconds": train_seconds,
        "wall_step_seconds": train_seconds / totals.steps,
        "engine_step_seconds": step_s,
        "exchange_seconds": exch_s,
        "bytes_sent_per_step": sent,
        "uncompressed_bytes_per_step": raw,
        "compression_ratio": raw / sent if sent else float("inf"),
        "bytes_sent_curve": totals.bytes_curve,  # this rank's
    }


def progress_bar(enabled, total, desc):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)


def make_schedule(optimizer, kind, total_steps):
    """Per-step learning-rate factor. Cosine decay to 0 makes the last step's model, which is
    evaluated, much less noisy than a constant rate, so runs can be compared."""
    if kind == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) /
                                                        total_steps)))


DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3, "onebitadam": 1e-3, "lans": 1e-2, "lamb": 1e-2,
              "onebitlamb": 1e-2}


def label(args):
    """What the exchange runs: the --compression option, or the plan file."""
    return f"plan {args.plan}" if args.plan else args.compression


def make_optimizer(args, model, comm, total_steps):
    """(the optimizer step() is called on, the one the schedule drives): DistributedOptimizer
    around SGD, AdamW, LANS or LAMB, or 1-bit Adam or 1-bit LAMB, which exchange by themselves."""
    import gradcomp.torch as gct
    lr = args.lr
    if args.optimizer in ("onebitadam", "onebitlamb"):
        common = dict(lr=lr, weight_decay=args.weight_decay, compression=args.compression,
                      transport=comm.transport, seed=args.seed,
                      min_compress_elements=args.min_compress_elements,
                      bucket_mb=args.bucket_mb, timeline=args.timeline)
        if args.optimizer == "onebitlamb":
            optimizer = gct.OneBitLamb(model.named_parameters(),
                                       warmup_steps=onebit_warmup(args, total_steps), **common)
        else:
            optimizer = gct.OneBitAdam(model.named_parameters(), variance=args.onebit_variance,
                                       **onebit_policy(args, total_steps), **common)
        return optimizer, optimizer
    if args.optimizer == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    elif args.optimizer in ("lans", "lamb"):
        cls = gct.LANS if args.optimizer == "lans" else gct.LAMB
        inner = cls(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    optimizer = gct.DistributedOptimizer(
        inner, model.named_parameters(), compression=args.compression, plan=args.plan,
        transport=comm.transport, seed=args.seed, local_size=args.local_size,
        min_compress_elements=args.min_compress_elements, bucket_mb=args.bucket_mb,
        timeline=args.timeline, auto=args.auto)
    return optimizer, inner


def onebit_policy(args, total_steps):
    """OneBitAdam's schedule: the freeze policy's warm-up, a fraction of the run's steps."""
    if args.onebit_variance == "freeze":
        return dict(warmup_steps=onebit_warmup(args, total_steps))
    return {}


def onebit_warmup(args, total_steps):
    """The exact steps before the variance freezes: --onebit-warmup of the run."""
    return max(1, round(args.onebit_warmup * total_steps))


def train(args):
    torch.set_num_threads(args.threads)
    train_x, train_y = load_split(args.data, "train")
    test_x, test_y = load_split(args.data, "test")

    import gradcomp.torch as gct
    comm = Collectives(make_transport(args.transport))
    rank, world = comm.rank, comm.world

    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = Net()
    per_rank = len(train_y) // world
    steps_per_epoch = -(-per_rank // args.batch_size)
    total_steps = max(1, round(args.epochs * steps_per_epoch))
    optimizer, sgd = make_optimizer(args, model, comm, total_steps)
    if rank == 0:
        print(f"fashion-mnist: {world} ranks, compression {label(args)!r}, "
              f"{sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{args.epochs:g} epoch(s) = {total_steps} steps of {args.batch_size} x {world} "
              f"images", flush=True)

    scheduler = make_schedule(sgd, args.schedule, total_steps)
    totals = StepTotals()
    bar = progress_bar(rank == 0 and not args.no_progress, total_steps, "train")
    start = time.perf_counter()
    step, epoch, loss_value = 0, 0, float("nan")
    epoch_losses = []
    while step < total_steps:
        order = shard_indices(len(train_y), rank, world, args.seed, epoch)
        loss_sum, loss_count = 0.0, 0
        for first in range(0, per_rank, args.batch_size):
            if step == total_steps:
                break
            idx = order[first:first + args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            loss.backward()
            optimizer.step()
            scheduler.step()
            totals.add(optimizer.last_step())
            loss_value = loss.item()
            if not np.isfinite(loss_value):
                raise TrainError(f"the loss is {loss_value} at step {step} (rank {rank}); "
                                   "try a smaller --lr")
            loss_sum, loss_count = loss_sum + loss_value, loss_count + 1
            step += 1
            if bar is not None:
                elapsed = time.perf_counter() - start
                bar.set_postfix(loss=f"{loss_value:.3f}",
                                samples_s=f"{step * args.batch_size * world / elapsed:.0f}",
                                refresh=False)
                bar.update()
        mean_loss = comm.sum([loss_sum / max(loss_count, 1)])[0] / world
        epoch_losses.append(mean_loss)
        if rank == 0:
            (bar.write if bar else print)(f"epoch {epoch + 1}: mean training loss {mean_loss:.4f}")
        epoch += 1
    train_seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()

    digest = check_identical(model, comm)
    accuracy = evaluate(model, test_x, test_y, comm)
    summary = {
        "compression": label(args),
        "transport": comm.transport.name,
        "world_size": world,
        "epochs": args.epochs,
        "steps": totals.steps,
        "batch_size_per_rank": args.batch_size,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "schedule": args.schedule,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "test_accuracy": accuracy,
        "final_epoch_loss": epoch_losses[-1],
        "epoch_losses": epoch_losses,
        **exchange_summary(comm, totals, train_seconds),
        "parameter_hash": digest,
        "plan_buckets": optimizer.plan.get("buckets"),
    }
    if args.compression == "auto":  # what it decided, and why (docs/auto.md)
        summary["auto"] = [{k: d[k] for k in ("step", "reason", "kept_name", "why")}
                           for d in optimizer.auto_report()["decisions"]]
    if rank == 0:
        print_summary(summary)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
                f.write("\n")
    return summary


def print_summary(s):
    rows = [
        ("test accuracy", f"{100 * s['test_accuracy']:.2f} %"),
        ("training wall time", f"{s['train_seconds']:.1f} s ({s['steps']} steps)"),
        ("step time", f"{1000 * s['wall_step_seconds']:.1f} ms wall; exchange "
                      f"{1000 * s['engine_step_seconds']:.1f} ms from first gradient to synchronized"),
        ("bytes sent per step per rank", f"{s['bytes_sent_per_step']:,.0f}"),
        ("uncompressed bytes per step", f"{s['uncompressed_bytes_per_step']:,.0f}"),
        ("compression ratio", f"{s['compression_ratio']:.1f}x"),
        ("identical parameters", f"yes on all {s['world_size']} ranks (hash {s['parameter_hash']})"),
    ]
    print(f"result ({s['compression']}, {s['world_size']} ranks over {s['transport']}):")
    for label, value in rows:
        print(f"  {label:<30} {value}")
    sys.stdout.flush()


def launcher_rank():
    """This process's rank as the launcher gave it (errors may come before the transport)."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return os.environ[name]
    return "0"


def run_reporting_errors(script, train_function, args):
    """train_function(args), with the failures a user can act on as one line naming the script
    and the rank, without a traceback."""
    where = f"{script} (rank {launcher_rank()})"
    try:
        import gradcomp
    except ImportError as e:
        sys.exit(f"{where}: cannot import gradcomp ({e}); run scripts/setup.sh and use "
                 "/usr/bin/python3")
    try:
        train_function(args)
    except TrainError as e:
        sys.exit(f"{where}: {e}")
    except gradcomp.Error as e:  # bad spec, a peer that died, a timeout: the message says which
        sys.exit(f"{where}: {type(e).__name__}: {e}")


def main(argv=None):
    run_reporting_errors("train.py", train, parse_args(argv))


if __name__ == "__main__":
    main()
