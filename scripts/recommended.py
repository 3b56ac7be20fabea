#!/usr/bin/python3
"""The "recommended" column from the accuracy tables: docs/recommended.md.

A codec held under SGD when its row in docs/accuracy.md (the Fashion-MNIST CNN, 5 epochs,
SGD) is within 0.5 pp of the uncompressed test accuracy, and under Adam-family optimizers when
its rows in docs/accuracy-lm.md (the small language model under AdamW, 2 ranks, on three
seeds) and docs/accuracy-lm-4ranks.md (the same at 4 ranks, on five seeds) are within 2% of the
uncompressed validation loss (seed 0, and the mean over the seeds); it is recommended when
it held under both. The library's own
table (gradcomp/recommended.h, which the planner's default candidates and
DistributedOptimizer's warning follow) must say the same:
this script writes docs/recommended.md from the two documents and exits non-zero, naming the
rows, when the library disagrees (tests/python/test_recommended.py runs the same check).

    /usr/bin/python3 scripts/recommended.py            # check, and write docs/recommended.md
    /usr/bin/python3 scripts/recommended.py --check    # check only
"""
import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGD_DOC = os.path.join(ROOT, "docs", "accuracy.md")
ADAM_DOC = os.path.join(ROOT, "docs", "accuracy-lm.md")  # 2 ranks, every codec
# 4 ranks, the codecs that held at 2, on five seeds: a gap that grows with the ranks shows here.
ADAM_4RANKS_DOC = os.path.join(ROOT, "docs", "accuracy-lm-4ranks.md")
OUT = os.path.join(ROOT, "docs", "recommended.md")
SGD_TOLERANCE_PP = 0.5
SEEDS_HEADING = "## Across seeds"  # the sweeps' --paired-codecs
ADAM_TOLERANCE_PERCENT = 2.0


def table_rows(path, delta_column, heading=None):
    """{codec: (option, delta)} from the first Markdown table of `path`, or the first after the
    line `heading` ({} when there is no such heading) (header row first; the option in
    backquotes with escaped bars; a failed run, or an incomplete mean, has no number)."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    first = 0
    if heading is not None:
        if heading not in lines:
            return {}
        first = lines.index(heading)
    start = next(i for i, line in enumerate(lines)
                 if i >= first and line.startswith("| codec |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    column = header.index(delta_column)
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip("|"))]
        option = cells[1].strip("`").replace("\\|", "|")
        match = re.match(r"[-+]?\d+(\.\d+)?", cells[column]) if len(cells) > column else None
        rows[cells[0]] = (option, float(match.group(0)) if match else None)
    return rows


def evidence():
    """{codec: dict(option, sgd_delta_pp, adam_delta_percent, adam4_delta_percent, sgd, adam,
    ...)} for every codec in the tables (a codec missing from a table, or whose run failed, did
    not hold there: the 4-rank table holds only what held at 2 ranks)."""
    sgd = table_rows(SGD_DOC, "Δ pp")
    # Codecs that also ran on the baseline's other seeds: the mean of their paired differences
    # must hold too (it is the steadier figure).
    sgd_mean = table_rows(SGD_DOC, "mean Δ", heading=SEEDS_HEADING)
    adam = table_rows(ADAM_DOC, "Δ %")
    adam_mean = table_rows(ADAM_DOC, "mean Δ", heading=SEEDS_HEADING)
    adam4 = table_rows(ADAM_4RANKS_DOC, "Δ %")
    adam4_mean = table_rows(ADAM_4RANKS_DOC, "mean Δ", heading=SEEDS_HEADING)
    out = {}
    for codec in sorted((set(sgd) | set(adam)) - {"none"}):
        option, sgd_delta = sgd.get(codec, (None, None))
        _, mean = sgd_mean.get(codec, (None, None))
        adam_option, adam_delta = adam.get(codec, (None, None))
        _, adam_mean_delta = adam_mean.get(codec, (None, None))
        _, adam4_delta = adam4.get(codec, (None, None))
        _, adam4_mean_delta = adam4_mean.get(codec, (None, None))
        out[codec] = dict(
            option=option or adam_option, adam_option=adam_option,
            sgd_delta_pp=sgd_delta, sgd_mean_delta_pp=mean, adam_delta_percent=adam_delta,
            adam_mean_delta_percent=adam_mean_delta, adam4_delta_percent=adam4_delta,
            adam4_mean_delta_percent=adam4_mean_delta,
            sgd=(sgd_delta is not None and sgd_delta >= -SGD_TOLERANCE_PP
                 and (mean is None or mean >= -SGD_TOLERANCE_PP)),
            adam=within_adam_tolerance(adam_delta, adam_mean_delta)
            and within_adam_tolerance(adam4_delta, adam4_mean_delta))
    return out


def disagreements(found, library):
    """Lines naming each codec where the library's table and the documents differ."""
    lines = []
    known = {r["codec"]: r for r in library}
    for codec in sorted(set(found) | set(known)):
        if codec not in known:
            lines.append(f"{codec}: in the accuracy tables but not in gradcomp/recommended.h")
            continue
        if codec not in found:
            lines.append(f"{codec}: in gradcomp/recommended.h but in neither accuracy table")
            continue
        lib, doc = known[codec], found[codec]
        if lib["option"] != doc["option"]:
            lines.append(f"{codec}: the library names '{lib['option']}', "
                         f"docs/accuracy.md measured '{doc['option']}'")
        for family in ("sgd", "adam"):
            if lib[family] != doc[family]:
                lines.append(f"{codec}: the library says {family}={lib[family]}, the tables "
                             f"say {family}={doc[family]}")
    return lines


