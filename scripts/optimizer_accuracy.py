#!/usr/bin/python3
"""Compressed training under Adam-family optimizers, next to uncompressed AdamW:
docs/optimizers-accuracy.md and its plots (docs/img/optimizers-accuracy-*.png).

The recipes: uncompressed AdamW (the reference), LANS and LAMB; CLAN (LANS over two-way
compression with error feedback on the worker and the server) with scaled 1-bit codes and with
top-k; 1-bit Adam (gradcomp.torch.OneBitAdam) and 1-bit LAMB (gradcomp.torch.OneBitLamb); and
the naive variant, AdamW over the same 1-bit exchange, to show why the recipes matter. Each on

- the language model (examples/language_model/train.py: a 1.45M-parameter GPT on Debian's
  fortune cookies) at 2 and 4 ranks, and
- the Fashion-MNIST CNN of the main job (examples/fashion_mnist/train.py) at 2 ranks,

with the same seed, steps, data and initial model for every recipe. 1-bit Adam's bytes over the
whole run (and 1-bit LAMB's) are compared with 1 / (w + (1 - w) / 32) of fp32 for the warm-up
fraction w.

    /usr/bin/python3 scripts/optimizer_accuracy.py            # everything (about 40 min here)
    /usr/bin/python3 scripts/optimizer_accuracy.py --resume   # reuse the runs already done

Each run's JSON summary and log are kept in --runs (build/optimizer-accuracy-runs).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy import LAUNCH, PYTHON, ROOT, fmt_bytes, free_port, run_launched  # noqa: E402

LM = os.path.join(ROOT, "examples", "language_model", "train.py")
FMNIST = os.path.join(ROOT, "examples", "fashion_mnist", "train.py")
LM_TOLERANCE_PERCENT = 1.0   # the target: within 1% of AdamW's validation loss
FMNIST_TOLERANCE_PP = 0.5
ONEBIT_WARMUP = 0.15         # 1-bit Adam's warm-up fraction under "freeze" (its default)

# LANS and LAMB move each layer by lr times its norm: their learning rate is not AdamW's (tuned
# on uncompressed LANS: docs/optimizers-accuracy.md says with what). Recipes with
# layerwise=True take it.
LM_LANS_LR = 1e-2
FMNIST_LANS_LR = 1e-2

REFERENCE = dict(name="AdamW", optimizer="adamw", compression="none")
DEFAULT_OUT = os.path.join(ROOT, "docs", "optimizers-accuracy.md")
# Scaled 1-bit codes with a pair of means per block of 256 elements (8 bytes per 256: 1.25 bits
# per element): one pair for a whole fused bucket loses each layer's scale (measured below).
ONEBIT = "onebit:block=256|ef|twoway"
RECIPES = [
    REFERENCE,
    dict(name="LANS", optimizer="lans", compression="none", layerwise=True),
    dict(name="CLAN 1-bit", optimizer="lans", compression=ONEBIT, layerwise=True),
    dict(name="CLAN 1-bit, one scale per bucket", optimizer="lans",
         compression="onebit|ef|twoway", layerwise=True, lm_only=True),
    # The tensors under 16,384 elements (0.8% of the language model: norms, biases) compressed
    # too, for the volume: in fp32 they hold the whole run near 21x.
    dict(name="CLAN 1-bit, every tensor compressed", optimizer="lans", compression=ONEBIT,
         layerwise=True, every_tensor=True),
    dict(name="CLAN top-k", optimizer="lans", compression="topk:ratio=0.001|ef|twoway",
         layerwise=True),
    dict(name="LAMB", optimizer="lamb", compression="none", layerwise=True),
    dict(name="1-bit LAMB", optimizer="onebitlamb", compression=ONEBIT, layerwise=True),
    dict(name="1-bit Adam", optimizer="onebitadam", compression=ONEBIT, variance="freeze"),
    # The norms and biases in 1-bit codes too: in fp32 they cost the volume formula 4-7%.
    dict(name="1-bit Adam, every tensor compressed", optimizer="onebitadam", compression=ONEBIT,
         variance="freeze", every_tensor=True),
    dict(name="1-bit Adam, doubling variance schedule", optimizer="onebitadam",
         compression=ONEBIT, variance="doubling"),
    dict(name="naive: AdamW over 1-bit", optimizer="adamw", compression=ONEBIT),
    # What each policy's variance costs by itself (the momentum exchanged exactly), and a
    # longer warm-up for the frozen one (language model, 2 ranks).
    dict(name="1-bit Adam, momentum uncompressed", optimizer="onebitadam", compression="none",
         variance="freeze", first_world_only=True),
    dict(name="1-bit Adam doubling, momentum uncompressed", optimizer="onebitadam",
         compression="none", variance="doubling", first_world_only=True),
    dict(name="1-bit Adam, 40% warm-up", optimizer="onebitadam", compression=ONEBIT,
         variance="freeze", warmup=0.4, first_world_only=True),
    dict(name="AdamW, beta2 0.999", optimizer="adamw", compression="none", beta2=0.999,
         first_world_only=True),
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-steps", type=int, default=400, help="language-model steps (400)")
    p.add_argument("--lm-worlds", default="2,4", help="ranks of the language-model runs (2,4)")
    p.add_argument("--fmnist-epochs", type=float, default=1.0, help="Fashion-MNIST epochs (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", help="comma-separated recipes, named as their run files are "
                   "(\"1-bit-adam--every-tensor-compressed\"; default: all)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--runs", default=os.path.join(ROOT, "build", "optimizer-accuracy-runs"))
    p.add_argument("--resume", action="store_true", help="reuse runs done with these settings")
    args = p.parse_args()
    args.lm_worlds = [int(w) for w in args.lm_worlds.split(",")]
    # By slug: most names hold a comma.
    slugs = {slug(r["name"]) for r in RECIPES}
    wanted = set(args.recipes.split(",")) if args.recipes else slugs
    if wanted - slugs:
        p.error(f"unknown recipes {sorted(wanted - slugs)}; known: {sorted(slugs)}")
    args.recipes = [r for r in RECIPES if slug(r["name"]) in wanted or r is REFERENCE]
    args.chosen = None if wanted == slugs else sorted(wanted)  # the report's command says so
    return args


def slug(name):
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def launch(world, script, recipe):
    """`gradcomp launch` of `script` on `world` ranks with the recipe's optimizer and exchange."""
    return [LAUNCH, "launch", "-n", str(world), "--master-port", str(free_port()), "--", PYTHON,
            script, "--optimizer", recipe["optimizer"], "--compression", recipe["compression"]]


