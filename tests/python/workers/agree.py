"""Trains the common model under each --compression for a few steps and records, per step,
the parameters' bytes (the test checks every rank holds the same), plus the plan and the
traffic of the last step."""
import hashlib

import torch
import torch.distributed as dist

import common
import gradcomp
import gradcomp.torch as gc


def train(rank, compression, steps, local_size, transport):
    model = common.make_model()
    initial = common.state_bytes(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    try:
        opt = gc.DistributedOptimizer(sgd, model.named_parameters(), compression=compression,
                                      local_size=local_size, transport=transport, seed=11)
    except gradcomp.Error as e:  # refused alike on every rank (the test says which may be)
        return {"error": str(e)}
    digests = []
    for step in range(steps):
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        opt.step()
        digests.append(hashlib.sha256(common.state_bytes(model)).hexdigest())
    return {"error": None, "digests": digests, "moved": common.state_bytes(model) != initial,
            "routes": sorted({b["route"] for b in opt.plan["buckets"]}),
            "codecs": sorted({b["codec"] for b in opt.plan["buckets"]}),
            "stats": opt.last_step()}


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", action="append", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--local-size", type=int, default=0)
    p.add_argument("--transport", default="default", choices=["default", "gloo", "mpi", "pg"])
    args = p.parse_args()
    rank, world = common.setup()
    transport = None
    if args.transport == "pg":
        dist.init_process_group("gloo")  # transport=None then means this process group
    elif args.transport != "default":
        transport = args.transport
    results = {c: train(rank, c, args.steps, args.local_size, transport)
               for c in args.compression}
    common.report(args.out, rank, {"world": world, "transport": gc_transport_name(transport),
                                   "results": results})


def gc_transport_name(kind):
    """The name of the transport gradcomp used (get_transport, formerly transport)."""
    get = getattr(gc, "get_transport", None) or gc.transport
    return get(kind).name


if __name__ == "__main__":
    main()
