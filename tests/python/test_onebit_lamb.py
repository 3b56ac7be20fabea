"""gradcomp.torch.OneBitLamb: the warm-up is LAMB on the mean gradient (gradcomp.torch.LAMB's
steps) while each layer's trust ratio is averaged; the compression stage steps on the exchanged
momentum with the variance frozen and each layer's frozen coefficient times a factor that
follows a fresh variance of the reconstructed gradient; bad input is refused by name. (2 ranks
bit-identical under "onebit|ef|twoway", resumed bit-exactly in either stage: with OneBitAdam's
runs, test_onebit_adam.py.)"""
import copy

import pytest
import torch

import gradcomp.torch as gc

WARMUP = 3
STEPS = 8
HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


class _Reference:
    """1-bit LAMB on one rank, in double, from the definition in gradcomp/optimizer.h."""

    def __init__(self, model, beta3=0.9, max_coeff=10.0, min_coeff=0.01, factor_max=4.0,
                 factor_min=0.5, threshold=0.1):
        self.params = [p.detach().double().clone() for p in model.parameters()]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        n = len(self.params)
        self.fresh, self.coeff, self.factor = [None] * n, [0.0] * n, [1.0] * n
        self.knobs = (beta3, max_coeff, min_coeff, factor_max, factor_min, threshold)

    def step(self, grads, t):
        beta1, beta2 = HYPER["betas"]
        lr, eps, wd = HYPER["lr"], HYPER["eps"], HYPER["weight_decay"]
        beta3, max_coeff, min_coeff, factor_max, factor_min, threshold = self.knobs
        bound = max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)
        for i, (x, g) in enumerate(zip(self.params, grads)):
            g = g.double()
            if t <= WARMUP:  # LAMB
                self.m[i].mul_(beta1).add_(g, alpha=1 - beta1)
                self.v[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                r = (self.m[i] / (1 - beta1 ** t)) / ((self.v[i] / (1 - beta2 ** t)).sqrt() + eps)
                r += wd * x
                ratio = (x.norm() / r.norm()).item() if x.norm() > 0 and r.norm() > 0 else 1.0
                held = min(max(ratio, min_coeff), max_coeff)
                self.coeff[i] = held if t == 1 else beta3 * self.coeff[i] + (1 - beta3) * held
                x -= lr * ratio * r
                continue
            if self.fresh[i] is None:
                self.fresh[i] = self.v[i].clone()
            momentum = beta1 * self.m[i] + (1 - beta1) * g  # one rank: its own, exactly
            rebuilt = (momentum - beta1 * self.m[i]) / (1 - beta1)
            self.fresh[i].mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
            self.m[i] = momentum
            frozen = (self.v[i] / (1 - beta2 ** WARMUP)).sqrt() + eps
            ratio = (frozen / ((self.fresh[i] / (1 - beta2 ** t)).sqrt() + eps)).max().item()
            u = ((momentum / (1 - beta1 ** t)) / frozen).clamp(-bound, bound)
            d = u + wd * x
            share = min(1.0, (u.norm() / d.norm()).item())
            f = min(max(ratio * share + 1 - share, factor_min), factor_max)
            last = self.factor[i]
            self.factor[i] = min(max(f, last * (1 - threshold)), last * (1 + threshold))
            x -= lr * self.coeff[i] * self.factor[i] * d


def test_warmup_is_lamb_then_the_coefficients_and_variance_freeze():
    # One rank, no compression: the exchange is exact, so the stages' arithmetic is on view.
    ours, lamb_model = _model(), _model()
    opt = gc.OneBitLamb(ours.named_parameters(), warmup_steps=WARMUP, compression="none", **HYPER)
    lamb = gc.LAMB(lamb_model.parameters(), **HYPER)
    reference = _Reference(ours)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(ours, step).backward()
        grads = [p.grad.clone() for p in ours.parameters()]
        opt.step()
        reference.step(grads, step + 1)
        if step < WARMUP:  # gradcomp.torch.LAMB itself, on the same gradients
            lamb.zero_grad()
            _loss(lamb_model, step).backward()
            lamb.step()
            for a, b in zip(ours.parameters(), lamb_model.parameters()):
                assert torch.equal(a, b), f"warm-up step {step} is not LAMB's"
        if step == WARMUP - 1:
            frozen = opt.state[next(ours.parameters())]["exp_avg_sq"].clone()
        for a, b in zip(ours.parameters(), reference.params):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    for p, coeff, factor in zip(ours.parameters(), reference.coeff, reference.factor):
        state = opt.state[p]
        assert state["lamb_coeff"] == pytest.approx(coeff, rel=1e-6)
        assert state["lamb_factor"] == pytest.approx(factor, rel=1e-5)
    state = opt.state[next(ours.parameters())]
    assert opt.frozen and state["step"] == STEPS and state["variance_updates"] == WARMUP
    assert torch.equal(state["exp_avg_sq"], frozen), "the variance changed after freezing"


def test_a_non_finite_average_is_skipped_in_either_stage():
    model = _model()
    opt = gc.OneBitLamb(model.named_parameters(), warmup_steps=2, compression="none")
    kinds = []
    for step in range(4):  # each a skipped step, then a clean one
        kinds.append(opt.exact)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        _loss(model, step).backward()
        next(model.parameters()).grad[0, 0] = float("nan")
        with pytest.warns(RuntimeWarning, match="OneBitLamb: this step's average is not finite"):
            opt.step()
        for a, b in zip(before, model.parameters()):
            assert torch.equal(a, b), f"step {step} (exact: {kinds[-1]}) moved the parameters"
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert True in kinds and False in kinds


def test_default_warmup_and_bad_input_is_refused_by_name():
    assert gc.OneBitLamb(_model().parameters(), total_steps=1000).warmup_steps == 150
    assert gc.OneBitLamb(_model().parameters()).warmup_steps == 1000
    with pytest.raises(ValueError, match="OneBitLamb: warmup_steps is 0"):
        gc.OneBitLamb(_model().parameters(), warmup_steps=0)
    with pytest.raises(ValueError, match="OneBitLamb: factor_min is 2; allowed: 0 < x <= 1"):
        gc.OneBitLamb(_model().parameters(), factor_min=2)
    with pytest.raises(ValueError, match="OneBitLamb: coeff_beta is 1; allowed: 0 <= x < 1"):
        gc.OneBitLamb(_model().parameters(), coeff_beta=1)
    with pytest.raises(ValueError, match="OneBitLamb: max_coeff is 'big'; allowed: a number"):
        gc.OneBitLamb(_model().parameters(), max_coeff="big")
    with pytest.raises(ValueError, match="OneBitLamb: eps is 0"):
        gc.OneBitLamb(_model().parameters(), eps=0)
    with pytest.raises(gc.Error, match="OneBitLamb: compression .* has its own start="):
        gc.OneBitLamb(_model().parameters(), compression="onebit|ef|twoway|start=5")
    model = _model()
    with pytest.raises(gc.Error, match="averages over the ranks by itself"):
        gc.DistributedOptimizer(gc.OneBitLamb(model.parameters()), model.named_parameters())


def test_load_state_dict_refuses_other_settings_and_other_optimizers():
    model = _model()
    opt = gc.OneBitLamb(model.parameters(), warmup_steps=2, compression="none")
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other = gc.OneBitLamb(_model().parameters(), warmup_steps=2, factor_max=2.0,
                          compression="none")
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(gc.Error, match="saved with factor_max=4.0, this optimizer has 2.0"):
        other.load_state_dict(saved)
    assert other.state_dict()["gradcomp"] == before["gradcomp"]
    adam = gc.OneBitAdam(_model().parameters(), warmup_steps=2, compression="none")
    with pytest.raises(gc.Error, match="OneBitAdam.load_state_dict: the state has no variance"):
        adam.load_state_dict(saved)
    with pytest.raises(gc.Error, match="OneBitLamb.load_state_dict: the state has no optimizer"):
        other.load_state_dict(adam.state_dict())


# ------------------------------------------------------------------ overlap=True (both optimizers)

def _train(make, steps, compression, overlap, unused=False):
    model = _model()
    extra = torch.nn.Linear(3, 3)  # never in the loss: no gradient, ever
    params = list(model.named_parameters()) + ([("extra.weight", extra.weight)] if unused else [])
    opt = make(params, warmup_steps=2, compression=compression, overlap=overlap)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        # handed over by backward itself, or all by step()
        assert opt._handed == [overlap] * len(list(model.parameters())) + [False] * unused
        opt.step()
        assert opt.last_step()["update_seconds"] > 0  # the update's own time, for benchmarks
    return [p.detach().clone() for _, p in params]


@pytest.mark.parametrize("make", [gc.OneBitAdam, gc.OneBitLamb])
@pytest.mark.parametrize("compression", ["none", "onebit:block=256|ef|twoway"])
def test_overlap_hands_over_during_backward_and_changes_no_bit(make, compression):
    # Both stages (warm-up 2 of 5 steps); a parameter with no gradient is handed over by step().
    straight = _train(make, 5, compression, overlap=False, unused=True)
    overlapped = _train(make, 5, compression, overlap=True, unused=True)
    for a, b in zip(straight, overlapped):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [gc.OneBitAdam, gc.OneBitLamb])
def test_overlap_refuses_a_second_gradient_before_step(make):
    model = _model()
    opt = make(model.named_parameters(), compression="none", overlap=True)
    _loss(model, 0).backward()
    with pytest.raises(gc.Error, match=r"parameter '2\.bias' got a gradient again before step"
                                       r"\(\).*use overlap=False"):
        _loss(model, 1).backward()
    with pytest.raises(ValueError, match="overlap is 1; allowed: True or False"):
        make(model.named_parameters(), overlap=1)


def test_overlap_hooks_do_not_keep_the_optimizer_alive():
    import gc as collector
    import weakref
    model = _model()
    ref = weakref.ref(gc.OneBitAdam(model.named_parameters(), compression="none", overlap=True))
    collector.collect()
    assert ref() is None
    _loss(model, 0).backward()  # the hooks left on the parameters do nothing now