def recipe_flags(recipe, lans_lr):
    """The flags a recipe adds on either task: the layer-wise learning rate, every tensor
    compressed, 1-bit Adam's variance policy."""
    flags = ["--lr", f"{lans_lr:g}"] if recipe.get("layerwise") else []
    flags += ["--onebit-variance", recipe["variance"]] if "variance" in recipe else []
    return flags + (["--min-compress-elements", "1"] if recipe.get("every_tensor") else [])


def lm_command(args, recipe, world, json_path):
    return (launch(world, LM, recipe)
            + ["--steps", str(args.lm_steps), "--batch-size", "8", "--seed", str(args.seed),
               "--onebit-warmup", f"{recipe.get('warmup', ONEBIT_WARMUP):g}", "--json",
               json_path, "--no-progress"]
            + recipe_flags(recipe, LM_LANS_LR)
            + (["--beta2", f"{recipe['beta2']:g}"] if "beta2" in recipe else []))


def fmnist_command(args, recipe, json_path):
    return (launch(2, FMNIST, recipe)
            + ["--epochs", f"{args.fmnist_epochs:g}", "--seed", str(args.seed), "--json",
               json_path, "--no-progress"]
            + recipe_flags(recipe, FMNIST_LANS_LR)
            + (["--onebit-warmup", f"{recipe['warmup']:g}"] if "warmup" in recipe else []))


def run_all(args):
    """{("lm", world) or ("fmnist", 2): {recipe name: summary}}."""
    results = {}
    for world in args.lm_worlds:
        print(f"language model, {world} ranks:", flush=True)
        results[("lm", world)] = {
            r["name"]: run_launched(
                os.path.join(args.runs, f"lm-w{world}-{slug(r['name'])}"),
                lambda j, r=r, w=world: lm_command(args, r, w, j), args.resume, r["name"],
                lambda s: f"validation loss {s['val_loss']:.4f}")
            for r in args.recipes if world == args.lm_worlds[0] or not r.get("first_world_only")}
    print("Fashion-MNIST, 2 ranks:", flush=True)
    results[("fmnist", 2)] = {
        r["name"]: run_launched(
            os.path.join(args.runs, f"fmnist-w2-{slug(r['name'])}"),
            lambda j, r=r: fmnist_command(args, r, j), args.resume, r["name"],
            lambda s: f"{100 * s['test_accuracy']:.2f} %")
        for r in args.recipes if not r.get("lm_only") and not r.get("first_world_only")}
    return results


# ---------------------------------------------------------------------------- the report

def onebit_formula(w):
    return 1 / (w + (1 - w) / 32)


def whole_run_ratio(summary):
    return summary["uncompressed_bytes_per_step"] / summary["bytes_sent_per_step"]


