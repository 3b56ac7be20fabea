#!/usr/bin/python3
"""Validation loss of a small language model under AdamW for every codec, next to uncompressed
training: docs/accuracy-lm.md (and its plot docs/img/lm-loss.png).

Trains examples/language_model/train.py (a 1.45M-parameter GPT-style model on Debian's fortune
cookies, AdamW) on W local ranks (gradcomp launch) once per codec, with the options of
scripts/accuracy.py's table (the codec settings only: every run here has the same optimizer and
learning rate), plus the uncompressed baseline on several seeds for the noise. A codec within
TOLERANCE_PERCENT of the baseline's validation loss passes.

    /usr/bin/python3 scripts/lm_accuracy.py                     # everything (about 45 min)
    /usr/bin/python3 scripts/lm_accuracy.py --codecs topk,powersgd --steps 100 --out /tmp/lm.md
    /usr/bin/python3 scripts/lm_accuracy.py --world 4 --codecs fp16,powersgd \
        --paired-codecs powersgd --out /tmp/lm4.md   # powersgd on seeds 0, 1 and 2, paired

Each run's JSON summary (with its training-loss curve) is kept in --runs (default
build/lm-accuracy-runs/s<steps>-w<world>-<optimizer>); --resume reuses runs already done with
the same settings. With --codecs the table goes to build/lm-accuracy-subset.md unless --out says
otherwise.
"""
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy import (BASELINE, CODECS, LAUNCH, PYTHON, ROOT, fmt_bytes,  # noqa: E402
                      free_port, paired_section, parse_sweep, run_launched, sweep,
                      sweep_parser)

TRAIN = os.path.join(ROOT, "examples", "language_model", "train.py")
TOLERANCE_PERCENT = 2.0

# Why a codec falls behind under AdamW, by the kind of error it makes (the likely reason: Adam
# divides each coordinate's step by the running root mean square of what that coordinate
# received, so the shape of the error matters as much as its size).
_BURSTS = ("error feedback sends each coordinate's accumulated residual in bursts: Adam's "
           "second moment grows with the square of the bursts, so the coordinates step in jumps "
           "and then shrink between them, where SGD would average them out")
_NOISE = ("unbiased noise on every coordinate: it adds its variance to Adam's second moment, "
          "which shrinks every step (SGD's momentum averages the same noise away)")
_SIGNS = ("every coordinate's magnitude is lost or shared: Adam then normalises signs, "
          "not gradients")
ADAM_LAG = dict(terngrad=_NOISE, qsgd=_NOISE, natural=_NOISE, dither=_NOISE, intq=_NOISE,
                signsgd=_SIGNS, signum=_SIGNS, efsignsgd=_SIGNS + "; and " + _BURSTS,
                onebit=_SIGNS + "; and " + _BURSTS, topk=_BURSTS, randomk=_BURSTS, dgc=_BURSTS,
                threshold=_BURSTS, powersgd="a rank-4 view of each matrix per step; " + _BURSTS)


def parse_args():
    p = sweep_parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="steps per run (400)")
    p.add_argument("--world", type=int, default=2, help="ranks per run (2)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank and step (8)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"], help="(adamw)")
    p.add_argument("--lr", type=float, help="peak learning rate (train.py's default: 2e-3)")
    p.add_argument("--out", help="the Markdown file (docs/accuracy-lm.md for all codecs, "
                                 "build/lm-accuracy-subset.md with --codecs)")
    p.add_argument("--plot", help="the loss-curve plot (docs/img/lm-loss.png with --out's "
                                  "default, else beside --out)")
    p.add_argument("--runs", help="directory of the runs' summaries and logs")
    args = parse_sweep(p)
    subset = bool(args.codecs)
    if args.out is None:
        args.out = os.path.join(ROOT, *(("build", "lm-accuracy-subset.md") if subset
                                        else ("docs", "accuracy-lm.md")))
    if args.plot is None:
        args.plot = (os.path.join(ROOT, "docs", "img", "lm-loss.png") if not subset and
                     args.out == os.path.join(ROOT, "docs", "accuracy-lm.md")
                     else os.path.splitext(args.out)[0] + ".png")
    if args.runs is None:
        args.runs = os.path.join(ROOT, "build", "lm-accuracy-runs",
                                 f"s{args.steps}-w{args.world}-{args.optimizer}")
    return args


def lm_option(entry, steps):
    """The codec's option for a run of `steps`, its warm-ups scaled to the run: DGC's stages
    (the Fashion-MNIST table's 117 steps are a sixteenth of 2 epochs) and an uncompressed
    start (start=469 there is the first fifth of 5 epochs)."""
    option = re.sub(r"stage_steps=\d+", f"stage_steps={max(1, steps // 16)}", entry["option"])
    return re.sub(r"start=\d+", f"start={max(1, steps // 5)}", option)


