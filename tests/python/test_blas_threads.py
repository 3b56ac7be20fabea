"""Ranks sharing a machine run one BLAS thread each: `gradcomp launch` sets OMP_NUM_THREADS=1
as torchrun does, and a process whose OpenBLAS runs more threads than torch was told to use
is warned at its first engine (Debian's torch multiplies in OpenBLAS, outside
torch.set_num_threads; its idle threads spin: docs/python.md, "Several ranks on one machine")."""
import json
import os
import subprocess

from conftest import GRADCOMP, PYTHON, ROOT, _environment, free_port

SCRIPT = """
import json, os, warnings, torch
torch.set_num_threads(1)
import gradcomp.torch as gct
model = torch.nn.Linear(8, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    gct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
said = [str(w.message) for w in caught if "OpenBLAS" in str(w.message)]
print("RESULT", json.dumps({"omp": os.environ.get("OMP_NUM_THREADS"), "said": said,
                            "blas": gct._blas_threads(), "rank": os.environ.get("RANK")}))
"""


def run(argv, omp):
    env = _environment({"PYTHONPATH": str(ROOT / "python")})
    del env["OMP_NUM_THREADS"]
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
            if line.startswith("RESULT ")], done.stderr


def test_openblas_threads_beyond_torchs_are_warned_once():
    assert (os.cpu_count() or 1) >= 2, "needs a machine of 2 or more cores (OpenBLAS's default)"
    [alone], _ = run([PYTHON, "-c", SCRIPT], omp=None)
    assert alone["blas"] == os.cpu_count(), alone  # Debian's OpenBLAS, a thread per core
    assert len(alone["said"]) == 1, alone  # two optimizers, one warning
    assert "torch uses 1 thread(s) but OpenBLAS runs" in alone["said"][0]
    assert "OMP_NUM_THREADS=1" in alone["said"][0]

    [chosen], _ = run([PYTHON, "-c", SCRIPT], omp="1")
    assert chosen["blas"] == 1 and chosen["said"] == [], chosen


def test_launch_gives_several_ranks_one_thread_each():
    ranks, stderr = run([str(GRADCOMP), "launch", "-n", "2", "--master-port", str(free_port()),
                         "--", PYTHON, "-c", SCRIPT], omp=None)
    assert sorted(r["rank"] for r in ranks) == ["0", "1"], ranks
    for r in ranks:
        assert r["omp"] == "1" and r["blas"] == 1 and r["said"] == [], r
    assert stderr.count("OMP_NUM_THREADS=1 for each of the 2 ranks") == 1, stderr
