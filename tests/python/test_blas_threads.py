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
import gradcomp._C, gradcomp.torch as gct
model = torch.nn.Linear(8, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    gct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
said = [str(w.message) for w in caught if "OpenBLAS" in str(w.message)]
rank = os.environ.get("RANK", "0")
with open(os.path.join(os.environ["RESULTS"], rank + ".json"), "w") as f:
    json.dump({"omp": os.environ.get("OMP_NUM_THREADS"), "said": said,
               "blas": gradcomp._C.openblas_threads(), "rank": rank}, f)
"""


def run(argv, omp, results):
    """Runs argv; returns each rank's record (a file each: their stdout would interleave) and
    the job's stderr."""
    env = _environment({"PYTHONPATH": str(ROOT / "python"), "RESULTS": str(results)})
    del env["OMP_NUM_THREADS"]
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(f.read_text()) for f in sorted(results.glob("*.json"))], done.stderr


def test_openblas_threads_beyond_torchs_are_warned_once(tmp_path):
    assert len(os.sched_getaffinity(0)) >= 2, "needs 2 or more cores (OpenBLAS's default)"
    (tmp_path / "alone").mkdir()
    [alone], stderr = run([PYTHON, "-c", SCRIPT], omp=None, results=tmp_path / "alone")
    assert alone["blas"] is not None and alone["blas"] >= 2, alone  # a thread per core
    assert len(alone["said"]) == 1, alone  # two optimizers, one warning
    # ... and only as a Python warning: the C++ check behind the engine does not say it again
    assert "OpenBLAS" not in stderr, stderr
    assert "torch uses 1 thread(s) but OpenBLAS runs" in alone["said"][0]
    assert "OMP_NUM_THREADS=1" in alone["said"][0]

    (tmp_path / "chosen").mkdir()
    [chosen], _ = run([PYTHON, "-c", SCRIPT], omp="1", results=tmp_path / "chosen")
    assert chosen["blas"] == 1 and chosen["said"] == [], chosen


def test_launch_gives_several_ranks_one_thread_each(tmp_path):
    ranks, stderr = run([str(GRADCOMP), "launch", "-n", "2", "--master-port", str(free_port()),
                         "--", PYTHON, "-c", SCRIPT], omp=None, results=tmp_path)
    assert sorted(r["rank"] for r in ranks) == ["0", "1"], ranks
    for r in ranks:
        assert r["omp"] == "1" and r["blas"] == 1 and r["said"] == [], r
    assert stderr.count("OMP_NUM_THREADS=1 for each of the 2 ranks") == 1, stderr
