"""Bad or unusual input to DistributedOptimizer, one --case per job; each rank reports what
happened (errors as [type name, message, is a gradcomp.Error])."""
import copy

import torch

import common
import gradcomp
import gradcomp.torch as gc


def error_of(action):
    try:
        action()
    except Exception as e:  # noqa: BLE001  (the test judges the type)
        return [type(e).__name__, str(e), isinstance(e, gradcomp.Error)]
    return None


def wrap(model, **options):
    return gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), **options)


def unknown_codec(rank, out):
    return {"error": error_of(lambda: wrap(common.make_model(), compression="zip")),
            "codecs": list(gradcomp.codec_names())}


def bad_numbers(rank, out):
    """Numbers out of range: a gradcomp.Error naming the argument, before any collective."""
    cases = {"bucket_mb": -1.0, "min_compress_elements": -5, "seed": -1,
             "backward_passes_per_step": 0, "codec_threads": 0}
    errors = {k: error_of(lambda k=k, v=v: wrap(common.make_model(), **{k: v}))
              for k, v in cases.items()}
    errors["bucket_mb nan"] = error_of(lambda: wrap(common.make_model(), bucket_mb=float("nan")))
    errors["seed str"] = error_of(lambda: wrap(common.make_model(), seed="1"))
    return errors


def route_and_small_model(rank, out):
    """A route that cannot carry the codec is a SpecError about the text the user wrote; a
    model too small to compress under the default plan warns."""
    import warnings
    route = error_of(lambda: wrap(common.make_model(), compression="topk:ratio=0.01|ef|allreduce"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap(torch.nn.Linear(4, 4), compression="topk:ratio=0.01|ef")
        small = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap(common.make_model(), compression="topk:ratio=0.01|ef")
        large = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        embedding = torch.nn.Embedding(100, 4, sparse=True)
        gc.DistributedOptimizer(torch.optim.SparseAdam(embedding.parameters()), embedding,
                                compression="topk:ratio=0.01|ef")
        sparse_only = [str(w.message) for w in caught]
    return {"route": route, "small": small, "large": large, "sparse_only": sparse_only}


def not_recommended(rank, out):
    """A codec the accuracy tables saw losing under this optimizer's family warns, naming it;
    so does one that held only after a warm-up the option lacks; one that held does not; a plan
    given by hand is the user's choice (no warning)."""
    import warnings

    def warnings_of(optimizer_class, compression, **options):
        model = common.make_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.DistributedOptimizer(optimizer_class(model.parameters(), lr=1e-3),
                                    model.named_parameters(), compression=compression, **options)
        return [str(w.message) for w in caught]
    plan = wrap(common.make_model(), compression="topk:ratio=0.01|ef").plan
    return {"adamw_topk": warnings_of(torch.optim.AdamW, "topk:ratio=0.01|ef"),
            "adamw_fp16": warnings_of(torch.optim.AdamW, "fp16"),
            "sgd_topk": warnings_of(torch.optim.SGD, "topk:ratio=0.01|ef"),
            "sgd_efsignsgd": warnings_of(torch.optim.SGD, "efsignsgd|ef"),
            "sgd_efsignsgd_warm": warnings_of(torch.optim.SGD, "efsignsgd|ef||start=50"),
            "adamw_efsignsgd_warm": warnings_of(torch.optim.AdamW, "efsignsgd|ef||start=50"),
            "adamw_plan": warnings_of(torch.optim.AdamW, "none", plan=plan)}


def bad_plan(rank, out):
    """A plan string that is not JSON, one with an unknown codec: where and which field; a
    shape that is not the parameter's. A plan without shapes gets the parameters' shapes."""
    model = common.make_model()
    plan = wrap(model, compression="powersgd:rank=2|ef").plan
    given = {**plan, "version": 1,
             "tensors": [{"name": t["name"], "elements": t["elements"]} for t in plan["tensors"]]}
    return {"syntax": error_of(lambda: wrap(common.make_model(), plan='{"format": "gradcomp-plan",')),
            "codec": error_of(lambda: wrap(common.make_model(), plan={
                "format": "gradcomp-plan", "version": 1,
                "tensors": [{"name": "0.weight", "elements": 16384}],
                "buckets": [{"tensors": [0], "codec": "nosuch"}]})),
            "shape": error_of(lambda: wrap(common.make_model(), plan={
                "format": "gradcomp-plan", "version": 2,
                "tensors": [{"name": "0.weight", "elements": 16384, "shape": [16384]}],
                "buckets": [{"tensors": [0], "codec": "none"}]})),
            "default_shapes": [(t["name"], t["shape"]) for t in plan["tensors"]],
            "filled_shapes": [(t["name"], t["shape"]) for t in wrap(model, plan=given).plan["tensors"]]}


def float64_parameter(rank, out):
    model = common.make_model()
    model[2].double()  # the middle layer's weight and bias become float64
    return {"error": error_of(lambda: wrap(model, compression="fp16"))}


def same_parameters_twice(rank, out):
    """A second DistributedOptimizer over the parameters a live one exchanges, around another
    optimizer (an Adam beside the SGD): refused by name (both would write their mean into the
    same .grad); the first trains on, and once it is gone the second may be built."""
    model = common.make_model()
    first = wrap(model, compression="fp16")
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    refused = error_of(lambda: gc.DistributedOptimizer(adam, model.named_parameters()))
    train(model, first, rank, 0)
    del first  # its exchange ends with it
    train(model, gc.DistributedOptimizer(adam, model.named_parameters()), rank, 1)
    return {"refused": refused, "params": common.state_bytes(model).hex()}


def train(model, opt, rank, step):
    opt.zero_grad()
    common.loss_of(model, *common.batch(rank, step)).backward()
    opt.step()


def frozen_parameter(rank, out):
    """requires_grad=False on the first layer: left out of the plan and never changed."""
    model = common.make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = common.snapshot(model[0].parameters())
    opt = wrap(model, compression="fp16")
    for step in range(2):
        opt.zero_grad()
        common.loss_of(model, *common.batch(rank, step)).backward()
        opt.step()
    return {"plan_tensors": [t["name"] for t in opt.plan["tensors"]],
            "frozen_unchanged": all(torch.equal(a, b)
                                    for a, b in zip(frozen, model[0].parameters())),
            "frozen_grads": [p.grad is None for p in model[0].parameters()],
            "params": common.state_bytes(model).hex()}


class WithExtra(torch.nn.Module):
    """The common model plus a head used only when asked (an unused parameter otherwise)."""

    def __init__(self):
        super().__init__()
        self.body = common.make_model()
        self.extra = torch.nn.Linear(64, 8)

    def forward(self, x, use_extra):
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


def unused_parameter(rank, out):
    """extra is unused everywhere at step 0, used by rank 0 only at step 1."""
    model = WithExtra()
    shadow = copy.deepcopy(model)
    opt = wrap(model, compression="none")
    steps = []
    for step in range(2):
        use = step == 1 and rank == 0
        x, y = common.batch(rank, step)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(shadow(x, use), y).backward()
        local = shadow.extra.weight.grad
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, use), y).backward()
        opt.synchronize()
        steps.append({"local": None if local is None else local.clone(),
                      "averaged": model.extra.weight.grad.clone()})
        opt.step()
        steps[-1]["params"] = common.state_bytes(model)
    common.save(out, "unused", rank, steps)
    return {"done": True}