def recipe_rows(runs, header, cells):
    """The table of one task: a row per recipe run, cells(summary, reference) giving the
    columns after recipe, optimizer and compression."""
    ref = runs[REFERENCE["name"]]
    lines = [f"| recipe | optimizer | compression | {' | '.join(header)} |",
             "|---|---|---|" + "---:|" * len(header)]
    for r in RECIPES:
        s = runs.get(r["name"])
        if s is None:
            continue
        cell = r["compression"].replace("|", "\\|")
        row = ([f"failed: {s['error'].replace('|', '/')}"] + [""] * (len(header) - 1)
               if "error" in s else cells(s, ref))
        lines.append(f"| {r['name']} | {r['optimizer']} | `{cell}` | {' | '.join(row)} |")
    return lines


def lm_table(runs):
    def cells(s, ref):
        diff = 100 * (s["val_loss"] / ref["val_loss"] - 1)
        flag = " **(!)**" if diff > LM_TOLERANCE_PERCENT else ""
        return [f"{s['val_loss']:.4f}", f"{diff:+.2f}{flag}", f"{s['val_perplexity']:.1f}",
                fmt_bytes(s["bytes_sent_per_step"]), f"{whole_run_ratio(s):.1f}x"]
    return recipe_rows(runs, ["validation loss", "Δ %", "perplexity", "bytes/step",
                              "fewer bytes than fp32"], cells)


def fmnist_table(runs):
    def cells(s, ref):
        diff = 100 * (s["test_accuracy"] - ref["test_accuracy"])
        flag = " **(!)**" if diff < -FMNIST_TOLERANCE_PP else ""
        return [f"{100 * s['test_accuracy']:.2f} %", f"{diff:+.2f}{flag}",
                fmt_bytes(s["bytes_sent_per_step"]), f"{whole_run_ratio(s):.1f}x"]
    return recipe_rows(runs, ["test accuracy", "Δ pp", "bytes/step", "fewer bytes than fp32"],
                       cells)


def volume_lines(results):
    """1-bit Adam's and 1-bit LAMB's whole-run bytes against the formula."""
    lines = ["| run | exact steps | fewer bytes than fp32, measured | the formula | gap | "
             "compressed steps alone |", "|---|---:|---:|---:|---:|---:|"]
    for (task, world), runs in results.items():
        for name in ("1-bit Adam", "1-bit Adam, every tensor compressed",
                     "1-bit Adam, doubling variance schedule", "1-bit LAMB"):
            s = runs.get(name)
            if s is None or "error" in s:
                continue
            curve = s["bytes_sent_curve"]
            # exact steps send every byte, as the first step (always exact) does
            compressed = [b for b in curve if b < curve[0]]
            exact = len(curve) - len(compressed)
            w = exact / len(curve)
            stage = s["uncompressed_bytes_per_step"] / statistics.mean(compressed)
            measured, formula = whole_run_ratio(s), onebit_formula(w)
            lines.append(f"| {task} {world} ranks, {name} | {exact} of {len(curve)} | "
                         f"{measured:.2f}x | {formula:.2f}x | "
                         f"{100 * (measured / formula - 1):+.1f} % | {stage:.1f}x |")
    return lines


