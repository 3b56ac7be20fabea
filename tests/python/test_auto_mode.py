"""compression="auto" (gradcomp.torch.DistributedOptimizer): the scheduler decides from what it
measures in the job, every rank alike; its report says what it tried and why it kept what it
kept; a checkpoint taken after the decision resumes bit-exactly without a new search; bad
arguments are clear errors."""
import json
import math
import subprocess

import pytest
import torch

import gradcomp.torch as gc
from conftest import GRADCOMP


@pytest.fixture(scope="module")
def runs(module_runner, tmp_path_factory):
    """36 steps at 2 ranks, saving a checkpoint after step 30 (after the decision), and the
    last 6 steps again in new processes from that checkpoint."""
    straight = module_runner("auto_mode.py", "--save-at", 30, "--errors").check()
    resumed = module_runner("auto_mode.py", "--begin", 30, "--load",
                            straight.out / "ckpt").check()
    return straight, resumed


def test_every_rank_takes_the_same_decision(runs):
    straight, _ = runs
    first = straight.load("params", 0)
    for rank in range(1, straight.world):
        assert all(torch.equal(a, b) for a, b in zip(first, straight.load("params", rank))), \
            f"rank {rank} differs"
        assert straight.report(rank)["plans"] == straight.report(0)["plans"]


def test_the_report_says_what_was_tried_and_why(runs):
    straight, _ = runs
    report = straight.report(0)["report"]
    assert report["phase"] == "decided"
    decision = report["decisions"][0]
    candidates = decision["candidates"]
    assert candidates[0]["name"] == "uncompressed"
    assert len(candidates) >= 2, "the planner proposed no compressed plan"
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in candidates)
    kept = candidates[decision["kept"]]
    # The fastest measured is kept, unless uncompressed is within twice their combined noise or
    # 3% of it, the larger (one rank group, no nodes: uncompressed is the one lossless plan):
    # docs/auto.md, "Decision".
    fastest = min(range(len(candidates)), key=lambda i: candidates[i]["measured_ms"])
    plain, best = candidates[0], candidates[fastest]
    margin = max(2 * math.hypot(plain["noise_ms"], best["noise_ms"]), 0.03 * plain["measured_ms"])
    expected = 0 if plain["measured_ms"] <= best["measured_ms"] + margin + 1e-9 else fastest
    assert decision["kept"] == expected, decision["why"]
    assert decision["why"]
    assert decision["link"]["bytes_per_s"] > 0
    # Warm-up (6 steps) uncompressed; the plan in force from the decision on is the kept one.
    plans = straight.report(0)["plans"]
    assert all(p == candidates[0]["summary"] for p in plans[:5])
    assert plans[-1] == kept["summary"]


def test_the_decision_is_in_the_timeline(runs):
    """The search's span, from its start to the decision, on a lane of its own, with what was
    kept and why."""
    straight, _ = runs
    report = straight.report(0)["report"]
    events = json.loads((straight.out / "trace.rank0.json").read_text())
    decided = [e for e in events if e.get("name") == "auto: decided"]
    assert len(decided) == 1, [e.get("name") for e in events][:20]
    args = decided[0]["args"]
    assert args["kept"] == report["decisions"][0]["kept_name"]
    assert args["why"] == report["decisions"][0]["why"]
    assert len(args["candidates"]) == len(report["decisions"][0]["candidates"])
    assert decided[0]["dur"] > 0


def test_a_checkpoint_after_the_decision_resumes_bit_exactly(runs):
    straight, resumed = runs
    for rank in range(straight.world):
        assert all(torch.equal(a, b) for a, b in
                   zip(straight.load("params", rank), resumed.load("params", rank))), \
            f"rank {rank}: resumed training differs"
        report = resumed.report(rank)["report"]
        assert report["phase"] == "decided" and not report["decisions"], "searched again"
        # The link watch's probe, as calibrated, is resumed with the decision.
        watch = report["link_watch"]
        assert watch is not None and watch["calibrated_ms"] > 0, report
        assert watch == {**straight.report(rank)["report"]["link_watch"], "last_ms": 0,
                         "faster_checks": 0}


