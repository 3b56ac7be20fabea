"""bench/cluster/slices.py's plans (a default plan, and the same with its large tensors in
slices) as the engine reads them, and the replay benchmark's contenders for plans: the
planner's without slices (plan-whole) and any plan file (plan:PATH)."""
import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "cluster"))
sys.path.insert(0, str(ROOT / "python"))
import bench  # noqa: E402
import slices  # noqa: E402
from gradcomp import _C  # noqa: E402


def profile():
    """A classifier's large weights first in backward order, small tensors after."""
    sizes = [("fc8.bias", 10), ("fc8.weight", 5 << 20), ("fc7.weight", 7 << 20),
             ("conv.bias", 64), ("conv.weight", 40000)]
    return {"tensors": [{"name": n, "elements": e, "ready_ms": i} for i, (n, e) in enumerate(sizes)]}


def test_large_tensors_of_their_own_bucket_are_cut_into_slices():
    whole = slices.default_plan(profile(), "randomk:ratio=0.01|ef")
    cut = slices.sliced(whole, 1 << 22, 4)
    # The engine's reader accepts it, as format 3, and reads back the same slices.
    read = json.loads(_C.validate_plan(json.dumps(cut)))
    assert read["version"] == 3
    assert {t["name"]: t.get("slices", 1) for t in read["tensors"]} == {
        "fc8.bias": 1, "fc8.weight": 4, "fc7.weight": 4, "conv.bias": 1, "conv.weight": 1}
    # Every piece in exactly one bucket; each slice alone, with its tensor's option.
    pieces = sorted(p for b in cut["buckets"] for p in b["tensors"])
    assert pieces == list(range(1 + 4 + 4 + 1 + 1))
    assert len(cut["buckets"]) == len(whole["buckets"]) + 2 * 3
    options = {(b["codec"], b["feedback"]) for b in cut["buckets"] if len(b["tensors"]) == 1
               and b["tensors"][0] in range(1, 9)}
    assert options == {("randomk:ratio=0.01", "ef")}
    # Nothing large enough: the plan is the same.
    assert slices.sliced(whole, 1 << 30, 4)["buckets"] == whole["buckets"]


def test_plan_contenders_are_accepted_on_request(tmp_path):
    plan = tmp_path / "p.json"
    args = argparse.Namespace(codecs="fp16", optimizer="none",
                              contenders=f"compute,plan:{plan},plan-whole,plan")
    chosen = bench.contenders(args)
    assert chosen[:3] == ["compute", "plan", "plan-whole"] and chosen[3] == f"plan:{plan}"
    assert bench.family(f"plan:{plan}") == "gradcomp" and bench.family("plan-whole") == "gradcomp"
    assert bench.label(f"plan:{plan}") == "gradcomp plan p.json"
    # Not among the default contenders: plan-whole repeats the planned plan where nothing is cut.
    assert "plan-whole" not in bench.contenders(argparse.Namespace(
        codecs="fp16", optimizer="none", contenders=None))
    with pytest.raises(bench.BenchError, match="plan-whole, auto, plan:PATH"):
        bench.contenders(argparse.Namespace(codecs="fp16", optimizer="none",
                                            contenders="horovod"))
