"""The DDP communication hook against DistributedOptimizer, under torch.distributed (gloo).

For each codec: a one-parameter model (so DDP has one bucket and the optimizer's plan one
bucket) trained through DDP + gradcomp's hook, and an identical copy through
DistributedOptimizer, on the same data; after the hook's layout warm-up, both paths' gradients
are recorded each step. Also the common model through DDP with the "none" hook and through
plain DDP (its own allreduce)."""
import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import gradcomp.torch as gc

WARMUP = 4  # iterations: the hook compresses once DDP's layout is final (docs/python.md)
STEPS = 3


class OneWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(64, 512) * 0.05)  # 32768 elements

    def forward(self, x):
        return (x @ self.weight)[:, :8]


def ddp_step(ddp, sgd, x, y):
    sgd.zero_grad()
    common.loss_of(ddp, x, y).backward()  # the hook's futures complete within backward
    grads = common.snapshot(p.grad for p in ddp.parameters())
    sgd.step()
    return grads


def hook_against_optimizer(rank, compression):
    hooked = DDP(OneWeight())
    hook = gc.comm_hook(compression)
    hooked.register_comm_hook(None, hook)
    hooked_sgd = torch.optim.SGD(hooked.parameters(), lr=0.1)
    for step in range(WARMUP):  # backward only: the warm-up leaves the weights as they are
        hooked_sgd.zero_grad()
        common.loss_of(hooked, *common.batch(rank, 100 + step)).backward()
    layout = hook._layout

    plain = copy.deepcopy(hooked.module)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = gc.DistributedOptimizer(sgd, plain.named_parameters(), compression=compression)
    # The hook's engine compressed the last warm-up iteration's gradient (its first step); the
    # optimizer's engine compresses the same one, so a codec with state (PowerSGD's warm start)
    # starts the recorded steps from the same state on both paths.
    opt.zero_grad()
    common.loss_of(plain, *common.batch(rank, 100 + WARMUP - 1)).backward()
    opt.synchronize()
    record = {"layout": layout, "hook": [], "optimizer": []}
    for step in range(STEPS):
        x, y = common.batch(rank, step)
        record["hook"].append(ddp_step(hooked, hooked_sgd, x, y))
        opt.zero_grad()
        common.loss_of(plain, x, y).backward()
        opt.synchronize()
        record["optimizer"].append(common.snapshot(p.grad for p in plain.parameters()))
        opt.step()
    record["hook_stats"] = hook.last_step()
    record["optimizer_stats"] = opt.last_step()
    record["plan"] = opt.plan
    return record


SCALES = [2.0 ** 10, 2.0 ** 11, 2.0 ** 9, 2.0 ** 9, 2.0 ** 12]  # a loss scale per step


def scaled_hooks_against_optimizer(rank, compression="topk:ratio=0.005|ef"):
    """A loss scale that changes every step (a GradScaler's), the loss multiplied by it and the
    gradients divided after backward: the optimizer given loss_scale against the hook given it
    and the hook not given it. The feedback memory follows the scale only where told. (Top-k
    keeps 0.5%: OneWeight's gradient is nonzero in 8 of its 512 columns, 1.6%, so a larger
    ratio would send it whole and leave the memory empty.)"""
    current = {"scale": 1.0}

    def scale():
        return current["scale"]

    paths = {}
    for name, given in (("hook", scale), ("hook_without_scale", None)):
        model = DDP(OneWeight())
        model.register_comm_hook(None, gc.comm_hook(compression, loss_scale=given))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(WARMUP):  # as hook_against_optimizer: backward only
            sgd.zero_grad()
            common.loss_of(model, *common.batch(rank, 100 + step)).backward()
        paths[name] = (model, sgd, lambda: None)
    plain = copy.deepcopy(paths["hook"][0].module)
    opt = gc.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1),
                                  plain.named_parameters(), compression=compression,
                                  loss_scale=scale)
    opt.zero_grad()
    common.loss_of(plain, *common.batch(rank, 100 + WARMUP - 1)).backward()
    opt.synchronize()
    paths["optimizer"] = (plain, opt, opt.synchronize)
    record = {name: [] for name in paths}
    for step, s in enumerate(SCALES):
        current["scale"] = s
        x, y = common.batch(rank, step)
        for name, (model, sgd, wait) in paths.items():
            sgd.zero_grad()
            (common.loss_of(model, x, y) * s).backward()
            wait()
            record[name].append(common.snapshot(p.grad for p in model.parameters()))
            for p in model.parameters():
                p.grad /= s
            sgd.step()
    return record