def fmt(value, unit):
    return "failed / not run" if value is None else f"{value:+.2f}{unit}"


def main_job_codec():
    """The main job's default compression (scripts/run_main.sh's compression='...')."""
    with open(os.path.join(ROOT, "scripts", "run_main.sh"), encoding="utf-8") as f:
        return re.search(r"^compression='([^']+)'$", f.read(), re.M).group(1)


def within_adam_tolerance(seed0, mean):
    """A seed-0 difference that holds (a missing run does not), and a mean over seeds that
    holds where the codec ran on them."""
    return seed0 is not None and seed0 <= ADAM_TOLERANCE_PERCENT and \
        (mean is None or mean <= ADAM_TOLERANCE_PERCENT)


def lost_at_more_ranks(found):
    """A paragraph naming the codecs that held at 2 ranks under AdamW but not at 4."""
    lost = [(codec, e) for codec, e in found.items() if not e["adam"] and
            within_adam_tolerance(e["adam_delta_percent"], e["adam_mean_delta_percent"])]
    if not lost:
        return []
    named = "; ".join(
        f"{codec} (`{e['option'].replace('|', chr(92) + '|')}`) {fmt(e['adam_delta_percent'], '%')}"
        f" at 2 ranks, {fmt(e['adam4_delta_percent'], '%')} at 4 on seed 0"
        + ("" if e["adam4_mean_delta_percent"] is None
           else f" and {fmt(e['adam4_mean_delta_percent'], '%')} on the mean over seeds")
        for codec, e in lost)
    return [
        f"Held at 2 ranks under AdamW but not at 4: {named}. The likely reason: at 4 ranks "
        "each step averages twice the data, which uncompressed training turns into a lower "
        "loss, while what a biased codec leaves out of each step (a low-rank view keeps the "
        "same rank) does not shrink with the ranks, so its gap grows with them. Such a codec "
        "is used under SGD without a warning (and by auto under SGD), and warned of under "
        "Adam-family optimizers.",
        "",
    ]


