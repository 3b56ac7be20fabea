#!/usr/bin/python3
"""gradcomp's PowerSGD against PyTorch's PowerSGD DDP hook: final loss, test accuracy, bytes.

The target it checks: "PowerSGD at rank r no worse than PyTorch's PowerSGD hook at rank r on
the same model, data, optimizer and seed (final loss), under SGD and under AdamW, at no more
bytes." Every run trains on W ranks (default 2) over one torch.distributed gloo group, with the
same initial model, the same data order (examples/fashion_mnist/train.py's seeded shards) and
the same seed for every contender:

  ddp            DDP, plain allreduce (uncompressed baseline)
  torch_powersgd DDP + torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook,
                 PowerSGDState(process_group=None, matrix_approximation_rank=r,
                 start_powerSGD_iter=S, use_error_feedback=True, warm_start=True,
                 min_compression_rate=2, random_seed=seed)
  gradcomp_hook  DDP + gradcomp.torch.comm_hook("powersgd:rank=r|ef||start=S", transport=<group>,
                 seed=seed, min_compress_elements=0)
  gradcomp_opt   gradcomp.torch.DistributedOptimizer(opt, model.named_parameters(),
                 compression="powersgd:rank=r|ef||start=S", min_compress_elements=0,
                 transport=<group>, seed=seed), no DDP (it broadcasts rank 0's parameters)

PyTorch's hook on gloo: its second and third allreduces are started from callbacks on gloo's
threads, so with several DDP buckets the ranks issue collectives in different orders and gloo
fails (`op.preamble.length <= op.nbytes`). The hook is therefore wrapped so that each bucket's
exchange is finished before the hook returns (the wrapper waits on the hook's future): the
arithmetic is the hook's own, only the overlap with backward is lost.

Models: "cnn" (the Fashion-MNIST CNN of examples/fashion_mnist/train.py, imported from there)
and "transformer" (a 2-layer pre-norm Transformer encoder over the 28 rows of an image as 28
tokens, d_model 64, 4 heads, feed-forward 128, no dropout, mean pooling, linear head).
Optimizers: "sgd" (lr 0.05, momentum 0.9, weight decay 1e-4) and "adamw" (lr 1e-3, weight
decay 0.01), both with a cosine decay of the learning rate to 0 at the last step.

Reported per run: the final training loss (mean over the last 50 steps and the ranks), test
loss and accuracy on the 10,000 test images, and bytes per step per rank after the warm-up:
DDP: every parameter, 4 bytes each; PyTorch's hook: computed from the model's shapes with the
hook's rule (each tensor viewed as shape[0] x rest; compressed when
2*r'*(rows+cols) < rows*cols with r' = min(r, rows, cols), then r'*(rows+cols) floats for P and
Q, else its elements); gradcomp: the mean of last_step()["bytes_sent"] over the compressed steps
(payloads handed to the transport; the 40-byte frame headers stay local on the allreduce
route and are not counted). It also checks that every rank ends with identical parameters.

Start it with gradcomp's launcher (Debian's torchrun crashes on Python 3.11):

    build/bin/gradcomp launch -n 2 -- /usr/bin/python3 scripts/powersgd_vs_torch.py \\
        --models cnn --optimizers sgd,adamw --ranks 4 --out build/powersgd_vs_torch.md

or without a launcher, which then runs `build/bin/gradcomp launch -n --world` itself. Results
go to stdout as a Markdown table with a computed reading (paired differences against the hook,
the noise); --out writes it to a file too, and --json (default: --out with .json) every figure,
rewritten after every run; --resume skips runs already in --json and adds the new ones, so
several commands build one report. Noise: --baseline-seeds runs DDP on several seeds (initial
weights and data order change); --codec-seed-offset N reruns the compressed contenders with
only the compressors' seed changed. --probe (with a small --steps) also records, every step,
||applied gradient − exact mean|| / ||exact mean|| overall and per compressed tensor.
--report-only rebuilds the report from --json without training, and --doc docs/accuracy.md
rewrites the section "## PowerSGD against PyTorch's hook" at the end of that file (the part
above it is scripts/accuracy.py's).
"""
import argparse
import hashlib
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(ROOT, "examples", "fashion_mnist", "train.py")
LAUNCHER = os.path.join(ROOT, "build", "bin", "gradcomp")
CONTENDERS = ["ddp", "torch_powersgd", "gradcomp_hook", "gradcomp_opt"]
LABELS = {
    "ddp": "DDP, uncompressed",
    "torch_powersgd": "DDP + PyTorch powerSGD_hook",
    "gradcomp_hook": "DDP + gradcomp comm_hook",
    "gradcomp_opt": "gradcomp DistributedOptimizer",
}
OPTIMIZERS = {
    "sgd": "SGD lr 0.05, momentum 0.9, weight decay 1e-4, cosine to 0",
    "adamw": "AdamW lr 1e-3, weight decay 0.01, cosine to 0",
}
LAST_STEPS = 50  # the final training loss is the mean over these


