"""comm_hook("auto", optimizer=sgd): the shared small model under DDP with gradcomp's hook
choosing the plan among the options recommended under SGD.
Records the parameters at the end, the hook's report, the plans in force per step and (when
not resuming) the timeline; with
--save-at, a checkpoint (model, optimizer, hook) after the decision, from which --load resumes
in new processes."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import gradcomp.torch as gc

# At most 5 + (1 + 2 + 2 + 2) x 3 = 26 steps to the decision (1 uncompressed, 2 proposed, 2
# refined, 2 measured again: no runoff but the lossless one; the checkpoint is taken after 30).
AUTO = {"warmup_steps": 5, "profile_steps": 3, "trial_steps": 3, "max_proposals": 2,
        "runoff": 0, "verbose": False, "drift": 9.0}


def main():
    args = common.resumable_parser(__doc__, steps=36).parse_args()
    rank, _ = common.setup()
    dist.init_process_group("gloo")
    dist._DEFAULT_FIRST_BUCKET_BYTES = 50_000  # several DDP buckets
    model = DDP(common.make_model(), bucket_cap_mb=0.05)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hook = gc.comm_hook("auto", min_compress_elements=1000, auto=AUTO, optimizer=sgd,
                        timeline=None if args.load else f"{args.out}/trace.json")
    model.register_comm_hook(None, hook)
    if args.load:
        state = torch.load(f"{args.load}.rank{rank}.pt")
        model.module.load_state_dict(state["model"])
        sgd.load_state_dict(state["optimizer"])
        hook.load_state_dict(state["hook"])
    plans = []
    for step in range(args.begin, args.steps):
        sgd.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        sgd.step()
        report = hook.auto_report()
        plans.append(report["plan"] if report else None)
        if args.save_at and step + 1 == args.save_at:
            torch.save({"model": model.module.state_dict(), "optimizer": sgd.state_dict(),
                        "hook": hook.state_dict()}, f"{args.out}/ckpt.rank{rank}.pt")
    hook.set_timeline(None)  # closes the trace (valid JSON from here on)
    common.save(args.out, "params", rank, [q.detach().clone() for q in model.parameters()])
    common.report(args.out, rank, {"plans": plans, "report": hook.auto_report(),
                                   "candidates": list(hook._auto_settings.candidates)})


if __name__ == "__main__":
    main()
