"""A DistributedOptimizer is freed when its last reference goes, without the garbage collector:
nothing it hands to the C++ side refers back to it (which would make a cycle the collector
cannot see, keeping its engine, threads and transport claim for the life of the process)."""
import gc
import weakref

import torch

import common
import gradcomp.torch as gtorch


def main():
    p = common.parser(__doc__)
    args = p.parse_args()
    rank, world = common.setup()
    gc.disable()  # only reference counting may free it
    model = common.make_model()
    freed = []
    for compression in ("fp16", "topk:ratio=0.01|ef", "auto"):
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = gtorch.DistributedOptimizer(sgd, model.named_parameters(), compression=compression)
        for step in range(2):
            opt.zero_grad()
            common.loss_of(model, *common.batch(rank, step)).backward()
            opt.step()
        ref = weakref.ref(opt)
        del opt
        freed.append(ref() is None)
    common.report(args.out, rank, {"world": world, "freed": freed})


if __name__ == "__main__":
    main()