def write(found, library, path):
    """docs/recommended.md; the "recommended" column is the library's (gradcomp.recommended():
    held under both, the optimizer unchanged), which main() has checked against `found`."""
    recommended_codecs = {r["codec"] for r in library if r["recommended"]}
    lines = [
        "# Recommended compression",
        "",
        "Generated by `scripts/recommended.py` from the accuracy tables; do not edit by hand.",
        "",
        f"A codec **held under SGD** when it ends within {SGD_TOLERANCE_PP} pp of "
        "uncompressed training on the Fashion-MNIST CNN under SGD at 5 epochs "
        "([accuracy.md](accuracy.md); seed 0, and the mean over seeds 0-2, each run against "
        "the baseline of its seed, where the codec ran on all three), and **under Adam-family "
        f"optimizers** when it ends within {ADAM_TOLERANCE_PERCENT:g}% of the uncompressed "
        "validation loss of a small GPT-style language model under AdamW at 2 ranks "
        "([accuracy-lm.md](accuracy-lm.md); seed 0, and the mean over seeds 0-2 where the "
        "codec ran on all three) and at 4 ranks, on seed 0 and on the mean over "
        "seeds 0-4 ([accuracy-lm-4ranks.md](accuracy-lm-4ranks.md): the codecs that held at "
        "2 ranks), each run against the baseline of its seed and at the settings of its row. "
        "It is "
        "**recommended** only when it held under both, with the optimizer unchanged. The "
        "library holds the same table (`gradcomp recommended`, `gradcomp.recommended()`, "
        "`include/gradcomp/recommended.h`); `tests/python/test_recommended.py` fails when the "
        "library and these documents disagree. What follows it:",
        "",
        f"- the defaults are recommended options: the main job's (`{main_job_codec()}`), the "
        "examples' and the README's, and `gradcomp plan` without `--codecs` considers only "
        "recommended options (`--optimizer sgd` or `adam` widens them to what held under that "
        "family);",
        "- `gradcomp.torch.DistributedOptimizer` warns when the compression's codec lost under "
        "the kind of optimizer it wraps (Adam-family: Adam, AdamW, NAdam, RAdam, Adamax, "
        "RMSprop, Adagrad; SGD), when it held with another kind of feedback than the "
        "option's (`dgc|dgc`: dgc held with `ef`), or when it held only after an uncompressed "
        "warm-up (a `start=N` field) the option lacks, naming what held; rank 0 warns for the "
        "job (the libtorch `DistributedOptimizer` alike). A codec that held under SGD only "
        "(`topk:ratio=0.01|ef`, say) trains a CNN under SGD without a warning.",
        "- gradcomp's LANS counts as Adam-family, and also takes the CLAN recipes that held "
        "with it where the codec lost under AdamW ([optimizers-accuracy.md]"
        "(optimizers-accuracy.md): within 1% of AdamW's validation loss on the language model "
        "at 2 and 4 ranks and 0.5 pp of its Fashion-MNIST accuracy), written exactly so: "
        + ", ".join(f"{r['codec']} as `{r['lans'].replace('|', chr(92) + '|')}`"
                    for r in library if r["lans"])
        + " (`gradcomp.recommended(\"lans\")`). LAMB has no such evidence and counts as "
        "Adam-family only.",
        "",
        "| codec | option | Fashion-MNIST, SGD: Δ pp | mean Δ pp over seeds | "
        "language model, AdamW, 2 ranks: Δ % | 2 ranks: mean Δ % over seeds | 4 ranks: Δ % | "
        "4 ranks: mean Δ % over seeds | held under | recommended |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for codec, e in found.items():
        under = [name for name, ok in (("SGD", e["sgd"]), ("Adam-family", e["adam"])) if ok]
        optional = ["" if e[key] is None else fmt(e[key], "") for key in
                    ("sgd_mean_delta_pp", "adam_mean_delta_percent", "adam4_delta_percent",
                     "adam4_mean_delta_percent")]
        lines.append(
            f"| {codec} | `{e['option'].replace('|', chr(92) + '|')}` | "
            f"{fmt(e['sgd_delta_pp'], '')} | {optional[0]} | "
            f"{fmt(e['adam_delta_percent'], '')} | {optional[1]} | {optional[2]} | "
            f"{optional[3]} | "
            f"{', '.join(under) if under else 'neither'} | "
            f"{'**yes**' if codec in recommended_codecs else 'no'} |")
    lines += [""] + lost_at_more_ranks(found) + [
        "Rows whose Fashion-MNIST settings change the optimizer (signsgd and signum: learning "
        "rate 0.001 and no optimizer momentum) could be recommended only with those changes, "
        "and the planner, which cannot change the optimizer, never picks them by default. "
        "Under AdamW every codec ran with "
        "the same "
        "optimizer settings (the warm-ups scaled to the run: DGC's stages, and `start=N` a "
        "fifth of the steps as on Fashion-MNIST).",
        "",
        "efsignsgd and onebit held under SGD with an uncompressed warm-up of the first fifth of "
        "the steps (`start=469` of 2,345: the first epoch), as 1-bit Adam warms up for 15-25% "
        "of its steps: over the whole run they send about 4.4x fewer bytes than uncompressed "
        "training, 28x after the warm-up. Without the warm-up both ended 0.97 pp behind; with "
        "half of it (235 steps) 0.42 and 0.47 pp behind.",
        "",
        "dgc held under SGD as DGC's compression (sampled threshold, exact top 0.1%, the "
        "paper's staged warm-up) with plain error feedback and the optimizer's momentum; DGC's "
        "own momentum correction and masking (`|dgc`, optimizer momentum off) ended 1.38 pp "
        "behind, and `dgc:masking=false` 0.99 pp (docs/feedback.md).",
        "",
        "The variants quoted in the two paragraphs above (not the table's rows) are single runs "
        "at seed 0 with the table's settings, each `build/bin/gradcomp launch -n 4 -- "
        "/usr/bin/python3 examples/fashion_mnist/train.py --epochs 5 --compression '<option>'` "
        "(train.py's defaults are the table's: seed 0, 32 images per rank, learning rate 0.05 "
        "with a cosine schedule, momentum 0.9), with `--momentum 0` for the `|dgc` feedback: "
        "`efsignsgd|ef||start=235` 91.78 %, `onebit|ef||start=235` 91.73 %, "
        "`dgc:ratio=0.001,stage_steps=117|dgc:masking=false` 91.21 %, against 92.20 % "
        "uncompressed.",
        "",
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare, write nothing")
    p.add_argument("--out", default=OUT, help="(docs/recommended.md)")
    args = p.parse_args()
    import gradcomp
    found = evidence()
    library = gradcomp.recommended()
    problems = disagreements(found, library)
    if not args.check:
        write(found, library, args.out)
        print(f"recommended: wrote {args.out}")
    if problems:
        sys.exit("recommended: gradcomp/recommended.h and the accuracy tables disagree:\n  "
                 + "\n  ".join(problems))
    print(f"recommended: the library agrees with the tables ({len(found)} codecs)")


if __name__ == "__main__":
    main()
