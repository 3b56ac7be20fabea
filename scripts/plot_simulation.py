#!/usr/bin/python3
"""Plots the JSON of `gradcomp simulate --json` (sweeps) or `gradcomp utility --json` as PNG.

    /usr/bin/python3 scripts/plot_simulation.py sweep.json [--out PREFIX]

writes PREFIX-time-vs-bandwidth.png (iteration time against bandwidth, one panel per worker
count, one line per codec or plan) and PREFIX-speedup-vs-workers.png (speedup over the
uncompressed run against the worker count, one panel per bandwidth). PREFIX defaults to the
input path without .json.
"""
import argparse
import collections
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        doc = json.load(f)
    if "rows" not in doc or not doc["rows"]:
        sys.exit(f"{path}: no rows; expected the --json output of `gradcomp simulate` (with "
                 f"--sweep-bandwidth or --sweep-workers) or of `gradcomp utility`")
    return doc


def series(doc):
    """Rows as {label: [(workers, gbit, seconds, baseline seconds)]}, and the baseline's name."""
    out = collections.defaultdict(list)
    if doc.get("command") == "gradcomp utility":
        for r in doc["rows"]:
            out[f'{r["method"]} ({r["schedule"]})'].append(
                (r["workers"], r["bandwidth_gbit"], r["iteration_s"], r["sync_s"]))
            out["syncSGD"].append((r["workers"], r["bandwidth_gbit"], r["sync_s"], r["sync_s"]))
        return out, "syncSGD"
    base = {(r["workers"], r["bandwidth_gbit"]): r["iteration_s"]
            for r in doc["rows"] if r["plan"] == "none"}
    for r in doc["rows"]:
        key = (r["workers"], r["bandwidth_gbit"])
        out[r["plan"]].append((*key, r["iteration_s"], base.get(key, math.nan)))
    return out, "none"


def panels(count):
    cols = min(count, 3)
    rows = (count + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def style(label):
    return "--" if "(serial)" in label else "-"


def color(label, labels):
    """One colour per method, whatever its schedule (serial dashed, overlapped solid)."""
    methods = sorted({l.split(" (")[0] for l in labels})
    return f"C{methods.index(label.split(' (')[0]) % 10}"


def plot_time(doc, data, path):
    workers = sorted({w for pts in data.values() for w, *_ in pts})
    fig, axes = panels(len(workers))
    for ax, w in zip(axes, workers):
        for label, pts in sorted(data.items()):
            pts = sorted((bw, t) for pw, bw, t, _ in set(pts) if pw == w)
            if pts:
                ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], style(label),
                        color=color(label, data), marker="o", ms=3, label=label)
        bound = doc["rows"][0].get("compute_bound_s")
        if bound:
            ax.axhline(1e3 * bound, color="gray", lw=0.8, ls=":", label="compute bound")
        ax.set_xscale("log")
        ax.set_xlabel("bandwidth per node (Gbit/s)")
        ax.set_ylabel("iteration time (ms)")
        ax.set_title(f'{doc["profile"]}, {w} workers')
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup(doc, data, baseline, path):
    bandwidths = sorted({bw for pts in data.values() for _, bw, *_ in pts})
    fig, axes = panels(len(bandwidths))
    for ax, bw in zip(axes, bandwidths):
        for label, pts in sorted(data.items()):
            if label == baseline:
                continue
            pts = sorted((w, base / t) for w, pb, t, base in set(pts) if pb == bw and t > 0)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style(label),
                        color=color(label, data), marker="o", ms=3, label=label)
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel(f"speedup over {baseline}")
        ax.set_title(f'{doc["profile"]}, {bw:g} Gbit/s')
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="output of gradcomp simulate --json or gradcomp utility --json")
    parser.add_argument("--out", help="prefix of the PNG files (default: the input without .json)")
    args = parser.parse_args()
    doc = load(args.json)
    prefix = args.out or os.path.splitext(args.json)[0]
    data, baseline = series(doc)
    if baseline not in data:
        print(f"note: no '{baseline}' rows, so no speedups; add it to the sweep's --codecs")
    written = [f"{prefix}-time-vs-bandwidth.png", f"{prefix}-speedup-vs-workers.png"]
    plot_time(doc, data, written[0])
    plot_speedup(doc, data, baseline, written[1])
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
