"""gradcomp.torch.profile: a recorded profile lists every trainable parameter once, with the
right sizes and ready times in order, and is a valid profile file (checked by the C++ loader
through `gradcomp plan` when the command exists, else against the schema here)."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

import gradcomp.torch as gc
from gradcomp.profile import validate_profile

GRADCOMP = Path(__file__).resolve().parents[2] / "build" / "bin" / "gradcomp"


def small_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


class Tied(torch.nn.Module):
    """A language-model shape: an embedding shared with the output layer, and a frozen part."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(16, 50)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.frozen(self.mix(self.embed(tokens)))))


@pytest.fixture(scope="module")
def cnn_profile():
    model = small_cnn()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4])
    loss = torch.nn.CrossEntropyLoss()
    return model, gc.profile(model, x, loss_fn=lambda out: loss(out, y), steps=3, warmup=1)


def trainable(model):
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def test_every_trainable_parameter_once_with_its_size(cnn_profile):
    model, p = cnn_profile
    names = [t["name"] for t in p["tensors"]]
    assert len(names) == len(set(names))
    assert {t["name"]: t["elements"] for t in p["tensors"]} == trainable(model)


def test_ready_times_are_ordered_and_within_backward(cnn_profile):
    _, p = cnn_profile
    ready = [t["ready_ms"] for t in p["tensors"]]
    assert ready == sorted(ready)
    assert 0 <= ready[0] and ready[-1] <= p["backward_ms"]
    assert p["forward_ms"] > 0 and p["backward_ms"] > 0


def test_a_chain_is_ready_from_its_last_layer_to_its_first(cnn_profile):
    _, p = cnn_profile
    layers = [int(t["name"].split(".")[0]) for t in p["tensors"]]
    assert layers == sorted(layers, reverse=True)


def test_header_fields(cnn_profile):
    _, p = cnn_profile
    assert p["format"] == "gradcomp-profile" and p["version"] == 1
    assert p["model"] == "Sequential" and p["batch_size"] == 4
    assert "gradcomp.torch.profile" in p["source"] and "3 steps" in p["source"]
    validate_profile(p)


def test_tied_and_frozen_parameters():
    model = Tied()
    tokens = torch.randint(0, 50, (2, 5))
    p = gc.profile(model, tokens, steps=2, warmup=1, name="tied")
    assert {t["name"]: t["elements"] for t in p["tensors"]} == trainable(model)
    assert "frozen.weight" not in {t["name"] for t in p["tensors"]}
    # The shared weight is complete only after the embedding's backward, the last step.
    assert p["tensors"][-1]["name"] == "embed.weight"
    assert p["model"] == "tied" and p["batch_size"] == 2


def test_leaves_the_model_as_it_was():
    model = small_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gc.profile(model, torch.randn(2, 3, 8, 8), steps=1, warmup=0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # batch-norm statistics too
    assert all(p.grad is None for p in model.parameters())


def test_unused_parameter_is_listed_last_with_a_warning():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 3), "idle": torch.nn.Linear(3, 3)})
    model.forward = lambda x: model["used"](x)
    with pytest.warns(UserWarning, match="idle.weight, idle.bias"):
        p = gc.profile(model, torch.randn(2, 3), steps=1, warmup=0)
    assert {t["name"] for t in p["tensors"][-2:]} == {"idle.weight", "idle.bias"}
    assert p["tensors"][-1]["ready_ms"] == p["backward_ms"]


def test_dict_batches_and_outputs_with_a_loss():
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x, scale):
            out = type("Output", (), {})()
            out.loss = self.fc(x).pow(2).mean() * scale
            return out

    p = gc.profile(WithLoss(), {"x": torch.randn(6, 4), "scale": 2.0}, steps=1, warmup=0)
    assert {t["name"] for t in p["tensors"]} == {"fc.weight", "fc.bias"}
    assert p["batch_size"] == 6


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        gc.profile(small_cnn(), torch.randn(1, 3, 8, 8), steps=0)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gc.profile(frozen, torch.randn(1, 2))


def plan_command_exists():
    if not GRADCOMP.exists():
        return False
    # CLI11 prints the top-level help for an unknown subcommand too: look for plan's option.
    run = subprocess.run([str(GRADCOMP), "plan", "--help"], capture_output=True, text=True,
                         timeout=60)
    return run.returncode == 0 and "--profile" in run.stdout


def test_saved_profile_loads(cnn_profile, tmp_path):
    _, p = cnn_profile
    path = tmp_path / "my.json"
    gc.save_profile(p, path)
    assert json.loads(path.read_text()) == p
    if plan_command_exists():  # the C++ loader is the reference
        run = subprocess.run([str(GRADCOMP), "plan", "--profile", str(path), "--workers", "2"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
    else:
        validate_profile(json.loads(path.read_text()))


def test_shipped_profiles_match_the_schema():
    for path in sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.json")):
        d = json.loads(path.read_text())
        if d.get("format") == "gradcomp-profile":
            validate_profile(d)


def sample():
    return {"format": "gradcomp-profile", "version": 1, "model": "m", "source": "by hand",
            "batch_size": 4, "forward_ms": 1.0, "backward_ms": 2.0,
            "tensors": [{"name": f"t{i}", "elements": 10, "ready_ms": 0.5 * i} for i in range(4)]}


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("forward_ms"), "missing field 'forward_ms'"),
    (lambda d: d["tensors"][1].pop("ready_ms"), r"missing field 'tensors\[1\].ready_ms'"),
    (lambda d: d["tensors"][3].update(elements=-1),
     r"tensors\[3\].elements must be a non-negative integer"),
    (lambda d: d["tensors"][2].update(elements=2.0),
     r"tensors\[2\].elements must be a non-negative integer"),
    (lambda d: d["tensors"][0].update(ready_ms=-1.0), r"tensors\[0\].ready_ms must be"),
    (lambda d: d["tensors"][2].update(ready_ms=0.4),
     r"tensors\[2\].ready_ms is before tensors\[1\].ready_ms"),
    (lambda d: d.update(version=2), "version 2 is not supported"),
    (lambda d: d.update(batch_size="4"), "batch_size must be a positive integer"),
    (lambda d: d.update(extra=1), "unknown field 'extra'"),
    (lambda d: d.update(backward_ms=1.0), r"backward_ms is before tensors\[3\].ready_ms"),
])
def test_schema_errors_name_the_field(edit, message, tmp_path):
    d = sample()
    validate_profile(d)
    edit(d)
    with pytest.raises(ValueError, match=message):
        validate_profile(d)
    with pytest.raises(ValueError, match=message):  # nothing invalid is written
        gc.save_profile(d, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()
