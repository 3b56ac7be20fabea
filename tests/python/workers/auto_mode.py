"""compression="auto" on the shared small model under SGD: the scheduler warms up, tries its
proposals and keeps one while training goes on. Records the parameters at the end, the
report, and (with --save-at) a checkpoint taken after the decision, from which --load resumes
in new processes; --errors records the refusals of bad arguments; --local-size groups the ranks
into nodes, --candidates names the options."""
import torch

import common
import gradcomp
import gradcomp.torch as gc

# At most 6 + (1 + 2 + 2 + 2) x 3 = 27 steps to the decision (1 uncompressed, 2 proposed, 2
# refined, 2 measured again: no runoff but the lossless one; the checkpoint is taken after 30).
AUTO = {"warmup_steps": 6, "profile_steps": 3, "trial_steps": 3, "max_proposals": 2,
        "runoff": 0, "verbose": False,
        "drift": 9.0}  # no new search from timing noise: the runs must be reproducible


def build(model, timeline=None, local_size=0, candidates=None):
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    auto = dict(AUTO, candidates=candidates) if candidates else AUTO
    return gc.DistributedOptimizer(sgd, model.named_parameters(), compression="auto",
                                   min_compress_elements=1000, auto=auto, timeline=timeline,
                                   local_size=local_size)


def refusals(model):
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    cases = {
        "with_plan": lambda: gc.DistributedOptimizer(sgd, model.named_parameters(),
                                                     compression="auto", plan={"buckets": []}),
        "auto_without_auto": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="fp16", auto={"warmup_steps": 3}),
        "unknown_key": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto={"warmup": 3}),
        "bad_candidate": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto={"candidates": ["nosuch"]}),
        "bad_steps": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto={"trial_steps": 1}),
        "bad_link_change": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto={"link_change": 0.5}),
        "bad_type": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto={"warmup_steps": "20"}),
        "candidates_string": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto={"candidates": "fp16"}),
        "nan_setting": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto={"drift": float("nan")}),
        "not_a_dict": lambda: gc.DistributedOptimizer(
            sgd, model.named_parameters(), compression="auto", auto='{"warmup_steps": 20}'),
    }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = "no error"
        except gradcomp.Error as e:
            out[name] = str(e)
    return out


def main():
    p = common.resumable_parser(__doc__, steps=36)
    p.add_argument("--errors", action="store_true")
    p.add_argument("--local-size", type=int, default=0, help="ranks per node (0: the launcher's)")
    p.add_argument("--candidates", help="';'-separated options instead of the recommended ones")
    args = p.parse_args()
    rank, world = common.setup()
    model = common.make_model()
    opt = build(model, timeline=None if args.load else f"{args.out}/trace.json",
                local_size=args.local_size,
                candidates=args.candidates.split(";") if args.candidates else None)
    if args.load:
        state = torch.load(f"{args.load}.rank{rank}.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    record = {"plans": []}
    for step in range(args.begin, args.steps):
        x, y = common.batch(rank, step)
        opt.zero_grad()
        common.loss_of(model, x, y).backward()
        opt.step()
        record["plans"].append(opt.auto_report()["plan"])
        if args.save_at and step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       f"{args.out}/ckpt.rank{rank}.pt")
    record["report"] = opt.auto_report()
    if not args.load:
        record["calibration"] = opt.write_auto_calibration(f"{args.out}/calibration.rank{rank}")
    record["last_step"] = opt.last_step()
    if args.errors:
        record["errors"] = refusals(model)
    opt.set_timeline(None)  # closes the trace (valid JSON from here on)
    common.save(args.out, "params", rank, [p.detach().clone() for p in model.parameters()])
    common.report(args.out, rank, record)


if __name__ == "__main__":
    main()
