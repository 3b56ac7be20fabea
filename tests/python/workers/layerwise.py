"""Trains the common model with gradcomp's LAMB and LANS inside DistributedOptimizer, for
steps [--begin, --end) under each --compression, optionally resuming from (and saving)
checkpoints of the model and the optimizer (LAMB/LANS moments and gradcomp's compression
state); records the initial and final parameters' bytes, the losses, and the warnings the
wrapper gave."""
import warnings

import torch

import common
import gradcomp.torch as gc

OPTIMIZERS = {"LAMB": gc.LAMB, "LANS": gc.LANS}


def train(rank, name, compression, begin, end, load=None, save=None):
    model = common.make_model()
    inner = OPTIMIZERS[name](model.parameters(), lr=0.01, weight_decay=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = gc.DistributedOptimizer(inner, model.named_parameters(), compression=compression,
                                      seed=3)
    if load:
        checkpoint = torch.load(f"{load}.rank{rank}.pt")
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    losses = []
    for step in range(begin, end):
        opt.zero_grad()
        loss = common.loss_of(model, *common.batch(rank, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   f"{save}.rank{rank}.pt")
    return {"final": common.state_bytes(model), "losses": losses,
            "warnings": [str(w.message) for w in caught if "gradcomp" in str(w.message)],
            "steps": [inner.state[p]["step"] for p in model.parameters()]}


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", action="append", required=True)
    p.add_argument("--begin", type=int, default=0)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--load", help="checkpoint prefix to resume from")
    p.add_argument("--save", help="checkpoint prefix to write at the end")
    args = p.parse_args()
    rank, _ = common.setup()
    finals, initials, report = {}, {}, {}
    for name in OPTIMIZERS:
        for i, compression in enumerate(args.compression):
            key = f"{name} {compression}"
            tag = f"{name}.{i}"
            run = train(rank, name, compression, args.begin, args.end,
                        f"{args.load}.{tag}" if args.load else None,
                        f"{args.save}.{tag}" if args.save else None)
            finals[key] = run.pop("final")
            initials[key] = common.state_bytes(common.make_model())
            report[key] = run
    common.save(args.out, "final", rank, finals)
    common.save(args.out, "initial", rank, initials)
    common.report(args.out, rank, report)


if __name__ == "__main__":
    main()
