"""The benchmark's command end to end on a small emulated cluster (real namespaces, tbf links,
DDP and gradcomp workers, `gradcomp plan` and `gradcomp simulate`), and its answers to bad
environments: not root, a stale namespace, a worker that dies, a latency asked for."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "cluster" / "bench.py"
RUN = ROOT / "bench" / "cluster" / "run.sh"
PYTHON = "/usr/bin/python3"
sys.path.insert(0, str(ROOT / "bench" / "cluster"))
import bench  # noqa: E402
import netns  # noqa: E402
import report  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_testing import NOT_ROOT, PROFILE, alive  # noqa: E402


def bench_argv(tmp_path, *extra):
    profile = tmp_path / "tiny.json"
    profile.write_text(json.dumps(PROFILE))
    return [PYTHON, str(BENCH), "--profiles", str(profile), "--rates", "1gbit",
            "--workers", "2", "--warmup", "1", "--steps", "2", "--no-train",
            "--costs", str(ROOT / "profiles" / "codec-costs.json"),
            "--codecs", "fp16,topk:ratio=0.01|ef", "--out", str(tmp_path / "out"),
            "--md", str(tmp_path / "report.md"), "--img", str(tmp_path / "img"), *extra]


def leftovers(pid):
    return [n for n in netns.stale_namespaces() if n.startswith(f"{netns.PREFIX}-{pid}-")]


def test_small_run_measures_every_contender_and_leaves_nothing(tmp_path):
    before = set(netns.stale_namespaces())
    proc = subprocess.run(bench_argv(tmp_path, "--contenders",
                                     "compute,ddp,ddp-fp16,gradcomp:topk:ratio=0.01|ef,plan"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "cluster-benchmark.json").read_text())
    (config,) = results["replay"]
    assert config["workers"] == 2 and config["dilation"] == 1
    # tbf holds the rate: the measured ring throughput is below the link rate, and not nothing.
    assert 0.3e9 < config["measured_link_bps"] <= 1.1e9
    assert config["measured_latency_s"] > 0
    runs = {r["contender"]: r for r in config["runs"]}
    assert set(runs) == {"compute", "ddp", "ddp-fp16", "gradcomp:topk:ratio=0.01|ef", "plan"}
    for name, run in runs.items():
        assert run["status"] == "ok", run
        assert len(run["step_ms"]) == 2
        assert run["predicted_ms"] > 0
    # Bytes counted on the link: DDP's ring allreduce sends at least half the gradient at W=2;
    # fp16 about half of that; the compute-only run almost nothing.
    raw = 4 * sum(t["elements"] for t in PROFILE["tensors"])
    assert runs["ddp"]["wire_bytes_per_step"] >= raw / 2
    assert runs["ddp-fp16"]["wire_bytes_per_step"] < 0.75 * runs["ddp"]["wire_bytes_per_step"]
    assert runs["compute"]["wire_bytes_per_step"] < 0.01 * raw
    plan = json.loads((ROOT / config["plan"]["path"]).read_text())
    assert len(plan["buckets"]) == config["plan"]["buckets"]
    # The report was written from these results, with every target evaluated.
    text = (tmp_path / "report.md").read_text()
    assert "Targets" in text and "gradcomp planned" in text
    assert len(report.evaluate_targets(results)) == 5
    assert proc.stdout.count("ms/step") == 5
    assert set(netns.stale_namespaces()) <= before


def test_a_dead_worker_fails_its_contender_only(tmp_path):
    """Kills rank 1 of the DDP run: that run is reported failed with the signal, the next
    contender still runs, and no namespace or process is left."""
    # 1,500 steps of the tiny profile take DDP about 20 s here: far longer than the wait for
    # the worker below, so the kill lands while it runs (400 steps could end before it).
    argv = bench_argv(tmp_path, "--contenders", "ddp,compute", "--steps", "1500")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        victim = wait_for_worker(proc.pid, tmp_path / "out" / "runs", "ddp")
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    results = json.loads((tmp_path / "out" / "cluster-benchmark.json").read_text())
    runs = {r["contender"]: r for r in results["replay"][0]["runs"]}
    assert runs["ddp"]["status"] == "failed"
    assert "rank 1" in runs["ddp"]["error"] and "SIGKILL" in runs["ddp"]["error"]
    assert runs["compute"]["status"] == "ok"
    assert "FAILED" in out
    assert not leftovers(proc.pid)
    assert not alive(victim)


def wait_for_worker(bench_pid, runs_dir, contender, timeout=180):
    """The pid of rank 1's worker once the contender's run has started (and had 2 s to step)."""
    host = f"{netns.PREFIX}-{bench_pid}-h1"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(runs_dir.glob(f"*/{contender}/rank1.log")):
            pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True,
                                  text=True, timeout=10).stdout.split()
            workers = [int(p) for p in pids if b"worker.py" in cmdline(p)]
            if workers:
                time.sleep(2)
                return workers[0]
        time.sleep(0.5)
    raise AssertionError(f"no {contender} worker appeared in {host} within {timeout} s")


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_stale_namespaces_are_removed_with_a_message(tmp_path):
    stale = f"{netns.PREFIX}-999999999-h0"  # no such process: an aborted run's leftover
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        done = subprocess.run([PYTHON, str(BENCH), "--clean"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert "left by an aborted run" in done.stdout and stale in done.stdout
        assert stale not in netns.stale_namespaces()
        again = subprocess.run([PYTHON, str(BENCH), "--clean"], capture_output=True,
                               text=True, timeout=60)
        assert "nothing to clean" in again.stdout
    finally:
        netns.remove_namespaces([stale])


def test_not_root_is_refused_before_anything_is_set_up(tmp_path):
    done = subprocess.run(NOT_ROOT + ["bash", str(RUN), "--quick"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert "must run as root" in done.stderr


def test_latency_is_refused_naming_netem(tmp_path):
    done = subprocess.run(bench_argv(tmp_path, "--delay", "1ms"), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert "netem" in done.stderr


def test_unknown_contender_lists_the_known_ones(tmp_path):
    done = subprocess.run(bench_argv(tmp_path, "--contenders", "ddp,horovod"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "unknown contender(s) horovod" in done.stderr and "ddp-fp16" in done.stderr


# ---------------------------------------------------------------- the optimizer comparison

# One contender of each kind the default set has: compute alone, compute with an update, the
# baseline, and both two-stage optimizers over gradcomp's 1-bit exchange (a run per contender
# is two Python workers; test_worker.py runs each of the default set's updates on its own).
OPTIMIZER_KINDS = ["compute", "compute+adamw", bench.BASELINE,
                   *(f"gradcomp:{bench.ONEBIT}+{o}" for o in bench.TWO_STAGE)]


def test_optimizer_comparison_measures_every_update_and_leaves_nothing(tmp_path):
    """--optimizers on a 2-host cluster: a contender of each kind, each with its optimizer's
    update in the step, the ranks of every exchanging contender agreeing, and the table."""
    assert set(OPTIMIZER_KINDS) <= set(bench.OPTIMIZER_CONTENDERS)
    before = set(netns.stale_namespaces())
    proc = subprocess.run(bench_argv(tmp_path, "--optimizers", "--contenders",
                                     ",".join(OPTIMIZER_KINDS)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "optimizer-benchmark.json").read_text())
    assert results["format"] == report.OPTIMIZER_FORMAT
    (config,) = results["configs"]
    runs = {r["contender"]: r for r in config["runs"]}
    assert list(runs) == OPTIMIZER_KINDS
    for name, run in runs.items():
        assert run["status"] == "ok", run
        assert len(run["step_ms"]) == 2 and len(run["after_backward_ms"]) == 2
        if run["optimizer"] != "none":
            assert len(run["update_ms"]) == 2
            assert run["ranks_agree"] == (run["family"] != "compute"), name
    for optimizer in bench.TWO_STAGE:
        onebit = runs[f"gradcomp:{bench.ONEBIT}+{optimizer}"]
        assert onebit["onebit_warmup_steps"] == 1 and onebit["onebit_compressed_steps"] == 2
    md = (tmp_path / "report.md").read_text()  # --md given: the table goes there
    assert "| DDP + AdamW | DDP gloo 25 MB | AdamW (torch) |" in md
    assert "x DDP + AdamW" in proc.stdout and "target 3x" in proc.stdout
    assert all(run["other_cpu_cores"] >= 0 for run in runs.values())
    assert set(netns.stale_namespaces()) <= before


def test_optimizer_names_and_refusals(tmp_path):
    assert bench.OPTIMIZERS == worker_optimizers()
    # The default set is accepted as it stands (the comparison above runs a part of it).
    assert bench.optimizer_contenders(bench.parse_args(["--optimizers"])) == \
        bench.OPTIMIZER_CONTENDERS
    assert bench.split_optimizer("gradcomp:onebit:block=256|ef|twoway+lans") == (
        "gradcomp:onebit:block=256|ef|twoway", "lans")
    assert bench.split_optimizer("gradcomp:topk:ratio=0.01|ef") == (
        "gradcomp:topk:ratio=0.01|ef", "none")
    assert bench.label("ddp-fp16+lamb") == "DDP + fp16 hook + LAMB"
    assert bench.family("ddp+adamw") == "ddp"
    done = subprocess.run(bench_argv(tmp_path, "--optimizers", "--contenders",
                                     "ddp+onebitadam"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert "1-bit Adam averages over the ranks by itself" in done.stderr
    done = subprocess.run(bench_argv(tmp_path, "--optimizers", "--contenders",
                                     "compute+onebitlamb"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert "1-bit LAMB averages over the ranks by itself" in done.stderr
    done = subprocess.run(bench_argv(tmp_path, "--contenders", "ddp+adamw,horovod+lans"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "unknown contender(s) horovod+lans" in done.stderr


def test_rounds_merge_every_measured_step():
    def row(steps, wire, status="ok"):
        return {"status": status, "step_ms": steps, "update_ms": [1.0] * len(steps),
                "backward_end_ms": None, "wire_bytes_per_step": wire, "seconds": 2.0,
                "onebit_compressed_steps": len(steps), "ranks_agree": True,
                "error": "gone" if status != "ok" else None}
    merged = bench.merge_rounds(None, row([10.0, 30.0, 20.0], 100.0))
    merged = bench.merge_rounds(merged, row([40.0, 50.0], 200.0))
    assert merged["step_ms"] == [10.0, 30.0, 20.0, 40.0, 50.0]
    assert merged["update_ms"] == [1.0] * 5 and merged["backward_end_ms"] is None
    assert merged["round_median_ms"] == [20.0, 45.0]
    assert merged["wire_bytes_per_step"] == 150.0 and merged["seconds"] == 4.0
    assert merged["onebit_compressed_steps"] == 5
    failed = bench.merge_rounds(merged, row([], None, status="failed"))
    assert failed["status"] == "failed" and failed["error"] == "gone"
    assert bench.merge_rounds(failed, row([5.0], 1.0)) is failed


def test_rounds_are_for_the_optimizer_comparison_only(tmp_path):
    done = subprocess.run(bench_argv(tmp_path, "--rounds", "2"), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--rounds must be >= 1, and is for --optimizers only" \
        in done.stderr


def worker_optimizers():
    """worker.py's --optimizer choices, read from its source (importing it loads torch)."""
    source = (ROOT / "bench" / "cluster" / "worker.py").read_text()
    line = next(l for l in source.splitlines() if l.startswith("OPTIMIZERS = "))
    return json.loads(line.split("=", 1)[1].replace("'", '"'))


