"""gradcomp.torch.OneBitAdam: exact steps are Adam's on the mean gradient, with the variance
corrected by its own count of updates; compressed steps step on the exchanged momentum with the
variance as it is (each coordinate's step within Adam's own bound); the "freeze" policy is
AdamW for its warm-up, then freezes the variance; the "doubling" policy's exact steps follow 0/1
Adam's schedule; 2 ranks stay bit-identical under "onebit|ef|twoway" and resume bit-exactly
after steps of either kind, under either policy; bad input is refused by name."""
import copy

import pytest
import torch

import gradcomp.torch as gc
from gradcomp.onebit_adam import is_exact_step

WARMUP = 3
STEPS = 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def _loss(model, step):
    x, y = _batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def test_warmup_is_adamw_and_then_the_variance_freezes():
    # One rank, no compression: the exchange is exact, so the stages' arithmetic is on view.
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    ours, reference = _model(), _model()
    opt = gc.OneBitAdam(ours.named_parameters(), variance="freeze", warmup_steps=WARMUP,
                        compression="none", **hyper)
    adamw = torch.optim.AdamW(reference.parameters(), **hyper)
    frozen_v = None
    for step in range(STEPS):
        for model, o in ((ours, opt), (reference, adamw)):
            o.zero_grad()
            _loss(model, step).backward()
        opt.step()
        if step == WARMUP - 1:
            ours_frozen = opt.state[next(ours.parameters())]["exp_avg_sq"].clone()
        if step < WARMUP:
            adamw.step()  # AdamW itself
            for a, b in zip(ours.parameters(), reference.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            continue
        # The reference's compression stage: m from the gradient, v as it was after the warm-up.
        if frozen_v is None:
            frozen_v = {p: adamw.state[p]["exp_avg_sq"].clone() for p in reference.parameters()}
        with torch.no_grad():
            for p in reference.parameters():
                st = adamw.state[p]
                st["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                t = step + 1
                m_hat = st["exp_avg"] / (1 - 0.9 ** t)
                v_hat = frozen_v[p] / (1 - 0.99 ** WARMUP)
                # clamped to Adam's own bound on a step, max(1, (1 - b1) / sqrt(1 - b2)) = 1
                direction = (m_hat / (v_hat.sqrt() + 1e-8)).clamp(-1.0, 1.0)
                p.sub_(0.01 * (direction + 0.05 * p))
        for a, b in zip(ours.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    state = opt.state[next(ours.parameters())]
    assert opt.frozen and state["step"] == STEPS and state["variance_updates"] == WARMUP
    assert torch.equal(state["exp_avg_sq"], ours_frozen), "the variance changed after freezing"


def test_doubling_updates_the_variance_on_exact_steps_only():
    # One rank, no compression: a compressed step's momentum is then the rank's own, exactly.
    hyper = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    ours, reference = _model(), _model()
    opt = gc.OneBitAdam(ours.named_parameters(), variance="doubling", variance_interval=2,
                        compression="none", **hyper)
    moments = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in reference.parameters()}
    updates, kinds = 0, []
    for step in range(12):
        kinds.append(opt.exact)
        updates += kinds[-1]
        for model in (ours, reference):
            model.zero_grad()
            _loss(model, step).backward()
        opt.step()
        with torch.no_grad():
            for p in reference.parameters():
                m, v = moments[p]
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                if kinds[-1]:
                    v.mul_(0.95).addcmul_(p.grad, p.grad, value=0.05)
                m_hat = m / (1 - 0.9 ** (step + 1))
                v_hat = v / (1 - 0.95 ** updates)
                direction = m_hat / (v_hat.sqrt() + 1e-8)
                if updates < step + 1:  # AdamW's until a step is not exact, then clamped to
                    direction.clamp_(-1.0, 1.0)  # max(1, (1 - b1) / sqrt(1 - b2)) = 1
                p.sub_(0.01 * (direction + 0.05 * p))
        for a, b in zip(ours.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # every step for 2 exact steps, then every 2nd for 2, every 4th for 2, ...
    assert kinds == [True, True, True, False, True, False, True, False, False, False, True,
                     False]
    state = opt.state[next(ours.parameters())]
    assert not opt.frozen and state["step"] == 12 and state["variance_updates"] == updates == 6


def test_each_kind_of_step_has_its_own_trace(tmp_path):
    model = _model()
    opt = gc.OneBitAdam(model.named_parameters(), variance="doubling", variance_interval=1,
                        compression="none", timeline=str(tmp_path / "trace.json"))
    for step in range(3):  # exact, exact, compressed
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    del opt
    import gc as collector
    collector.collect()  # the engines write their traces when they end
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["trace-exact.rank0.json", "trace.rank0.json"]
    for name in names:  # each a Chrome trace with its steps' buckets
        assert '"name":"thread_name"' in (tmp_path / name).read_text(), name


def test_doubling_schedule_shares_fewer_exact_steps_as_it_goes():
    assert [t for t in range(40) if is_exact_step(t, 1)] == [0, 1, 3, 7, 15, 31]
    assert sum(is_exact_step(t, 16) for t in range(400)) == 74
    assert sum(is_exact_step(t, 16) for t in range(100_000)) == 201
    assert all(is_exact_step(t, 16) for t in range(16))


def test_default_policy_and_warmup():
    assert gc.OneBitAdam(_model().parameters()).variance == "freeze"
    assert gc.OneBitAdam(_model().parameters(), total_steps=1000).warmup_steps == 150
    assert gc.OneBitAdam(_model().parameters(), total_steps=3).warmup_steps == 1
    assert gc.OneBitAdam(_model().parameters()).warmup_steps == 1000
    doubling = dict(variance="doubling")
    assert gc.OneBitAdam(_model().parameters(), total_steps=1000, **doubling).warmup_steps is None


@pytest.mark.parametrize("policy", [dict(variance="freeze", warmup_steps=2),
                                    dict(variance="doubling", variance_interval=1)])
def test_a_non_finite_average_is_skipped_on_either_kind_of_step(policy):
    model = _model()
    opt = gc.OneBitAdam(model.named_parameters(), compression="none", **policy)
    kinds = []
    for step in range(4):  # each a skipped step (exact or compressed), then a clean one
        kinds.append(opt.exact)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        _loss(model, step).backward()
        next(model.parameters()).grad[0, 0] = float("nan")
        with pytest.warns(RuntimeWarning, match="not finite"):
            opt.step()
        assert not opt.last_step()["finite"], step
        for a, b in zip(before, model.parameters()):
            assert torch.equal(a, b), f"step {step} (exact: {kinds[-1]}) moved the parameters"
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()  # a clean step moves on
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert True in kinds and False in kinds


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="warmup_steps is 0"):
        gc.OneBitAdam(_model().parameters(), variance="freeze", warmup_steps=0)
    with pytest.raises(ValueError, match="warmup_steps applies to variance=\"freeze\""):
        gc.OneBitAdam(_model().parameters(), variance="doubling", warmup_steps=10)
    with pytest.raises(ValueError, match="variance is 'sometimes'; allowed: 'freeze', 'doubling'"):
        gc.OneBitAdam(_model().parameters(), variance="sometimes")
    with pytest.raises(ValueError, match="variance_interval is 0; allowed: an int >= 1"):
        gc.OneBitAdam(_model().parameters(), variance_interval=0)
    with pytest.raises(ValueError, match="OneBitAdam: lr is -1"):
        gc.OneBitAdam(_model().parameters(), lr=-1)
    with pytest.raises(gc.Error, match="has its own start="):
        gc.OneBitAdam(_model().parameters(), compression="onebit|ef|twoway|start=5")
    with pytest.raises(gc.Error, match="parameter '0.weight' is torch.float64 on cpu; float32"):
        gc.OneBitAdam(_model().double().named_parameters())


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "OneBitLamb"])
def test_changing_requires_grad_after_construction_is_refused(optimizer):
    """Both two-stage optimizers (the check is their shared base's). A layer left out frozen,
    then unfrozen, would never be updated; a layer frozen after construction would keep moving
    by its momentum and weight decay. Either step is refused, naming the layer, with nothing
    moved; built again, the optimizer steps."""
    build = getattr(gc, optimizer)

    def step(model, opt, step):
        opt.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except gc.Error as e:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            return str(e)
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return None

    model = _model()
    model[0].weight.requires_grad_(False)
    opt = build(model.named_parameters(), compression="none", weight_decay=0.01)
    assert step(model, opt, 0) is None
    model[0].weight.requires_grad_(True)  # unfrozen: it has a gradient now
    error = step(model, opt, 1)
    assert error and f"{optimizer}: parameter '0.weight' has a gradient" in error, error
    opt = build(model.named_parameters(), compression="none", weight_decay=0.01)
    assert step(model, opt, 2) is None

    model[2].bias.requires_grad_(False)  # frozen after construction: no gradient
    error = step(model, opt, 3)
    assert error and "parameter '2.bias' requires no gradient now" in error, error
    opt = build(model.named_parameters(), compression="none", weight_decay=0.01)
    assert step(model, opt, 4) is None


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "OneBitLamb"])
def test_a_gradient_changed_after_it_left_is_refused(optimizer):
    """overlap=True hands each gradient over during backward: clipping it after backward (as
    most scripts do) would be lost. step() refuses, naming it, with nothing moved; with
    overlap=False the clipped gradient is the one exchanged."""
    steps = {}
    for overlap in (True, False):
        model = _model()
        opt = getattr(gc, optimizer)(model.named_parameters(), compression="none",
                                     warmup_steps=2, overlap=overlap)
        _loss(model, 0).backward()
        opt.step()  # untouched gradients: a step
        opt.zero_grad()
        _loss(model, 1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except gc.Error as e:
            steps[overlap] = str(e)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            continue
        steps[overlap] = [p.detach().clone() for p in model.parameters()]
    assert "parameter '0.weight': its .grad changed after backward" in steps[True], steps[True]
    assert not any(torch.equal(a, b) for a, b in zip(before, steps[False]))


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "OneBitLamb"])
def test_channels_last_parameters_step_as_contiguous_ones(optimizer):
    """A channels_last convolution (the usual layout of CNN training on GPUs) steps through the
    warm-up and the compressed stage to the same bits as the same model laid out contiguous,
    and keeps its layout."""
    def conv_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                                   torch.nn.Linear(8 * 6 * 6, 4))

    models = [conv_model(), conv_model().to(memory_format=torch.channels_last)]
    opts = [getattr(gc, optimizer)(m.named_parameters(), warmup_steps=2) for m in models]
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randn(16, 4, generator=g)
        for model, opt, layout in zip(models, opts, (torch.contiguous_format,
                                                     torch.channels_last)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(memory_format=layout)), y).backward()
            opt.step()
        for a, b in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b), f"step {step}: the layouts' weights differ"
    assert models[1][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not models[1][0].weight.is_contiguous()


def test_wrapping_it_in_distributed_optimizer_is_refused():
    model = _model()
    with pytest.raises(gc.Error, match="averages over the ranks by itself"):
        gc.DistributedOptimizer(gc.OneBitAdam(model.parameters()), model.named_parameters())


def test_load_state_dict_refuses_another_policy_and_changes_nothing():
    model = _model()
    freeze = dict(variance="freeze", compression="none")
    opt = gc.OneBitAdam(model.parameters(), warmup_steps=2, **freeze)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other = gc.OneBitAdam(_model().parameters(), warmup_steps=5, **freeze)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(gc.Error, match="saved with warmup_steps=2, this optimizer has 5"):
        other.load_state_dict(saved)
    assert other.state_dict()["gradcomp"] == before["gradcomp"]
    doubling = gc.OneBitAdam(_model().parameters(), variance="doubling", compression="none")
    with pytest.raises(gc.Error, match="saved with variance='freeze', this optimizer has "
                                       "'doubling'"):
        doubling.load_state_dict(saved)
    with pytest.raises(gc.Error, match="no gradcomp part"):
        other.load_state_dict(torch.optim.Adam(_model().parameters()).state_dict())


# OneBitLamb (test_onebit_lamb.py) shares the two-stage machinery and these runs.
POLICIES = {"freeze": ["--variance", "freeze", "--warmup", WARMUP],
            "doubling": ["--variance", "doubling", "--interval", 2],
            "onebitlamb": ["--optimizer", "onebitlamb", "--variance", "freeze", "--warmup",
                           WARMUP]}
KINDS = {"freeze": [True] * WARMUP + [False] * (STEPS - WARMUP),
         "doubling": [True, True, True, False, True, False, True, False],
         "onebitlamb": [True] * WARMUP + [False] * (STEPS - WARMUP)}


@pytest.fixture(scope="module", params=sorted(POLICIES))
def runs(request, module_runner, tmp_path_factory):
    """2 ranks: STEPS steps straight, saving checkpoints as it goes after 2 steps (exact ones)
    and after 5 (a compressed one), each rank its own file and rank 0 one file of both ranks'
    state; each resumed in new processes, after 5 also from rank 0's single file ("5-one")."""
    policy = POLICIES[request.param]
    ckpt = tmp_path_factory.mktemp("onebit") / "ckpt"
    straight = module_runner("onebit_adam.py", "--end", STEPS, *policy, "--save", ckpt,
                             "--save-at", 2, "--save-at", 5, "--save-one-file").check()
    resumed = {}
    for at, load in ((2, "--load"), (5, "--load"), ("5-one", "--load-one-file")):
        begin = int(str(at).split("-")[0])
        resumed[at] = module_runner("onebit_adam.py", "--begin", begin, "--end", STEPS, *policy,
                                    load, f"{ckpt}-at{begin}").check()
    return request.param, straight, resumed


def test_ranks_stay_bit_identical_and_bytes_drop_on_compressed_steps(runs):
    policy, straight, _ = runs
    finals = straight.loads("final")
    assert finals[0] == finals[1], "the ranks' parameters differ"
    steps = straight.report(0)["steps"]
    assert [s["exact"] for s in steps] == KINDS[policy]
    for s in steps:
        if s["exact"]:
            assert s["bytes_sent"] == s["uncompressed_bytes"]
        else:
            # two 16,384-element weights at 1 bit, both ways; biases and head in fp32
            assert s["bytes_sent"] * 5 < s["uncompressed_bytes"], s


@pytest.mark.parametrize("at", [2, 5, "5-one"])
def test_resume_after_either_kind_of_step_is_bit_exact(runs, at):
    """From each rank's own file, or ("5-one") from the one file rank 0 saved of every rank's
    state (state_dict(all_ranks=True)): every rank resumes its own error feedback."""
    _, straight, resumed = runs
    for rank, final in enumerate(resumed[at].loads("final")):
        assert final == straight.load("final", rank), \
            f"rank {rank}: resumed after step {at}, training differs"


def test_overlap_on_two_ranks_gives_the_same_bits(runs, module_runner):
    """overlap=True hands each input over during backward: the same exchange, the same bits,
    under each policy and for OneBitLamb."""
    policy, straight, _ = runs
    overlapped = module_runner("onebit_adam.py", "--end", STEPS, *POLICIES[policy],
                               "--overlap").check()
    finals = overlapped.loads("final")
    assert finals[0] == finals[1], "the ranks' parameters differ"
    assert finals[0] == straight.load("final", 0), "overlap changed the result"


@pytest.mark.parametrize("optimizer,overlap", [("OneBitAdam", False), ("OneBitLamb", False),
                                                ("OneBitAdam", True)])
def test_find_unused_parameters_leaves_a_layer_no_rank_used(optimizer, overlap, module_runner):
    """2 ranks, 3 exact steps then 5 compressed: a layer no rank uses keeps its value and step
    count; a layer rank 1 alone uses on odd steps is updated alike on both ranks; one rank 0
    alone uses from the second compressed step on learns its variance in an exact step of its
    own, then steps compressed, alike on both ranks; without the option the unused layer moves
    (its momentum and weight decay), as documented."""
    job = module_runner("onebit_unused.py", "--optimizer", optimizer,
                        *(["--overlap"] if overlap else [])).check()
    reports = job.reports()
    finals = job.loads("final")
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), f"ranks differ on {name}"
    for r in reports:
        assert sorted(r["unchanged"]) == ["never.bias", "never.weight"], r
        assert r["steps"]["never.weight"] == 0 and r["steps"]["sometimes.weight"] == 4, r
        assert r["steps"]["body.0.weight"] == 8, r
        assert r["steps"]["late.weight"] == 4 and r["variance_updates"]["late.weight"] == 1, r
        # 4 of Adam's steps at lr 0.01 (0.105 measured): a step of m / eps where its variance
        # is 0 would move it by thousands
        assert r["late_moved"] < 1.0, r
    plain = module_runner("onebit_unused.py", "--optimizer", optimizer,
                          "--find-unused", "False").check()
    for r in plain.reports():
        assert r["unchanged"] == [], r  # stepped on zeros: weight decay moved them


