"""What cutting large tensors into slices does on the replay, with nothing else changed: one
codec's default plan (25 MB buckets, as the front ends make it) against the same plan with
every tensor of at least --slice-from elements cut into --slices slices, each slice a bucket of
its own with the tensor's option (plan format 3, docs/plan-format.md). Both run as contenders of
bench/cluster/bench.py (plan:PATH) on the same emulated cluster, side by side.

    /usr/bin/python3 bench/cluster/slices.py --profile vgg16 --codec 'randomk:ratio=0.01|ef' \\
        --rate 1gbit --workers 4 --slices 4 --out /tmp/slices

Arguments after `--` go to bench.py (e.g. -- --warmup 3 --steps 5).
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "python"))


def default_plan(profile, codec):
    """The default plan of `codec` for the profile's tensors (the front ends' rules)."""
    from gradcomp import _C  # noqa: E402 (loads torch: only here)
    tensors = [(t["name"], t["elements"]) for t in profile["tensors"]]
    return json.loads(_C.default_plan(tensors, codec, 25 << 20, 16384))


def sliced(plan, slice_from, slices):
    """`plan` with every tensor of at least `slice_from` elements that has a bucket of its own
    cut into `slices` slices, one bucket each, in the tensor's place and with its option."""
    cut = {b["tensors"][0] for b in plan["buckets"]
           if len(b["tensors"]) == 1 and plan["tensors"][b["tensors"][0]]["elements"] >= slice_from}
    first, pieces = [], 0  # tensor -> its first piece
    for t, tensor in enumerate(plan["tensors"]):
        first.append(pieces)
        pieces += slices if t in cut else 1
    tensors = [dict(t, slices=slices) if i in cut else dict(t)
               for i, t in enumerate(plan["tensors"])]
    buckets = []
    for b in plan["buckets"]:
        if len(b["tensors"]) == 1 and b["tensors"][0] in cut:
            start = first[b["tensors"][0]]
            buckets += [dict(b, tensors=[start + s]) for s in range(slices)]
        else:
            buckets.append(dict(b, tensors=[first[t] for t in b["tensors"]]))
    return {**plan, "version": 3, "tensors": tensors, "buckets": buckets}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="vgg16", help="a shipped profile name or a path")
    p.add_argument("--codec", default="randomk:ratio=0.01|ef",
                   help="the compression of the default plan's large buckets")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--slices", type=int, default=4)
    p.add_argument("--slice-from", type=int, default=1 << 22,
                   help="cut tensors of at least this many elements")
    p.add_argument("--costs", default=None, help="codec costs for bench.py (default: "
                   "bench/cluster/results/codec-costs-w<workers>.json)")
    p.add_argument("--out", required=True, type=Path)
    args, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    profile_path = Path(args.profile)
    if not profile_path.suffix:
        profile_path = ROOT / "profiles" / f"{args.profile}.json"
    profile = json.loads(profile_path.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    whole = default_plan(profile, args.codec)
    cut = sliced(whole, args.slice_from, args.slices)
    paths = {"whole": args.out / "whole.json", "sliced": args.out / "sliced.json"}
    paths["whole"].write_text(json.dumps(whole, indent=2))
    paths["sliced"].write_text(json.dumps(cut, indent=2))
    costs = args.costs or ROOT / "bench" / "cluster" / "results" / f"codec-costs-w{args.workers}.json"
    command = ["/usr/bin/python3", str(HERE / "bench.py"), "--profiles", str(profile_path),
               "--rates", args.rate, "--workers", str(args.workers), "--no-train",
               "--costs", str(costs), "--contenders",
               f"compute,plan:{paths['whole']},plan:{paths['sliced']}",
               "--out", str(args.out), "--md", str(args.out / "cluster-benchmark.md"),
               "--img", str(args.out / "img"), *rest]
    print(" ".join(command), flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
