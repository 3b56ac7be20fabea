"""The benchmark's auto contender (gradcomp's compression="auto"): the worker steps until it
has decided and measures after the decision, every rank alike; bench.py and worker.py use the
same settings; the report shows the decision under the config's table."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT / "bench" / "cluster"))
import bench  # noqa: E402
import report  # noqa: E402
import worker  # noqa: E402
from test_report import make_run, replay_config, steps_around  # noqa: E402
from test_worker import run_workers  # noqa: E402


def test_auto_decides_in_unmeasured_steps_then_measures_the_kept_plan(tmp_path):
    ranks = run_workers(tmp_path, "auto", timeout=300)
    autos = [r["auto"] for r in ranks]
    assert all(len(r["step_s"]) == 3 for r in ranks)
    assert ranks[0]["grad_digest"] == ranks[1]["grad_digest"]
    # Every rank decided at the same step, once, before the measured steps, within the bound.
    assert len({a["decided_after_steps"] for a in autos}) == 1
    assert autos[0]["phase"] == "decided" and autos[0]["decisions"] == 1
    assert autos[0]["decided_after_steps"] <= worker.auto_search_steps(worker.AUTO)
    decision = autos[0]["decision"]
    assert decision["step"] == autos[0]["decided_after_steps"] + 1
    assert decision["candidates"][0]["name"] == "uncompressed"
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in decision["candidates"])
    # The CPU time of each trial's steps, and the machine the ranks share (this one).
    assert all(c["cpu_ms"] > 0 for c in decision["candidates"])
    assert decision["machine"]["ranks"] == len(ranks) and decision["machine"]["cores"] >= 1
    assert decision["kept_name"] == decision["candidates"][decision["kept"]]["name"]
    assert decision["search_steps"] > 0 and decision["search_seconds"] > 0
    # The plan in force is the kept one.
    assert autos[0]["plan"] == decision["candidates"][decision["kept"]]["summary"]
    assert (tmp_path / "out" / "auto-report.json").exists()
    # Its calibrated, corrected model predicts the other gradcomp contenders of the config.
    (tmp_path / "out").rename(tmp_path / bench.slug("auto"))
    config = {"dilation": 2, "codec_costs": "profiles/codec-costs.json", "runs": [
        {"contender": "auto", "status": "ok", "auto": autos[0]},
        {"contender": "gradcomp:topk:ratio=0.01|ef", "status": "ok", "optimizer": "none"},
        {"contender": "ddp", "status": "ok", "optimizer": "none"},
        {"contender": "gradcomp:topk:ratio=0.01|ef+adamw", "status": "ok", "optimizer": "adamw"}]}
    bench.calibrated_predictions(config, tmp_path, tmp_path / "auto-calibration")
    auto_run, topk, ddp, topk_adamw = config["runs"]
    assert auto_run.get("calibrated_ms", 0) > 0 and topk.get("calibrated_ms", 0) > 0, config
    assert "calibrated_ms" not in ddp  # not gradcomp's: its own model has no say
    # Another optimizer's update is in no term of auto's correction (fitted without it).
    assert "calibrated_ms" not in topk_adamw
    report_json = json.loads((tmp_path / "auto" / "auto-report.json").read_text())
    assert config["auto_calibration"]["correction"] == report_json["model_correction"]
    # top-k is none of auto's candidates: its costs come from the config's file, auto's own stay.
    assert "topk" in config["auto_calibration"]["borrowed_costs"]
    assert not set(config["auto_calibration"]["borrowed_costs"]) & set(report_json["codec_costs"])
    costs = json.loads((tmp_path / "auto-calibration" / "codec-costs.json").read_text())
    assert {k: costs[k] for k in report_json["codec_costs"]} == report_json["codec_costs"]
    simulated = json.loads((tmp_path / "auto-calibration" / "simulated.json").read_text())
    assert simulated["correction"] == report_json["model_correction"]
    assert topk["calibrated_ms"] == 1e3 * simulated["rows"][0]["iteration_s"] / 2
    # The report itself is kept beside (its trials, for `gradcomp correct --report`).
    kept = json.loads((tmp_path / "auto-calibration" / "auto-report.json").read_text())
    assert kept == report_json


def test_bench_and_worker_share_the_auto_settings():
    source = (ROOT / "bench" / "cluster" / "worker.py").read_text()
    line = next(l for l in source.splitlines() if l.startswith("AUTO = "))
    assert json.loads(line.split("=", 1)[1]) == bench.AUTO == worker.AUTO
    assert bench.AUTO_SEARCH_STEPS == worker.auto_search_steps(bench.AUTO)
    assert bench.family("auto") == "auto" and "auto" in bench.LABELS
    assert worker.parse_contender("auto") == ("auto", None)


def test_report_shows_the_decision_under_the_table():
    candidates = [{"name": "uncompressed", "summary": "4 buckets: 4 none",
                   "predicted_ms": 1300.0, "measured_ms": 1400.0, "first_step": 21},
                  {"name": "the planner's best", "summary": "9 buckets: 9 powersgd:rank=4/ef",
                   "predicted_ms": 200.0, "measured_ms": 250.0, "first_step": 26,
                   "cpu_ms": 95.0}]
    auto = {"settings": bench.AUTO, "options": ["fp16", "powersgd:rank=4|ef"],
            "decided_after_steps": 30, "phase": "decided", "decisions": 1,
            "plan": candidates[1]["summary"], "ranks_agree": True,
            "decision": {"step": 31, "kept": 1, "kept_name": "the planner's best",
                         "why": "fastest measured", "search_steps": 10.0,
                         "search_seconds": 12.5, "candidates": candidates, "remeasured": [1, 0]}}
    config = replay_config()
    config["runs"].append(make_run("auto", steps_around(240.0), family="auto", auto=auto))
    md = report.render_markdown({"replay": [config]}, [])
    assert "kept **the planner's best**" in md and "from step 31" in md
    assert ("| the planner's best (kept, measured twice) | 9 buckets: 9 powersgd:rank=4/ef | "
            "200.0 | 250.0 | 95.0 |") in md
    assert "| uncompressed (measured twice) | 4 buckets: 4 none |" in md
    assert "| label of auto | 240.0 |" in md
    # Time-dilated: the candidates' times are divided by the dilation, as every step time; the
    # CPU time is real time, as the contenders' (a report without it shows none).
    dilated = "\n".join(report._auto_block(auto, 10))
    assert "| uncompressed (measured twice) | 4 buckets: 4 none | 130.0 | 140.0 | - |" in dilated
    assert "| 20.0 | 25.0 | 95.0 |" in dilated


def test_auto_candidates_reach_the_replay_settings(capsys):
    base = ["--profiles", "resnet50", "--rates", "1gbit", "--workers", "4", "--no-train"]
    assert "candidates" not in bench.parse_args(base).auto
    args = bench.parse_args(base + ["--auto-candidates",
                                    "qsgd:levels=15,block=512; randomk:ratio=0.01|ef"])
    assert args.auto == dict(bench.AUTO, candidates=["qsgd:levels=15,block=512",
                                                      "randomk:ratio=0.01|ef"])
    assert bench.AUTO.get("candidates") is None  # the shared default is left alone
    with pytest.raises(SystemExit):
        bench.parse_args(base + ["--auto-candidates", " ; "])
    assert "--auto-candidates: give at least one option" in capsys.readouterr().err