def unused_parameter_found(rank, out):
    """As unused_parameter, under Adam with weight decay and find_unused_parameters=True."""
    model = WithExtra()
    adam = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    opt = gc.DistributedOptimizer(adam, model.named_parameters(), compression="none",
                                  find_unused_parameters=True)
    steps = []
    for step in range(2):
        use = step == 1 and rank == 0
        before = model.extra.weight.detach().clone()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(*[common.batch(rank, step)[0], use]),
                                     common.batch(rank, step)[1]).backward()
        grad = model.extra.weight.grad
        steps.append({"grad_is_none": grad is None,
                      "averaged": None if grad is None else grad.clone()})
        opt.step()
        steps[-1]["extra_moved"] = not torch.equal(before, model.extra.weight.detach())
        steps[-1]["params"] = common.state_bytes(model)
    common.save(out, "unused_found", rank, steps)
    return {"done": True}


def sparse_gradient(rank, out):
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16, sparse=True),
                                torch.nn.Linear(16, 4))
    opt = wrap(model, compression="none")
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]]) + rank
    backward = error_of(lambda: model(tokens).sum().backward())
    return {"backward": backward, "step": error_of(opt.step)}


def backward_twice(rank, out):
    """Two backward passes before step(): each exchanges .grad as it stands when it ends, as
    DDP does, so after the second, .grad is the mean over ranks of (first mean + this rank's
    second gradient)."""
    model = common.make_model()
    opt = wrap(model, compression="none")  # alive: its hooks hold it only weakly
    first = mean_of_local_gradients(model, step=0)
    seconds = [local_gradients(model, r, step=1) for r in range(2)]
    common.loss_of(model, *common.batch(rank, 0)).backward()
    after_first = all(torch.equal(e, p.grad) for e, p in zip(first, model.parameters()))
    second = error_of(lambda: common.loss_of(model, *common.batch(rank, 1)).backward())
    expected = [((f + a) + (f + b)) * 0.5 for f, a, b in zip(first, *seconds)]
    after_second = all(torch.equal(e, p.grad) for e, p in zip(expected, model.parameters()))
    return {"optimizer": repr(opt), "second": second, "after_first": after_first,
            "after_second": after_second}


def local_gradients(model, rank, step):
    local = copy.deepcopy(model)
    common.loss_of(local, *common.batch(rank, step)).backward()
    return [p.grad for p in local.parameters()]


def mean_of_local_gradients(model, step):
    """Both ranks' local gradients of this step, averaged, computed on a copy of the model."""
    grads = [local_gradients(model, r, step) for r in range(2)]
    return [(a + b) * 0.5 for a, b in zip(*grads)]


def different_models(rank, out):
    """Rank 1's middle layer is narrower: the ranks registered different tensors."""
    model = common.make_model()
    if rank == 1:
        model[2] = torch.nn.Linear(256, 32)
        model[4] = torch.nn.Linear(32, 8)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    try:
        wrap(model, compression="fp16")
    except Exception as e:
        common.report(out, rank, {"error": [type(e).__name__, str(e),
                                            isinstance(e, gradcomp.Error)],
                                  "shapes": shapes})
        raise  # the process ends with the error, as a user's script would
    common.report(out, rank, {"error": None, "shapes": shapes})
    return None


CASES = {f.__name__: f for f in (unknown_codec, bad_numbers, bad_plan, route_and_small_model,
                                 not_recommended,
                                 float64_parameter, frozen_parameter, same_parameters_twice,
                                 unused_parameter, unused_parameter_found, sparse_gradient,
                                 backward_twice,
                                 different_models)}


def main():
    p = common.parser(__doc__)
    p.add_argument("--case", action="append", required=True, choices=sorted(CASES))
    args = p.parse_args()
    rank, _ = common.setup()
    results = {}
    for case in args.case:
        results[case] = CASES[case](rank, args.out)
        if results[case] is None:  # the case wrote its own report
            return
    common.report(args.out, rank, results)


if __name__ == "__main__":
    main()
