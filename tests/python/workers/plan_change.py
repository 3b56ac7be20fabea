"""DistributedOptimizer.set_compression mid-training: a model whose gradients do not depend on
its parameters (loss = <p, x> with rank- and step-dependent x, in two micro-batches of x / 2
accumulated per step), plain SGD at lr 1, so the
parameters end at p0 minus everything applied. Plans change every few steps (top-k with error
feedback, PowerSGD with error feedback, a plan given as a dict, one that cuts the weight into
three slices in different buckets, the two-way route, then none);
the record holds, per rank, the parameters and the largest distance from p0 minus the sum of
the true means, and the errors of the refused changes."""
import torch

import common
import gradcomp
import gradcomp.torch as gc

SIZES = {"weight": 16384, "bias": 10}


def inputs(rank, step):
    g = torch.Generator().manual_seed(7919 * step + rank + 1)
    return {name: torch.randn(n, generator=g) for name, n in SIZES.items()}


def refused(call):
    try:
        call()
    except gradcomp.Error as e:  # CommError is one too
        return f"{type(e).__name__}: {e}"
    return "no error"


def main():
    args = common.parser(__doc__).parse_args()
    rank, world = common.setup()
    params = {name: torch.nn.Parameter(torch.zeros(n)) for name, n in SIZES.items()}
    sgd = torch.optim.SGD(params.values(), lr=1.0)
    opt = gc.DistributedOptimizer(sgd, list(params.items()), compression="topk:ratio=0.01|ef",
                                  backward_passes_per_step=2)
    weight_plan = {"format": "gradcomp-plan", "version": 1,
                   "tensors": [{"name": "bias", "elements": 10},
                               {"name": "weight", "elements": 16384}],
                   "buckets": [{"tensors": [1], "codec": "randomk:ratio=0.1", "feedback": "ef"},
                               {"tensors": [0], "codec": "none"}]}
    # Pieces: bias 0, weight#0..2 1-3 (plan format 3).
    sliced_plan = {"format": "gradcomp-plan", "version": 3,
                   "tensors": [{"name": "bias", "elements": 10},
                               {"name": "weight", "elements": 16384, "slices": 3}],
                   "buckets": [{"tensors": [1], "codec": "topk:ratio=0.05", "feedback": "ef",
                                "route": "allgather"},
                               {"tensors": [3, 0], "codec": "none"},
                               {"tensors": [2], "codec": "randomk:ratio=0.1", "feedback": "ef"}]}
    schedule = {3: ("powersgd:rank=2|ef", None), 6: ("none", weight_plan),
                7: ("none", sliced_plan), 9: ("efsignsgd|ef|twoway", None), 12: ("none", None)}
    record = {"errors": {}}
    step = 0
    for step in range(14):
        if step in schedule:
            compression, plan = schedule[step]
            opt.set_compression(compression, plan=plan)
        x = inputs(rank, step)
        for micro in range(2):
            loss = sum((params[n] * x[n] / 2).sum() for n in SIZES)
            loss.backward()
            if step == 4 and micro == 0:  # refused during accumulation; nothing changes
                record["errors"]["mid_step"] = refused(lambda: opt.set_compression("fp16"))
        opt.step()
        opt.zero_grad()
        if step == 1:
            record["bytes_topk"] = opt.last_step()["bytes_sent"]
    # Ranks that ask for different plans: an error on every rank, the plan they had kept.
    record["errors"]["differ"] = refused(
        lambda: opt.set_compression("fp16" if rank % 2 else "none"))
    record["plan_after"] = opt.plan["buckets"][0]["codec"]
    expected = {n: torch.zeros(k, dtype=torch.float64) for n, k in SIZES.items()}
    for s in range(step + 1):
        for r in range(world):
            for n, x in inputs(r, s).items():
                expected[n] -= x.double() / world
    record["worst"] = max(float((params[n].double() - expected[n]).abs().max()) for n in SIZES)
    record["moved"] = max(float(params[n].abs().max()) for n in SIZES)
    common.save(args.out, "params", rank, {n: p.detach().clone() for n, p in params.items()})
    common.report(args.out, rank, record)


if __name__ == "__main__":
    main()
