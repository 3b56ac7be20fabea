"""Trains the common model under each --compression for steps [--begin, --end), optionally
resuming from checkpoints (model + DistributedOptimizer state_dict, one file per rank and
codec) and optionally saving them at the end; records the final parameters' bytes.

With --load, each codec is resumed twice: with the whole state_dict ("full"), and with only
the model and SGD state, dropping gradcomp's compression state ("model_only"), the control
showing that state matters. --check-errors also tries wrong checkpoints (load_errors.py)."""
import torch

import common
import gradcomp.torch as gc
import load_errors


def train(rank, compression, begin, end, load=None, save=None, model_only=False,
          one_file=False):
    model = common.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = gc.DistributedOptimizer(sgd, model.named_parameters(), compression=compression,
                                  seed=7)
    if load:
        checkpoint = torch.load(f"{load}.all.pt" if one_file else f"{load}.rank{rank}.pt")
        model.load_state_dict(checkpoint["model"])
        if model_only:
            sgd.load_state_dict({k: v for k, v in checkpoint["optimizer"].items()
                                 if k != "gradcomp"})
        else:
            opt.load_state_dict(checkpoint["optimizer"])
    for step in range(begin, end):
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        opt.step()
    if save and one_file:
        # Rank 0 alone writes one file holding every rank's compression state.
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(all_ranks=True)}
        if rank == 0:
            torch.save(state, f"{save}.all.pt")
    elif save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   f"{save}.rank{rank}.pt")
    stats = opt.last_step()
    return common.state_bytes(model), stats["bytes_sent"], stats["uncompressed_bytes"]


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", action="append", required=True)
    p.add_argument("--begin", type=int, default=0)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--load", help="checkpoint prefix to resume from")
    p.add_argument("--save", help="checkpoint prefix to write at the end")
    p.add_argument("--check-errors", action="store_true")
    p.add_argument("--one-file", action="store_true",
                   help="rank 0 saves one checkpoint for all ranks, every rank loads it")
    args = p.parse_args()
    rank, world = common.setup()

    finals, report = {}, {}
    for i, compression in enumerate(args.compression):
        load = f"{args.load}.{i}" if args.load else None
        save = f"{args.save}.{i}" if args.save else None
        if args.check_errors and i == 0:
            report["errors"] = load_errors.check(rank, world, load, compression,
                                                 "topk:ratio=0.5|ef")
        final, sent, uncompressed = train(rank, compression, args.begin, args.end, load, save,
                                          one_file=args.one_file)
        finals[compression] = {"full": final}
        report[compression] = {"bytes_sent": sent, "uncompressed_bytes": uncompressed}
        if load:
            finals[compression]["model_only"] = train(rank, compression, args.begin, args.end,
                                                      load, model_only=True,
                                                      one_file=args.one_file)[0]
    common.save(args.out, "final", rank, finals)
    common.report(args.out, rank, report)


if __name__ == "__main__":
    main()
