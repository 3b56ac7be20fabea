"""The emulated-cluster benchmark: gradcomp against PyTorch DDP and its compression hooks, side
by side on the same emulated network, with the simulator's prediction next to each measurement.

For each profile, link rate and worker count it builds a cluster (netns.py: one network
namespace per host, tbf-limited veth links to a bridge), measures the links, asks `gradcomp
plan` for a plan for exactly that cluster, runs every contender (worker.py, one process per
host) and asks `gradcomp simulate` what each should take. Results go to
bench/cluster/results/cluster-benchmark.json after every configuration, and report.py turns
them into docs/cluster-benchmark.md and plots. bench/cluster/run.sh is the entry point.

A contender may name the optimizer that updates the parameters in every step after a '+'
("ddp+adamw", "gradcomp:onebit:block=256|ef|twoway+lans"; worker.py --optimizer); without one
it takes --optimizer (none: the exchange only, as in docs/cluster-benchmark.md). --optimizers
runs the optimizer comparison of docs/optimizers.md instead: DDP + AdamW against gradcomp's
adaptive recipes, at 1 Gbit/s x 4 by default, into bench/cluster/results/optimizer-benchmark.json
and a Markdown table beside it (the simulator does not model the update, so no predictions).

The contender "auto" is gradcomp's compression="auto" (worker.py; its settings: AUTO): it
searches (uncompressed warm-up, calibration, trials) in unmeasured steps, and its step is
measured after its decision, as the others' after their warm-up; its decision (each
candidate's predicted and measured step, the one kept, why, the search's cost) is in its row.

Links faster than --max-real-rate run by time dilation: compute K times slower, links at
rate / K, measured times divided by K (this machine's kernel cannot carry 10 Gbit/s of TCP and
gloo's reductions on 2 cores). Dilation hides K-fold any CPU cost of encoding, so the planner
and the simulator see codec costs divided by K too, and the report marks those rows.
"""
import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import netns  # noqa: E402
import report  # noqa: E402

PYTHON = "/usr/bin/python3"  # Debian's, with torch
GRADCOMP = ROOT / "build" / "bin" / "gradcomp"
WORKER = HERE / "worker.py"
TRAINING_BEGAN = "training-began"  # worker.py's: rank 0 makes it as training begins

# The codecs gradcomp runs on its default plan, and the planner's choices.
MAIN_CODECS = ["fp16", "intq", "qsgd", "topk:ratio=0.01|ef", "randomk:ratio=0.01|ef",
               "powersgd|ef", "efsignsgd"]
DDP_CONTENDERS = ["ddp", "ddp-fp16", "ddp-bf16", "ddp-powersgd:rank=1", "ddp-powersgd:rank=4"]
TRAIN_CONTENDERS = ["ddp", "ddp-fp16", "ddp-powersgd:rank=1", "gradcomp:fp16",
                    "gradcomp:topk:ratio=0.01|ef", "gradcomp:powersgd|ef", "auto"]
LABELS = {
    "compute": "compute only (no exchange)",
    "ddp": "DDP gloo 25 MB",
    "ddp-fp16": "DDP + fp16 hook",
    "ddp-bf16": "DDP + bf16 hook",
    "ddp-powersgd:rank=1": "DDP + PowerSGD hook r1",
    "ddp-powersgd:rank=4": "DDP + PowerSGD hook r4",
    "plan": "gradcomp planned",
    "plan-whole": "gradcomp planned, whole tensors",
    "auto": "gradcomp auto, after deciding",
}

# worker.py's settings of compression="auto" (not imported: worker.py loads torch; a test
# compares them), and the most steps it can take before it decides: its warm-up, then up to
# 2 + max_proposals + refine_proposals (the scheduler's default: 2) + runoff + 1 (its default:
# 3) trials of trial_steps each (uncompressed, over nodes the planner's best uncompressed plan,
# the proposals, then the plans within the noise of the fastest and a lossless one whose loss
# the noise may hide, measured again).
AUTO = {"warmup_steps": 20, "profile_steps": 8, "trial_steps": 5, "max_proposals": 4}
AUTO_SEARCH_STEPS = (AUTO["warmup_steps"]
                     + (2 + AUTO["max_proposals"] + 2 + 4) * AUTO["trial_steps"])

# worker.py's --optimizer choices (not imported: worker.py loads torch; a test compares them).
OPTIMIZERS = ["none", "sgd", "adamw", "lans", "lamb", "onebitadam", "onebitlamb"]
TWO_STAGE = ("onebitadam", "onebitlamb")  # distributed optimizers of their own

# The optimizer comparison (--optimizers): the baseline, gradcomp's adaptive recipes over the
# same 1-bit exchange (docs/optimizers.md), and what the steps are made of: compute alone (the
# bound), compute and each kind of update without an exchange, each exchange without an update.
ONEBIT = "onebit:block=256|ef|twoway"
OPTIMIZER_CONTENDERS = ["compute", "compute+adamw", "compute+lans", "ddp", f"gradcomp:{ONEBIT}",
                        "ddp+adamw", f"gradcomp:{ONEBIT}+lans", f"gradcomp:{ONEBIT}+onebitadam",
                        f"gradcomp:{ONEBIT}+onebitlamb", f"gradcomp:{ONEBIT}+adamw"]
BASELINE = "ddp+adamw"
OPTIMIZER_LABELS = {"sgd": "SGD", "adamw": "AdamW", "lans": "LANS", "lamb": "LAMB",
                    "onebitadam": "1-bit Adam", "onebitlamb": "1-bit LAMB"}
LABELS.update({
    "compute+adamw": "compute only + AdamW (no exchange)",
    "compute+lans": "compute only + LANS (no exchange)",
    f"gradcomp:{ONEBIT}": "gradcomp 1-bit exchange only (no update)",
    "ddp+adamw": "DDP + AdamW",
    f"gradcomp:{ONEBIT}+lans": "gradcomp CLAN 1-bit (LANS)",
    f"gradcomp:{ONEBIT}+onebitadam": "gradcomp 1-bit Adam",
    f"gradcomp:{ONEBIT}+onebitlamb": "gradcomp 1-bit LAMB",
    f"gradcomp:{ONEBIT}+adamw": "gradcomp AdamW over 1-bit (naive)",
})


class BenchError(Exception):
    """A failure with a message for the user."""


