#!/usr/bin/env python3
"""The language model of docs/accuracy-lm.md (examples/language_model/train.py, AdamW) on an
emulated cluster: each compression's validation loss and training time, run one after the
other on the same cluster, with the same seed, batches and initial model. compression="auto"
is a contender as a user runs it (`--compression auto`, nothing else), so that its decisions
are judged on a second model, a Transformer, and not only on the CNN they were tuned on.

    /usr/bin/python3 bench/cluster/lm.py --rate 1gbit --workers 2 --steps 400 \\
        --compressions 'none;auto;dither;powersgd:rank=4|ef' --out bench/cluster/results/auto-lm

`--rate 1gbit,1gbit,100mbit` gives each host its own link (here the third behind a slower one);
`--rate-change 1gbit,1gbit,100mbit@40` changes the links 40 s into each run's training (timed
from rank 0's line before its first step) and sets them back after the run.

Writes OUT/lm.json and OUT/lm.md (the table); each rank's log and summary in OUT/runs/ (not
kept in git). Needs root (network namespaces), as bench.py does.
"""
import argparse
import contextlib
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import netns  # noqa: E402

PYTHON = "/usr/bin/python3"  # Debian's, with torch
TRAIN = ROOT / "examples" / "language_model" / "train.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit",
                   help="link rate of every host, or one per host, comma-separated "
                        "(1gbit,1gbit,100mbit: the last host behind a slower link) (1gbit)")
    p.add_argument("--rate-change", default=None, metavar="RATE@SECONDS",
                   help="the links change to RATE (one for every host, or one per host as in "
                        "--rate) this many seconds into each run's training, and are set back "
                        "after it: a link that gets slower or faster during training "
                        "(1gbit,1gbit,100mbit@40: the third host's link drops to 100 Mbit/s)")
    p.add_argument("--workers", type=int, default=2, help="hosts, one rank each (2)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (400)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank and step (8)")
    p.add_argument("--seed", type=int, default=0, help="(0)")
    p.add_argument("--compressions", default="none;auto",
                   help="';'-separated (options may hold commas): none, auto, or gradcomp "
                        "options (none;auto)")
    p.add_argument("--auto", type=json.loads, default=None, metavar="JSON",
                   help="settings of the auto contender (train.py --auto; default: none, "
                        "as a user runs it)")
    p.add_argument("--out", type=Path, required=True, help="directory for lm.json and lm.md")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run (3600)")
    args = p.parse_args(argv)
    if args.workers < 2 or args.steps < 1 or args.batch_size < 1:
        p.error("--workers must be at least 2, --steps and --batch-size at least 1")
    try:
        args.rates = netns.parse_rates(args.rate)
        netns.host_rates(args.rates, args.workers)
    except netns.ClusterError as e:
        p.error(f"--rate: {e}")
    args.change = None
    if args.rate_change is not None:
        try:
            args.change = netns.parse_rate_change(args.rate_change)
            netns.host_rates(args.change[0], args.workers)
        except netns.ClusterError as e:
            p.error(f"--rate-change: {e}")
    args.compressions = [c.strip() for c in args.compressions.split(";") if c.strip()]
    if not args.compressions:
        p.error("--compressions names no compression")
    return args


# Rank 0 of train.py prints this line just before its first training step.
TRAINING_BEGINS = "language model: "


def slug(text):
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in text)


def run_one(cluster, args, compression, port):
    """One training run; returns rank 0's summary (train.py --json)."""
    out = args.out / "runs" / slug(compression)
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"
    summary.unlink(missing_ok=True)
    argv = [PYTHON, str(TRAIN), "--compression", compression, "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--no-progress",
            "--json", str(summary)]
    if compression == "auto" and args.auto is not None:
        argv += ["--auto", json.dumps(args.auto)]
    env = dict(os.environ, WORLD_SIZE=str(args.workers), MASTER_ADDR=cluster.address(0),
               MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"),
               GRADCOMP_TIMEOUT=str(int(args.timeout)))
    for log in out.glob("rank*.log"):
        log.unlink()  # the logs are appended to, and the change is timed from rank 0's
    began = TrainingBegan(out / "rank0.log")
    with (cluster.rates_changed(*args.change, began) if args.change
          else contextlib.nullcontext({})) as changed:
        cluster.run(lambda r: argv, lambda r: dict(env, RANK=str(r)), args.timeout, out)
    result = json.loads(summary.read_text())
    if args.change:  # None: the run ended before the change
        result["rate_changed_s"] = (round(changed["wall"] - began.wall, 1)
                                    if "wall" in changed else None)
    return result


