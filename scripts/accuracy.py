#!/usr/bin/python3
"""Fashion-MNIST test accuracy of every codec next to uncompressed training: docs/accuracy.md.

Trains examples/fashion_mnist/train.py on W local ranks (gradcomp launch) once per codec at its
recommended settings, plus the uncompressed baseline on several seeds (its run-to-run spread
tells how much of a difference is noise), all with the same epochs, seed and batch size, then
writes a Markdown table.

    /usr/bin/python3 scripts/accuracy.py                       # everything (about 50 min)
    /usr/bin/python3 scripts/accuracy.py --codecs topk,qsgd --epochs 0.2 --out /tmp/acc.md

Each run's JSON summary is kept in --runs (default build/accuracy-runs/e<epochs>-w<world>);
--resume reuses the summaries of runs already done with the same settings. With --codecs the
table goes to build/accuracy-subset.md unless --out says otherwise.
"""
import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "fashion_mnist", "train.py")
LAUNCH = os.path.join(ROOT, "build", "bin", "gradcomp")
PYTHON = "/usr/bin/python3"
TOLERANCE_PP = 0.5

# One row per codec: the gradcomp option, the optimizer settings it needs (beyond the common
# --lr, momentum 0.9) and why these settings, then the likely reason if it falls more than
# TOLERANCE_PP behind the baseline.
CODECS = [
    dict(name="fp16", option="fp16", why="half-precision cast",
         lag="rounding to 11 significant bits"),
    dict(name="bf16", option="bf16", why="bfloat16 cast",
         lag="rounding to 8 significant bits"),
    dict(name="intq", option="intq:bits=8", why="8-bit integers, a shared scale (allreduce)",
         lag="stochastic rounding noise"),
    dict(name="qsgd", option="qsgd:levels=15,block=512",
         why="4-bit QSGD with the paper's 512-element blocks; unbiased, no feedback",
         lag="quantization variance"),
    dict(name="terngrad", option="terngrad", why="ternary, unbiased, no feedback (as published)",
         lag="the high variance of ternary levels scaled by the maximum"),
    dict(name="natural", option="natural", why="natural compression (powers of two), unbiased",
         lag="quantization variance"),
    dict(name="dither", option="dither", why="BytePS's linear 5-bit dithering, unbiased",
         lag="quantization variance"),
    dict(name="signsgd", option="signsgd", lr=0.001, momentum=0.0,
         why="majority vote of signs as published: no feedback, no momentum, a sign-sized "
             "learning rate (0.001)",
         lag="biased sign compression without error feedback; every coordinate moves by the "
             "same step, so the learning rate is a compromise"),
    dict(name="signum", option="signum:momentum=0.9", lr=0.001, momentum=0.0,
         why="sign of the codec's own momentum, majority vote, as published (optimizer "
             "momentum off, learning rate 0.001)",
         lag="biased sign compression without error feedback"),
    dict(name="efsignsgd", option="efsignsgd|ef||start=469",
         why="scaled sign with error feedback (Karimireddy et al.) after an uncompressed "
             "warm-up of 469 steps (the first epoch of five at 4 ranks, as 1-bit Adam warms up "
             "for 15-25% of its steps); without it 0.97 pp behind, with a 235-step warm-up "
             "0.42 pp behind",
         lag="1 bit per element and one scale per bucket: much of each step's gradient "
             "waits in the error-feedback memory, and this short run ends before it is paid "
             "back"),
    dict(name="onebit", option="onebit|ef||start=469",
         why="1-bit SGD with error feedback (Seide et al.) after the same 469-step "
             "uncompressed warm-up; without it 0.97 pp behind, with 235 steps 0.47 pp behind",
         lag="1 bit per element with two values per bucket: the error-feedback memory needs "
             "more steps than this short run to pay back what was not sent"),
    dict(name="topk", option="topk:ratio=0.01|ef", why="top 1% with error feedback",
         lag="1% of the coordinates per step: the delay of error feedback"),
    dict(name="randomk", option="randomk:ratio=0.01|ef",
         why="random 1% (shared indices, allreduce) with error feedback",
         lag="a random 1% of the coordinates carries about 1% of the gradient's energy (top-k "
             "picks the largest): each coordinate is sent about every 100 steps, 9 times in "
             "this run, too few to converge"),
    dict(name="dgc", option="dgc:ratio=0.001,stage_steps=117|ef",
         why="DGC's compression (a sampled threshold, exact top 0.1%) after the paper's "
             "staged warm-up, 117 steps (a quarter epoch at 4 ranks) at each of 25%, 6.25%, "
             "1.56% and 0.39%, with plain error feedback and the optimizer's momentum. DGC's "
             "own momentum correction and masking (|dgc, optimizer momentum off) ended 1.38 pp "
             "behind (90.82 %), without masking 0.99 pp behind, and at 1% 1.64 pp behind: held "
             "per rank before sparsification the momentum trains worse here than applied to "
             "the averaged gradient",
         lag="0.1% of the coordinates per step once the warm-up (the first epoch) is over: "
             "the error feedback's delay is 10x longer than topk's"),
    dict(name="threshold", option="threshold:tau=0.01|ef",
         why="every |g| >= 0.01 with error feedback (tau chosen for this model's gradients)",
         lag="a fixed threshold sends few coordinates while the gradients are small"),
    dict(name="powersgd", option="powersgd:rank=4|ef",
         why="rank 4 (Vogels et al. use 1-4) with error feedback, warm start",
         lag="each weight is its own matrix (conv2 64 x 288, fc1 128 x 3136, as in the paper "
             "and PyTorch's hook); rank 4 keeps a small part of each step's gradient, the "
             "rest waits in the error-feedback memory"),
]
BASELINE = dict(name="none", option="none", why="uncompressed float32 allreduce")
# Sections that other scripts write at the end of the table's file (powersgd_vs_torch.py):
# kept when the table is rewritten.
KEPT_SECTIONS = ("## PowerSGD against PyTorch's hook",)


