"""Training patterns real scripts use around the optimizer, each recorded per step so the test
can compare ranks bit for bit (and with a reference where one is exact):

  two_optimizers  two models, one loss through both, one DistributedOptimizer each
  one_optimizer   the same two models under a single DistributedOptimizer (the reference)
  gan             DCGAN's loop: two discriminator backward passes, its step, then the
                  generator's backward through the discriminator, the generator's step
  skip_step       a GradScaler-style skip: backward, synchronize(), no step() at step 1
  backward_raises backward raises on the ranks in --who at step 1 (after some gradients were
                  handed over); a try/except loop goes on, skipping non-finite steps (or,
                  with --plain-loop, calling step() whatever the gradients hold)
  dead_peer       rank 1 leaves at step 2; rank 0 records what its backward() raised (with
                  --mid-backward S: a bucket per tensor, and rank 0's backward waits S seconds
                  before its first layer's gradient, so the exchange of the others has failed
                  while gradients are still being handed over)
  stalled_peer    rank 1 stops itself (SIGSTOP) at step 2 over a torch.distributed group;
                  rank 0 records the timeout and must then be able to exit
  unfreeze        fine-tuning: the first layer frozen when the optimizer is built, unfrozen at
                  step 2; step() must refuse, then a DistributedOptimizer built again
                  around the same SGD trains on, the ranks together
  add_group       fine-tuning: the first layer added to the wrapped SGD (add_param_group) at
                  step 2; step() must refuse, then a DistributedOptimizer built again around it
                  trains on, twice side by side: one model whose LR scheduler still holds the
                  old wrapper, one whose scheduler holds the SGD (the old wrapper dropped)
  ddp_twice       a model wrapped in DistributedDataParallel given to DistributedOptimizer: the
                  DDP model itself (refused), then its named_parameters() (a warning)
  subgroups       4 ranks in two data-parallel groups ([0, 1], [2, 3]) made by the script, each
                  rank's optimizer over its own group (built on the members only); then a
                  second optimizer over the same group, which must be refused; DDP over the
                  group with gradcomp's hook, first without the hook's transport (refused),
                  then with a twin group
  channels_last   a convolutional model in channels_last memory format (its weights are not
                  contiguous), different on every rank until the optimizer's broadcast, next
                  to a copy of rank 0's model averaged by hand (the reference)
  collectives_in_backward
                  a model whose layers allreduce on the default torch.distributed group in
                  forward and backward (as SyncBatchNorm does), under a DistributedOptimizer
                  given no transport, next to the same model averaged by hand (the reference)
"""
import os
import signal
import sys
import time
import warnings

import torch

import common
import gradcomp
import gradcomp.torch as gc


class Boom(torch.autograd.Function):
    """Raises in backward: the layers after it have their gradients already, those before not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


class SyncMean(torch.autograd.Function):
    """The mean over the ranks, in forward and backward, on the default group (SyncBatchNorm's
    pattern: its collectives run on the training thread, during backward too)."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist
        x = x.clone()
        dist.all_reduce(x)
        return x / dist.get_world_size()

    @staticmethod
    def backward(ctx, grad):
        return SyncMean.forward(ctx, grad)


class Centred(torch.nn.Module):
    """common.make_model's layers, each output centred on the mean over every rank's batch."""

    def __init__(self, seed):
        super().__init__()
        self.layers = common.make_model(seed)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if isinstance(layer, torch.nn.Linear):
                x = x - SyncMean.apply(x.mean(0, keepdim=True))
        return x


def wrap(model, compression, prefix="", bucket_mb=25):
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = [(prefix + n, p) for n, p in model.named_parameters()]
    return gc.DistributedOptimizer(sgd, named, compression=compression, bucket_mb=bucket_mb)


def finite_grads(model):
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
               if p.grad is not None)


def two_models(args, rank, mode):
    a, b = common.make_model(0), common.make_model(1)
    if mode == "two":
        opts = [wrap(a, args.compression, "a."), wrap(b, args.compression, "b.")]
    else:
        named = [("a." + n, p) for n, p in a.named_parameters()] + \
                [("b." + n, p) for n, p in b.named_parameters()]
        sgd = torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)
        opts = [gc.DistributedOptimizer(sgd, named, compression=args.compression)]
    steps = []
    for step in range(args.steps):
        x, y = common.batch(rank, step)
        for o in opts:
            o.zero_grad()
        (common.loss_of(a, x, y) + torch.sin(b(x)).mean()).backward()
        for o in opts:
            o.step()
        steps.append({"a": common.state_bytes(a), "b": common.state_bytes(b)})
    return steps