class TrainingBegan:
    """True once rank 0's log says its training begins; `wall` is when that was first seen."""

    def __init__(self, log):
        self.log, self.wall = log, None

    def __call__(self):
        if self.wall is None and self.log.exists() and TRAINING_BEGINS in self.log.read_text(
                errors="replace"):
            self.wall = time.time()
        return self.wall is not None


def rates_text(rates):
    return (netns.format_rate(rates) if not isinstance(rates, list) else
            ", ".join(netns.format_rate(r) for r in rates))


def table(args, rows):
    base = next((r for r in rows if r["compression"] == "none"), None)
    links = (f"at {args.rate}" if not isinstance(args.rates, list) else
             f"with links at {rates_text(args.rates)}")
    change = (f"; the links changed to {rates_text(args.change[0])} {args.change[1]:g} s into "
              "each run's training" if args.change else "")
    lines = [f"### {args.workers} hosts {links}, {args.steps} steps of "
             f"{args.batch_size} windows per rank, AdamW, seed {args.seed}{change}", "",
             "| compression | validation loss | Δ % vs none | training s | vs none | "
             "MB sent per step and rank |" + (" links changed at s |" if change else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if change else "")]
    for r in rows:
        delta = (f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}" if base else "")
        speed = f"{base['train_seconds'] / r['train_seconds']:.2f}x" if base else ""
        at = ("" if not change else " never |" if r.get("rate_changed_s") is None else
              f" {r['rate_changed_s']:.1f} |")
        lines.append(f"| `{r['compression']}` | {r['val_loss']:.4f} | {delta} | "
                     f"{r['train_seconds']:.1f} | {speed} | "
                     f"{r['bytes_sent_per_step'] / 1e6:.3f} |{at}")
    for r in rows:
        for d in r.get("auto", []):
            lines.append(f"\n`auto` at step {d['step']} ({d['reason']}): kept "
                         f"**{d['kept_name']}** ({d['why']}).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    rows = []
    with netns.Cluster(args.workers, args.rates, run_id=f"{os.getpid()}") as c:
        for i, compression in enumerate(args.compressions):
            summary = run_one(c, args, compression, 29700 + i)
            keep = ("compression", "val_loss", "val_perplexity", "final_train_loss",
                    "train_seconds", "bytes_sent_per_step", "uncompressed_bytes_per_step",
                    "parameter_hash", "auto", "plan", "rate_changed_s")
            rows.append({k: summary[k] for k in keep if k in summary})
            r = rows[-1]
            changed = ("" if not args.change else "; the links did not change" if
                       r["rate_changed_s"] is None else
                       f"; the links changed {r['rate_changed_s']:.1f} s into training")
            print(f"{compression:<28} validation loss {r['val_loss']:.4f}, "
                  f"{r['train_seconds']:.1f} s of training{changed}", flush=True)
    command = "/usr/bin/python3 bench/cluster/lm.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    (args.out / "lm.json").write_text(json.dumps(
        {"command": command, "started": started, "commit": commit, "rate": args.rate,
         "rates_bps": c.rates, "workers": args.workers, "steps": args.steps,
         "batch_size": args.batch_size, "seed": args.seed, "auto_settings": args.auto,
         "rate_change": args.change and {"rates_bps": args.change[0],
                                         "after_seconds": args.change[1]},
         "runs": rows}, indent=2) + "\n")
    text = (f"Generated by `{command}` (started {started}, commit {commit}).\n\n"
            + table(args, rows))
    (args.out / "lm.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