def none_hook_against_plain_ddp(rank):
    """Several DDP buckets (small bucket caps, the first one included), some of them over
    min_compress_elements."""
    dist._DEFAULT_FIRST_BUCKET_BYTES = 50_000  # DDP's documented knob for its first bucket
    models = [DDP(common.make_model(), bucket_cap_mb=0.05) for _ in range(2)]
    hook = gc.comm_hook("none")
    models[1].register_comm_hook(None, hook)
    sgds = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    record = {"plain": [], "hooked": []}
    for step in range(WARMUP + STEPS):  # through the warm-up and beyond
        x, y = common.batch(rank, step)
        record["plain"].append(ddp_step(models[0], sgds[0], x, y))
        record["hooked"].append(ddp_step(models[1], sgds[1], x, y))
    record["layout"] = hook._layout
    return record


class WithUnusedHead(torch.nn.Module):
    """common.make_model's layers and a head the loss never uses."""

    def __init__(self):
        super().__init__()
        self.body = common.make_model()
        self.unused = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.body(x)


def ddp_graph_modes(rank, compression):
    """Per DDP mode that issues collectives of its own during backward or rebuilds its buckets
    late: plain DDP against DDP with the hook, on the same data. With "none" their gradients
    must agree bit for bit (as test_none_hook_equals_plain_ddp); with a lossy codec, the hook
    must have compressed, and the ranks' parameters must agree (checked by the test)."""
    dist._DEFAULT_FIRST_BUCKET_BYTES = 50_000  # several buckets, rebuilt in another layout
    modes = {"find_unused_parameters": (WithUnusedHead, {"find_unused_parameters": True}),
             "static_graph": (common.make_model, {"static_graph": True}),
             "static_graph_unused": (WithUnusedHead, {"static_graph": True})}
    records = {}
    for mode, (make, options) in modes.items():
        torch.manual_seed(0)
        models = [DDP(make(), bucket_cap_mb=0.05, **options) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        hook = gc.comm_hook(compression)
        models[1].register_comm_hook(None, hook)
        sgds = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
        record = {"plain": [], "hooked": []}
        for step in range(WARMUP + STEPS):
            x, y = common.batch(rank, step)
            for model, sgd, kept in zip(models, sgds, (record["plain"], record["hooked"])):
                sgd.zero_grad()
                common.loss_of(model, x, y).backward()
                # The unused head's gradients stay None (DDP leaves them so, and so must the hook).
                kept.append([None if p.grad is None else p.grad.clone()
                             for p in model.parameters()])
                sgd.step()
        record["layout"] = hook._layout
        record["stats"] = hook.last_step()
        record["parameters"] = common.state_bytes(models[1])
        records[mode] = record
    return records


def uneven_inputs(rank, compression):
    """DDP's join() with uneven inputs (rank r has WARMUP + STEPS + 3 r batches): plain DDP
    against DDP with the hook. A rank out of data matches the others' exchange by calling the
    hook with zero buckets from its forward pass, outside any backward pass."""
    models = [DDP(common.make_model()) for _ in range(2)]
    hook = gc.comm_hook(compression, min_compress_elements=0)
    models[1].register_comm_hook(None, hook)
    record = {}
    for name, model in zip(("plain", "hooked"), models):
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        with model.join():
            for step in range(WARMUP + STEPS + 3 * rank):
                sgd.zero_grad()
                common.loss_of(model, *common.batch(rank, step)).backward()
                sgd.step()
        record[name] = common.state_bytes(model)
    record["stats"] = hook.last_step()
    return record


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", action="append", required=True)
    p.add_argument("--graph-modes", action="append", default=[],
                   help="a codec to run the DDP modes with (ddp_graph_modes); repeatable")
    args = p.parse_args()
    rank, _ = common.setup()
    dist.init_process_group("gloo")
    results = {c: hook_against_optimizer(rank, c) for c in args.compression}
    results["none_vs_ddp"] = none_hook_against_plain_ddp(rank)
    results["scaled"] = scaled_hooks_against_optimizer(rank)
    results["graph_modes"] = {c: ddp_graph_modes(rank, c) for c in args.graph_modes}
    results["uneven_inputs"] = {c: uneven_inputs(rank, c) for c in args.graph_modes}
    common.save(args.out, "grads", rank, results)
    common.report(args.out, rank, {"done": True})


if __name__ == "__main__":
    main()