def plot(results, out_dir, stem):
    """The report's three plots, named after it (docs/img/<stem>-lm-loss.png, ...)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(curve, width=20):
        return [statistics.mean(curve[max(0, i - width + 1):i + 1]) for i in range(len(curve))]

    names = []
    lm = [(w, runs) for (task, w), runs in results.items() if task == "lm"]
    fig, axes = plt.subplots(1, len(lm), figsize=(7 * len(lm), 5), squeeze=False)
    for ax, (world, runs) in zip(axes[0], lm):
        for name, s in runs.items():
            if "error" in s:
                continue
            ax.plot(smooth(s["train_loss_curve"]), label=name,
                    linewidth=2.5 if name == REFERENCE["name"] else 1.2,
                    color="black" if name == REFERENCE["name"] else None)
        ax.set_title(f"Language model, {world} ranks")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (20-step moving average)")
        ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}-lm-loss.png")
    fig.savefig(path, dpi=110)
    names.append(path)

    world, runs = lm[0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in runs.items():
        if "error" not in s:
            ax.plot(s["bytes_sent_curve"], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("bytes sent by rank 0")
    ax.set_title(f"Language model, {world} ranks: bytes per step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}-bytes.png")
    fig.savefig(path, dpi=110)
    names.append(path)

    runs = results[("fmnist", 2)]
    ok = [(n, s) for n, s in runs.items() if "error" not in s]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.barh([n for n, _ in ok], [100 * s["test_accuracy"] for _, s in ok], color="tab:blue")
    for i, (_, s) in enumerate(ok):
        ax.text(100 * s["test_accuracy"] + 0.1, i, f"{100 * s['test_accuracy']:.2f} %",
                va="center", fontsize=8)
    low = min(100 * s["test_accuracy"] for _, s in ok)
    ax.set_xlim(left=max(0, low - 5), right=100)
    ax.set_xlabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST CNN, 2 ranks")
    ax.invert_yaxis()
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}-fmnist.png")
    fig.savefig(path, dpi=110)
    names.append(path)
    return names


def write_report(args, results):
    img = os.path.join(os.path.dirname(args.out), "img")
    os.makedirs(img, exist_ok=True)
    stem = os.path.splitext(os.path.basename(args.out))[0]
    plot(results, img, stem)
    lines = [
        "# Compression under Adam-family optimizers: CLAN, 1-bit Adam, 1-bit LAMB and the naive "
        "variant",
        "",
        "Generated by `scripts/optimizer_accuracy.py`; do not edit by hand. Command:",
        "",
        "```bash",
        f"/usr/bin/python3 scripts/optimizer_accuracy.py --lm-steps {args.lm_steps} "
        f"--lm-worlds {','.join(map(str, args.lm_worlds))} --fmnist-epochs "
        f"{args.fmnist_epochs:g} --seed {args.seed}"
        + (f" --recipes {','.join(args.chosen)}" if args.chosen else "")
        + ("" if args.out == DEFAULT_OUT else
           f" --out {os.path.relpath(args.out, ROOT)} --runs {os.path.relpath(args.runs, ROOT)}"),
        "```",
        "",
        "Every recipe trains from the same initial model on the same batches (seed "
        f"{args.seed}). AdamW: betas (0.9, 0.95) on the language model, (0.9, 0.999) on the CNN; "
        f"LANS with the same betas at lr {LM_LANS_LR:g} on both (uncompressed LANS on the "
        "language model, 2 ranks, tried first: 4.6509 at lr 5e-3, 4.4017 at 1e-2, 4.3298 at "
        "2e-2; 1e-2 was kept, not tuned further); LAMB and 1-bit LAMB at LANS's learning rate "
        "(1-bit LAMB with beta2 0.999 on the language model, as 1-bit Adam; its warm-up is "
        "gradcomp.torch.LAMB's steps, the same share of the steps as 1-bit Adam's); 1-bit Adam "
        "with AdamW's learning rate. CLAN is "
        "LANS inside DistributedOptimizer over the two-way route (error feedback on the worker "
        "and on the server); 1-bit Adam is gradcomp.torch.OneBitAdam with its default \"freeze\" "
        f"variance policy (a warm-up of {100 * ONEBIT_WARMUP:.0f}% of the steps unless said, "
        "beta2 0.999 on the language model, where 0.95 explodes the rare tokens' rows), or "
        "with the \"doubling\" policy (exact steps at 0/1 Adam's intervals, AdamW's betas); "
        "the naive variant is AdamW inside "
        f"DistributedOptimizer over the same `{ONEBIT}` exchange as CLAN 1-bit. Tensors of at "
        "least 16,384 elements are compressed (99.2% of the language model's parameters). "
        "\"fewer bytes than fp32\": "
        "the run's uncompressed bytes over the bytes it sent (means over steps and ranks).",
        "",
    ]
    for world in args.lm_worlds:
        ref = results[("lm", world)][REFERENCE["name"]]
        lines += [f"## Language model, {world} ranks", "",
                  f"{args.lm_steps} steps of 8 windows of 64 tokens per rank; Δ is relative to "
                  f"AdamW's validation loss ({ref.get('val_loss', float('nan')):.4f}); **(!)** "
                  f"marks more than {LM_TOLERANCE_PERCENT:g}% above it.", ""]
        lines += lm_table(results[("lm", world)]) + [""]
    lines += [f"![training loss](img/{stem}-lm-loss.png)", "",
              "## Fashion-MNIST CNN, 2 ranks", "",
              f"{args.fmnist_epochs:g} epoch(s), batch 32 per rank, cosine schedule; **(!)** "
              f"marks more than {FMNIST_TOLERANCE_PP:g} pp below AdamW.", ""]
    lines += fmnist_table(results[("fmnist", 2)]) + [""]
    lines += [f"![test accuracy](img/{stem}-fmnist.png)", "",
              "## 1-bit Adam's and 1-bit LAMB's volume against 1 / (w + (1 - w) / 32)", "",
              "w: the exact steps' share of the steps (counted from the bytes per step); the "
              "compressed steps' own ratio shows what the blocks' means, the uncompressed "
              "tensors and the frames' headers cost (the formula assumes every element at 1 "
              "bit).", ""]
    lines += volume_lines(results) + ["", f"![bytes per step](img/{stem}-bytes.png)", ""]
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


def main():
    args = parse_args()
    results = run_all(args)
    write_report(args, results)


if __name__ == "__main__":
    main()