def test_bad_arguments_are_clear_errors(runs):
    errors = runs[0].report(0)["errors"]
    assert "give no plan" in errors["with_plan"]
    assert 'needs compression="auto"' in errors["auto_without_auto"]
    assert "unknown setting 'warmup'; known: " in errors["unknown_key"]
    assert "warmup_steps" in errors["unknown_key"]
    assert "nosuch" in errors["bad_candidate"]
    assert "trial_steps" in errors["bad_steps"]
    assert "link_change is 0.5" in errors["bad_link_change"]
    assert 'warmup_steps is "20"; a whole number' in errors["bad_type"]
    assert 'candidates is "fp16"; a list of options' in errors["candidates_string"]
    assert "auto= is a dict of settings" in errors["not_a_dict"]
    assert "not finite" in errors["nan_setting"]


def test_the_decision_replays_offline_with_gradcomp_plan(runs, tmp_path):
    """The profile, link and codec costs it measured, written in the formats `gradcomp plan`
    reads, give the planner's best plan again, bit for bit."""
    straight, _ = runs
    record = straight.report(0)
    report = record["report"]
    profile, cluster, costs, _ = record["calibration"]
    out = tmp_path / "plan.json"
    subprocess.run([str(GRADCOMP), "plan", "--profile", profile, "--cluster", cluster,
                    "--costs", costs, "--codecs", ",".join(report["planner_codecs"]),
                    "--small-tensors", str(report["min_compress_elements"]),
                    *(["--one-lossy-step"] if report["one_lossy_step"] else []),
                    "--json", str(out)],
                   check=True, capture_output=True, timeout=60)
    replayed = json.loads(out.read_text())
    best = [c for c in report["decisions"][0]["candidates"] if c["name"] == "the planner's best"]
    # Always proposed (and so named) when it compresses, whatever the model predicts of the
    # other proposals: docs/auto.md, "Proposals".
    if best:
        assert replayed["buckets"] == best[0]["plan"]["buckets"]
    else:
        assert all(b["codec"] == "none" for b in replayed["buckets"]), \
            [c["name"] for c in report["decisions"][0]["candidates"]]


def test_the_corrected_model_replays_offline_with_gradcomp_simulate(runs, tmp_path):
    """The correction it saves, given to `gradcomp simulate` with the calibration, predicts
    every trial of the decision as the scheduler's corrected model did: the same mean error."""
    straight, _ = runs
    record = straight.report(0)
    decision = record["report"]["decisions"][0]
    profile, cluster, costs, correction = record["calibration"]
    errors = []
    for i, candidate in enumerate(decision["candidates"]):
        plan, out = tmp_path / f"plan{i}.json", tmp_path / f"sim{i}.json"
        plan.write_text(json.dumps(candidate["plan"]))
        subprocess.run([str(GRADCOMP), "simulate", "--profile", profile, "--cluster", cluster,
                        "--costs", costs, "--correction", correction, "--plan", str(plan),
                        "--json", str(out)], check=True, capture_output=True, timeout=60)
        predicted_ms = json.loads(out.read_text())["rows"][0]["iteration_s"] * 1e3
        errors.append(abs(predicted_ms - candidate["measured_ms"]) / candidate["measured_ms"])
    corrected = decision["model_error"]["corrected"]
    assert sum(errors) / len(errors) == pytest.approx(corrected, rel=1e-6, abs=1e-9), errors
    assert corrected <= decision["model_error"]["uncorrected"]


@pytest.fixture(scope="module")
def ddp_runs(module_runner):
    straight = module_runner("ddp_auto.py", "--save-at", 30).check()
    resumed = module_runner("ddp_auto.py", "--begin", 30, "--load", straight.out / "ckpt").check()
    return straight, resumed