def test_train_contenders_are_checked_and_train_only_needs_training(tmp_path):
    done = subprocess.run(bench_argv(tmp_path, "--train-contenders", "ddp,horovod"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--train-contenders: unknown horovod" in done.stderr
    assert "auto" in done.stderr  # auto is one of the training contenders
    # Any gradcomp option trains too; only the unknown one is named.
    done = subprocess.run(bench_argv(tmp_path, "--train-contenders",
                                     "gradcomp:randomk:ratio=0.001|ef,horovod"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--train-contenders: unknown horovod;" in done.stderr
    assert "gradcomp:SPEC" in done.stderr
    done = subprocess.run(bench_argv(tmp_path, "--train-auto", "{candidates"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--train-auto" in done.stderr
    done = subprocess.run(bench_argv(tmp_path, "--train-only", "--no-train"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--train-only runs the training workload alone" in done.stderr


def test_train_rate_change_is_checked(tmp_path):
    for bad in ("1gbit", "fast@10", "1gbit@0", "1gbit@x"):
        done = subprocess.run(bench_argv(tmp_path, "--train-rate-change", bad),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "--train-rate-change" in done.stderr, (bad, done.stderr)
        assert "RATE@SECONDS" in done.stderr


def test_a_rate_change_comes_after_its_seconds_and_is_undone(tmp_path):
    """Each training contender runs at the configured rate, the links changed by a timer during
    the run and set back afterwards, so that every contender sees the same links."""
    def rate_of(cluster):
        shown = subprocess.run(["tc", "-n", cluster.namespaces[1], "qdisc", "show", "dev",
                                cluster.ifname], capture_output=True, text=True).stdout
        return shown.split(" rate ")[1].split()[0]

    with netns.Cluster(2, "100mbit", run_id=f"{os.getpid()}rc") as cluster:
        cluster.set_rate("300mbit")  # what a contender before left: set back first
        with bench.rate_changed(cluster, 1e8, ("1gbit", 1e9, 0.5)):
            assert rate_of(cluster) == "100Mbit"
            time.sleep(1.5)
            assert rate_of(cluster) == "1Gbit"
        assert rate_of(cluster) == "100Mbit"
        with bench.rate_changed(cluster, 1e8, None):  # no change asked: the rate holds
            assert rate_of(cluster) == "100Mbit"
        # Timed from the training's first step: the file the worker's rank 0 makes then (one
        # left by the run before is not it).
        began = tmp_path / "training-began"
        began.touch()
        with bench.rate_changed(cluster, 1e8, ("1gbit", 1e9, 0.5), began) as changed:
            time.sleep(1.5)
            assert rate_of(cluster) == "100Mbit" and "wall" not in changed
            began.touch()
            time.sleep(1.5)
            assert rate_of(cluster) == "1Gbit" and "wall" in changed
        assert rate_of(cluster) == "100Mbit"


def test_the_change_is_placed_on_the_training_time_evaluations_left_out():
    wall = {"began": 1000.0, "evaluations": [[1010.0, 1012.0], [1020.0, 1023.0]]}
    assert bench.training_seconds_at(1005.0, wall) == 5.0
    assert bench.training_seconds_at(1011.0, wall) == 10.0  # during an evaluation: its start
    assert bench.training_seconds_at(1015.0, wall) == 13.0
    assert bench.training_seconds_at(1030.0, wall) == 25.0
