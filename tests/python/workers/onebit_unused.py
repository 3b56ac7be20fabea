"""Two-stage optimizers with find_unused_parameters: the common model plus three side layers,
`sometimes` (used by rank 1 on odd steps only), `never` (used by no rank) and `late` (used by
rank 0 alone from the second compressed step on: its variance learned by an exact step of its
own), trained for
--steps steps (--warmup exact ones, then compressed). Records the final parameters, the names
of those left unchanged, each parameter's step count, or the error that refused the ranks'
flags (--flag-of-rank R=True|False)."""
import torch

import common
import gradcomp.torch as gc


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = common.make_model()
        torch.manual_seed(1)
        self.sometimes = torch.nn.Linear(8, 8)
        self.never = torch.nn.Linear(8, 8)
        self.late = torch.nn.Linear(8, 8)

    def forward(self, x, use_sometimes, use_late):
        y = self.body(x)
        y = self.sometimes(y) if use_sometimes else y
        return self.late(y) if use_late else y


def main():
    p = common.parser(__doc__)
    p.add_argument("--optimizer", choices=["OneBitAdam", "OneBitLamb"], required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--find-unused", choices=["True", "False"], default="True")
    p.add_argument("--flag-of-rank", action="append", default=[],
                   help="R=True|False: rank R's own find_unused_parameters")
    p.add_argument("--overlap", action="store_true")
    args = p.parse_args()
    rank, _ = common.setup()
    flags = dict(item.split("=") for item in args.flag_of_rank)
    flag = flags.get(str(rank), args.find_unused) == "True"
    model = Model()
    before = {n: common.snapshot([t])[0] for n, t in model.named_parameters()}
    try:
        opt = getattr(gc, args.optimizer)(model.named_parameters(), lr=0.01, weight_decay=0.01,
                                          warmup_steps=args.warmup, seed=4, overlap=args.overlap,
                                          find_unused_parameters=flag)
    except gc.Error as e:
        common.report(args.out, rank, {"refused": str(e)})
        return
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        x, y = common.batch(rank, step)
        late = rank == 0 and step > args.warmup
        common.loss_of(lambda v: model(v, rank == 1 and step % 2 == 1, late), x, y).backward()
        opt.step()
    state = {n: opt.state[t].get("step", 0) for n, t in model.named_parameters()}
    learned = {n: opt.state[t].get("variance_updates", 0) for n, t in model.named_parameters()}
    common.save(args.out, "final", rank,
                {n: t.detach().clone() for n, t in model.named_parameters()})
    common.report(args.out, rank, {
        "unchanged": [n for n, t in model.named_parameters() if torch.equal(t, before[n])],
        "steps": state, "variance_updates": learned,
        "late_moved": max((t - before[n]).abs().max().item()
                          for n, t in model.named_parameters() if n.startswith("late."))})


if __name__ == "__main__":
    main()
