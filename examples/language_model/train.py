"""Data-parallel training of a small GPT-style language model under AdamW, with compressed
gradient exchange.

Start W ranks with a launcher, e.g.

    build/bin/gradcomp launch -n 2 -- /usr/bin/python3 examples/language_model/train.py \
        --compression "dither"

The text is Debian's fortune cookies as word tokens (corpus.py beside this file). The model: a
token embedding and a learned position embedding, pre-norm Transformer blocks (causal
self-attention, a GELU feed-forward of 4x the width), a final layer norm and an untied output
layer over the vocabulary. Every rank samples its batches of windows from its own contiguous
shard of the training tokens (a seeded generator per rank and seed); gradients are averaged by
gradcomp.torch.DistributedOptimizer around torch.optim.AdamW with a linear warm-up then cosine
decay of the learning rate. At the end the ranks check that they hold identical parameters and
score the validation tokens (each rank a slice); rank 0 prints a summary (and writes it as JSON
with --json, the loss curve included).

The collectives, the parameter check and the summary's exchange figures are those of
examples/fashion_mnist/train.py.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "fashion_mnist"))
import corpus  # noqa: E402
from train import (Collectives, StepTotals, TrainError, check_identical,  # noqa: E402
                   exchange_summary, make_transport, progress_bar, run_reporting_errors)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="none",
                   help='gradcomp option "codec[|feedback[|route]]", or "auto" (chosen and '
                        're-chosen while training, docs/auto.md) (default: none)')
    p.add_argument("--plan", metavar="PATH",
                   help="a gradcomp plan file (docs/plan-format.md; its tensors are the "
                        "parameter names) to run instead of --compression")
    p.add_argument("--auto", type=json.loads, default=None, metavar="JSON",
                   help='with --compression auto: its settings, e.g. \'{"candidates": '
                        '["dither", "fp16"]}\' (docs/auto.md)')
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (600)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per rank and step (16)")
    p.add_argument("--context", type=int, default=64, help="tokens per window (64)")
    p.add_argument("--width", type=int, default=128, help="model width (128)")
    p.add_argument("--layers", type=int, default=2, help="Transformer blocks (2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (4096)")
    p.add_argument("--optimizer", default="adamw",
                   choices=["adamw", "lans", "lamb", "onebitadam", "onebitlamb", "sgd"],
                   help="adamw (torch's, in DistributedOptimizer: the default), lans or lamb "
                        "(gradcomp's, in DistributedOptimizer; lans with --compression "
                        "'onebit|ef|twoway' is CLAN), onebitadam (gradcomp's 1-bit Adam: its own "
                        "exchange, --compression is the momentum's on compressed steps), "
                        "onebitlamb (gradcomp's 1-bit LAMB, likewise, after --onebit-warmup), "
                        "sgd (momentum 0.9)")
    p.add_argument("--beta2", type=float, default=None,
                   help="Adam's second-moment decay (0.95; onebitlamb, and onebitadam with "
                        "--onebit-variance freeze: 0.999, their papers': a variance that decays "
                        "fast leaves rows seen only early, rare tokens, near 0 when it freezes)")
    p.add_argument("--onebit-warmup", type=float, default=0.15,
                   help="onebitlamb, onebitadam --onebit-variance freeze: fraction of the steps "
                        "before the variance freezes (0.15)")
    p.add_argument("--onebit-variance", default="freeze", choices=["freeze", "doubling"],
                   help="onebitadam: which steps exchange exactly and update the variance: "
                        "freeze (after --onebit-warmup, the default) or doubling (0/1 Adam's "
                        "schedule)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (2e-3)")
    p.add_argument("--warmup", type=float, default=0.05,
                   help="fraction of the steps of linear learning-rate warm-up (0.05)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="(0.1)")
    p.add_argument("--seed", type=int, default=0,
                   help="model initialisation, batches and the codecs' randomness (0)")
    p.add_argument("--transport", default="auto", choices=["auto", "gloo", "mpi", "torch"],
                   help="as in examples/fashion_mnist/train.py (auto)")
    p.add_argument("--local-size", type=int, default=0,
                   help="ranks per node for the node routes (hierarchical, sharded); "
                        "0: from the launcher (LOCAL_WORLD_SIZE or mpirun)")
    p.add_argument("--min-compress-elements", type=int, default=16384,
                   help="smaller tensors travel uncompressed (16384)")
    p.add_argument("--data", default=corpus.DEFAULT_DIR,
                   help=f"the fortunes directory or a file from corpus.py --out "
                        f"({corpus.DEFAULT_DIR})")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the summary here")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.context, args.layers) <= 0 or args.lr <= 0:
        p.error("--steps, --batch-size, --context, --layers and --lr must be positive")
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    if not 0 <= args.warmup < 1:
        p.error(f"--warmup is a fraction of the steps in [0, 1), not {args.warmup}")
    if args.plan and (args.optimizer.startswith("onebit") or args.compression != "none"):
        p.error("--plan is for DistributedOptimizer's optimizers (not 1-bit Adam or LAMB), "
                "instead of --compression")
    if args.beta2 is None:
        frozen = (args.optimizer == "onebitlamb"
                  or args.optimizer == "onebitadam" and args.onebit_variance == "freeze")
        args.beta2 = 0.999 if frozen else 0.95
    return args


# ---------------------------------------------------------------------------- the model

class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + feed-forward(norm(x))."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def attention(self, x):
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(w, dim=2))
        scores = q @ k.transpose(-2, -1) / math.sqrt(w // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, w))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)  # untied from the embedding
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------- training

def windows(tokens, starts, context):
    """Inputs and next-token targets for windows beginning at `starts`."""
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = tokens[idx]
    return chunk[:, :-1], chunk[:, 1:]


def validation_loss(model, tokens, context, comm, batch=64):
    """Mean cross-entropy per token over the non-overlapping windows of the validation text;
    each rank scores every W-th window and the sums are added."""
    model.eval()
    starts = torch.arange(0, len(tokens) - context - 1, context)[comm.rank::comm.world]
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            x, y = windows(tokens, starts[i:i + batch], context)
            logits = model(x)
            loss_sum += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                              reduction="sum"))
            count += y.numel()
    model.train()
    total, n = comm.sum([loss_sum, count])
    return total / n


def make_optimizer(args, model):
    decay = [p for p in model.parameters() if p.dim() > 1]  # no decay on norms and biases
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [dict(params=decay, weight_decay=args.weight_decay),
              dict(params=rest, weight_decay=0.0)]
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr, momentum=0.9)
    if args.optimizer in ("lans", "lamb"):
        import gradcomp.torch as gct
        cls = gct.LANS if args.optimizer == "lans" else gct.LAMB
        return cls(groups, lr=args.lr, betas=(0.9, args.beta2))
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2))


def label(args):
    """What the exchange runs: the --compression option, or the plan file."""
    return f"plan {args.plan}" if args.plan else args.compression


def make_distributed(args, model, comm):
    """(the optimizer step() is called on, the one the schedule drives): DistributedOptimizer
    around make_optimizer's, or 1-bit Adam or 1-bit LAMB, which exchange by themselves."""
    import gradcomp.torch as gct
    if args.optimizer in ("onebitadam", "onebitlamb"):
        named = list(model.named_parameters())
        groups = [dict(params=[(n, p) for n, p in named if p.dim() > 1],
                       weight_decay=args.weight_decay),
                  dict(params=[(n, p) for n, p in named if p.dim() <= 1], weight_decay=0.0)]
        common = dict(lr=args.lr, betas=(0.9, args.beta2), compression=args.compression,
                      transport=comm.transport, seed=args.seed,
                      min_compress_elements=args.min_compress_elements)
        if args.optimizer == "onebitlamb":
            optimizer = gct.OneBitLamb(groups, warmup_steps=onebit_warmup(args, args.steps),
                                       **common)
        else:
            optimizer = gct.OneBitAdam(groups, variance=args.onebit_variance,
                                       **onebit_policy(args, args.steps), **common)
        return optimizer, optimizer
    inner = make_optimizer(args, model)
    optimizer = gct.DistributedOptimizer(
        inner, model.named_parameters(), compression=args.compression, plan=args.plan,
        transport=comm.transport, seed=args.seed, local_size=args.local_size,
        min_compress_elements=args.min_compress_elements, auto=args.auto)
    return optimizer, inner