def parse_args(argv=None):
    doc = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn", help="comma list of cnn, transformer (cnn)")
    p.add_argument("--optimizers", default="sgd,adamw", help="comma list of sgd, adamw")
    p.add_argument("--ranks", default="4", help="PowerSGD ranks r, comma list (4)")
    p.add_argument("--start", type=int, default=10,
                   help="S: uncompressed steps before PowerSGD starts, every contender (10)")
    p.add_argument("--seeds", default="0",
                   help="seeds of the compressed contenders, comma list (0)")
    p.add_argument("--baseline-seeds", default="0,1",
                   help="seeds of the uncompressed DDP baseline (0,1): their spread is the "
                        "seed-to-seed noise")
    p.add_argument("--codec-seed-offset", type=int, default=0,
                   help="the compressors' randomness (PowerSGDState's random_seed, gradcomp's "
                        "seed) uses seed + this, the model and data order seed alone: a run "
                        "with another offset shows the noise of the random start alone (0)")
    p.add_argument("--contenders", default=",".join(CONTENDERS[1:]),
                   help=f"compressed contenders, comma list of {', '.join(CONTENDERS[1:])}")
    p.add_argument("--steps", type=int, default=0,
                   help="steps per run (0: --epochs passes over the training set)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes when --steps is 0 (1)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank and step (32)")
    p.add_argument("--world", type=int, default=2,
                   help="ranks when the script launches itself (2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    p.add_argument("--data", default=None, help="Fashion-MNIST directory (train.py's default)")
    p.add_argument("--out", metavar="MD", help="also write the Markdown table here")
    p.add_argument("--json", metavar="PATH",
                   help="every figure of every run (default: --out with .json)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in --json and run only the missing ones")
    p.add_argument("--probe", action="store_true",
                   help="also measure, at every step, how far the gradient each contender "
                        "applies is from the exact mean of the ranks' gradients (a second "
                        "forward and backward per step; use with a small --steps)")
    p.add_argument("--progress", action="store_true", help="tqdm bar on rank 0 (if installed)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the report of the runs in --json (no launcher)")
    p.add_argument("--doc", metavar="MD",
                   help="rewrite the section '%s' of this Markdown file (from the heading to "
                        "the end of the file; appended if missing) from the runs in --json, "
                        "e.g. docs/accuracy.md" % "## PowerSGD against PyTorch's hook")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.baseline_seeds = [int(s) for s in args.baseline_seeds.split(",") if s]
    args.contenders = [c for c in args.contenders.split(",") if c]
    for m in args.models:
        if m not in ("cnn", "transformer"):
            p.error(f"unknown model {m!r}")
    for o in args.optimizers:
        if o not in OPTIMIZERS:
            p.error(f"unknown optimizer {o!r}")
    for c in args.contenders:
        if c not in CONTENDERS[1:]:
            p.error(f"unknown contender {c!r}")
    if args.json is None and args.out:
        args.json = os.path.splitext(args.out)[0] + ".json"
    if args.resume and not args.json:
        p.error("--resume needs --json or --out")
    if (args.report_only or args.doc) and not args.json:
        p.error("--report-only and --doc need --json (or --out)")
    if args.probe and not args.steps:
        p.error("--probe needs --steps (it runs a second backward pass per step)")
    return args


def relaunch(argv):
    """Not started by a launcher: start --world ranks of this script with gradcomp's."""
    args = parse_args(argv)
    command = [LAUNCHER, "launch", "-n", str(args.world), "--", sys.executable,
               os.path.abspath(__file__), *argv]
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    return subprocess.call(command)


# ---------------------------------------------------------------------------- models

def load_train_module():
    spec = importlib.util.spec_from_file_location("fashion_mnist_train", TRAIN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model(name, train_module):
    import torch
    import torch.nn as nn

    if name == "cnn":
        return train_module.Net()

    class RowTransformer(nn.Module):
        """The 28 rows of an image as 28 tokens of 28 pixels: linear embedding to d_model,
        learned positions, pre-norm Transformer encoder layers, mean over tokens, linear head."""

        def __init__(self, d_model=64, heads=4, ff=128, layers=2):
            super().__init__()
            self.embed = nn.Linear(28, d_model)
            self.pos = nn.Parameter(0.02 * torch.randn(28, d_model))
            layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, 10)

        def forward(self, x):
            h = self.embed(x.squeeze(1)) + self.pos
            h = self.encoder(h)
            return self.head(self.norm(h).mean(1))

    return RowTransformer()


def make_optimizer(name, params):
    import torch
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def torch_hook_bytes(model, r):
    """Bytes per step per rank of PyTorch's hook after its warm-up: its own rule per tensor."""
    floats = 0
    for p in model.parameters():
        rows = p.shape[0]
        cols = p.numel() // rows
        rr = min(r, rows, cols)
        if (rows + cols) * rr * 2 < rows * cols:  # _should_compress, min_compression_rate 2
            floats += rr * (rows + cols)
        else:
            floats += p.numel()
    return 4 * floats


def compressed_tensors(model, r):
    """Names of the tensors either PowerSGD compresses (the same rule in both)."""
    out = []
    for name, p in model.named_parameters():
        rows = p.shape[0]
        cols = p.numel() // rows
        rr = min(r, rows, cols)
        if p.dim() >= 2 and 2 * rr * (rows + cols) < rows * cols:
            out.append(f"{name} {rows}x{cols}")
    return out


# ---------------------------------------------------------------------------- one run

def synced_torch_powersgd(state, bucket):
    """PyTorch's powerSGD_hook with its bucket finished before returning (gloo ordering)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
    fut = powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def gradient_error(model, params, exact, compressed):
    """||applied − exact|| / ||exact|| over all parameters, and per compressed tensor: the
    applied gradient is .grad after backward (the mean the exchange wrote back)."""
    import torch
    applied = torch.cat([p.grad.reshape(-1) for p in params])
    out = {"all": float((applied - exact).norm() / exact.norm())}
    offset = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if name in compressed:
            e = exact[offset:offset + n]
            out[name] = float((applied[offset:offset + n] - e).norm() / e.norm())
        offset += n
    return out


def digest_words(model):
    h = hashlib.blake2b(digest_size=8)
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    d = h.digest()
    return [int.from_bytes(d[i:i + 2], "little") for i in range(0, 8, 2)]


def run_one(cfg, data, train_module, args, rank, world, group):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import gradcomp.torch as gct

    train_x, train_y, test_x, test_y = data
    contender, r, seed, start = cfg["contender"], cfg["r"], cfg["seed"], args.start
    codec_seed = seed + cfg.get("codec_seed_offset", 0)
    torch.manual_seed(seed)
    model = make_model(cfg["model"], train_module)
    spec = f"powersgd:rank={r}|ef||start={start}"
    hook = None
    if contender == "gradcomp_opt":
        base = make_optimizer(cfg["optimizer"], model.parameters())
        optimizer = gct.DistributedOptimizer(base, model.named_parameters(), compression=spec,
                                             min_compress_elements=0, transport=group,
                                             seed=codec_seed)
        net = model
    else:
        net = DDP(model)
        if contender == "torch_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                       start_powerSGD_iter=start, use_error_feedback=True,
                                       warm_start=True, min_compression_rate=2,
                                       random_seed=codec_seed)
            net.register_comm_hook(state, synced_torch_powersgd)
        elif contender == "gradcomp_hook":
            hook = gct.comm_hook(spec, transport=group, seed=codec_seed,
                                 min_compress_elements=0)
            net.register_comm_hook(None, hook)
        base = make_optimizer(cfg["optimizer"], model.parameters())
        optimizer = base

    per_rank = len(train_y) // world
    steps_per_epoch = -(-per_rank // args.batch_size)
    total = args.steps or max(1, round(args.epochs * steps_per_epoch))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        base, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total) / total)))

    n_params = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    compressed = [n.split()[0] for n in compressed_tensors(model, r or 1)]
    probe = []
    losses, sent, first_compressed = [], [], None
    bar = None
    if args.progress and rank == 0:
        try:
            from tqdm import tqdm
            bar = tqdm(total=total, desc=run_key(cfg), unit="step", file=sys.stderr,
                       dynamic_ncols=True)
        except ImportError:
            pass
    t0 = time.perf_counter()
    step, epoch = 0, 0
    while step < total:
        order = train_module.shard_indices(len(train_y), rank, world, seed, epoch)
        for first in range(0, per_rank, args.batch_size):
            if step == total:
                break
            idx = order[first:first + args.batch_size]
            if args.probe:  # this rank's own gradient, without DDP's or gradcomp's hooks
                own = torch.autograd.grad(F.cross_entropy(model(train_x[idx]), train_y[idx]),
                                          params)
                exact = torch.cat([g.reshape(-1) for g in own])
                dist.all_reduce(exact)
                exact /= world
            optimizer.zero_grad()
            loss = F.cross_entropy(net(train_x[idx]), train_y[idx])
            loss.backward()
            if args.probe:
                probe.append(gradient_error(model, params, exact, compressed))
            optimizer.step()
            schedule.step()
            value = loss.item()
            if not math.isfinite(value):
                raise RuntimeError(f"{run_key(cfg)}: loss {value} at step {step}")
            losses.append(value)
            last = None
            if contender == "gradcomp_opt":
                last = optimizer.last_step()
            elif hook is not None:
                last = hook.last_step()
            if last is not None and last["bytes_sent"] < last["uncompressed_bytes"]:
                if first_compressed is None:
                    first_compressed = step
                sent.append(last["bytes_sent"])
            step += 1
            if bar is not None:
                bar.set_postfix(loss=f"{value:.3f}", refresh=False)
                bar.update()
        epoch += 1
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if contender == "torch_powersgd":
        first_compressed = start  # state.iter >= start_powerSGD_iter from step S (0-based)

    # Test loss and accuracy: identical models, each rank scores its slice, the sums are added.
    model.eval()
    mine = torch.arange(rank, len(test_y), world)
    correct, loss_sum = 0.0, 0.0
    with torch.no_grad():
        for b in range(0, len(mine), 1000):
            i = mine[b:b + 1000]
            out = model(test_x[i])
            correct += float((out.argmax(1) == test_y[i]).sum())
            loss_sum += float(F.cross_entropy(out, test_y[i], reduction="sum"))
    final = float(np.mean(losses[-LAST_STEPS:]))
    table = torch.zeros(world, 4, dtype=torch.float64)
    table[rank] = torch.tensor(digest_words(model), dtype=torch.float64)
    sums = torch.tensor([correct, loss_sum, final, sum(sent), len(sent), seconds],
                        dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(table)
    identical = all(table[i].tolist() == table[0].tolist() for i in range(world))
    if contender == "ddp":
        bytes_step = 4 * n_params
    elif contender == "torch_powersgd":
        bytes_step = torch_hook_bytes(model, r)
    else:
        bytes_step = float(sums[3] / sums[4]) if sums[4] else float("nan")
    result = dict(cfg)
    result.update({
        "start": start if contender != "ddp" else None,
        "steps": total,
        "batch_size_per_rank": args.batch_size,
        "world_size": world,
        "parameters": n_params,
        "final_train_loss": float(sums[2]) / world,
        "test_accuracy": float(sums[0]) / len(test_y),
        "test_loss": float(sums[1]) / len(test_y),
        "bytes_per_step": bytes_step,
        "uncompressed_bytes_per_step": 4 * n_params,
        "first_compressed_step": first_compressed,
        "compressed_steps_counted": int(sums[4]) // world,
        "seconds": float(sums[5]) / world,
        "seconds_per_step": float(sums[5]) / world / total,
        "identical_parameters": identical,
        "loss_curve_rank0_every_10": losses[::10] if rank == 0 else None,
        "spec": spec if contender.startswith("gradcomp") else None,
        "probe": probe or None,
    })
    del net, optimizer, hook
    return result


def run_key(cfg):
    key = f"{cfg['model']}/{cfg['optimizer']}/r{cfg['r']}/{cfg['contender']}/seed{cfg['seed']}"
    if cfg.get("codec_seed_offset"):
        key += f"+codec{cfg['codec_seed_offset']}"
    if cfg.get("probe_steps"):
        key += f"+probe{cfg['probe_steps']}"
    return key


def plan_runs(args):
    runs = []
    for model in args.models:
        for opt in args.optimizers:
            for seed in args.baseline_seeds:
                runs.append(dict(model=model, optimizer=opt, contender="ddp", r=0, seed=seed))
            for r in args.ranks:
                for seed in args.seeds:
                    for c in args.contenders:
                        runs.append(dict(model=model, optimizer=opt, contender=c, r=r, seed=seed,
                                         codec_seed_offset=args.codec_seed_offset))
    probe_steps = args.steps if args.probe else 0
    for run in runs:
        run["probe_steps"] = probe_steps
    return runs


# ---------------------------------------------------------------------------- report

SECTION = "## PowerSGD against PyTorch's hook"


def fmt_bytes(b):
    if b != b:
        return "n/a"
    return f"{b / 1e6:.3f} MB" if b >= 1e6 else f"{b / 1e3:.1f} kB"


def seed_label(x):
    offset = x.get("codec_seed_offset") or 0
    return f"{x['seed']}" + (f" (codec {x['seed'] + offset})" if offset else "")


def sort_runs(results, meta):
    def where(values, v):
        return values.index(v) if v in values else len(values)
    results.sort(key=lambda x: (
        bool(x.get("probe_steps")), where(meta["models"], x["model"]),
        where(meta["optimizers"], x["optimizer"]), x["r"] != 0, -x["r"], x["seed"],
        x.get("codec_seed_offset") or 0, CONTENDERS.index(x["contender"])))


def reference(x, by_key):
    """PyTorch's hook on the same model, optimizer, r, seed (and codec seed)."""
    return by_key.get(run_key(dict(x, contender="torch_powersgd")))


def results_table(results):
    by_key = {run_key(x): x for x in results}
    lines = [
        "| model | optimizer | r | contender | seed | final train loss | Δ vs hook | "
        "test acc % | test loss | Δ vs hook | bytes/step/rank | first compressed step | "
        "s/step |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in results:
        ref = reference(x, by_key)
        delta = delta_test = ""
        if x["contender"].startswith("gradcomp") and ref:
            delta = f"{x['final_train_loss'] - ref['final_train_loss']:+.4f}"
            delta_test = f"{x['test_loss'] - ref['test_loss']:+.4f}"
        fc = "" if x["first_compressed_step"] is None else str(x["first_compressed_step"])
        lines.append(
            f"| {x['model']} | {x['optimizer']} | {x['r'] or '-'} | {LABELS[x['contender']]} | "
            f"{seed_label(x)} | {x['final_train_loss']:.4f} | {delta} | "
            f"{100 * x['test_accuracy']:.2f} | {x['test_loss']:.4f} | {delta_test} | "
            f"{fmt_bytes(x['bytes_per_step'])} | {fc} | {x['seconds_per_step']:.3f} |")
    return lines


def probe_table(probed):
    lines = [
        "| model | optimizer | r | contender | seed | steps | first compressed step k | "
        "error at k | at k+1 | at k+5 | mean over steps ≥ k | per compressed tensor (mean) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x in probed:
        k, pr = x["first_compressed_step"], x["probe"]
        at = [f"{pr[i]['all']:.4f}" if i < len(pr) else "" for i in (k, k + 1, k + 5)]
        later = pr[k:]
        names = [n for n in later[0] if n != "all"] if later else []
        per = ", ".join(f"{n} {sum(e[n] for e in later) / len(later):.3f}" for n in names)
        mean = sum(e["all"] for e in later) / len(later) if later else float("nan")
        lines.append(f"| {x['model']} | {x['optimizer']} | {x['r']} | {LABELS[x['contender']]} "
                     f"| {seed_label(x)} | {x['steps']} | {k} | {' | '.join(at)} | {mean:.4f} "
                     f"| {per} |")
    return lines


def spread(values):
    return max(values) - min(values) if values else float("nan")


def probe_mean(x):
    later = x["probe"][x["first_compressed_step"]:]
    return sum(e["all"] for e in later) / len(later) if later else float("nan")


def reading(main, probed=()):
    """Factual summary of the paired differences against PyTorch's hook, with the noise."""
    by_key = {run_key(x): x for x in main}
    out = []
    plain = [x for x in main if not x.get("codec_seed_offset")]
    worst = []
    for c in ("gradcomp_opt", "gradcomp_hook"):
        for r in sorted({x["r"] for x in plain if x["contender"] == c}, reverse=True):
            pairs = [(x, reference(x, by_key)) for x in plain
                     if x["contender"] == c and x["r"] == r and reference(x, by_key)]
            if not pairs:
                continue
            d = [x["final_train_loss"] - y["final_train_loss"] for x, y in pairs]
            dt = [x["test_loss"] - y["test_loss"] for x, y in pairs]
            da = [100 * (x["test_accuracy"] - y["test_accuracy"]) for x, y in pairs]
            rel = [(x["final_train_loss"] / y["final_train_loss"] - 1) * 100 for x, y in pairs]
            more_bytes = [x for x, y in pairs if x["bytes_per_step"] > y["bytes_per_step"]]
            i = max(range(len(d)), key=lambda j: d[j])
            worst.append((d[i], pairs[i][0]))
            out.append(
                f"- **{LABELS[c]}, r = {r}**, {len(pairs)} run{'s' if len(pairs) > 1 else ''} "
                f"paired with PyTorch's hook "
                f"(same model, optimizer and seed): final training loss "
                f"{sum(d) / len(d):+.4f} on average ({min(d):+.4f} to {max(d):+.4f}, "
                f"{min(rel):+.2f}% to {max(rel):+.2f}%; higher than the hook's in "
                f"{sum(v > 0 for v in d)} of {len(d)}), test loss {sum(dt) / len(dt):+.4f} "
                f"({min(dt):+.4f} to {max(dt):+.4f}), test accuracy {sum(da) / len(da):+.2f} pp "
                f"({min(da):+.2f} to {max(da):+.2f}); bytes per step "
                + ("the same as the hook's in every pair" if not more_bytes and all(
                    x["bytes_per_step"] == y["bytes_per_step"] for x, y in pairs)
                   else f"more than the hook's in {len(more_bytes)} of {len(pairs)}") + ".")
    # Noise 1: the uncompressed baseline on several seeds (initial weights and data order).
    groups = {}
    for x in main:
        if x["contender"] == "ddp":
            groups.setdefault((x["model"], x["optimizer"]), []).append(x)
    seed_spreads = {k: spread([x["final_train_loss"] for x in v])
                    for k, v in groups.items() if len(v) >= 2}
    if seed_spreads:
        out.append(
            "- Seed-to-seed noise (uncompressed baseline, seeds differ in initial weights and "
            "data order): the final training loss ranges over "
            + ", ".join(f"{v:.4f} ({m}/{o})" for (m, o), v in seed_spreads.items())
            + ". Each gradcomp row is paired with the hook's run of the same seed (the same "
            "batches in the last 50 steps), so the paired differences are much smaller than "
            "this spread.")
    # Noise 2: the same run with only the compressors' random seed changed.
    codec = {}
    for x in main:
        if x["contender"] != "ddp":
            key = (x["model"], x["optimizer"], x["r"], x["seed"], x["contender"])
            codec.setdefault(key, []).append(x)
    codec = {k: v for k, v in codec.items() if len(v) >= 2}
    noise_by_r = {}
    for (m, o, r, seed, c), runs in codec.items():
        losses = [x["final_train_loss"] for x in runs]
        accs = [100 * x["test_accuracy"] for x in runs]
        if spread(losses) >= noise_by_r.get(r, (0.0, 0))[0]:
            noise_by_r[r] = (spread(losses), len(runs))
        out.append(
            f"- Noise of the random start alone, {LABELS[c]}, {m}/{o}, r = {r}, seed {seed} "
            f"(the same initial weights and data order, {len(runs)} compressor seeds): final "
            f"training loss {', '.join(f'{v:.4f}' for v in losses)} (mean "
            f"{sum(losses) / len(losses):.4f}, range {spread(losses):.4f}); test accuracy "
            f"{', '.join(f'{v:.2f}' for v in accs)} %.")
    for (m, o, r, seed, c), runs in codec.items():
        ref = codec.get((m, o, r, seed, "torch_powersgd"))
        if c.startswith("gradcomp") and ref:
            mean = sum(x["final_train_loss"] for x in runs) / len(runs)
            mean_ref = sum(x["final_train_loss"] for x in ref) / len(ref)
            out.append(
                f"- Over the compressor seeds, {LABELS[c]} against the hook ({m}/{o}, r = {r}): "
                f"mean final training loss {mean:.4f} against {mean_ref:.4f} "
                f"({mean - mean_ref:+.4f}).")
    # The per-step gradient error of the probe runs, gradcomp against the hook.
    groups = {}
    for x in probed:
        groups.setdefault((x["model"], x["optimizer"], x["r"], x["seed"], x["steps"]), {})[
            x["contender"]] = x
    for (m, o, r, seed, n), by_c in groups.items():
        ref = by_c.get("torch_powersgd")
        if not ref:
            continue
        others = [f"{LABELS[c]} {probe_mean(x):.4f} ({probe_mean(x) / probe_mean(ref) - 1:+.1%})"
                  for c, x in by_c.items() if c.startswith("gradcomp")]
        out.append(f"- Gradient error over the compressed steps of {n}-step probe runs "
                   f"({m}/{o}, r = {r}, seed {seed}), mean of ||applied − exact mean|| / "
                   f"||exact mean||: PyTorch's hook {probe_mean(ref):.4f}, "
                   + ", ".join(others) + ".")
    # The uncompressed warm-up is the same for every contender: the loss of step S agrees.
    warm = {}
    for x in main:
        curve = x.get("loss_curve_rank0_every_10") or []
        if len(curve) > 1 and x.get("start") in (None, 10):
            warm.setdefault((x["model"], x["optimizer"], x["seed"]), set()).add(curve[1])
    if warm:
        same = sum(len(v) == 1 for v in warm.values())
        out.append(f"- Before compression starts every contender trains alike: rank 0's loss at "
                   f"step 10 is the same float in every run of the same model, optimizer and "
                   f"seed in {same} of {len(warm)} groups.")
    for top, x in worst:
        if x["r"] in noise_by_r:
            noise, seeds = noise_by_r[x["r"]]
            verdict = "within" if top <= noise else "larger than"
            out.append(
                f"- {LABELS[x['contender']]}, r = {x['r']}: its largest excess over the hook's "
                f"final training loss, {top:+.4f} ({x['model']}/{x['optimizer']}, seed "
                f"{x['seed']}), is {verdict} the spread caused by the compressor's seed alone "
                f"at r = {x['r']} ({noise:.4f}, the largest range over {seeds} compressor "
                f"seeds).")
    return out


def markdown(results, meta):
    sort_runs(results, meta)
    main = [x for x in results if not x.get("probe_steps")]
    probed = [x for x in results if x.get("probe_steps") and x.get("probe")
              and x["first_compressed_step"] is not None]
    lines = results_table(main) if main else []
    if probed:
        lines += ["", "Gradient error ||applied − exact mean|| / ||exact mean|| per step "
                  "(--probe; short runs: the exact mean of the ranks' own gradients from a "
                  "second backward pass without hooks; applied: .grad after the exchange):", ""]
        lines += probe_table(probed)
    lines += ["", "Reading (computed from the runs above):", ""] + reading(main, probed)
    bad = [run_key(x) for x in results if not x["identical_parameters"]]
    lines.append("- Parameters identical on every rank at the end: "
                 + ("yes, in every run." if not bad else f"NO for {', '.join(bad)}."))
    return "\n".join(lines) + "\n"


def section(results, meta):
    """The section of docs/accuracy.md, from its heading to the end of the file (paragraphs on
    one line each, as scripts/accuracy.py writes the part above)."""
    main = [x for x in results if not x.get("probe_steps")]
    steps = ", ".join(str(n) for n in sorted({x["steps"] for x in main}))
    world = meta["world_size"]
    start = meta["start"]
    params = {x["model"]: x["parameters"] for x in results}
    tensors = "; ".join(f"{m}, r = {r}: {', '.join(t)}"
                        for m, by_r in meta["compressed_tensors"].items()
                        for r, t in by_r.items())
    optimizers = "; ".join(f"`{k}`: {v}" for k, v in meta["optimizer_settings"].items())
    commands = "\n".join(meta["commands"])
    paragraphs = [
        SECTION,
        "Written by `scripts/powersgd_vs_torch.py` (this section, from its heading to the end "
        "of the file). `scripts/accuracy.py` writes the part above and keeps this section as it "
        "is; `/usr/bin/python3 scripts/powersgd_vs_torch.py --report-only --json "
        "docs/data/powersgd_vs_torch.json --doc docs/accuracy.md` rewrites it from the stored "
        "runs (that JSON holds every figure and each run's loss curve).",
        "The target: \"PowerSGD at rank r no worse than PyTorch's PowerSGD hook at rank r on "
        "the same model, data, optimizer and seed (final loss), under SGD and under AdamW, at "
        "no more bytes.\"",
        f"Commands (torch {meta['torch']}, {world} ranks on this 2-core machine, shared with "
        "another engineer's training jobs during most runs; each later command adds its runs "
        "to the same JSON):",
        f"```bash\n{commands}\n```",
        f"Every run: {world} ranks over one torch.distributed gloo group (`gradcomp launch`), "
        f"{steps} steps of {meta['batch_size_per_rank']} images per rank (1 epoch of "
        "Fashion-MNIST; --probe runs are shorter), the same initial weights, data order "
        "(examples/fashion_mnist/train.py's seeded shards) and seed for every contender. "
        f"Models: `cnn`, the CNN of examples/fashion_mnist/train.py "
        f"({params.get('cnn', 0):,} parameters); `transformer`, a 2-layer pre-norm Transformer "
        "encoder over the 28 rows of an image as 28 tokens (d_model 64, 4 heads, feed-forward "
        f"128, no dropout, mean pooling; {params.get('transformer', 0):,} parameters). "
        f"Optimizers: {optimizers}. Contenders, all compressing after S = {start} "
        "uncompressed steps:",
        "\n".join([
            "- DDP, uncompressed: plain allreduce.",
            "- DDP + PyTorch powerSGD_hook: `PowerSGDState(process_group=None, "
            f"matrix_approximation_rank=r, start_powerSGD_iter={start}, use_error_feedback=True, "
            "warm_start=True, min_compression_rate=2, random_seed=seed)`. On gloo this hook "
            "fails with several DDP buckets (the CNN has two): it starts its P and Q allreduces "
            "from callbacks on gloo's threads, so the ranks issue collectives in different "
            "orders. It is wrapped so that each bucket's exchange finishes before the hook "
            "returns; its arithmetic is unchanged, only its overlap with backward is lost.",
            "- DDP + gradcomp comm_hook: `gradcomp.torch.comm_hook(\"powersgd:rank=r|ef||start="
            f"{start}\", transport=<the group>, seed=seed, min_compress_elements=0)`. Its engine "
            "counts steps from when it is built, after DDP's bucket layout has been seen twice "
            f"(3 steps here), so it compresses from step {start + 3}, 3 steps later than the "
            "others.",
            "- gradcomp DistributedOptimizer: `DistributedOptimizer(opt, model.named_parameters(), "
            f"compression=\"powersgd:rank=r|ef||start={start}\", min_compress_elements=0, "
            "transport=<the group>, seed=seed)`, no DDP (it broadcasts rank 0's parameters)."]),
        "Compressed tensors (the same rule in both implementations: a tensor of two or more "
        "dimensions as a shape[0] x rest matrix when 2·r'·(rows + cols) < rows·cols, r' = "
        f"min(r, rows, cols)): {tensors}. The other tensors travel uncompressed.",
        f"Final train loss: the mean training loss of the last "
        f"{meta['last_steps_for_final_loss']} steps, averaged over the ranks. Test loss and "
        "accuracy: the 10,000 test images after the last step. Bytes per step and rank after "
        "the warm-up: DDP, every parameter as float32; PyTorch's hook, computed from the shapes "
        "with its rule (r'·(rows + cols) floats for P and Q per compressed matrix, the other "
        "tensors as they are, 4 bytes each); gradcomp, the mean of "
        "`last_step()[\"bytes_sent\"]` over the compressed steps (the payloads handed to the "
        "transport: P, then Q with the uncompressed tensors; each round's 40-byte frame header "
        "stays local on the allreduce route and is not counted; it would add 2 rounds x 40 "
        "bytes per bucket: 80 bytes for the optimizer's one bucket, 160 for the hook's two on "
        "the CNN). Δ: the gradcomp run minus PyTorch's hook with the same model, optimizer, r "
        "and seed (rows marked \"codec N\" use compressor seed N with the model and data of the "
        "seed before it; their Δ pairs two unrelated random starts). s/step: wall time per "
        "step, not a speed comparison (the hook wrapper gives up its overlap, and the "
        "machine's load changed between runs).",
        markdown(results, meta).rstrip("\n"),
    ]
    return "\n\n".join(paragraphs) + "\n"


def write_outputs(args, results, meta):
    text = markdown(results, meta)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json and not args.report_only:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "runs": results}, f, indent=1)
            f.write("\n")
    return text


def update_doc(path, results, meta):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    at = text.find("\n" + SECTION + "\n")
    kept = text[:at + 1] if at >= 0 else text.rstrip("\n") + "\n\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(kept + section(results, meta))


def report_only(args):
    with open(args.json, encoding="utf-8") as f:
        stored = json.load(f)
    text = write_outputs(args, stored["runs"], stored["meta"])
    if args.doc:
        update_doc(args.doc, stored["runs"], stored["meta"])
    print(text, end="")
    return 0


# ---------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--report-only" in argv:
        return report_only(parse_args(argv))
    if "RANK" not in os.environ:
        return relaunch(argv)
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import gradcomp.torch  # noqa: F401 (fails early if the package is missing)

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="env://")
    group = dist.distributed_c10d._get_default_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    train_module = load_train_module()
    directory = args.data or train_module.DEFAULT_DATA
    data = (*train_module.load_split(directory, "train"),
            *train_module.load_split(directory, "test"))

    meta = {
        "command": "build/bin/gradcomp launch -n %d -- /usr/bin/python3 "
                   "scripts/powersgd_vs_torch.py %s" % (world, shlex.join(argv)),
        "world_size": world, "models": args.models, "optimizers": args.optimizers,
        "optimizer_settings": {o: OPTIMIZERS[o] for o in args.optimizers},
        "start": args.start, "batch_size_per_rank": args.batch_size,
        "torch": torch.__version__, "last_steps_for_final_loss": LAST_STEPS,
        "compressed_tensors": {m: {str(r): compressed_tensors(make_model(m, train_module), r)
                                   for r in args.ranks} for m in args.models},
    }
    meta["commands"] = [meta.pop("command")]
    results = []
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as f:
            previous = json.load(f)
        results = previous["runs"]
        # Several invocations add to one file: keep what the earlier ones recorded.
        old = previous["meta"]
        earlier = old.get("commands", [old["command"]] if "command" in old else [])
        meta["commands"] = earlier + meta["commands"]
        for key in ("models", "optimizers"):
            meta[key] = old[key] + [v for v in meta[key] if v not in old[key]]
        meta["optimizer_settings"] = {**old["optimizer_settings"], **meta["optimizer_settings"]}
        for m, by_rank in old["compressed_tensors"].items():
            meta["compressed_tensors"][m] = {**by_rank, **meta["compressed_tensors"].get(m, {})}
    done = {run_key(x) for x in results}
    for cfg in plan_runs(args):
        if run_key(cfg) in done:
            continue
        t = time.perf_counter()
        result = run_one(cfg, data, train_module, args, rank, world, group)
        dist.barrier()
        if rank == 0:
            results.append(result)
            write_outputs(args, results, meta)
            print(f"{run_key(cfg)}: loss {result['final_train_loss']:.4f}, acc "
                  f"{100 * result['test_accuracy']:.2f} %, {fmt_bytes(result['bytes_per_step'])}"
                  f"/step, {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    if rank == 0:
        print(write_outputs(args, results, meta), flush=True)
        if args.doc:
            update_doc(args.doc, results, meta)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo can hang in teardown; every rank is past the final barrier


if __name__ == "__main__":
    sys.exit(main())