# ---------------------------------------------------------------------------- settings

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="bench/cluster/run.sh",
        description="Side-by-side benchmark of gradcomp against PyTorch DDP and its hooks on "
                    "an emulated cluster (network namespaces + tbf). Needs root.")
    p.add_argument("--quick", action="store_true",
                   help="a few-minute subset: resnet50, 1gbit and 10gbit, 4 workers, no train")
    p.add_argument("--optimizers", action="store_true",
                   help="the optimizer comparison instead (docs/optimizers.md): "
                        f"{', '.join(OPTIMIZER_CONTENDERS)}; defaults: profiles resnet50 and "
                        "bert-base, 1gbit, 4 workers, no train")
    p.add_argument("--rounds", type=int, default=1,
                   help="--optimizers: run the contenders this many times in turn (round "
                        "robin, so a job that shares the cores for a while slows all alike); "
                        "medians over every round's measured steps")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="none",
                   help="the optimizer of every contender that names none after a '+' (none: "
                        "no update, the step is the exchange)")
    p.add_argument("--profiles", default=None,
                   help="replay profiles, comma separated (shipped names or paths; default "
                        "resnet50)")
    p.add_argument("--rates", default=None,
                   help="link rates, comma separated (default 100mbit,1gbit,10gbit)")
    p.add_argument("--workers", default=None, help="worker counts (default 2,4,8)")
    p.add_argument("--codecs", default=",".join(MAIN_CODECS),
                   help="gradcomp codecs on default plans, and the planner's choices "
                        "(separated by ',')")
    p.add_argument("--contenders", default=None,
                   help="run only these contenders (e.g. ddp,plan,gradcomp:fp16), each with "
                        "an optimizer after a '+' if wanted (ddp+adamw); with --optimizers any "
                        "compute, ddp..., gradcomp:SPEC with any optimizer")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps not measured (5; --quick 4): DDP's PowerSGD hook compresses "
                        "from its third step and settles over the next ones")
    p.add_argument("--steps", type=int, default=None, help="measured steps (8; --quick 5)")
    p.add_argument("--burn", action="store_true", help="compute burns CPU instead of waiting")
    p.add_argument("--max-real-rate", default="1gbit",
                   help="faster links run time-dilated (1gbit)")
    p.add_argument("--delay", help="link latency: not possible on this kernel (no netem)")
    p.add_argument("--train", dest="train", action="store_true", default=None,
                   help="also the Fashion-MNIST time-to-accuracy runs (default unless --quick)")
    p.add_argument("--no-train", dest="train", action="store_false")
    p.add_argument("--train-epochs", type=float, default=2.0)
    p.add_argument("--train-rate", default="1gbit")
    p.add_argument("--train-workers", type=int, default=4)
    p.add_argument("--train-rate-change", default=None, metavar="RATE@SECONDS",
                   help="training: every link changes to RATE this many seconds after each "
                        "contender's first training step (e.g. 1gbit@60): a link that gets "
                        "faster or slower during training; the report places it on each "
                        "contender's training time")
    p.add_argument("--train-optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="the training runs' optimizer: SGD with momentum (the main job's "
                        "default) or AdamW; auto then takes the options recommended for it")
    p.add_argument("--target-accuracy", type=float, default=0.85)
    p.add_argument("--train-contenders", default=",".join(TRAIN_CONTENDERS),
                   help="the training runs' contenders, comma separated (default: "
                        f"{', '.join(TRAIN_CONTENDERS)})")
    p.add_argument("--auto-candidates", default=None, metavar="SPECS",
                   help="replay, contender auto: the options it may choose, ';'-separated "
                        "(they may hold commas); default: those recommended for the "
                        "replay's optimizer (with none: under both SGD and Adam)")
    p.add_argument("--train-auto", type=json.loads, default=None, metavar="JSON",
                   help="training, contender auto: its auto= settings (default: none, as a "
                        "user would run it)")
    p.add_argument("--train-only", action="store_true",
                   help="only the Fashion-MNIST time-to-accuracy runs (no replay)")
    p.add_argument("--slice-from", type=int, default=0, metavar="ELEMENTS",
                   help="the planner may cut tensors of this many elements or more into slices "
                        "(gradcomp plan --slice-from; default 0: never)")
    p.add_argument("--costs", help="codec costs JSON for the planner and the simulator (default: "
                                   "measured now with `gradcomp bench codecs`)")
    p.add_argument("--out", default=str(HERE / "results"), help="results directory")
    p.add_argument("--md", default=None,
                   help="the Markdown report (default docs/cluster-benchmark.md; with "
                        "--optimizers OUT/optimizer-benchmark.md, a table for docs/optimizers.md)")
    p.add_argument("--img", default=str(ROOT / "docs" / "img"))
    p.add_argument("--clean", action="store_true",
                   help="only remove namespaces and processes left by an aborted run")
    args = p.parse_args(argv)
    if args.optimizers and args.quick:
        p.error("--optimizers and --quick are two different runs; choose one")
    narrow = args.quick or args.optimizers
    args.profiles = args.profiles or ("resnet50,bert-base" if args.optimizers else "resnet50")
    args.rates = args.rates or ("1gbit" if args.optimizers else
                                "1gbit,10gbit" if args.quick else "100mbit,1gbit,10gbit")
    args.workers = [int(w) for w in (args.workers or ("4" if narrow else "2,4,8")).split(",")]
    if args.md is None:
        args.md = str(Path(args.out) / "optimizer-benchmark.md" if args.optimizers
                      else ROOT / "docs" / "cluster-benchmark.md")
    args.steps = args.steps or (5 if args.quick else 8)
    args.warmup = args.warmup if args.warmup is not None else (4 if args.quick else 5)
    if args.train is None:
        args.train = not narrow or args.train_only
    if args.train_only and (args.optimizers or not args.train):
        p.error("--train-only runs the training workload alone; drop --optimizers/--no-train")
    unknown = [c for c in split(args.train_contenders)
               if c not in TRAIN_CONTENDERS and not c.startswith("gradcomp:")]
    if unknown:
        p.error(f"--train-contenders: unknown {', '.join(unknown)}; choose from "
                f"{', '.join(TRAIN_CONTENDERS)}, or gradcomp:SPEC")
    if args.train and args.optimizers:
        p.error("--optimizers replays profiles only; drop --train")
    if args.train_rate_change is not None:
        args.train_rate_change = parse_rate_change(p, args.train_rate_change)
    args.auto = dict(AUTO)
    if args.auto_candidates is not None:
        candidates = [c.strip() for c in args.auto_candidates.split(";") if c.strip()]
        if not candidates:
            p.error("--auto-candidates: give at least one option, e.g. 'fp16;powersgd:rank=4|ef'")
        args.auto["candidates"] = candidates
    if args.rounds < 1 or (args.rounds > 1 and not args.optimizers):
        p.error("--rounds must be >= 1, and is for --optimizers only")
    if min(args.workers) < 2:
        p.error("--workers: every count must be at least 2")
    return args


