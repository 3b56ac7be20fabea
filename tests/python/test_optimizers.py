"""gradcomp.torch.LAMB and LANS: the fused C++ kernel against the same update written in torch
operations, checkpoints that resume bit-exactly, bad input refused, and (2 ranks) as the
inner optimizer of DistributedOptimizer with and without compression: ranks bit-identical."""
import copy

import pytest
import torch

import gradcomp.torch as gc
from gradcomp.optimizers import LAMB, LANS

OPTIMIZERS = [LAMB, LANS]
STEPS = 6
COMPRESSIONS = ["none", "onebit|ef|twoway", "powersgd:rank=4|ef"]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4)).to(dtype)


def _train(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
        y = torch.randn(16, 4, generator=g).to(x.dtype)
        optimizer.zero_grad()
        (model(x).float() - y.float()).pow(2).mean().backward()  # bf16 has no CPU mse_loss
        optimizer.step()


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.0, "bias_correction": False},
                                     {"betas": (0.8, 0.99), "lr": 0.05}])
def test_fused_kernel_matches_the_torch_update(cls, options):
    # float64 parameters take the torch-operations path (in double precision): the reference.
    fused, reference = _model(), _model(torch.float64)
    fused_opt = cls(fused.parameters(), **options)
    reference_opt = cls(reference.parameters(), **options)
    _train(fused, fused_opt, 10)
    _train(reference, reference_opt, 10)
    for a, b in zip(fused.parameters(), reference.parameters()):
        gap = (a.double() - b).abs().max() / b.abs().max()
        assert gap < 1e-4, f"{cls.__name__} {options}: fused and torch updates differ by {gap}"
    assert fused_opt.state[next(fused.parameters())]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_half_precision_parameters_keep_float32_moments(cls):
    model = _model(torch.bfloat16)
    optimizer = cls(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, optimizer, 3)
    state = optimizer.state[next(model.parameters())]
    assert state["exp_avg"].dtype == torch.float32 and state["step"] == 3
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_layers_move_by_lr_times_their_norm(cls):
    # The trust ratio: each weight matrix moves by about lr * ||x|| on the first step, however
    # large or small its gradient.
    model = _model()
    optimizer = cls(model.parameters(), lr=0.01, weight_decay=0.0)
    weight = model[0].weight
    before = weight.detach().clone()
    x = torch.randn(16, 32) * 1000.0
    torch.nn.functional.mse_loss(model(x), torch.zeros(16, 4)).backward()
    optimizer.step()
    moved = (weight.detach() - before).norm()
    assert moved == pytest.approx(0.01 * before.norm(), rel=1e-3)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_resumes_bit_exactly(cls):
    straight = _model()
    straight_opt = cls(straight.parameters(), lr=0.02)
    _train(straight, straight_opt, 8)

    first = _model()
    first_opt = cls(first.parameters(), lr=0.02)
    _train(first, first_opt, 4)
    saved = copy.deepcopy({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = cls(resumed.parameters(), lr=0.02)
    resumed_opt.load_state_dict(saved["optimizer"])
    _train(resumed, resumed_opt, 4, start=4)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b), "resumed training differs from uninterrupted training"


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_bad_hyper_parameters_are_value_errors_naming_them(cls):
    params = _model().parameters()
    with pytest.raises(ValueError, match=f"{cls.__name__}: lr is -1"):
        cls(params, lr=-1)
    with pytest.raises(ValueError, match="beta1 is 1; allowed: 0 <= beta1 < 1"):
        cls(_model().parameters(), betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="eps is 0"):
        cls(_model().parameters(), eps=0)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_sparse_gradients_are_refused(cls):
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    optimizer = cls(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support sparse gradients"):
        optimizer.step()


@pytest.fixture(scope="module")
def distributed(module_runner, tmp_path_factory):
    """2 ranks: STEPS steps straight; the first half saving checkpoints; the second half in new
    processes resuming from them."""
    checkpoint = tmp_path_factory.mktemp("layerwise") / "ckpt"
    args = [a for c in COMPRESSIONS for a in ("--compression", c)]
    straight = module_runner("layerwise.py", *args, "--end", STEPS).check()
    module_runner("layerwise.py", *args, "--end", STEPS // 2, "--save", checkpoint).check()
    resumed = module_runner("layerwise.py", *args, "--begin", STEPS // 2, "--end", STEPS,
                            "--load", checkpoint).check()
    return straight, resumed


@pytest.mark.parametrize("name", ["LAMB", "LANS"])
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_inside_distributed_optimizer_ranks_agree_and_resume_exactly(distributed, name,
                                                                     compression):
    straight, resumed = distributed
    key = f"{name} {compression}"
    finals = [f[key] for f in straight.loads("final")]
    assert finals[0] == finals[1], f"{key}: the ranks' parameters differ"
    assert straight.report(0)[key]["steps"][0] == STEPS
    assert finals[0] != straight.load("initial", 0)[key], f"{key}: the parameters did not move"
    for rank, final in enumerate(resumed.loads("final")):
        assert final[key] == finals[rank], f"{key}: rank {rank} resumed differently"


def test_distributed_optimizer_counts_them_as_adam_family(distributed):
    # powersgd:rank=4|ef lost under AdamW at 4 ranks (docs/accuracy-lm-4ranks.md): the wrapper
    # warns under LAMB and LANS too; uncompressed, no warning.
    straight, _ = distributed
    report = straight.report(0)
    for name in ("LAMB", "LANS"):
        assert any("powersgd" in w and "lost accuracy under Adam-family" in w
                   for w in report[f"{name} powersgd:rank=4|ef"]["warnings"])
        assert report[f"{name} none"]["warnings"] == []
    # onebit lost under AdamW: LAMB is warned; LANS too, but only because plain onebit is not
    # CLAN's recipe (blocks of 256), which the warning names.
    assert any("onebit" in w for w in report["LAMB onebit|ef|twoway"]["warnings"])
    assert any("held under LANS only as 'onebit:block=256|ef|twoway'" in w
               for w in report["LANS onebit|ef|twoway"]["warnings"])


def test_clan_recipe_is_backed_under_lans_only():
    from gradcomp import _C
    recipe = "onebit:block=256|ef|twoway"
    assert _C.recommendation_warning(recipe, "lans", "LANS") == ""
    assert "lost accuracy under Adam-family" in _C.recommendation_warning(recipe, "adam", "LAMB")
    for other in ("onebit:block=256|ef|allgather", "onebit|ef|twoway", "onebit:block=256||twoway"):
        assert "held under LANS only as" in _C.recommendation_warning(other, "lans", "LANS")
    # Codecs that held under AdamW hold under LANS; those that lost, with no recipe, do not.
    assert _C.recommendation_warning("fp16", "lans", "LANS") == ""
    assert "lost accuracy" in _C.recommendation_warning("powersgd:rank=4|ef", "lans", "LANS")
    assert "lost accuracy" in _C.recommendation_warning("topk:ratio=0.01|ef", "lans", "LANS")
