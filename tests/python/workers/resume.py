"""Trains the common model under each --compression for steps [--begin, --end), optionally
resuming from checkpoints (model + DistributedOptimizer state_dict, one file per rank and
codec, or one file rank 0 saved for all ranks) and optionally saving them after step
--save-at (by default at the end; the run goes on, so one job is both the straight run and the
one that saves); records the final parameters' bytes, and those at the save.

With --load, each codec is resumed twice: with the whole state_dict ("full"), and with only
the model and SGD state, dropping gradcomp's compression state ("model_only"), the control
showing that state matters. --check-errors also tries wrong checkpoints (load_errors.py)."""
import torch

import common
import gradcomp.torch as gc
import load_errors


def save_checkpoints(rank, model, opt, save, save_one_file):
    """Each rank its own file under `save`; rank 0 alone one file holding every rank's
    compression state under `save_one_file` (state_dict(all_ranks=True) is collective)."""
    if save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   f"{save}.rank{rank}.pt")
    if save_one_file:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(all_ranks=True)}
        if rank == 0:
            torch.save(state, f"{save_one_file}.all.pt")


def train(rank, compression, begin, end, load=None, model_only=False, one_file=False,
          save=None, save_one_file=None, save_at=None):
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
    at_save = None
    for step in range(begin, end):
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        opt.step()
        if step + 1 == save_at:
            save_checkpoints(rank, model, opt, save, save_one_file)
            at_save = common.state_bytes(model)
    stats = opt.last_step()
    return common.state_bytes(model), at_save, stats["bytes_sent"], stats["uncompressed_bytes"]


def codec_prefix(prefix, i):
    """The checkpoint prefix of the i-th codec's files (None if there are none)."""
    return f"{prefix}.{i}" if prefix else None


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", action="append", required=True)
    p.add_argument("--begin", type=int, default=0)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--load", help="checkpoint prefix to resume from")
    p.add_argument("--one-file", action="store_true",
                   help="--load names the one file rank 0 saved for all ranks")
    p.add_argument("--save", help="checkpoint prefix for each rank's own file")
    p.add_argument("--save-one-file", help="checkpoint prefix for rank 0's one file")
    p.add_argument("--save-at", type=int, help="save after this step (default: --end)")
    p.add_argument("--check-errors", action="store_true")
    args = p.parse_args()
    rank, world = common.setup()
    save_at = args.save_at if args.save_at is not None else args.end

    finals, report = {}, {}
    for i, compression in enumerate(args.compression):
        load = codec_prefix(args.load, i)
        if args.check_errors and i == 0:
            report["errors"] = load_errors.check(rank, world, load, compression,
                                                 "topk:ratio=0.5|ef")
        final, at_save, sent, uncompressed = train(
            rank, compression, args.begin, args.end, load, one_file=args.one_file,
            save=codec_prefix(args.save, i), save_one_file=codec_prefix(args.save_one_file, i),
            save_at=save_at)
        finals[compression] = {"full": final, "at_save": at_save}
        report[compression] = {"bytes_sent": sent, "uncompressed_bytes": uncompressed}
        if load:
            finals[compression]["model_only"] = train(rank, compression, args.begin, args.end,
                                                      load, model_only=True,
                                                      one_file=args.one_file)[0]
    common.save(args.out, "final", rank, finals)
    common.report(args.out, rank, report)


if __name__ == "__main__":
    main()
