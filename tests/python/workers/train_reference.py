"""Trains the common model with DistributedOptimizer around momentum SGD and records, per step,
this rank's local gradients (before the exchange), the averaged gradients, the clipped ones,
the parameters and momentum buffers after the step and the learning rate used, so the test can
replay the same SGD on the reference mean gradients."""
import copy

import torch
import torch.distributed as dist

import common
import gradcomp.torch as gc


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", default="none")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-3)
    p.add_argument("--step-lr", type=int, default=0, help="StepLR step_size (0: no scheduler)")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ max_norm (0: none)")
    p.add_argument("--accum", type=int, default=1, help="backward_passes_per_step")
    p.add_argument("--transport", default="own", choices=["own", "pg"])
    p.add_argument("--explicit-sync", type=int, default=1,
                   help="call synchronize() after backward (0: read and clip .grad right "
                        "after backward, as most scripts do)")
    args = p.parse_args()
    rank, world = common.setup()
    if args.transport == "pg":
        dist.init_process_group("gloo")

    model = common.make_model()
    shadow = copy.deepcopy(model)
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    opt = gc.DistributedOptimizer(sgd, model.named_parameters(), compression=args.compression,
                                  backward_passes_per_step=args.accum)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, args.step_lr, 0.5) if args.step_lr else None

    record = {"initial": common.snapshot(params), "steps": []}
    for step in range(args.steps):
        local = common.local_gradients(shadow, params, rank, step, args.accum)
        opt.zero_grad()
        for micro in range(args.accum):
            common.loss_of(model, *common.batch(rank, step, micro)).backward()
        if args.explicit_sync:
            opt.synchronize()
        averaged = common.snapshot(p.grad for p in params)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        clipped = common.snapshot(p.grad for p in params)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        if scheduler:
            scheduler.step()
        record["steps"].append({
            "local": local, "averaged": averaged, "clipped": clipped, "lr": lr,
            "params": common.snapshot(params),
            "momentum": common.snapshot(sgd.state[p]["momentum_buffer"] for p in params),
        })
    common.save(args.out, "train", rank, record)
    common.report(args.out, rank, {"world": world, "last_step": opt.last_step()})


if __name__ == "__main__":
    main()