def parse_rate_change(p, text):
    """--train-rate-change RATE@SECONDS -> (text of RATE, bits/s, seconds)."""
    try:
        bps, after = netns.parse_rate_change(text)
    except netns.ClusterError as e:
        p.error(f"--train-rate-change: {e}")
    if isinstance(bps, list):
        p.error(f"--train-rate-change: '{text}': give one rate for every link, e.g. 1gbit@60")
    return text.partition("@")[0], bps, after


def contenders(args):
    codecs = [f"gradcomp:{c}" for c in split(args.codecs)]
    chosen = ["compute", *DDP_CONTENDERS, *codecs, "plan", "auto"]
    if args.contenders:
        wanted = split(args.contenders)
        # On request only: the planner without slices (the same plan where no tensor is cut).
        # And any plan file: plan:PATH (a plan of the profile's tensors, run as given).
        known = [*chosen[:-1], "plan-whole", chosen[-1]]
        unknown = [c for c in wanted
                   if split_optimizer(c)[0] not in known and not c.startswith("plan:")]
        if unknown:
            raise BenchError(f"unknown contender(s) {', '.join(unknown)}; choose from "
                             f"{', '.join(known)}, plan:PATH (each may end in +OPTIMIZER)")
        order = {c: i for i, c in enumerate(known)}
        chosen = sorted(wanted, key=lambda c: order.get(split_optimizer(c)[0], len(known)))
    for name in chosen:
        check_optimizer(name, args.optimizer)
    return chosen


def optimizer_contenders(args):
    """The optimizer comparison's contenders: the default set, or --contenders (any compute,
    ddp... or gradcomp contender with any optimizer; no plan: nothing is planned here)."""
    chosen = split(args.contenders) if args.contenders else list(OPTIMIZER_CONTENDERS)
    for name in chosen:
        base = split_optimizer(name)[0]
        if not (base in ("compute", "ddp", "gradcomp") or base.startswith(("ddp-", "gradcomp:"))):
            raise BenchError(f"contender '{name}' cannot run in the optimizer comparison; use "
                             "compute, ddp, ddp-HOOK, gradcomp or gradcomp:SPEC, each with "
                             f"+OPTIMIZER ({', '.join(OPTIMIZERS)})")
        check_optimizer(name, args.optimizer)
    return chosen


def split_optimizer(name, default="none"):
    """(contender, optimizer) of a contender name: "ddp+adamw" -> ("ddp", "adamw"); without a
    known optimizer after the last '+', the name is all contender and the optimizer `default`."""
    base, plus, optimizer = name.rpartition("+")
    if plus and optimizer in OPTIMIZERS:
        return base, optimizer
    return name, default


def check_optimizer(name, default):
    base, optimizer = split_optimizer(name, default)
    if optimizer in TWO_STAGE and not (base == "gradcomp" or base.startswith("gradcomp:")):
        raise BenchError(f"contender '{name}': {OPTIMIZER_LABELS[optimizer]} averages over the "
                         "ranks by itself, so "
                         "it runs with gradcomp or gradcomp:SPEC only (SPEC: its exchange)")


def split(text):
    return [item for item in text.split(",") if item]


def family(contender):
    contender = split_optimizer(contender)[0]
    if contender in ("compute", "ddp", "plan", "auto"):
        return contender
    return "ddp-hook" if contender.startswith("ddp-") else "gradcomp"


def label(contender):
    if contender in LABELS:
        return LABELS[contender]
    if contender.startswith("plan:"):
        return f"gradcomp plan {Path(contender[len('plan:'):]).name}"
    base, optimizer = split_optimizer(contender)
    text = LABELS.get(base, base.replace("gradcomp:", "gradcomp "))
    return text + (f" + {OPTIMIZER_LABELS[optimizer]}" if optimizer != "none" else "")


# ---------------------------------------------------------------------------- gradcomp CLI