def train_command(args, option, seed, json_path):
    cmd = [LAUNCH, "launch", "-n", str(args.world), "--master-port", str(free_port()), "--",
           PYTHON, TRAIN, "--compression", option, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--optimizer", args.optimizer,
           "--seed", str(seed), "--json", json_path, "--no-progress"]
    if args.lr is not None:
        cmd += ["--lr", f"{args.lr:g}"]
    return cmd


def run(args, entry, seed):
    option = lm_option(entry, args.steps)
    stem = os.path.join(args.runs, f"{entry['name']}.seed{seed}")
    return run_launched(stem, lambda json_path: train_command(args, option, seed, json_path),
                        args.resume, f"{entry['name']} (seed {seed}): {option}",
                        lambda s: f"validation loss {s['val_loss']:.4f}")


# ---------------------------------------------------------------------------- the report

def relative(result, reference):
    return 100 * (result["val_loss"] / reference["val_loss"] - 1)


def table_row(entry, option, result, reference):
    cell = option.replace("|", "\\|")
    if "error" in result:
        error = result["error"].replace("|", "/")
        return f"| {entry['name']} | `{cell}` | failed: {error} | | | | | |"
    diff = relative(result, reference)
    flag = " **(!)**" if diff > TOLERANCE_PERCENT else ""
    return (f"| {entry['name']} | `{cell}` | {result['val_loss']:.4f} | {diff:+.2f}{flag} | "
            f"{result['val_perplexity']:.1f} | {result['final_train_loss']:.4f} | "
            f"{fmt_bytes(result['bytes_sent_per_step'])} | {result['compression_ratio']:.1f}x |")


def lag(args, entry, baselines, results, paired):
    """How a codec lies more than TOLERANCE_PERCENT above the baseline ("+2.50%", or "+1.90% on
    seed 0, +2.40% on the mean over 5 seeds"), or None when it does not."""
    result = results[entry["name"]]
    if "error" in result:
        return None
    gap = relative(result, baselines[0])
    text = f"{gap:+.2f}%"
    runs = [result, *paired.get(entry["name"], [])]
    if len(runs) > 1 and all("error" not in r for r in [*runs, *baselines]):
        mean = statistics.mean(relative(r, b) for r, b in zip(runs, baselines))
        if gap <= TOLERANCE_PERCENT and mean <= TOLERANCE_PERCENT:
            return None
        return f"{text} on seed {args.seed}, {mean:+.2f}% on the mean over {len(runs)} seeds"
    return text if gap > TOLERANCE_PERCENT else None


def command_line(args):
    parts = ["/usr/bin/python3 scripts/lm_accuracy.py", f"--steps {args.steps}",
             f"--world {args.world}", f"--batch-size {args.batch_size}",
             f"--optimizer {args.optimizer}", f"--seed {args.seed}",
             f"--baseline-seeds {','.join(map(str, args.baseline_seeds))}"]
    if args.lr is not None:
        parts.append(f"--lr {args.lr:g}")
    if args.codecs:
        parts.append(f"--codecs {args.codecs}")
    if args.paired:
        parts.append(f"--paired-codecs {','.join(e['name'] for e in args.paired)}")
    return " ".join(parts)