def gan(args, rank):
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 64))
    discriminator = common.make_model(1)
    opt_g = wrap(generator, args.compression, "generator.")
    opt_d = wrap(discriminator, args.compression, "discriminator.")
    steps = []
    for step in range(args.steps):
        real, _ = common.batch(rank, step)
        noise = torch.randn(16, 16, generator=torch.Generator().manual_seed(step * 7 + rank))
        opt_d.zero_grad()
        discriminator(real).mean().backward()
        fake = generator(noise)
        (-discriminator(fake.detach()).mean()).backward()
        d_grads = common.snapshot(p.grad for p in discriminator.parameters())
        opt_d.step()
        opt_g.zero_grad()
        discriminator(fake).mean().backward()  # reaches the discriminator's parameters too
        opt_g.step()
        steps.append({"d_grads": d_grads, "g": common.state_bytes(generator),
                      "d": common.state_bytes(discriminator)})
    return steps


def skip_step(args, rank):
    model = common.make_model()
    opt = wrap(model, args.compression)
    steps = []
    for step in range(args.steps):
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        opt.synchronize()  # as before scaler.unscale_ and its inf check
        if step != 1:
            opt.step()
        steps.append({"params": common.state_bytes(model)})
    return steps


def backward_raises(args, rank):
    model = common.make_model()
    opt = wrap(model, args.compression)
    raisers = {int(r) for r in args.who.split(",")}
    steps = []
    for step in range(args.steps):
        if args.peer_dies and step == 1 and rank == 1:
            os._exit(0)  # noqa: SLF001 (leaves without a word, as a crashed host would)
        outcome = "stepped"
        (model if args.model_zero_grad else opt).zero_grad()
        try:
            h = model[0](common.batch(rank, step)[0])
            if step == 1 and rank in raisers:
                h = Boom.apply(h)
            rest = torch.nn.Sequential(*list(model)[1:])
            torch.nn.functional.mse_loss(rest(h), common.batch(rank, step)[1]).backward()
            if args.plain_loop:  # no check of its own: step() must skip a non-finite mean
                finite = finite_grads(model)
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    opt.step()
                outcome = "stepped" if finite else "non-finite; " + "; ".join(
                    str(w.message) for w in said)
            elif finite_grads(model):
                opt.step()
            else:
                outcome = "non-finite"  # skipped, as a GradScaler would
        except gradcomp.CommError as e:
            steps.append({"outcome": f"comm error: {e}", "params": common.state_bytes(model)})
            break
        except ValueError as e:
            outcome = f"raised: {e}"
            if args.step_after_raise:
                try:
                    opt.step()
                    outcome += "; step() stepped"
                except gc.Error as e2:
                    outcome += f"; step() refused: {e2}"
        steps.append({"outcome": outcome, "params": common.state_bytes(model)})
    return steps


def dead_peer(args, rank):
    model = common.make_model()
    opt = wrap(model, args.compression, bucket_mb=1 / 1024 if args.mid_backward else 25)
    steps = []
    if args.mid_backward and rank == 0:
        def wait(grad):
            if len(steps) == 2:
                time.sleep(args.mid_backward)
            return grad
        model[0].weight.register_hook(wait)  # runs before that gradient is handed over
    for step in range(args.steps):
        if step == 2 and rank == 1:
            os._exit(0)  # noqa: SLF001 (leaves without a word, as a crashed host would)
        opt.zero_grad()
        try:
            common.loss_of(model, *common.batch(rank, step)).backward()
        except Exception as e:  # noqa: BLE001 (the test checks which type arrived)
            steps.append({"error_type": type(e).__name__, "error": str(e),
                          "is_comm_error": isinstance(e, gc._C.CommError)})
            break
        opt.step()
        steps.append({"params": common.state_bytes(model)})
    return steps