def gradcomp(*argv):
    done = subprocess.run([str(GRADCOMP), *map(str, argv)], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise BenchError(f"gradcomp {argv[0]} failed: {done.stderr.strip() or done.stdout}")
    return done.stdout


def profile_path(name):
    path = Path(name)
    if not path.suffix:
        path = ROOT / "profiles" / f"{name}.json"
    if not path.exists():
        raise BenchError(f"profile '{name}' not found (looked for {path}); the shipped ones are "
                         f"{', '.join(p.stem for p in sorted((ROOT / 'profiles').glob('*.json')) if p.stem != 'codec-costs')}")
    return path


class Model:
    """What the planner and the simulator are told about one configuration: the measured link
    and codec costs scaled by CPU sharing and time dilation."""

    def __init__(self, profile, workers, link_bps, latency_s, costs, cost_scale, plan_path,
                 compute_ms, rows_path):
        self.compute_ms, self.rows_path = compute_ms, rows_path
        # lambda 1: the emulated compute waits (or burns a core of its own), so communication
        # does not slow it down.
        self.common = ["--profile", profile, "--workers", workers,
                       "--inter", f"{link_bps / 1e6:.1f}mbit",
                       "--inter-latency", f"{latency_s * 1e6:.1f}us", "--lambda", "1",
                       "--costs", costs,
                       "--cost-scale", f"{cost_scale:.6g}"]
        self.plan_path = plan_path
        self.whole_plan_path = plan_path.with_name(plan_path.stem + "-whole.json")

    def plan(self, codecs, slice_from=0, whole=False):
        """The planner's plan, tensors of `slice_from` elements or more may be cut into slices
        (0: none; whole: none, the plan-whole contender's), written to its path."""
        path = self.whole_plan_path if whole else self.plan_path
        text = gradcomp("plan", *self.common, "--codecs", ",".join(codecs), "--json", path,
                        "--slice-from", "0" if whole else str(slice_from))
        predicted = next(float(line.split()[-2]) for line in text.splitlines()
                         if line.startswith("predicted iteration time"))
        plan = json.loads(Path(path).read_text())
        return {"codecs": codecs, "predicted_ms": predicted, "path": display_path(path),
                "buckets": len(plan["buckets"]), "summary": plan_summary(plan),
                "slices": {t["name"]: t["slices"] for t in plan["tensors"] if "slices" in t}}

    def predict(self, contender):
        """(predicted ms, how the contender was modelled)."""
        kind = contender.split(":", 1)
        extra, note = [], None
        if contender == "compute":
            return self.compute_ms, "the profile's forward + backward"
        if contender == "plan":
            extra = ["--plan", self.plan_path]
        elif contender == "plan-whole":
            extra = ["--plan", self.whole_plan_path]
        elif contender.startswith("plan:"):
            extra = ["--plan", contender[len("plan:"):]]
        elif contender == "ddp":
            extra, note = ["--codecs", "none"], "as gradcomp's uncompressed 25 MB plan"
        elif contender == "ddp-fp16":
            extra = ["--codecs", "fp16", "--encode-on", "caller", "--min-compress", "0"]
            note = "as fp16 on every bucket, encoded on the backward thread"
        elif contender.startswith("ddp-powersgd"):
            extra = ["--codecs", f"powersgd:{kind[1]}", "--encode-on", "caller"]
            note = ("as gradcomp's powersgd on the same buckets, encoded on the backward thread "
                    "(the hook also blocks backward until its exchange ends: not modelled)")
        elif contender.startswith("gradcomp:"):
            extra = ["--codecs", kind[1]]
        else:
            return None, "not modelled"
        gradcomp("simulate", *self.common, *extra, "--json", self.rows_path)
        rows = json.loads(Path(self.rows_path).read_text())["rows"]
        return 1e3 * rows[0]["iteration_s"], note


def display_path(path):
    """Relative to the repository when inside it (the results JSON is committed)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def measure_codec_costs(codecs, workers, out):
    """Codec costs on this machine with `workers` workers sharing it, for the planner and the
    simulator: `gradcomp bench codecs` run by that many processes at once (in a training step
    every rank encodes at the same time, and they share the cores and the memory bus) on
    buckets of 4M-16M elements (out of cache, as buckets are), fitted by `gradcomp costs
    --fit` to the first copy's report. Measured outside any cluster and undilated."""
    names = sorted({c.split("|")[0] for c in ["none", *codecs]})
    reports = [out / f"codec-bench-w{workers}-{i}.json" for i in range(workers)]
    costs_path = out / f"codec-costs-w{workers}.json"
    say(f"measuring codec costs with {workers} copies at once ({', '.join(names)}) ...")
    copies = [subprocess.Popen([str(GRADCOMP), "bench", "codecs", "--codecs", *names,
                                "--sizes", "22", "24", "--min-time", "0.1", "--json", str(r)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for r in reports]
    for copy in copies:
        _, err = copy.communicate(timeout=900)
        if copy.returncode != 0:
            raise BenchError(f"gradcomp bench codecs failed: {err.strip()}")
    gradcomp("costs", "--fit", reports[0], "--source",
             f"bench/cluster/bench.py: gradcomp bench codecs, {workers} copies at once, 2^22 and "
             "2^24 elements, this machine", "--json", costs_path)
    return costs_path


def plan_summary(plan):
    """'randomk:ratio=0.01|ef x 40, none x 9': which compressions, on how many buckets."""
    counts = {}
    for bucket in plan["buckets"]:
        key = "|".join(bucket.get(k, "none") for k in ("codec", "feedback", "route"))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------- one run

class Runner:
    """Runs contenders on one cluster and turns the ranks' JSON into a result row."""

    def __init__(self, cluster, out_dir, port):
        self.cluster, self.out_dir, self.port = cluster, out_dir, port

    def run(self, name, worker_args, timeout):
        out = self.out_dir / slug(name)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        self.port += 1
        world = len(self.cluster.namespaces)
        env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR=self.cluster.address(0),
                   MASTER_PORT=str(self.port), GLOO_SOCKET_IFNAME=self.cluster.ifname,
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"),
                   GRADCOMP_TIMEOUT=str(int(timeout)))
        argv = [PYTHON, str(WORKER), *worker_args, "--iface", self.cluster.ifname,
                "--out", str(out), "--timeout", str(int(timeout))]
        start = time.monotonic()
        self.cluster.run(lambda r: argv, lambda r: dict(env, RANK=str(r)), timeout, out)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        return ranks, time.monotonic() - start


def slug(text):
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in text)


def probe_latency(runner, workers, link_bps):
    """The latency per message of the alpha-beta model, fitted to gradcomp's allreduce of 1024
    floats on this cluster, the size of a compressed bucket (a ring allreduce is 2 (W - 1)
    messages of 4 KiB / W): on 2 shared cores thread wake-ups, not the wire, make most of it,
    and a one-word allreduce (also recorded) hides them. The 90th percentile, not the median:
    in a training step a collective ends when the last of W busy ranks gets to it."""
    ranks, _ = runner.run("probe", ["--workload", "probe", "--contender", "compute"], 120)
    seconds = statistics.median(r["allreduce_4k_p90_s"] for r in ranks)
    wire = 2 * (workers - 1) / workers * 4096 * 8 / link_bps
    return max(seconds - wire, 0) / (2 * (workers - 1)), ranks[0]


def replay_row(contender, ranks, dilation):
    mean = statistics.fmean
    payload = [r["payload_bytes_per_step"] for r in ranks if r["payload_bytes_per_step"]]
    row = {
        "step_ms": [1e3 * s / dilation for s in ranks[0]["step_s"]],
        "wire_bytes_per_step": mean(r["tx_bytes_per_step"] for r in ranks),
        "payload_bytes_per_step": mean(payload) if payload else None,
        "cpu_ms_per_step": 1e3 * mean(r["cpu_s_per_step"] for r in ranks),
        "ranks_median_ms": [1e3 * statistics.median(r["step_s"]) / dilation for r in ranks],
    }
    r0 = ranks[0]
    if r0.get("window_s"):
        # What else ran meanwhile: the machine's busy CPU less the workers' own, in cores.
        workers = sum(r["cpu_s_per_step"] for r in ranks) * len(r0["step_s"])
        row["other_cpu_cores"] = max(0.0, (r0["machine_busy_s"] - workers) / r0["window_s"])
    marks = r0["step_marks"]
    if marks and len(marks[0]) == 4:
        # Rank 0's phases, as its step times: until backward returned (compute and the
        # exchange's tail), and the optimizer's step after it.
        row.update(backward_end_ms=[1e3 * (m[2] - m[0]) / dilation for m in marks],
                   after_backward_ms=[1e3 * (m[3] - m[2]) / dilation for m in marks])
    if "auto" in r0:
        # Every rank must have decided alike, at the same step (the scheduler agrees first).
        row["auto"] = dict(r0["auto"], ranks_agree=len({
            (r["auto"]["decided_after_steps"], r["auto"]["decision"]["kept_name"])
            for r in ranks}) == 1)
    if r0.get("optimizer", "none") == "none":
        return row
    row.update(update_ms=[1e3 * s / dilation for s in r0["update_s"]],
               ranks_agree=len({r["param_digest"] for r in ranks}) == 1)
    if "onebit_warmup_steps" in r0:
        row.update(onebit_warmup_steps=r0["onebit_warmup_steps"],
                   onebit_compression=r0["onebit_compression"],
                   onebit_compressed_steps=r0["onebit_compressed_steps"])
    return row


def failed_row(contender, error):
    """The error's message without the worker's log, which goes in log_tail (and says it)."""
    message = str(error).split(". Last lines of ")[0]
    tail = [line for line in getattr(error, "log_tail", "").splitlines() if line.strip()]
    if tail:
        message += f"; its last words: {tail[-1].strip()}"
    say(f"   {label(contender):<32} FAILED: {message}")
    return {"contender": contender, "label": label(contender), "family": family(contender),
            "status": "failed", "error": message,
            "log_tail": getattr(error, "log_tail", "")[-2000:]}


# ---------------------------------------------------------------------------- configurations

def replay_config(args, profile, rate, workers, names, out, port):
    rate_bps = netns.parse_rate(rate)
    dilation = max(1, round(rate_bps / netns.parse_rate(args.max_real_rate)))
    link_bps = rate_bps / dilation
    config_name = f"{Path(profile).stem}-{rate}-w{workers}"
    out_dir = out / "runs" / config_name
    out_dir.mkdir(parents=True, exist_ok=True)
    # The codec costs were measured with W copies sharing the machine; dilation divides every
    # measured time (but not the CPU's) by K.
    cost_scale = 1.0 / dilation
    config = {"profile": Path(profile).stem, "rate": rate, "rate_bps": rate_bps,
              "dilation": dilation, "workers": workers, "link_bps": link_bps,
              "cost_scale": cost_scale, "codec_costs": display_path(args.costs_path),
              "runs": []}
    profile_json = json.loads(Path(profile).read_text())
    config["compute_ms"] = profile_json["forward_ms"] + profile_json["backward_ms"]
    say(f"\n== {config_name}: {workers} hosts, links {netns.format_rate(link_bps)}"
        + (f" (time-dilated x{dilation}: emulates {rate})" if dilation > 1 else ""))
    with netns.Cluster(workers, link_bps, run_id=f"{os.getpid()}") as cluster:
        measured = cluster.measure_rate(1.0) * dilation
        config["measured_link_bps"] = measured
        runner = Runner(cluster, out_dir, port)
        latency, probe = probe_latency(runner, workers, link_bps)
        latency /= dilation
        config["measured_latency_s"] = latency
        config["probe"] = {k: v for k, v in probe.items() if k.startswith("allreduce_")}
        say(f"   measured ring throughput per link: {measured / 1e9:.3f} Gbit/s; latency per "
            f"message {latency * 1e6:.0f} us (emulated time)")
        plan_path = out / "plans" / f"{config_name}.json"
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        model = Model(profile, workers, measured, latency, args.costs_path, cost_scale, plan_path,
                      config["compute_ms"], out_dir / "simulated.json")
        config["plan"] = model.plan(split(args.codecs), args.slice_from)
        say(f"   planner: {config['plan']['summary']}; predicted "
            f"{config['plan']['predicted_ms']:.1f} ms; slices {config['plan']['slices'] or 'none'}")
        if any(split_optimizer(n)[0] == "plan-whole" for n in names):
            config["plan_whole"] = model.plan(split(args.codecs), whole=True)
            say(f"   planner, whole tensors: {config['plan_whole']['summary']}; predicted "
                f"{config['plan_whole']['predicted_ms']:.1f} ms")
        for name in names:
            config["runs"].append(run_replay(args, runner, model, name, profile, dilation,
                                             config))
    calibrated_predictions(config, out_dir, out / "auto-calibration" / config_name)
    return config


def calibrated_predictions(config, out_dir, calibration):
    """What auto's own model predicts of the config's other gradcomp contenders, calibrated on
    the live cluster and corrected by its trials (the profile, link, codec costs and correction
    its report holds, written to the folder `calibration`, through `gradcomp simulate
    --correction`): each such run gets calibrated_ms, in emulated time as its steps. Only
    the runs under auto's own optimizer: the simulator has no term for an update, and the
    correction's step overhead, fitted on auto's trials, holds the time of that one. Nothing
    without a finished auto run."""
    auto = next((r for r in config["runs"] if r.get("status") == "ok" and "auto" in r), None)
    report_path = out_dir / slug("auto") / "auto-report.json"
    if auto is None or not report_path.exists():
        return
    report_json = json.loads(report_path.read_text())
    calibration.mkdir(parents=True, exist_ok=True)
    # The whole report too (its trials): `gradcomp correct --report` refits them offline.
    (calibration / "auto-report.json").write_text(report_path.read_text())
    costs, borrowed = with_borrowed_costs(report_json["codec_costs"], config.get("codec_costs"))
    report_json["codec_costs"] = costs
    files = {}
    for key, name in (("profile", "profile.json"), ("cluster", "cluster.json"),
                      ("codec_costs", "codec-costs.json"), ("model_correction", "correction.json")):
        files[key] = calibration / name
        files[key].write_text(json.dumps(report_json[key], indent=1) + "\n")
    config["auto_calibration"] = {"path": display_path(calibration),
                                  "correction": report_json["model_correction"],
                                  "borrowed_costs": borrowed}
    decision = report_json["decisions"][0]
    kept_plan = calibration / "kept-plan.json"
    kept_plan.write_text(json.dumps(decision["candidates"][decision["kept"]]["plan"]) + "\n")
    common = ["--profile", files["profile"], "--cluster", files["cluster"], "--costs",
              files["codec_costs"], "--correction", files["model_correction"]]
    rows_path = calibration / "simulated.json"
    for run in config["runs"]:
        base = split_optimizer(run["contender"])[0]
        if run.get("status") != "ok" or run.get("optimizer", "none") != auto.get("optimizer",
                                                                                "none"):
            continue
        if base == "auto":
            extra = ["--plan", kept_plan]
        elif base.startswith("gradcomp:"):
            extra = ["--codecs", base.split(":", 1)[1]]
        elif base in ("plan", "plan-whole") and config.get(base.replace("-", "_")):
            extra = ["--plan", ROOT / config[base.replace("-", "_")]["path"]]
        else:
            continue
        try:
            gradcomp("simulate", *common, *extra, "--json", rows_path)
        except BenchError as e:
            run["calibrated_note"] = f"simulator failed: {e}"
            continue
        rows = json.loads(rows_path.read_text())["rows"]
        run["calibrated_ms"] = 1e3 * rows[0]["iteration_s"] / config["dilation"]


def with_borrowed_costs(measured, costs_path):
    """Auto measures the costs of its own candidates' codecs only; a fixed contender's codec
    outside them takes its costs from the config's codec costs file (measured on this machine
    with as many copies as workers, in real CPU seconds as auto's are). Returns the merged
    entries and the names borrowed (auto's own entries are never replaced)."""
    if not costs_path:
        return measured, []
    offline = json.loads((ROOT / costs_path).read_text())
    offline = offline.get("codecs", offline)
    borrowed = sorted(name for name in offline if name not in measured)
    return {**measured, **{name: offline[name] for name in borrowed}}, borrowed


def run_replay(args, runner, model, name, profile, dilation, config):
    base, optimizer = split_optimizer(name, args.optimizer)
    if optimizer == "none":
        try:
            predicted, note = model.predict(base)
        except BenchError as e:
            predicted, note = None, f"simulator failed: {e}"
    else:
        predicted, note = None, "not modelled: the simulator has no optimizer update"
    expect_s = max(predicted or 0, config["compute_ms"]) / 1e3 * dilation
    if base == "auto":
        predicted, note, expect_s = auto_prediction(model, config, dilation)
    paths = {"plan": model.plan_path, "plan-whole": model.whole_plan_path}
    contender = f"plan:{paths[base]}" if base in paths else base
    row = run_contender(args, runner, name, contender, profile, dilation, expect_s,
                        predicted_ms=predicted, prediction_note=note)
    if row["status"] == "ok":
        say(f"   {label(name):<32} {statistics.median(row['step_ms']):9.1f} ms/step  "
            f"{row['wire_bytes_per_step'] / 1e6:8.2f} MB/step on the wire  predicted "
            f"{predicted if predicted is None else round(predicted, 1)} ms  "
            f"({row['seconds']:.0f} s)")
        if "auto" in row:
            say_auto(row["auto"])
    return row


def auto_prediction(model, config, dilation):
    """(predicted ms, note, a step's seconds for the timeout) of the auto contender: it has no
    plan until it runs, so no prediction (its own model's are in its decision); until it
    decides it runs uncompressed, whose step bounds the kept plan's (it keeps none slower)."""
    try:
        uncompressed_ms = model.predict("ddp")[0]
    except BenchError:
        uncompressed_ms = config["compute_ms"]
    expect_s = max(uncompressed_ms, config["compute_ms"]) / 1e3 * dilation
    return None, ("not modelled: auto chooses its plan while it runs (its own model's "
                  "predictions are in its decision)"), expect_s


def say_auto(auto):
    d = auto["decision"]
    say(f"   {'':<32} auto kept '{d['kept_name']}' from step {d['step']} ({d['why']}); search "
        f"{d['search_steps']:g} steps, {d['search_seconds']:.1f} s"
        + (f" ({d['search_cost_seconds']:+.1f} s against uncompressed steps, payback "
           f"{d['payback_steps']:.0f} steps)" if "payback_steps" in d else "")
        + ("" if auto.get("ranks_agree", True) else "; RANKS DISAGREE"))
    for c in d["candidates"]:
        say(f"   {'':<34}{c['name']:<36} predicted {c['predicted_ms']:8.1f} ms, measured "
            f"{c['measured_ms']:8.1f} ms  [{c['summary']}]")


def run_contender(args, runner, name, contender, profile, dilation, expect_s, **extra):
    """Runs one contender's replay (`contender`: the worker's --contender) and returns its
    row, failed or ok; expect_s: a generous guess of one step's seconds, for the timeout."""
    optimizer = split_optimizer(name, args.optimizer)[1]
    worker_args = ["--workload", "replay", "--profile", str(profile), "--warmup",
                   str(args.warmup), "--steps", str(args.steps), "--dilation", str(dilation),
                   "--contender", contender, "--optimizer", optimizer]
    unmeasured = args.warmup
    if contender == "auto":
        # Its search, and the kept plan's first step, are unmeasured steps too.
        worker_args += ["--auto", json.dumps(args.auto)]
        unmeasured = max(args.warmup, AUTO_SEARCH_STEPS) + 1
    if args.burn:
        worker_args.append("--burn")
    row = {"contender": name, "label": label(name), "family": family(name),
           "exchange": split_optimizer(name)[0], "optimizer": optimizer, **extra}
    timeout = 180 + 6 * (unmeasured + args.steps) * expect_s
    try:
        ranks, seconds = runner.run(name, worker_args, timeout)
    except netns.ClusterError as e:
        return {**row, **failed_row(name, e)}
    row.update(status="ok", seconds=seconds, **replay_row(name, ranks, dilation))
    return row


def train_config(args, out, port):
    rate_bps = netns.parse_rate(args.train_rate)
    workers = args.train_workers
    config = {"rate": args.train_rate, "workers": workers, "dilation": 1,
              "epochs": args.train_epochs, "target_accuracy": args.target_accuracy,
              "optimizer": args.train_optimizer, "runs": []}
    change = args.train_rate_change
    if change:
        config["rate_change"] = {"rate": change[0], "after_seconds": change[2]}
    out_dir = out / "runs" / f"train-{args.train_rate}-w{workers}"
    say(f"\n== Fashion-MNIST training: {workers} hosts at {args.train_rate}"
        + (f" ({change[0]} after {change[2]:g} s)" if change else "")
        + f", {args.train_epochs:g} epochs each, {args.train_optimizer}")
    with netns.Cluster(workers, rate_bps, run_id=f"{os.getpid()}") as cluster:
        runner = Runner(cluster, out_dir, port)
        for name in split(args.train_contenders):
            # auto's training time includes its search (the replay's row measures after it).
            row = {"contender": name, "family": family(name),
                   "label": "gradcomp auto (search included)" if name == "auto" else label(name)}
            try:
                settings = (["--train-auto", json.dumps(args.train_auto)]
                            if name == "auto" and args.train_auto else [])
                began = runner.out_dir / slug(name) / TRAINING_BEGAN
                with rate_changed(cluster, rate_bps, change, began) as changed:
                    ranks, seconds = runner.run(name, ["--workload", "train", "--contender", name,
                                                       "--epochs", str(args.train_epochs),
                                                       "--train-optimizer", args.train_optimizer,
                                                       *settings], 1800)
            except netns.ClusterError as e:
                config["runs"].append({**row, **failed_row(name, e)})
                continue
            r0 = ranks[0]
            row.update(status="ok", eval_epochs=r0["eval_epochs"],
                       epoch_seconds=r0["epoch_seconds"],
                       epoch_accuracy=r0["epoch_accuracy"],
                       wire_bytes_per_step=statistics.fmean(r["tx_bytes_per_step"]
                                                            for r in ranks))
            if "auto" in r0:
                row["auto"] = r0["auto"]
            if change:
                row["rate_changed_s"] = (training_seconds_at(changed["wall"], r0["training_wall"])
                                         if "wall" in changed else None)
            say(f"   {label(name):<32} accuracy {100 * r0['epoch_accuracy'][-1]:.2f} % after "
                f"{r0['epoch_seconds'][-1]:.1f} s of training ({seconds:.0f} s)"
                + (f"; link changed at {row['rate_changed_s']:.1f} s of training"
                   if row.get("rate_changed_s") is not None else
                   "; training ended before the link changed" if change else ""))
            config["runs"].append(row)
    return config


@contextlib.contextmanager
def rate_changed(cluster, rate_bps, change, began=None):
    """Runs the body at rate_bps, every link changed to change's rate after its seconds: from
    the moment the file `began` appears (the training's first step: worker.py makes it), or
    from the body's start without one. Yields a dict that gets "wall", the wall-clock time
    of the change, once it is made. The links are back at rate_bps afterwards, so every
    contender sees the same links."""
    cluster.set_rate(rate_bps)
    if not change:
        yield {}
        return
    if began is not None:
        Path(began).unlink(missing_ok=True)  # a run before this one's
    with cluster.rates_changed(change[1], change[2],
                               None if began is None else Path(began).exists) as changed:
        yield changed


def training_seconds_at(wall, training_wall):
    """The training time (evaluations left out, as the worker's epoch_seconds) at wall-clock
    time `wall`, from the worker's wall clock of its first step and of its evaluations."""
    seconds = wall - training_wall["began"]
    for paused, resumed in training_wall["evaluations"]:
        seconds -= max(0.0, min(wall, resumed) - paused)
    return seconds


def optimizer_config(args, profile, rate, workers, names, out, port):
    """One cluster of the optimizer comparison: every contender's step with its optimizer's
    update (no planner, no simulator: neither models the update)."""
    rate_bps = netns.parse_rate(rate)
    dilation = max(1, round(rate_bps / netns.parse_rate(args.max_real_rate)))
    link_bps = rate_bps / dilation
    config_name = f"{Path(profile).stem}-{rate}-w{workers}"
    profile_json = json.loads(Path(profile).read_text())
    elements = sum(t["elements"] for t in profile_json["tensors"])
    config = {"profile": Path(profile).stem, "rate": rate, "rate_bps": rate_bps,
              "dilation": dilation, "workers": workers, "link_bps": link_bps,
              "elements": elements, "baseline": BASELINE,
              "compute_ms": profile_json["forward_ms"] + profile_json["backward_ms"],
              "runs": []}
    say(f"\n== optimizers, {config_name}: {workers} hosts, links {netns.format_rate(link_bps)}"
        + (f" (time-dilated x{dilation}: emulates {rate})" if dilation > 1 else ""))
    # For the timeout only: a ring allreduce of fp32 gradients at the link rate and torch's
    # AdamW (about 7 ns per element on a core here) with the workers sharing the cores.
    expect_s = (config["compute_ms"] / 1e3 * dilation + 64 * elements / link_bps
                + 2e-8 * elements * workers / (os.cpu_count() or 1))
    with netns.Cluster(workers, link_bps, run_id=f"{os.getpid()}") as cluster:
        config["measured_link_bps"] = cluster.measure_rate(1.0) * dilation
        say(f"   measured ring throughput per link: {config['measured_link_bps'] / 1e9:.3f} "
            "Gbit/s (emulated time)")
        runner = Runner(cluster, out / "runs" / f"optimizers-{config_name}", port)
        rows = {}
        for round_index in range(args.rounds):
            if args.rounds > 1:
                say(f"   round {round_index + 1} of {args.rounds}")
            for name in names:
                base = split_optimizer(name, args.optimizer)[0]
                row = run_contender(args, runner, name, base, profile, dilation, expect_s)
                if row["status"] == "ok":
                    say_optimizer_row(row)
                rows[name] = merge_rounds(rows.get(name), row)
    config["runs"] = list(rows.values())
    return config


# Per-step lists a round adds to; per-step means a round is averaged into; counts it adds to.
STEP_LISTS = ("step_ms", "backward_end_ms", "after_backward_ms", "update_ms")
ROUND_MEANS = ("wire_bytes_per_step", "payload_bytes_per_step", "cpu_ms_per_step",
               "other_cpu_cores")
ROUND_SUMS = ("onebit_compressed_steps", "seconds")


def merge_rounds(merged, row):
    """One row of every round of a contender: the measured steps of all rounds, figures per
    step averaged over the rounds, each round's median kept. A failed round fails the row."""
    row = dict(row, round_median_ms=[statistics.median(row["step_ms"])]
               if row["status"] == "ok" else [])
    if merged is None or merged["status"] != "ok":
        return merged or row
    if row["status"] != "ok":
        return row
    rounds = len(merged["round_median_ms"])
    for key in STEP_LISTS:
        if merged.get(key) is not None:
            merged[key] = merged[key] + row[key]
    for key in ROUND_MEANS:
        if merged.get(key) is not None:
            merged[key] = (merged[key] * rounds + row[key]) / (rounds + 1)
    for key in ROUND_SUMS:
        if merged.get(key) is not None:
            merged[key] += row[key]
    merged["round_median_ms"] = merged["round_median_ms"] + row["round_median_ms"]
    merged["ranks_agree"] = merged.get("ranks_agree", True) and row.get("ranks_agree", True)
    return merged


def say_optimizer_row(row):
    update = row.get("update_ms")
    text = (f"   {row['label']:<36} {statistics.median(row['step_ms']):9.1f} ms/step  "
            + (f"update {statistics.median(update):7.1f} ms  " if update else "")
            + f"{row['wire_bytes_per_step'] / 1e6:8.2f} MB/step on the wire  "
            + (f"other jobs {row['other_cpu_cores']:.2f} cores  "
               if row.get("other_cpu_cores") is not None else "")
            + f"({row['seconds']:.0f} s)")
    if "onebit_warmup_steps" in row:
        text += (f"; {OPTIMIZER_LABELS[row['optimizer']]}: warm-up of "
                 f"{row['onebit_warmup_steps']} uncompressed "
                 f"step(s) before the measured steps; {row['onebit_compressed_steps']} of "
                 f"{len(row['step_ms'])} measured steps compressed")
    if row.get("ranks_agree") is False and row["family"] != "compute":
        text += "; RANKS DISAGREE"
    say(text)


def run_optimizers(args, names, profiles):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "optimizer-benchmark.json"
    results = {
        "format": report.OPTIMIZER_FORMAT, "version": 1,
        "command": "bench/cluster/run.sh" + "".join(f" {a}" for a in sys.argv[1:]),
        "started": now(), "machine": machine(),
        "settings": {"warmup": args.warmup, "steps": args.steps, "burn": args.burn,
                     "max_real_rate": args.max_real_rate, "optimizer": args.optimizer,
                     "rounds": args.rounds},
        "configs": [],
    }
    port = 29600
    for profile in profiles:
        for rate in split(args.rates):
            for workers in args.workers:
                results["configs"].append(optimizer_config(args, profile, rate, workers, names,
                                                           out, port))
                port += 100
                save(results, results_path)
    results["finished"] = now()
    save(results, results_path)
    md_path = Path(args.md)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(report.render_optimizer_markdown(results))
    say(f"\nwrote {results_path}\nwrote {md_path}")
    for config in results["configs"]:
        for line in report.optimizer_verdicts(config):
            say(line)
    return 0


# ---------------------------------------------------------------------------- main

def say(text):
    print(text, flush=True)


def machine():
    def command(*argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=10,
                                  cwd=ROOT).stdout.strip()
        except OSError:
            return ""
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    torch_version = command(PYTHON, "-c", "import torch; print(torch.__version__)")
    return {"cores": os.cpu_count(), "kernel": platform.release(), "cpu": cpu,
            "torch": torch_version, "commit": command("git", "rev-parse", "--short", "HEAD")}


def clean_stale():
    """Removes what an aborted run left, unless that run is still going."""
    stale = [n for n in netns.stale_namespaces() if not owner_alive(n)]
    if stale:
        say(f"removing {len(stale)} network namespace(s) left by an aborted run: "
            f"{', '.join(stale)}")
        netns.remove_namespaces(stale)
    return stale


def owner_alive(namespace):
    """Namespaces are named gcbench-<pid>-...: is that benchmark process still running?"""
    parts = namespace.split("-")
    if len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) == os.getpid():
        return False
    try:
        cmdline = Path(f"/proc/{parts[1]}/cmdline").read_bytes()
    except OSError:
        return False
    return b"bench.py" in cmdline


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.delay:
            raise netns.delay_unsupported(args.delay)
        netns.check_environment()
        if args.clean:
            if not clean_stale():
                say("nothing to clean: no namespace left by an aborted run")
            return 0
        clean_stale()
        live = netns.stale_namespaces()
        if live:
            raise BenchError(f"another benchmark is running (namespaces {', '.join(live)}); "
                             "wait for it: two at once would share the CPUs and spoil both")
        if not GRADCOMP.exists():
            raise BenchError(f"{GRADCOMP} is missing: build first (bash scripts/setup.sh; "
                             "bench/cluster/run.sh does)")
        names = optimizer_contenders(args) if args.optimizers else contenders(args)
        profiles = [profile_path(p) for p in split(args.profiles)]
        for rate in split(args.rates):
            netns.parse_rate(rate)
        if args.optimizers:
            return run_optimizers(args, names, profiles)
        return run_all(args, names, profiles)
    except (BenchError, netns.ClusterError) as e:
        print(f"bench/cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench/cluster: interrupted; namespaces and workers removed", file=sys.stderr)
        return 130


