"""examples/fashion_mnist/train.py --plan: the shipped plan files (PowerSGD on each large
tensor, fc1's weight whole or in 4 slices) fit the example's model, compress, and keep the ranks
identical; a plan beside --compression is refused."""
import json
import subprocess

import pytest

from conftest import GRADCOMP, PYTHON, ROOT, _environment, free_port

TRAIN = ROOT / "examples" / "fashion_mnist" / "train.py"


@pytest.mark.parametrize("name", ["powersgd-whole", "powersgd-sliced"])
def test_trainer_runs_the_shipped_plan_files(tmp_path, name):
    plan = ROOT / "examples" / "fashion_mnist" / "plans" / f"{name}.json"
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [str(GRADCOMP), "launch", "-n", "2", "--master-port", str(free_port()), "--",
         PYTHON, str(TRAIN), "--epochs", "0.02", "--plan", str(plan), "--no-progress",
         "--json", str(out)],
        env=_environment({}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(out.read_text())
    assert summary["compression"] == f"plan {plan}"
    assert "yes on all 2 ranks" in proc.stdout  # identical parameters
    # PowerSGD at rank 4 on 95% of the parameters: far fewer bytes than the whole model.
    assert summary["bytes_sent_per_step"] < summary["uncompressed_bytes_per_step"] / 4
    tensors = {t["name"]: t for t in json.loads(plan.read_text())["tensors"]}
    assert tensors["fc1.weight"].get("slices", 1) == (4 if name.endswith("sliced") else 1)


def test_trainer_refuses_a_plan_beside_a_compression():
    proc = subprocess.run([PYTHON, str(TRAIN), "--plan", "p.json", "--compression", "fp16"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--plan is for DistributedOptimizer's optimizers" in proc.stderr
