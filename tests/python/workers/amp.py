"""Mixed-precision style training with a dynamic loss scaler (as torch.cuda.amp.GradScaler
does it: scale the loss, skip the step and halve the scale on an overflow, double it after a
run of good steps), optionally with an overflow injected on rank 0 at one step, under each
--compression in turn (a fresh model, optimizer and scaler for each: one job serves several
codecs). Records, per codec, what each step did and the loss on a fixed evaluation batch."""
import torch

import common
import gradcomp.torch as gc


class DynamicScaler:
    """The parts of GradScaler this test needs, on the CPU (torch 1.13's GradScaler is CUDA
    only): get_scale(), and update() after each step."""

    def __init__(self, scale=2.0 ** 12, growth_interval=4):
        self.scale = scale
        self.growth_interval = growth_interval
        self.good_steps = 0

    def get_scale(self):
        return self.scale

    def update(self, found_inf):
        if found_inf:
            self.scale *= 0.5
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0


def train(args, rank, world, compression):
    """Trains a fresh model under `compression`; returns (its parameters' bytes, its record)."""
    model = common.make_model()
    scaler = DynamicScaler() if args.scaler else None
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  model.named_parameters(), compression=compression,
                                  loss_scale=scaler)
    eval_x, eval_y = common.batch(world + 7, 0, rows=256)
    with torch.no_grad():
        initial_loss = common.loss_of(model, eval_x, eval_y).item()
    outcomes, scales = [], []
    for step in range(args.steps):
        x, y = common.batch(rank, step)
        if step == args.inject_at and rank == 0:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scale = scaler.get_scale() if scaler else 1.0
        scales.append(scale)
        (common.loss_of(model, x, y) * scale).backward()
        found_inf = not all(bool(torch.isfinite(q.grad).all()) for q in model.parameters())
        if found_inf:
            outcomes.append("skipped")
        else:
            for q in model.parameters():
                q.grad.div_(scale)
            opt.step()
            outcomes.append("stepped")
        if scaler:
            scaler.update(found_inf)
    with torch.no_grad():
        eval_loss = common.loss_of(model, eval_x, eval_y).item()
    return common.state_bytes(model), {
        "outcomes": outcomes, "scales": scales, "eval_loss": eval_loss,
        "initial_loss": initial_loss, "finite": opt.last_step()["finite"]}


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", action="append", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--inject-at", type=int, default=-1, help="overflow on rank 0 at this step")
    p.add_argument("--scaler", type=int, default=1, help="0: no loss scaling at all")
    args = p.parse_args()
    rank, world = common.setup()
    params, records = {}, {}
    for compression in args.compression:
        params[compression], records[compression] = train(args, rank, world, compression)
    common.save(args.out, "amp", rank, params)
    common.report(args.out, rank, records)


if __name__ == "__main__":
    main()
