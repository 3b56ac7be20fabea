"""Trains the common model with one --compression that routes over dedicated parameter servers
(route 'servers'), recording the parameters' digest after every step. --kill-server S makes
rank 0 kill server S (SIGKILL) after step --at; --exit-rank R makes rank R leave abruptly
after step --at; --checkpoint asks for this rank's state_dict at the end and reports what happened; --save P
--save-after K has rank 0 write one checkpoint of every rank (state_dict(all_ranks=True)) after
K steps, and --load P --begin K resumes from it (--model-only: the model and SGD state alone);
--ddp trains through DDP with gradcomp's communication hook instead; --pause S after step --at
has every rank sleep S seconds (a long evaluation between steps)."""
import hashlib
import os
import signal
import subprocess
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import gradcomp
import gradcomp.torch as gc


def server_pid(index):
    """The pid of `gradcomp server --index <index>` of this job (its store names the job)."""
    store = os.environ["GRADCOMP_SERVER_STORE"]
    pattern = f"server --index {index} .*--store {store}"
    return int(subprocess.check_output(["pgrep", "-f", pattern], text=True).split()[0])


def train_ddp(rank, compression, args):
    """The common model through DDP and gradcomp's hook; the parameters' digest per step."""
    model = DDP(common.make_model())
    hook = gc.comm_hook(compression, seed=11)
    model.register_comm_hook(None, hook)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.load:
        checkpoint = torch.load(args.load)
        model.module.load_state_dict(checkpoint["model"])
        sgd.load_state_dict(checkpoint["optimizer"])
        hook.load_state_dict(checkpoint["hook"])
    digests = []
    for step in range(args.begin, args.steps):
        if step == args.save_after:
            state = {"model": model.module.state_dict(), "optimizer": sgd.state_dict(),
                     "hook": hook.state_dict(all_ranks=True)}
            if rank == 0:
                torch.save(state, args.save)
        sgd.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        sgd.step()
        digests.append(hashlib.sha256(common.state_bytes(model.module)).hexdigest())
    return digests, hook.last_step()


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--transport", default="default", choices=["default", "pg"])
    p.add_argument("--kill-server", type=int, default=-1)
    p.add_argument("--exit-rank", type=int, default=-1)
    p.add_argument("--at", type=int, default=1)
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--save")
    p.add_argument("--save-after", type=int, default=-1)
    p.add_argument("--load")
    p.add_argument("--begin", type=int, default=0)
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--pause", type=float, default=0.0)
    args = p.parse_args()
    rank, world = common.setup()
    if args.transport == "pg" or args.ddp:
        dist.init_process_group("gloo")
    if args.ddp:
        digests, stats = train_ddp(rank, args.compression, args)
        common.report(args.out, rank, {"world": world, "digests": digests, "stats": stats})
        return
    model = common.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = gc.DistributedOptimizer(sgd, model.named_parameters(), compression=args.compression,
                                  seed=11)
    if args.load:
        checkpoint = torch.load(args.load)
        model.load_state_dict(checkpoint["model"])
        if args.model_only:
            sgd.load_state_dict({k: v for k, v in checkpoint["optimizer"].items()
                                 if k != "gradcomp"})
        else:
            opt.load_state_dict(checkpoint["optimizer"])
    digests, error = [], None
    try:
        for step in range(args.begin, args.steps):
            if step == args.save_after:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(all_ranks=True)}
                if rank == 0:
                    torch.save(state, args.save)
            opt.zero_grad()
            common.loss_of(model, *common.batch(rank, step)).backward()
            opt.step()
            digests.append(hashlib.sha256(common.state_bytes(model)).hexdigest())
            if step == args.at and rank == 0 and args.kill_server >= 0:
                os.kill(server_pid(args.kill_server), signal.SIGKILL)
                time.sleep(0.5)
            if step == args.at and rank == args.exit_rank:
                os._exit(3)
            if step == args.at and args.pause > 0:
                time.sleep(args.pause)
    except gradcomp.Error as e:
        error = {"type": type(e).__name__, "message": str(e), "step": len(digests)}
    record = {"world": world, "digests": digests, "error": error,
              "routes": sorted({b["route"] for b in opt.plan["buckets"]})}
    if args.checkpoint and error is None:
        try:
            opt.state_dict()
            record["checkpoint"] = "saved"
        except gradcomp.Error as e:
            record["checkpoint"] = str(e)
    if args.checkpoint:  # and stop the servers before exit (the exit would too)
        del opt  # the last reference: the optimizer, its engine and its claim go now
        gradcomp.stop_servers()
        gradcomp.stop_servers()  # a second stop does nothing
    common.report(args.out, rank, record)
    if error is not None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
