"""Trains the common model with gradcomp.torch.OneBitAdam for steps [--begin, --end) under a
variance policy (--variance freeze: frozen after --warmup steps; doubling: exact steps every
--interval), or with OneBitLamb (--optimizer onebitlamb, --variance freeze), optionally
resuming from a checkpoint and saving them as it goes (model and optimizer state_dict, one file
per rank, after each --save-at step: PREFIX-at<step>.rank<r>.pt; with --save-one-file also rank
0's single file of every rank's state, PREFIX-at<step>.pt); records the final parameters' bytes
and each step's kind, bytes sent and uncompressed bytes."""
import torch

import common
import gradcomp.torch as gc


def main():
    p = common.parser(__doc__)
    p.add_argument("--begin", type=int, default=0)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--optimizer", choices=["onebitadam", "onebitlamb"], default="onebitadam")
    p.add_argument("--variance", choices=["freeze", "doubling"], required=True)
    p.add_argument("--warmup", type=int, help="freeze: the warm-up's steps")
    p.add_argument("--interval", type=int, default=16, help="doubling: variance_interval")
    p.add_argument("--compression", default="onebit|ef|twoway")
    p.add_argument("--overlap", action="store_true", help="overlap=True")
    p.add_argument("--load", help="checkpoint prefix to resume from (this rank's file)")
    p.add_argument("--load-one-file", help="checkpoint prefix to resume from (rank 0's file)")
    p.add_argument("--save-one-file", action="store_true",
                   help="--save also rank 0's file of every rank's state (all_ranks=True)")
    p.add_argument("--save", help="checkpoint prefix to write after each --save-at step")
    p.add_argument("--save-at", type=int, action="append", default=[],
                   help="save after this step (repeatable); the run goes on")
    args = p.parse_args()
    rank, _ = common.setup()
    model = common.make_model()
    policy = (dict(warmup_steps=args.warmup) if args.variance == "freeze"
              else dict(variance_interval=args.interval))
    if args.optimizer == "onebitlamb":
        assert args.variance == "freeze", "1-bit LAMB freezes after its warm-up"
        opt = gc.OneBitLamb(model.named_parameters(), lr=0.01, weight_decay=0.01,
                            compression=args.compression, seed=4, overlap=args.overlap, **policy)
    else:
        opt = gc.OneBitAdam(model.named_parameters(), lr=0.01, weight_decay=0.01,
                            variance=args.variance, compression=args.compression, seed=4,
                            overlap=args.overlap, **policy)
    if args.load or args.load_one_file:
        checkpoint = torch.load(f"{args.load}.rank{rank}.pt" if args.load
                                else f"{args.load_one_file}.pt")
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    steps = []
    for step in range(args.begin, args.end):
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        exact = opt.exact  # this step's kind
        opt.step()
        stats = opt.last_step()
        steps.append({"exact": exact, "bytes_sent": stats["bytes_sent"],
                      "uncompressed_bytes": stats["uncompressed_bytes"]})
        if args.save and step + 1 in args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       f"{args.save}-at{step + 1}.rank{rank}.pt")
            if args.save_one_file:
                everyone = opt.state_dict(all_ranks=True)  # a collective: every rank calls it
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": everyone},
                               f"{args.save}-at{step + 1}.pt")
    common.save(args.out, "final", rank, common.state_bytes(model))
    common.report(args.out, rank, {"steps": steps})


if __name__ == "__main__":
    main()
