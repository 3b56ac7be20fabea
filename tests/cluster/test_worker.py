"""The benchmark's worker on loopback (no namespaces): every contender runs the replay of a small
profile with 2 real ranks, and what each reports is checked against what must hold: the bytes
that crossed the link, the exchanged gradients (identical on every rank; the exact mean where
the exchange is lossless), the measured step count."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "bench" / "cluster" / "worker.py"
PYTHON = "/usr/bin/python3"
sys.path.insert(0, str(ROOT / "bench" / "cluster"))
import worker  # noqa: E402
from cluster_testing import PROFILE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from free_port import free_port  # noqa: E402

ELEMENTS = sum(t["elements"] for t in PROFILE["tensors"])


def run_workers(tmp_path, contender, world=2, extra=(), timeout=120):
    """Starts `world` workers on loopback; returns their rank JSONs (or fails with the logs)."""
    profile = tmp_path / "tiny.json"
    profile.write_text(json.dumps(PROFILE))
    out = tmp_path / "out"
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   GRADCOMP_TIMEOUT="60")
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [PYTHON, str(WORKER), "--contender", contender, "--profile", str(profile),
             "--warmup", "2", "--steps", "3", "--iface", "lo", "--out", str(out), *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(world))
    assert codes == [0] * world, f"exit codes {codes}\n{logs}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def own_grad_sum(rank, seed=0):
    """The sum of the gradients rank `rank` produces (worker.ReplayModel's, before exchange)."""
    model = worker.ReplayModel(PROFILE, 1.0, False, seed, rank)
    return sum(float(g.double().sum()) for g in model.grads)


@pytest.mark.parametrize("contender", ["ddp", "gradcomp:none"])
def test_lossless_exchange_is_the_mean_on_every_rank(tmp_path, contender):
    ranks = run_workers(tmp_path, contender)
    mean = (own_grad_sum(0) + own_grad_sum(1)) / 2
    for r in ranks:
        assert len(r["step_s"]) == 3
        assert r["grad_digest"] == ranks[0]["grad_digest"]
        assert r["grad_sum"] == pytest.approx(mean, rel=1e-5, abs=1e-4)
        # A ring allreduce of W=2 sends at least half the gradient bytes per rank and step.
        assert r["tx_bytes_per_step"] >= 4 * ELEMENTS / 2


@pytest.mark.parametrize("contender", ["ddp-fp16", "ddp-powersgd:rank=1",
                                       "gradcomp:topk:ratio=0.01|ef", "gradcomp:powersgd|ef"])
def test_compressed_contenders_agree_across_ranks(tmp_path, contender):
    ranks = run_workers(tmp_path, contender)
    assert ranks[0]["grad_digest"] == ranks[1]["grad_digest"]
    if contender.startswith("gradcomp:"):
        # gradcomp counts what it sent: far less than the raw gradient for these codecs.
        assert 0 < ranks[0]["payload_bytes_per_step"] < 4 * ELEMENTS / 2


def test_compute_only_exchanges_nothing(tmp_path):
    ranks = run_workers(tmp_path, "compute")
    assert ranks[0]["grad_sum"] == pytest.approx(own_grad_sum(0), rel=1e-6)
    assert ranks[1]["grad_sum"] == pytest.approx(own_grad_sum(1), rel=1e-6)
    assert ranks[0]["grad_digest"] != ranks[1]["grad_digest"]
    # Waiting for the profile's ready times: a step cannot be shorter than forward + backward.
    assert min(ranks[0]["step_s"]) >= 0.012


def test_dilation_stretches_compute(tmp_path):
    ranks = run_workers(tmp_path, "compute", extra=("--dilation", "5"))
    assert ranks[0]["compute_s"] == pytest.approx(5 * 0.012)
    assert min(ranks[0]["step_s"]) >= 5 * 0.012


def test_plan_contender_runs_the_plan(tmp_path):
    plan = tmp_path / "plan.json"
    profile = tmp_path / "tiny.json"
    profile.write_text(json.dumps(PROFILE))
    subprocess.run([str(ROOT / "build" / "bin" / "gradcomp"), "plan", "--profile", str(profile),
                    "--workers", "2", "--inter", "100mbit", "--codecs",
                    "fp16,topk:ratio=0.01|ef", "--json", str(plan)], check=True,
                   capture_output=True)
    buckets = len(json.loads(plan.read_text())["buckets"])
    ranks = run_workers(tmp_path, f"plan:{plan}")
    assert [r["plan_buckets"] for r in ranks] == [buckets, buckets]
    assert ranks[0]["grad_digest"] == ranks[1]["grad_digest"]


def test_probe_measures_a_word_allreduce(tmp_path):
    ranks = run_workers(tmp_path, "compute", extra=("--workload", "probe"))
    assert all(0 < r[f"allreduce_{n}_s"] <= r[f"allreduce_{n}_p90_s"]
               for r in ranks for n in ("word", "4k"))


def test_bad_contender_is_named(tmp_path):
    with pytest.raises(worker.BenchError, match="contender 'ddp-int8' is unknown"):
        worker.parse_contender("ddp-int8")


def test_missing_launch_variables_are_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([PYTHON, str(WORKER), "--contender", "ddp", "--profile",
                           str(ROOT / "profiles" / "resnet50.json"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "RANK is not set" in done.stderr


def test_profile_shapes_are_torchvision_shapes_for_cnns():
    profile = json.loads((ROOT / "profiles" / "resnet50.json").read_text())
    shapes = worker.profile_shapes(profile)
    by_name = dict(zip((t["name"] for t in profile["tensors"]), shapes))
    assert by_name["fc.weight"] == (1000, 2048)
    assert by_name["conv1.weight"] == (64, 3, 7, 7)
    assert all(torch.Size(s).numel() == t["elements"]
               for s, t in zip(shapes, profile["tensors"]))


@pytest.mark.parametrize("contender", ["ddp", "gradcomp:topk:ratio=0.01|ef"])
def test_train_reports_accuracy_over_time(tmp_path, contender):
    """A few dozen steps of the main job's training: evaluations every half epoch and at the
    end, cumulative training time, accuracy far above chance (10 classes), the same on both
    ranks (they hold identical models)."""
    ranks = run_workers(tmp_path, contender, extra=("--workload", "train", "--epochs", "0.04"))
    r0 = ranks[0]
    assert r0["steps"] == round(0.04 * -(-30000 // 32))
    assert r0["eval_epochs"][-1] == pytest.approx(r0["steps"] / -(-30000 // 32))
    assert r0["epoch_seconds"] == sorted(r0["epoch_seconds"]) and r0["epoch_seconds"][0] > 0
    assert r0["epoch_accuracy"][-1] > 0.3
    assert ranks[1]["epoch_accuracy"] == r0["epoch_accuracy"]
    assert r0["tx_bytes_per_step"] > 0


def test_train_with_auto_decides_as_a_user_would_run_it(tmp_path):
    """compression="auto" with its defaults in the training workload: it decides within 0.15
    epoch (141 steps: the warm-up, up to 7 trials, a runoff of 3 and a lossless plan measured
    again with the fastest, 6 steps each), every rank alike, and says what it kept. The run
    may end in a later search: the drift watch searches again when the step time moves by
    more than 20% (a CI machine's builds beside the test can do that)."""
    ranks = run_workers(tmp_path, "auto", extra=("--workload", "train", "--epochs", "0.15"))
    auto = ranks[0]["auto"]
    assert auto["decisions"], auto
    decision = auto["decisions"][0]
    assert decision["reason"].startswith("first decision"), decision["reason"]
    assert ranks[1]["auto"]["phase"] == auto["phase"]
    assert decision["kept"] and decision["why"] and decision["step"] <= ranks[0]["steps"]
    assert len(decision["candidates"]) >= 2
    assert all(c["measured_ms"] > 0 for c in decision["candidates"])
    assert ranks[1]["auto"]["plan"] == auto["plan"]
    assert ranks[1]["epoch_accuracy"] == ranks[0]["epoch_accuracy"]


def test_train_under_adamw_and_auto_takes_the_options_recommended_for_adam(tmp_path):
    """--train-optimizer adamw: the training steps with AdamW, and auto chooses among the
    options that held under Adam-family optimizers (not SGD's)."""
    import gradcomp._C as C
    adam, sgd = C.recommended_options("adam"), C.recommended_options("sgd")
    assert set(adam) != set(sgd)
    ranks = run_workers(tmp_path, "auto", extra=("--workload", "train", "--epochs", "0.04",
                                                 "--train-optimizer", "adamw"))
    r0 = ranks[0]
    assert r0["optimizer"] == "adamw"
    def codecs(options):
        return {o.split("|")[0] for o in options} - {"none"}
    assert codecs(r0["auto"]["options"]) == codecs(adam), r0["auto"]["options"]
    assert r0["epoch_accuracy"][-1] > 0.3
    assert ranks[1]["epoch_accuracy"] == r0["epoch_accuracy"]


def test_train_auto_settings_reach_the_scheduler(tmp_path):
    """--train-auto: auto's settings in the training workload (its candidates here)."""
    settings = {"candidates": ["fp16"], "warmup_steps": 10, "profile_steps": 5,
                "trial_steps": 3}
    ranks = run_workers(tmp_path, "auto", extra=("--workload", "train", "--epochs", "0.05",
                                                 "--train-auto", json.dumps(settings)))
    decision = ranks[0]["auto"]["decisions"][0]
    assert decision["reason"].startswith("first decision")
    candidates = decision["candidates"]
    assert candidates[0]["name"] == "uncompressed" and len(candidates) >= 2
    for c in candidates:  # "3 buckets: 1 fp16/none/allgather, 2 none"
        codecs = {part.split()[1].split("/")[0] for part in c["summary"].split(": ")[1].split(", ")}
        assert codecs <= {"fp16", "none"}, c
    # A trial each, and one more for each candidate measured again: by default up to 3 within
    # the noise of the fastest (runoff), and the lossless one when the noise may hide its loss.
    remeasured = decision["remeasured"]
    assert len(remeasured) <= 3 + 1 and all(0 <= c < len(candidates) for c in remeasured)
    assert decision["step"] <= 10 + 3 * (len(candidates) + len(remeasured)) + 1


# ---------------------------------------------------------------------------- --optimizer

def initial_param_sum(seed=0):
    """The parameters' sum before any update (worker.ReplayModel with an optimizer)."""
    model = worker.ReplayModel(PROFILE, 1.0, False, seed, 0, init=True)
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def test_ddp_and_lossless_gradcomp_take_the_same_adamw_steps(tmp_path):
    """torch's AdamW under DDP and inside DistributedOptimizer with no compression: every
    step's mean is exact at 2 ranks, so both runs end with the same parameters, bit for bit,
    on every rank, and not where they started."""
    (tmp_path / "ddp").mkdir()
    (tmp_path / "gc").mkdir()
    ddp = run_workers(tmp_path / "ddp", "ddp", extra=("--optimizer", "adamw"))
    ours = run_workers(tmp_path / "gc", "gradcomp:none", extra=("--optimizer", "adamw"))
    digests = {r["param_digest"] for r in ddp + ours}
    assert len(digests) == 1
    assert ddp[0]["param_sum"] != pytest.approx(initial_param_sum(), abs=1e-3)
    for r in ddp + ours:
        assert r["optimizer"] == "adamw"
        assert len(r["update_s"]) == 3 and all(s > 0 for s in r["update_s"])
        # The update happens after backward: its marks are in order within each step.
        assert all(m[0] <= m[1] <= m[2] <= m[3] for m in r["step_marks"])
        # The machine's busy CPU over the measured steps (for bench.py's other-jobs figure).
        assert r["machine_busy_s"] >= 0 and r["window_s"] >= sum(r["step_s"])


@pytest.mark.parametrize("optimizer", ["lans", "onebitadam", "onebitlamb"])
def test_adaptive_recipes_update_alike_on_every_rank(tmp_path, optimizer):
    """CLAN (LANS over the 1-bit two-way exchange), 1-bit Adam and 1-bit LAMB over the same
    exchange:
    compressed, yet the ranks apply the same mean, so they hold the same parameters."""
    ranks = run_workers(tmp_path, "gradcomp:onebit:block=256|ef|twoway",
                        extra=("--optimizer", optimizer))
    assert ranks[0]["param_digest"] == ranks[1]["param_digest"]
    assert ranks[0]["param_sum"] != pytest.approx(initial_param_sum(), abs=1e-3)
    assert 0 < ranks[0]["payload_bytes_per_step"] < 4 * ELEMENTS / 4
    assert all(s >= 0 for s in ranks[0]["update_s"])
    if optimizer in ("onebitadam", "onebitlamb"):
        # --warmup 2: one uncompressed step, then one compressed before the measured three.
        assert ranks[0]["onebit_warmup_steps"] == 1
        assert ranks[0]["onebit_compression"] == "onebit:block=256|ef|twoway"
        assert ranks[0]["onebit_compressed_steps"] == 3


def test_compute_only_with_an_optimizer_updates_each_rank_alone(tmp_path):
    ranks = run_workers(tmp_path, "compute", extra=("--optimizer", "sgd"))
    assert ranks[0]["param_digest"] != ranks[1]["param_digest"]  # no exchange: own gradients
    assert ranks[0]["payload_bytes_per_step"] is None


def test_without_an_optimizer_nothing_is_updated(tmp_path):
    ranks = run_workers(tmp_path, "gradcomp:none")
    assert ranks[0]["optimizer"] == "none" and ranks[0]["update_s"] is None
    assert "param_digest" not in ranks[0]


@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "onebitadam", "--warmup", "0"], "needs --warmup >= 1"),
    (["--optimizer", "onebitlamb", "--warmup", "0"], "onebitlamb needs --warmup >= 1"),
    (["--optimizer", "adamw", "--workload", "train"], "--optimizer is for the replay workload"),
    (["--optimizer", "adam"], "invalid choice: 'adam'"),
])
def test_bad_optimizer_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        worker.parse_args(["--contender", "gradcomp:none", "--profile", "p.json", "--out", "o",
                           *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("optimizer", ["onebitadam", "onebitlamb"])
@pytest.mark.parametrize("contender", ["ddp", "compute", "plan:p.json"])
def test_two_stage_optimizers_need_a_gradcomp_contender(contender, optimizer):
    with pytest.raises(worker.BenchError, match=f"{optimizer} averages over the ranks by itself"):
        worker.check_optimizer(optimizer, worker.parse_contender(contender)[0], contender)
    worker.check_optimizer(optimizer, "gradcomp", "gradcomp")  # accepted