def sweep_parser(description):
    """The flags both accuracy sweeps take (parse them with parse_sweep)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--codecs", help="comma-separated subset of: "
                   + ",".join(c["name"] for c in CODECS) + " (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of every codec run (0)")
    p.add_argument("--baseline-seeds", default="0,1,2",
                   help="seeds of the uncompressed runs; the first must be --seed (0,1,2)")
    p.add_argument("--resume", action="store_true",
                   help="reuse summaries of runs already done with the same settings")
    p.add_argument("--paired-codecs", default="",
                   help="comma-separated codecs that also run on the baseline's other seeds, "
                        "each compared with the baseline of its own seed (a section of the "
                        "table gives every seed's difference and their mean)")
    return p


def parse_sweep(p):
    """Parses a sweep_parser's flags: baseline_seeds as a list, selected as CODECS entries."""
    args = p.parse_args()
    args.baseline_seeds = [int(s) for s in args.baseline_seeds.split(",") if s]
    if not args.baseline_seeds or args.baseline_seeds[0] != args.seed:
        p.error("--baseline-seeds must start with --seed (the codecs are compared to that run)")
    args.selected = select_codecs(p, args.codecs)
    args.paired = select_codecs(p, args.paired_codecs) if args.paired_codecs else []
    unselected = [e["name"] for e in args.paired if e not in args.selected]
    if unselected:
        p.error(f"--paired-codecs {','.join(unselected)}: not among --codecs")
    return args


def parse_args():
    p = sweep_parser(__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=float, default=5.0, help="epochs per run (5)")
    p.add_argument("--world", type=int, default=4, help="ranks per run (4)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (0.05)")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "constant"],
                   help="learning-rate schedule of every run (cosine)")
    p.add_argument("--out", help="the Markdown file to write (docs/accuracy.md for all codecs, "
                                 "build/accuracy-subset.md with --codecs)")
    p.add_argument("--runs", help="directory of the runs' JSON summaries and logs "
                                  "(build/accuracy-runs/e<epochs>-w<world>)")
    args = parse_sweep(p)
    # A quick check of a few codecs must not overwrite the committed table.
    if args.out is None:
        args.out = os.path.join(ROOT, *(("build", "accuracy-subset.md") if args.codecs
                                        else ("docs", "accuracy.md")))
    if args.runs is None:
        args.runs = os.path.join(ROOT, "build", "accuracy-runs",
                                 f"e{args.epochs:g}-w{args.world}")
    return args


def select_codecs(parser, names):
    if not names:
        return list(CODECS)
    known = {c["name"]: c for c in CODECS}
    chosen = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name == "none":
            continue  # the baseline always runs
        if name not in known:
            parser.error(f"unknown codec '{name}'; choose from {', '.join(known)}")
        chosen.append(known[name])
    return chosen