def onebit_policy(args, total_steps):
    """OneBitAdam's schedule: the freeze policy's warm-up, a fraction of the run's steps."""
    if args.onebit_variance == "freeze":
        return dict(warmup_steps=onebit_warmup(args, total_steps))
    return {}


def onebit_warmup(args, total_steps):
    """The exact steps before the variance freezes: --onebit-warmup of the run."""
    return max(1, round(args.onebit_warmup * total_steps))


def make_schedule(optimizer, steps, warmup_fraction):
    warmup = max(1, round(warmup_fraction * steps))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, steps - warmup) /
                                     max(1, steps - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(args):
    torch.set_num_threads(args.threads)
    try:
        data = corpus.load(args.data, args.vocab)
    except (OSError, ValueError) as e:
        raise TrainError(str(e)) from None

    import gradcomp.torch as gct
    comm = Collectives(make_transport(args.transport))
    rank, world = comm.rank, comm.world
    shard = len(data["train"]) // world
    mine = data["train"][rank * shard:(rank + 1) * shard]

    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = GPT(args.vocab, args.context, args.width, args.layers, args.heads)
    optimizer, inner = make_distributed(args, model, comm)
    scheduler = make_schedule(inner, args.steps, args.warmup)
    batches = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    if rank == 0:
        print(f"language model: {world} ranks, compression {label(args)!r}, "
              f"{sum(p.numel() for p in model.parameters()):,} parameters, {args.optimizer}, "
              f"{args.steps} steps of {args.batch_size} x {args.context} tokens x {world} ranks",
              flush=True)

    totals = StepTotals()
    bar = progress_bar(rank == 0 and not args.no_progress, args.steps, "train")
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(mine) - args.context - 1, (args.batch_size,),
                               generator=batches)
        x, y = windows(mine, starts, args.context)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        totals.add(optimizer.last_step())
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise TrainError(f"the loss is {losses[-1]} at step {step} (rank {rank}); try a "
                             "smaller --lr")
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update()
    train_seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()

    digest = check_identical(model, comm)
    val_loss = validation_loss(model, data["valid"], args.context, comm)
    # The training loss curve, averaged over the ranks.
    curve = [v / world for v in comm.sum(losses)]
    tail = curve[-min(50, len(curve)):]
    summary = {
        "compression": label(args),
        "transport": comm.transport.name,
        "world_size": world,
        "steps": totals.steps,
        "batch_size_per_rank": args.batch_size,
        "context": args.context,
        "parameters": sum(p.numel() for p in model.parameters()),
        "optimizer": args.optimizer,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "final_train_loss": sum(tail) / len(tail),
        "train_loss_curve": curve,
        **exchange_summary(comm, totals, train_seconds),
        "parameter_hash": digest,
        "plan": optimizer.plan if hasattr(optimizer, "plan") else None,  # at the end
    }
    if args.compression == "auto":  # what it decided, and why (docs/auto.md)
        summary["auto"] = [{k: d[k] for k in ("step", "reason", "kept_name", "why")}
                           for d in optimizer.auto_report()["decisions"]]
    if rank == 0:
        print(f"result ({label(args)}, {world} ranks over {comm.transport.name}):\n"
              f"  validation loss {val_loss:.4f} (perplexity {math.exp(val_loss):.1f}), "
              f"training loss {summary['final_train_loss']:.4f} (last 50 steps)\n"
              f"  {train_seconds:.1f} s, {summary['bytes_sent_per_step']:,.0f} of "
              f"{summary['uncompressed_bytes_per_step']:,.0f} bytes per step and rank "
              f"({summary['compression_ratio']:.1f}x); identical parameters on all ranks "
              f"({digest})", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
                f.write("\n")
    return summary


def main(argv=None):
    run_reporting_errors("language_model/train.py", train, parse_args(argv))


if __name__ == "__main__":
    main()