def plot(args, baselines, results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(curve, width=20):
        return [statistics.mean(curve[max(0, i - width + 1):i + 1]) for i in range(len(curve))]

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.get_cmap("tab20").colors  # one colour per codec, dashes for every other one
    for i, (name, result) in enumerate([("none", baselines[0]), *results.items()]):
        if "error" in result:
            continue
        ax.plot(smooth(result["train_loss_curve"]), label=name,
                linewidth=2.5 if name == "none" else 1.2,
                color="black" if name == "none" else colors[(i - 1) % len(colors)],
                linestyle="-" if i % 2 or name == "none" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of the ranks, 20-step moving average)")
    ax.set_title(f"Language model, {args.optimizer}, {args.world} ranks: training loss per codec")
    ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
    ax.legend(ncol=3, fontsize=8)
    ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


def write_report(args, baselines, results, paired):
    reference = baselines[0]
    ok = [b["val_loss"] for b in baselines if "error" not in b]
    first = next((r for r in [reference, *results.values()] if "error" not in r), {})
    lines = [
        f"# Language-model validation loss per codec, {args.world} ranks",
        "",
        "Generated by `scripts/lm_accuracy.py`; do not edit by hand. Command:",
        "",
        "```bash",
        command_line(args),
        "```",
        "",
        f"Each run: `examples/language_model/train.py` on {args.world} local ranks (`gradcomp "
        f"launch`, Gloo), {args.steps} steps of {args.batch_size} windows of 64 tokens per rank, "
        f"a GPT-style model of {first.get('parameters', 0):,} parameters (2 pre-norm blocks, "
        "width 128, 4 heads, untied 4,096-word embedding and output layer) on Debian's fortune "
        f"cookies (`examples/language_model/corpus.py`), {args.optimizer} "
        "(AdamW: betas 0.9, 0.95, weight decay 0.1 on matrices; linear warm-up over 5% of the "
        "steps, then cosine decay to 0), the same learning rate, initial model and batches for "
        "every codec. Codec settings are those of the Fashion-MNIST table "
        "([accuracy.md](accuracy.md)); its optimizer changes for signsgd and signum are "
        "not applied here. Tensors of at least 16,384 elements are compressed (the embedding, "
        "the output layer and the blocks' matrices, 99.2% of the parameters; the position "
        "embedding, biases and norms travel uncompressed).",
        "",
    ]
    if "error" in reference:
        lines += [f"The uncompressed baseline failed: {reference['error']}", ""]
    else:
        lines += [f"Uncompressed baseline (seed {args.seed}): validation loss "
                  f"**{reference['val_loss']:.4f}** (perplexity {reference['val_perplexity']:.1f}"
                  f"), {fmt_bytes(reference['bytes_sent_per_step'])} per step and rank.", ""]
    if len(ok) > 1:
        seeds = ", ".join(f"seed {s}: {v:.4f}" for s, v in zip(args.baseline_seeds, ok))
        spread = 100 * (max(ok) - min(ok)) / min(ok)
        lines += [f"Run-to-run spread of the baseline over {len(ok)} seeds ({seeds}): mean "
                  f"{statistics.mean(ok):.4f}, standard deviation {statistics.stdev(ok):.4f}, "
                  f"range {spread:.2f}% of the lowest. A codec's difference smaller than this "
                  "range is noise.", ""]
    lines += [
        f"Δ is the validation loss relative to the seed-{args.seed} baseline in percent; "
        f"**(!)** marks a codec more than {TOLERANCE_PERCENT:g}% above it. Training loss: the "
        "mean over the last 50 steps and the ranks. Bytes: mean bytes one rank hands to the "
        "transport per step; ratio: uncompressed bytes / bytes sent.",
        "",
        "| codec | option | validation loss | Δ % | perplexity | training loss | bytes/step | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        table_row(BASELINE, "none", reference, reference),
    ]
    for entry in args.selected:
        lines.append(table_row(entry, lm_option(entry, args.steps), results[entry["name"]],
                               reference))
    lines += ["", f"![training loss per codec](img/{os.path.basename(args.plot)})"
              if os.path.dirname(os.path.abspath(args.plot)) ==
              os.path.join(os.path.dirname(os.path.abspath(args.out)), "img")
              else f"Plot: {args.plot}", ""]
    lines += [f"## More than {TOLERANCE_PERCENT:g}% above the baseline, and the likely reason",
              ""]
    lagging = [(e, gap) for e in args.selected
               if (gap := lag(args, e, baselines, results, paired)) is not None]
    if not lagging:
        lines.append(f"None: every codec is within {TOLERANCE_PERCENT:g}% of the baseline"
                     + (f", on seed {args.seed} and on the mean over seeds." if paired else "."))
    for entry, gap in lagging:
        why = ADAM_LAG.get(entry["name"], "not analysed")
        lines.append(f"- **{entry['name']}** ({gap}): {why}.")
    lines.append("")
    lines += paired_section(
        args, baselines, results, paired, difference=relative,
        lags=lambda mean: mean > TOLERANCE_PERCENT,
        what="the run's validation loss relative to the baseline of its own seed, in percent",
        option=lambda entry: lm_option(entry, args.steps))
    failed = [e["name"] for e in args.selected if "error" in results[e["name"]]]
    if failed:
        lines += [f"Failed runs: {', '.join(failed)} (logs in {args.runs}).", ""]
    runs = [*baselines, *results.values(), *(r for rs in paired.values() for r in rs)]
    done = [r for r in runs if "run_seconds" in r]
    lines += [f"Time of all {len(done)} runs: {sum(r['run_seconds'] for r in done) / 60:.0f} min "
              f"on this machine ({os.cpu_count()} cores).", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main():
    args = parse_args()
    start = time.perf_counter()
    baselines, results, paired = sweep(args, run, TRAIN,
                                       f"{args.steps} steps of {args.optimizer}")
    write_report(args, baselines, results, paired)
    plot(args, baselines, results)
    print(f"lm_accuracy: wrote {args.out} and {args.plot} "
          f"({(time.perf_counter() - start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