def free_port():
    """A port for the rendezvous store that nothing listens on now (other jobs may be using
    the launcher's default)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(args, entry, seed, json_path):
    lr = entry.get("lr", args.lr)
    momentum = entry.get("momentum", 0.9)
    return [LAUNCH, "launch", "-n", str(args.world), "--master-port", str(free_port()), "--",
            PYTHON, TRAIN, "--compression", entry["option"], "--epochs", f"{args.epochs:g}",
            "--seed", str(seed), "--batch-size", str(args.batch_size), "--lr", f"{lr:g}",
            "--schedule", args.schedule, "--momentum", f"{momentum:g}", "--json", json_path, "--no-progress"]


def run(args, entry, seed):
    """Trains once; returns the summary dict, or dict(error=...) when the run failed."""
    stem = os.path.join(args.runs, f"{entry['name']}.seed{seed}")
    return run_launched(stem, lambda json_path: train_command(args, entry, seed, json_path),
                        args.resume, f"{entry['name']} (seed {seed}): {entry['option']}",
                        lambda s: f"{100 * s['test_accuracy']:.2f} %")


def run_launched(stem, command, resume, label, describe):
    """Runs command(stem + ".json") (a `gradcomp launch`), its output in stem + ".log"; returns
    the summary it wrote (with the run's settings and seconds added), or dict(error=...).
    With resume, a summary already there from the same settings is returned instead."""
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    json_path, log_path = stem + ".json", stem + ".log"
    cmd = command(json_path)
    # The settings of the run: the command after `<launcher> launch`, without the rendezvous
    # port and the output path.
    skip = {0, 1}
    for flag in ("--master-port", "--json"):
        skip |= {cmd.index(flag), cmd.index(flag) + 1}
    key = shlex.join(word for i, word in enumerate(cmd) if i not in skip)
    if resume and os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            summary = json.load(f)
        if summary.get("accuracy_py_command") == key:
            print(f"  {label}: reused {json_path}", flush=True)
            return summary
    if os.path.exists(json_path):
        os.remove(json_path)
    print(f"  {label} ...", end="", flush=True)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    seconds = time.perf_counter() - start
    if code != 0 or not os.path.exists(json_path):
        with open(log_path, encoding="utf-8") as f:
            tail = [line.strip() for line in f if line.strip()][-3:]
        print(f" FAILED (exit {code}, {seconds:.0f} s; see {log_path})", flush=True)
        return dict(error=" / ".join(tail) or f"exit code {code}")
    with open(json_path, encoding="utf-8") as f:
        summary = json.load(f)
    summary["accuracy_py_command"] = key
    summary["run_seconds"] = seconds
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(f" {describe(summary)} in {seconds:.0f} s", flush=True)
    return summary


# ---------------------------------------------------------------------------- the report

def fmt_bytes(n):
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def baseline_spread(baselines):
    accs = [100 * b["test_accuracy"] for b in baselines if "error" not in b]
    if not accs:
        return None
    return dict(values=accs, mean=statistics.mean(accs),
                stdev=statistics.stdev(accs) if len(accs) > 1 else 0.0,
                range=max(accs) - min(accs))


def table_row(entry, result, reference):
    option = entry["option"].replace("|", "\\|")  # a bare | would end the table cell
    if "error" in result:
        error = result["error"].replace("|", "\\|")
        return f"| {entry['name']} | `{option}` | failed: {error} | | | | | |", None
    acc = 100 * result["test_accuracy"]
    diff = acc - 100 * reference["test_accuracy"]
    flag = " **(!)**" if diff < -TOLERANCE_PP else ""
    ratio = result["compression_ratio"]
    return (f"| {entry['name']} | `{option}` | {acc:.2f} | {diff:+.2f}{flag} | "
            f"{fmt_bytes(result['bytes_sent_per_step'])} | {ratio:.1f}x | "
            f"{1000 * result['wall_step_seconds']:.0f} | {result['train_seconds']:.0f} |"), diff


def command_line(args):
    parts = ["/usr/bin/python3 scripts/accuracy.py", f"--epochs {args.epochs:g}",
             f"--world {args.world}", f"--seed {args.seed}",
             f"--baseline-seeds {','.join(map(str, args.baseline_seeds))}",
             f"--batch-size {args.batch_size}", f"--lr {args.lr:g}",
             f"--schedule {args.schedule}"]
    if args.codecs:
        parts.append(f"--codecs {args.codecs}")
    if getattr(args, "paired", None):
        parts.append(f"--paired-codecs {','.join(e['name'] for e in args.paired)}")
    return " ".join(parts)


def accuracy_difference(run, baseline):
    """A Fashion-MNIST run's test accuracy minus its baseline's, in percentage points."""
    return 100 * (run["test_accuracy"] - baseline["test_accuracy"])


def paired_section(args, baselines, results, paired, difference=accuracy_difference,
                   lags=lambda mean: mean < -TOLERANCE_PP,
                   what="a run minus the baseline of its own seed, in percentage points",
                   option=lambda entry: entry["option"]):
    """The codecs run on every baseline seed: each seed's Δ against the baseline of that seed,
    and their mean (a seed's own noise cancels in the pair; the mean is the steadier figure).
    difference(run, baseline) is a Δ, `what` says what it is; lags(mean) flags a mean out of
    tolerance; option(entry) is the option the runs used."""
    if not paired:
        return []
    head = " | ".join(f"Δ seed {s}" for s in args.baseline_seeds)
    others = ", ".join(map(str, args.baseline_seeds[1:]))
    lines = [
        "## Across seeds",
        "",
        f"These codecs also ran on the baseline's other seeds ({others}: the seed "
        "of the model, the shuffling and the codec, as in that baseline run). Each Δ "
        f"is {what}; the mean is over "
        "the seeds.",
        "",
        f"| codec | option | {head} | mean Δ |",
        "|---|---|" + "---:|" * (len(args.baseline_seeds) + 1),
    ]
    for entry in args.paired:
        runs = [results[entry["name"]], *paired[entry["name"]]]
        diffs = [None if "error" in r or "error" in b else difference(r, b)
                 for r, b in zip(runs, baselines)]
        cells = " | ".join("failed" if d is None else f"{d:+.2f}" for d in diffs)
        if None in diffs:
            mean = "incomplete"
        else:
            m = statistics.mean(diffs)
            mean = f"{m:+.2f}" + (" **(!)**" if lags(m) else "")
        cell = option(entry).replace("|", "\\|")
        lines.append(f"| {entry['name']} | `{cell}` | {cells} | {mean} |")
    return lines + [""]


def write_report(args, baselines, results, paired=None):
    reference = baselines[0]
    spread = baseline_spread(baselines)
    ok = [r for r in [reference, *results.values()] if "error" not in r]
    steps = ok[0]["steps"] if ok else 0
    lines = [
        "# Fashion-MNIST accuracy per codec",
        "",
        "Generated by `scripts/accuracy.py`; do not edit by hand. Command:",
        "",
        "```bash",
        command_line(args),
        "```",
        "",
        f"Each run: `examples/fashion_mnist/train.py` on {args.world} local ranks (`gradcomp "
        f"launch`, Gloo), {args.epochs:g} epoch(s) = {steps} steps of {args.batch_size} images "
        f"per rank, the 421,642-parameter CNN, SGD (learning rate {args.lr:g} with a "
        f"{args.schedule} schedule, momentum 0.9, weight decay 1e-4 unless the row says "
        f"otherwise), seed {args.seed} for the model, "
        "the shuffling and the codecs. Tensors of at least 16,384 elements (conv2 and fc1 "
        "weights, 99.6% of the parameters) are compressed, the others travel uncompressed. "
        "Accuracy is on the 10,000 test images after the last step.",
        "",
    ]
    if "error" in reference:
        lines += [f"The uncompressed baseline failed: {reference['error']}", ""]
    else:
        lines += [
            f"Uncompressed baseline (seed {args.seed}): **{100 * reference['test_accuracy']:.2f} %**"
            f", {fmt_bytes(reference['bytes_sent_per_step'])} per step and rank.",
            "",
        ]
    if spread:
        seeds = ", ".join(f"seed {s}: {v:.2f} %" for s, v in zip(args.baseline_seeds,
                                                                  spread["values"]))
        lines += [
            f"Run-to-run spread of the baseline over {len(spread['values'])} seeds ({seeds}): "
            f"mean {spread['mean']:.2f} %, standard deviation {spread['stdev']:.2f} pp, range "
            f"{spread['range']:.2f} pp. A codec's difference smaller than this range is noise.",
            "",
        ]
    lines += [
        f"Δ is the accuracy minus the seed-{args.seed} baseline in percentage points; **(!)** "
        f"marks a codec more than {TOLERANCE_PP} pp below it (reasons under the table). Bytes: "
        "mean bytes one rank hands to the transport per step (all buckets and rounds); ratio: "
        "uncompressed bytes / bytes sent. Step: mean wall time per step. Times are not a speed "
        "comparison: 4 ranks share 2 cores over loopback, and the machine ran other jobs "
        "whose load changed from run to run; the bytes are what a network would carry.",
        "",
        "| codec | option | accuracy % | Δ pp | bytes/step | ratio | step ms | train s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    row, _ = table_row(BASELINE, reference, reference)
    lines.append(row)
    lagging = []
    for entry in args.selected:
        row, diff = table_row(entry, results[entry["name"]], reference)
        lines.append(row)
        if diff is not None and diff < -TOLERANCE_PP:
            lagging.append((entry, diff))
    lines += ["", *paired_section(args, baselines, results, paired), "## Settings", ""]
    for entry in args.selected:
        extra = []
        if "lr" in entry:
            extra.append(f"learning rate {entry['lr']:g}")
        if "momentum" in entry:
            extra.append(f"optimizer momentum {entry['momentum']:g}")
        note = f" ({', '.join(extra)})" if extra else ""
        lines.append(f"- **{entry['name']}** `{entry['option']}`{note}: {entry['why']}.")
    lines += ["", "Variants quoted above (other warm-ups, feedbacks or ratios than the rows') "
              "are single runs at seed 0 with the table's settings: `build/bin/gradcomp launch "
              "-n 4 -- /usr/bin/python3 examples/fashion_mnist/train.py --epochs 5 --compression "
              "'<option>'` (train.py's defaults are the table's: seed 0, 32 images per rank, "
              "learning rate 0.05 with a cosine schedule, momentum 0.9), with `--momentum 0` for "
              "DGC's own `|dgc` feedback."]
    lines += ["", f"## More than {TOLERANCE_PP} pp below the baseline, and the likely reason",
              ""]
    if not lagging:
        lines.append(f"None: every codec is within {TOLERANCE_PP} pp of the baseline (or above).")
    for entry, diff in lagging:
        noise = (" (within the baseline's seed range: possibly noise)"
                 if spread and -diff <= spread["range"] else "")
        lines.append(f"- **{entry['name']}** ({diff:+.2f} pp){noise}: {entry['lag']}.")
    failed = [e["name"] for e in args.selected if "error" in results[e["name"]]]
    if failed:
        lines += ["", f"Failed runs: {', '.join(failed)} (logs in {args.runs})."]
    # Summed over the runs (reused ones included), so a resumed table reports its full cost.
    extra = [r for runs in (paired or {}).values() for r in runs]
    done = [r for r in [*baselines, *results.values(), *extra] if "run_seconds" in r]
    run_seconds = sum(r["run_seconds"] for r in done)
    overhead = statistics.mean(r["run_seconds"] - r["train_seconds"] for r in done) if done else 0
    lines += ["", f"Time of all {len(done)} runs: {run_seconds / 60:.0f} min on this machine "
              f"({os.cpu_count()} cores, shared with other jobs); on average {overhead:.0f} s of "
              "each run is start-up and evaluation (the ranks importing torch, reading the data, "
              "checking their parameters and scoring the test set).", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tail = kept_sections(args.out)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + tail)


def kept_sections(path):
    """The end of `path` from the first of KEPT_SECTIONS on ("" when none is there): other
    scripts' sections, which a rewrite of the table must not drop."""
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    starts = [i for i in (text.find("\n" + h + "\n") for h in KEPT_SECTIONS) if i >= 0]
    return text[min(starts):] if starts else ""


def sweep(args, run_one, train_script, what):
    """The baseline on every seed, then every selected codec, then the paired codecs on the
    baseline's other seeds: (baselines, {codec: result}, {codec: [result per other seed]})."""
    for path in (LAUNCH, train_script):
        if not os.path.exists(path):
            sys.exit(f"{os.path.basename(sys.argv[0])}: {path} is missing; run "
                     "scripts/setup.sh first")
    print(f"{len(args.selected)} codec(s) + {len(args.baseline_seeds)} baseline run(s), "
          f"{what} each, {args.world} ranks", flush=True)
    baselines = [run_one(args, BASELINE, seed) for seed in args.baseline_seeds]
    results = {entry["name"]: run_one(args, entry, args.seed) for entry in args.selected}
    paired = {entry["name"]: [run_one(args, entry, seed) for seed in args.baseline_seeds[1:]]
              for entry in args.paired}
    return baselines, results, paired


def main():
    args = parse_args()
    start = time.perf_counter()
    baselines, results, paired = sweep(args, run, TRAIN, f"{args.epochs:g} epoch(s)")
    write_report(args, baselines, results, paired)
    print(f"accuracy: wrote {args.out} ({(time.perf_counter() - start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
