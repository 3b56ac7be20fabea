"""examples/language_model: the corpus preparation (Debian's fortunes as word tokens) and the
GPT-style trainer under AdamW that scripts/lm_accuracy.py runs for docs/accuracy-lm.md."""
import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import GRADCOMP, PYTHON, ROOT, _environment, free_port

sys.path.insert(0, str(ROOT / "examples" / "language_model"))
import corpus  # noqa: E402

TRAIN = ROOT / "examples" / "language_model" / "train.py"


@pytest.fixture(scope="module")
def data():
    return corpus.build(vocab_size=512)


def test_corpus_is_split_by_fortune_and_every_id_is_in_the_vocabulary(data):
    fortunes = corpus.read_fortunes()
    valid = [f for f in fortunes if corpus.is_validation(f)]
    assert 0.02 < len(valid) / len(fortunes) < 0.08, "about 5% of the fortunes validate"
    # Each split is exactly its fortunes' tokens, one <eos> per fortune.
    eos = data["vocab"].index(corpus.EOS)
    assert int((data["valid"] == eos).sum()) == len(valid)
    assert int((data["train"] == eos).sum()) == len(fortunes) - len(valid)
    assert len(data["vocab"]) == 512 and data["vocab"][0] == corpus.UNK
    assert len(set(data["vocab"])) == 512
    for split in ("train", "valid"):
        assert data[split].dtype == torch.long
        assert 0 <= int(data[split].min()) and int(data[split].max()) < 512


def test_corpus_is_the_same_on_every_build_and_through_a_file(data, tmp_path):
    again = corpus.build(vocab_size=512)
    assert again["vocab"] == data["vocab"]
    assert torch.equal(again["train"], data["train"]) and torch.equal(again["valid"], data["valid"])
    path = tmp_path / "fortunes.pt"
    torch.save(data, path)
    loaded = corpus.load(str(path), 512)
    assert torch.equal(loaded["train"], data["train"])
    with pytest.raises(ValueError, match="vocabulary of 512 words, not 1024"):
        corpus.load(str(path), 1024)


def test_corpus_names_the_missing_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        corpus.read_fortunes(str(tmp_path / "nowhere"))


def train(tmp_path, *args):
    out = tmp_path / "summary.json"
    cmd = [str(GRADCOMP), "launch", "-n", "2", "--master-port", str(free_port()), "--",
           PYTHON, str(TRAIN), "--steps", "6", "--batch-size", "2", "--vocab", "512",
           "--json", str(out), "--no-progress", *args]
    proc = subprocess.run(cmd, env=_environment({}), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_trainer_ends_with_identical_ranks_and_reports_its_figures(tmp_path):
    summary, stdout = train(tmp_path, "--compression", "topk:ratio=0.01|ef",
                            "--min-compress-elements", "4096")
    assert "identical parameters on all ranks" in stdout
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["optimizer"] == "adamw"
    assert math.isfinite(summary["val_loss"]) and 0 < summary["val_loss"] < math.log(512) + 1
    assert len(summary["train_loss_curve"]) == 6
    # Top 1% of the large matrices: far fewer bytes than the whole model.
    assert summary["bytes_sent_per_step"] < summary["uncompressed_bytes_per_step"] / 5
    assert summary["uncompressed_bytes_per_step"] == 4 * summary["parameters"]


@pytest.mark.parametrize("variance", ["doubling", "freeze"])
def test_trainer_runs_one_bit_adam_under_either_variance_policy(tmp_path, variance):
    summary, stdout = train(tmp_path, "--optimizer", "onebitadam", "--onebit-variance",
                            variance, "--compression", "onebit:block=256|ef|twoway",
                            "--min-compress-elements", "4096")
    assert "identical parameters on all ranks" in stdout
    assert summary["optimizer"] == "onebitadam"
    assert math.isfinite(summary["val_loss"]) and 0 < summary["val_loss"] < math.log(512) + 1
    # doubling: 6 steps are all exact (the first 16 are); freeze: 15% of 6 is 1 exact step
    full = summary["uncompressed_bytes_per_step"]
    exact = [b for b in summary["bytes_sent_curve"] if b == full]
    assert len(exact) == (6 if variance == "doubling" else 1), summary["bytes_sent_curve"]


def test_trainer_runs_compression_auto_and_reports_its_decision(tmp_path):
    # A short search (the defaults need 30 warm-up steps and 6 per trial): it decides within
    # the run, ranks stay identical through its plan changes, and the summary says what it kept.
    settings = {"warmup_steps": 2, "profile_steps": 2, "trial_steps": 2, "verbose": False}
    summary, stdout = train(tmp_path, "--compression", "auto", "--auto", json.dumps(settings),
                            "--steps", "30", "--min-compress-elements", "4096")
    assert "identical parameters on all ranks" in stdout
    assert summary["compression"] == "auto"
    assert len(summary["auto"]) >= 1, summary.get("auto")
    first = summary["auto"][0]
    assert first["step"] <= 30 and first["kept_name"] and first["why"]


def test_trainer_refuses_a_width_the_heads_do_not_divide(tmp_path):
    proc = subprocess.run([PYTHON, str(TRAIN), "--width", "130", "--heads", "4"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--width (130) must be a multiple of --heads (4)" in proc.stderr


@pytest.mark.parametrize("name", ["powersgd-whole", "powersgd-sliced"])
def test_trainer_runs_the_shipped_plan_files(tmp_path, name):
    # The plans of docs/plan-format.md's accuracy runs (the sliced one cuts the embedding and
    # the output layer into 4 slices each): they fit the default model and keep ranks identical.
    plan = ROOT / "examples" / "language_model" / "plans" / f"{name}.json"
    summary, stdout = train(tmp_path, "--plan", str(plan), "--vocab", "4096")
    assert "identical parameters on all ranks" in stdout
    assert summary["compression"] == f"plan {plan}"
    assert math.isfinite(summary["val_loss"]) and 0 < summary["val_loss"] < math.log(4096) + 1
    assert summary["bytes_sent_per_step"] < summary["uncompressed_bytes_per_step"] / 5

def test_trainer_refuses_a_plan_beside_a_compression(tmp_path):
    proc = subprocess.run([PYTHON, str(TRAIN), "--plan", "p.json", "--compression", "fp16"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--plan is for DistributedOptimizer's optimizers" in proc.stderr