def test_nodes_are_calibrated_apart_and_their_routes_run(run_workers):
    """4 ranks in nodes of 2: the link inside a node and the one between nodes are fitted
    apart, a candidate on the sharded route gets trials through the engine, and every rank ends
    with the same parameters."""
    job = run_workers("auto_mode.py", "--local-size", 2, "--candidates",
                      "topk:ratio=0.01|ef|sharded:inner=allgather", world=4).check()
    decision = job.report(0)["report"]["decisions"][0]
    assert decision["per_node"] == 2
    assert decision["intra_link"]["bytes_per_s"] > 0 and decision["link"]["bytes_per_s"] > 0
    routes = {b["route"] for c in decision["candidates"] for b in c["plan"]["buckets"]}
    assert "sharded:inner=allgather" in routes, routes
    assert all(math.isfinite(c["measured_ms"]) and c["measured_ms"] > 0
               for c in decision["candidates"])
    first = job.load("params", 0)
    for rank in range(1, 4):
        assert all(torch.equal(a, b) for a, b in zip(first, job.load("params", rank))), \
            f"rank {rank} differs"


def test_a_job_with_servers_tells_the_planner_and_tries_them(run_workers):
    """Started with parameter servers (GRADCOMP_SERVERS), auto tells the planner, which may then
    route buckets over them (tests/model/planner_test.cpp: it offers route servers only then);
    the calibration it saves for `gradcomp plan` says so too. A candidate on route servers gets
    trials through the engine, the plan changes to and from it, and every rank ends with the
    same parameters whatever was kept."""
    job = run_workers("auto_mode.py", "--candidates", "topk:ratio=0.01|ef|servers",
                      servers=2).check()
    report = job.report(0)["report"]
    assert report["cluster"]["servers"] == 2, report["cluster"]
    tried = [c for c in report["decisions"][0]["candidates"]
             if any(b["route"] == "servers" for b in c["plan"]["buckets"])]
    assert tried and all(c["measured_ms"] > 0 for c in tried), report["decisions"][0]
    first = job.load("params", 0)
    assert all(torch.equal(a, b) for a, b in zip(first, job.load("params", 1)))
    without = run_workers("auto_mode.py", "--candidates", "topk:ratio=0.01|ef").check()
    assert "servers" not in without.report(0)["report"]["cluster"]


def test_a_model_as_users_write_them_stays_bit_identical_through_every_plan_change(
        run_workers):
    """3 ranks, AdamW, a model with tied weights, a GRU, attention, a frozen layer and a branch
    used on odd steps only, two backward passes a step, clipping: the ranks' parameters are
    bit-identical after every step, through the warm-up, every trial's plan and the kept one."""
    job = run_workers("auto_awkward.py", world=3).check()
    reports = job.reports()
    plans = reports[0]["plans"]
    assert len(set(plans)) >= 3, plans  # uncompressed, trials, the kept plan
    assert reports[0]["report"]["phase"] == "decided"
    for rank, report in enumerate(reports[1:], 1):
        assert report["plans"] == plans, f"rank {rank} ran other plans"
        differ = [s for s, (a, b) in enumerate(zip(reports[0]["digests"], report["digests"]))
                  if a != b]
        assert not differ, f"rank {rank} differs from rank 0 after steps {differ}"
    assert all(r["frozen_kept"] and r["still_tied"] for r in reports)
    # find_unused_parameters: the branch's weight gets a gradient on the steps that use it only.
    assert reports[0]["odd_branch_grad"] == [bool(s % 2) for s in range(len(plans))]


def test_the_ddp_hook_decides_too_every_rank_alike(ddp_runs):
    straight, _ = ddp_runs
    report = straight.report(0)["report"]
    assert report["phase"] == "decided", report["phase"]
    assert len(report["decisions"][0]["candidates"]) >= 2
    first = straight.load("params", 0)
    for rank in range(1, straight.world):
        assert straight.report(rank)["plans"] == straight.report(0)["plans"]
        assert all(torch.equal(a, b) for a, b in zip(first, straight.load("params", rank)))


def test_the_ddp_hook_takes_the_candidates_of_the_optimizers_family(ddp_runs):
    """Told the optimizer (SGD), the hook's auto chooses among what held under SGD: PowerSGD
    among them, which lost under AdamW at 4 ranks and is not offered without it."""
    straight, _ = ddp_runs
    assert straight.report(0)["candidates"] == list(gc._auto_settings(
        "auto", None, None, torch.optim.SGD([torch.zeros(1)], lr=0.1)).candidates)
    assert "powersgd:rank=4|ef" in straight.report(0)["candidates"]