def stalled_peer(args, rank):
    import torch.distributed as dist
    dist.init_process_group("gloo")  # c10d's own timeout: 30 minutes
    model = common.make_model()
    opt = wrap(model, args.compression)
    steps = []
    for step in range(args.steps):
        if step == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        try:
            common.loss_of(model, *common.batch(rank, step)).backward()
        except Exception as e:  # noqa: BLE001 (the test checks which type arrived)
            steps.append({"error_type": type(e).__name__, "error": str(e)})
            common.save(args.out, "steps", rank, steps)
            common.report(args.out, rank, {"steps": len(steps)})
            sys.exit(3)  # as an uncaught error would; the interpreter must get out
        opt.step()
        steps.append({"params": common.state_bytes(model)})
    return steps


def unfreeze(args, rank):
    model = common.make_model()
    model[0].requires_grad_(False)

    def build(sgd):
        return gc.DistributedOptimizer(sgd, model.named_parameters(), compression=args.compression)

    opt = build(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    steps = []
    for step in range(args.steps):
        if step == 2:
            model[0].requires_grad_(True)
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        record = {}
        before = common.state_bytes(model)
        try:
            opt.step()
        except gc.Error as e:
            record = {"error": str(e), "moved": common.state_bytes(model) != before}
            opt = build(opt.optimizer)  # as the error says: the same SGD, its momenta kept
        record["params"] = common.state_bytes(model)
        steps.append(record)
    return steps


def add_group(args, rank):
    models = [common.make_model(), common.make_model()]

    def build(model, sgd):
        return gc.DistributedOptimizer(sgd, model.named_parameters(), compression=args.compression)

    sgds = [torch.optim.SGD(m[1:].parameters(), lr=0.05, momentum=0.9) for m in models]
    opts = [build(m, sgd) for m, sgd in zip(models, sgds)]
    # Model 0's scheduler holds its first wrapper through the rebuild, model 1's only the SGD.
    schedulers = [torch.optim.lr_scheduler.StepLR(opts[0], 3, 0.5),
                  torch.optim.lr_scheduler.StepLR(sgds[1], 3, 0.5)]
    steps = []
    for step in range(args.steps):
        record = {}
        for i, model in enumerate(models):
            if step == 2:
                sgds[i].add_param_group({"params": list(model[0].parameters())})
            opts[i].zero_grad()
            common.loss_of(model, *common.batch(rank, step)).backward()
            before = common.state_bytes(model)
            try:
                opts[i].step()
            except gc.Error as e:
                record[f"error{i}"] = str(e)
                record[f"moved{i}"] = common.state_bytes(model) != before
                opts[i] = build(model, sgds[i])  # as the error says: the same SGD
            schedulers[i].step()
            record[f"params{i}"] = common.state_bytes(model)
        steps.append(record)
    try:
        schedulers[0].optimizer.step()  # the replaced wrapper
    except gc.Error as e:
        steps[-1]["replaced"] = str(e)
    return steps


def ddp_twice(args, rank):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    model = DDP(common.make_model())
    record = {}
    try:
        gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    except gc.Error as e:
        record["error"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                model.named_parameters())
    record["warnings"] = [str(w.message) for w in caught]
    record["warned_at"] = [w.filename for w in caught]
    return [record]


def subgroups(args, rank):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    mine = groups[rank // 2]
    model = common.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = gc.DistributedOptimizer(sgd, model.named_parameters(), compression=args.compression,
                                  transport=mine)
    steps = []
    for step in range(args.steps):
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        opt.step()
        steps.append({"params": common.state_bytes(model)})
    try:
        gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                model.named_parameters(), transport=mine)
    except gc.Error as e:
        steps[-1]["second"] = str(e)
    # DDP over the group, its hook given the group as state (PyTorch's hooks' convention) but
    # no transport: it would average over all four ranks; refused at the first bucket.
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(common.make_model(), process_group=mine)
    ddp.register_comm_hook(mine, gc.comm_hook("none"))
    try:
        common.loss_of(ddp, *common.batch(rank, 0)).backward()
    except gc.Error as e:
        steps[-1]["hook"] = str(e)
    # Given a twin of the group (made on every rank), the hook averages over the group.
    twins = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ddp = DDP(common.make_model(), process_group=mine)
    ddp.register_comm_hook(mine, gc.comm_hook("none", transport=twins[rank // 2]))
    common.loss_of(ddp, *common.batch(rank, 0)).backward()
    steps[-1]["hook_grads"] = b"".join(p.grad.numpy().tobytes() for p in ddp.parameters())
    return steps


def own_gloo_beside_torch(args, rank):
    """DDP needs torch.distributed; gradcomp's own Gloo transport (for the routes over nodes)
    beside it must not try to serve its store on torch's MASTER_PORT."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    ddp = DDP(common.make_model())
    ddp.register_comm_hook(None, gc.comm_hook(args.compression, transport="gloo"))
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    steps = []
    for step in range(args.steps):
        sgd.zero_grad()
        common.loss_of(ddp, *common.batch(rank, step)).backward()
        sgd.step()
        steps.append({"params": common.state_bytes(ddp.module),
                      "transport": gc.get_transport("gloo").name})
    return steps


def average_by_hand(model):
    """The reference exchange: each gradient summed over the default group, then divided."""
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def channels_last(args, rank):
    import torch.distributed as dist
    dist.init_process_group("gloo")

    def convnet(seed):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                                  torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten())
        return net.to(memory_format=torch.channels_last)

    model, reference = convnet(rank), convnet(0)  # the broadcast makes rank 0's everywhere
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = gc.DistributedOptimizer(sgd, model.named_parameters(), compression=args.compression,
                                  min_compress_elements=0)
    by_hand = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    steps = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1009 * rank + step)
        x = torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        by_hand.zero_grad()
        reference(x).square().mean().backward()
        average_by_hand(reference)
        by_hand.step()
        steps.append({"params": common.state_bytes(model),
                      "reference": common.state_bytes(reference),
                      "channels_last": model[0].weight.is_contiguous(
                          memory_format=torch.channels_last)})
    return steps


def collectives_in_backward(args, rank):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    model, reference = Centred(0), Centred(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # Buckets small enough that several are exchanged while backward still runs.
    opt = gc.DistributedOptimizer(sgd, model.named_parameters(), compression=args.compression,
                                  min_compress_elements=0, bucket_mb=0.02)
    by_hand = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    steps = []
    for step in range(args.steps):
        x, y = common.batch(rank, step)
        opt.zero_grad()
        common.loss_of(model, x, y).backward()
        opt.step()
        by_hand.zero_grad()
        common.loss_of(reference, x, y).backward()
        average_by_hand(reference)
        by_hand.step()
        steps.append({"params": common.state_bytes(model),
                      "reference": common.state_bytes(reference)})
    return steps


def main():
    p = common.parser(__doc__)
    p.add_argument("--case", required=True, choices=[
        "two_optimizers", "one_optimizer", "gan", "skip_step", "backward_raises", "dead_peer",
        "stalled_peer", "collectives_in_backward", "unfreeze", "add_group", "ddp_twice",
        "subgroups", "channels_last", "own_gloo_beside_torch"])
    p.add_argument("--compression", default="none")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mid-backward", type=float, default=0,
                   help="dead_peer: seconds rank 0 waits in step 2's backward (see above)")
    p.add_argument("--who", default="0", help="backward_raises: the ranks whose backward raises")
    p.add_argument("--step-after-raise", type=int, default=0,
                   help="backward_raises: call step() after the exception")
    p.add_argument("--peer-dies", type=int, default=0,
                   help="backward_raises: rank 1 leaves before step 1 (rank 0's raises)")
    p.add_argument("--model-zero-grad", type=int, default=0,
                   help="backward_raises: clear with model.zero_grad(), not the optimizer's")
    p.add_argument("--plain-loop", type=int, default=0,
                   help="backward_raises: call step() after every backward that returned, "
                        "finite or not")
    args = p.parse_args()
    rank, world = common.setup()
    if args.case in ("two_optimizers", "one_optimizer"):
        steps = two_models(args, rank, "two" if args.case == "two_optimizers" else "one")
    else:
        steps = globals()[args.case](args, rank)
    common.save(args.out, "steps", rank, steps)
    common.report(args.out, rank, {"world": world, "steps": len(steps)})


if __name__ == "__main__":
    main()