def run_all(args, names, profiles):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "cluster-benchmark.json"
    command = "bench/cluster/run.sh" + "".join(f" {a}" for a in sys.argv[1:])
    results = {
        "format": "gradcomp-cluster-benchmark", "version": 1, "command": command,
        "started": now(), "machine": machine(),
        "settings": {"warmup": args.warmup, "steps": args.steps, "burn": args.burn,
                     "max_real_rate": args.max_real_rate,
                     "target_accuracy": args.target_accuracy, "codecs": split(args.codecs),
                     "optimizer": args.optimizer, "auto": args.auto},
        "replay": [], "train": [],
    }
    costs = {}  # workers -> codec costs measured with that many copies
    port = 29600
    for profile in [] if args.train_only else profiles:
        for rate in split(args.rates):
            for workers in args.workers:
                if workers not in costs:
                    costs[workers] = (Path(args.costs) if args.costs else
                                      measure_codec_costs(split(args.codecs), workers, out))
                args.costs_path = costs[workers]
                runs = [n for n in names if n != "ddp-bf16" or not results["replay"]]
                results["replay"].append(replay_config(args, profile, rate, workers, runs,
                                                       out, port))
                port += 100
                save(results, results_path)
    if args.train:
        results["train"].append(train_config(args, out, port))
    results["finished"] = now()
    save(results, results_path)
    written = report.write_report(results, Path(args.md), Path(args.img))
    say(f"\nwrote {results_path}")
    for path in written:
        say(f"wrote {path}")
    for target in report.evaluate_targets(results):
        say(f"target {target['status']:<8} {target['name']}: {target['detail']}")
    return 0


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def save(results, path):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