def test_auto_candidates_follow_the_optimizers_family():
    param = [torch.zeros(1)]
    def candidates(optimizer):
        return list(gc._auto_settings("auto", None, None, optimizer).candidates)
    sgd = candidates(torch.optim.SGD(param, lr=0.1))
    adam = candidates(torch.optim.AdamW(param))
    unknown = candidates(None)  # a hook told nothing: what held under both
    assert "powersgd:rank=4|ef" in sgd and "powersgd:rank=4|ef" not in adam
    assert "topk:ratio=0.01|ef" in sgd and "topk:ratio=0.01|ef" not in adam
    assert unknown == [c for c in sgd if c in adam] and "fp16" in unknown
    assert all("start=" not in c and c != "none" for c in sgd + adam)


def test_a_hook_told_the_optimizer_warns_of_a_compression_that_lost_under_it(tmp_path):
    """comm_hook(codec, optimizer=...) warns as DistributedOptimizer does (one process, its own
    gloo group: a hook needs one to be built)."""
    script = f"""
import warnings, torch, torch.distributed as dist
import gradcomp.torch as gc
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
param = [torch.zeros(1)]
for name, optimizer in (("AdamW", torch.optim.AdamW(param)), ("SGD", torch.optim.SGD(param, lr=0.1))):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gc.comm_hook("topk:ratio=0.01|ef", optimizer=optimizer)
    print(name, sum("not recommended with " + name in str(w.message) for w in seen))
"""
    out = subprocess.run(["/usr/bin/python3", "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AdamW", "1", "SGD", "0"], out.stdout


def test_the_ddp_hook_marks_its_decision_in_the_timeline(ddp_runs):
    straight, _ = ddp_runs
    report = straight.report(0)["report"]
    events = json.loads((straight.out / "trace.rank0.json").read_text())
    decided = [e for e in events if e.get("name") == "auto: decided"]
    assert len(decided) == 1, [e.get("name") for e in events][:20]
    assert decided[0]["args"]["kept"] == report["decisions"][0]["kept_name"]
    assert decided[0]["dur"] > 0


def test_the_ddp_hook_resumes_its_decision(ddp_runs):
    """Not bit-exactly: DDP rebuilds its buckets after a restart, and the hook averages those
    first iterations uncompressed (docs/python.md); from then on the kept plan runs again."""
    straight, resumed = ddp_runs
    kept = straight.report(0)["plans"][-1]
    for rank in range(straight.world):
        report = resumed.report(rank)["report"]
        assert report["phase"] == "decided" and not report["decisions"], "searched again"
        # The link watch's probe, as calibrated, is resumed with the decision.
        watch = report["link_watch"]
        assert watch is not None and watch["calibrated_ms"] > 0, report
        assert watch == {**straight.report(rank)["report"]["link_watch"], "last_ms": 0,
                         "faster_checks": 0}
        assert resumed.report(rank)["plans"][-1] == kept


def test_the_main_jobs_script_takes_auto_and_lists_its_decisions(tmp_path):
    """examples/fashion_mnist/train.py --compression auto --auto JSON: the settings reach the
    scheduler and the summary lists what it decided."""
    from conftest import ROOT, free_port
    settings = {"candidates": ["fp16"], "warmup_steps": 6, "profile_steps": 3, "trial_steps": 3}
    summary = tmp_path / "summary.json"
    done = subprocess.run(
        [str(GRADCOMP), "launch", "-n", "2", "--master-port", str(free_port()), "--",
         "/usr/bin/python3", str(ROOT / "examples" / "fashion_mnist" / "train.py"),
         "--epochs", "0.04", "--compression", "auto", "--auto", json.dumps(settings),
         "--min-compress-elements", "1000", "--no-progress", "--json", str(summary)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    decisions = json.loads(summary.read_text())["auto"]
    assert decisions and decisions[0]["reason"].startswith("first decision")
    assert decisions[0]["kept_name"] in ("uncompressed", "the planner's best") \
        or "fp16" in decisions[0]["kept_name"], decisions
    assert "gradcomp auto: decided" in done.stderr