def test_find_unused_parameters_must_agree_over_the_ranks(module_runner):
    job = module_runner("onebit_unused.py", "--optimizer", "OneBitAdam",
                        "--flag-of-rank", "0=True", "--flag-of-rank", "1=False").check()
    for rank, r in enumerate(job.reports()):
        assert "the ranks use different find_unused_parameters" in r["refused"], r
        assert f"this rank's {rank == 0}" in r["refused"], r


def _body_and_late():
    """A linear layer and "late", a tensor the loss takes from the second compressed step on,
    with their names."""
    torch.manual_seed(0)
    body = torch.nn.Linear(32, 4)
    late = torch.nn.Parameter(torch.full((8,), 0.5))
    return body, late, [("body." + n, p) for n, p in body.named_parameters()] + [("late", late)]


def _late_loss(body, late, step):
    x, y = _batch(step)
    loss = torch.nn.functional.mse_loss(body(x), y)
    if step > WARMUP:  # first used on the second compressed step
        loss = loss + (late * torch.arange(8.0)).sum()
    return loss


def test_a_parameter_first_used_after_the_warmup_takes_an_exact_step_of_its_own():
    """With find_unused_parameters, a tensor no rank used in the warm-up has no variance, and a
    compressed step would divide by it: its first use takes an exact step of its own instead,
    AdamW's first step on its gradient (one rank: the mean is its gradient), while the rest
    takes the compressed step; later compressed steps move it by its learned variance. Every
    tensor is compressed, fused in one bucket: the codes' error on the unused tensor's zeros
    stays out of that step, where its gradient's coordinate 0 is 0 (else a step of m / eps)."""
    body, late, named = _body_and_late()
    opt = gc.OneBitAdam(named, lr=0.01, weight_decay=0.01, warmup_steps=WARMUP,
                        min_compress_elements=1, find_unused_parameters=True)
    for step in range(WARMUP + 3):
        opt.zero_grad(set_to_none=True)
        _late_loss(body, late, step).backward()
        if step == WARMUP + 1:
            twin = torch.nn.Parameter(late.detach().clone())
            twin.grad = late.grad.clone()
            torch.optim.AdamW([twin], lr=0.01, weight_decay=0.01).step()
            body_before = [p.detach().clone() for p in body.parameters()]
        opt.step()
        if step == WARMUP + 1:
            assert torch.allclose(late, twin, rtol=0, atol=1e-7), (late - twin).abs().max()
            assert opt.state[late]["variance_updates"] == 1 and opt.state[late]["step"] == 1
            assert opt.state[body.weight]["variance_updates"] == WARMUP
            assert not any(torch.equal(a, p) for a, p in zip(body_before, body.parameters()))
    assert torch.isfinite(late).all() and (late - 0.5).abs().max() < 0.1, late
    assert opt.state[late]["step"] == 2 and opt.state[late]["variance_updates"] == 1


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "OneBitLamb"])
def test_a_parameter_no_rank_used_in_the_warmup_learns_its_variance_without_find_unused(
        optimizer):
    """Without find_unused_parameters a tensor no rank used in the warm-up took exact steps on
    zeros, so its variance holds nothing but zeros (its count of updates does not show it): a
    compressed step would divide its momentum, the codes' error of its zeros in a fused
    bucket, by that (a sign-like step of about 3 lr in every coordinate). It steps exactly on
    its own instead: while no rank uses it on a mean of 0 (weight decay alone, as in the warm-up),
    and at its first use as AdamW does on the same history (zero gradients, then its own).
    Every tensor is compressed, fused in one bucket; one rank."""
    body, late, named = _body_and_late()
    twin = torch.nn.Parameter(late.detach().clone())
    opt = getattr(gc, optimizer)(named, lr=0.01, weight_decay=0.01, warmup_steps=WARMUP,
                                 min_compress_elements=1)
    adamw = (torch.optim.AdamW if optimizer == "OneBitAdam" else gc.LAMB)(
        [twin], lr=0.01, weight_decay=0.01)
    for step in range(WARMUP + 3):
        opt.zero_grad(set_to_none=True)
        _late_loss(body, late, step).backward()
        if step <= WARMUP + 1:  # the twin's history: zeros, then the same gradient
            twin.grad = torch.zeros_like(twin) if late.grad is None else late.grad.clone()
            adamw.step()
        opt.step()
        if step <= WARMUP + 1:
            assert torch.allclose(late, twin, rtol=0, atol=1e-7), (step, (late - twin).abs().max())
    assert opt.state[late]["exp_avg_sq"].any()
    assert torch.isfinite(late).all() and (late - 0.5).abs().max() < 0.1, late


@pytest.mark.parametrize("find_unused", [True, False])
def test_the_ranks_agreements_are_float32_whatever_the_default_dtype(find_unused):
    """The small collectives of find_unused_parameters and of the unlearned parameters' exact
    steps are float32 tensors the transport takes, under torch.set_default_dtype(torch.float64)
    too (before, the optimizer's construction failed with find_unused_parameters)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        body, late, named = _body_and_late()
        body.float()
        late.data = late.data.float()
        opt = gc.OneBitAdam(named, lr=0.01, warmup_steps=WARMUP, min_compress_elements=1,
                            find_unused_parameters=find_unused)
        for step in range(WARMUP + 3):
            opt.zero_grad(set_to_none=True)
            x, y = _batch(step)
            loss = torch.nn.functional.mse_loss(body(x.float()), y.float())
            if step > WARMUP:
                loss = loss + (late * torch.arange(8.0, dtype=torch.float32)).sum()
            loss.backward()
            opt.step()
    finally:
        torch.set_default_dtype(before)
    assert opt.state[late]["exp_avg_sq"].any() and torch.isfinite(late).all()
