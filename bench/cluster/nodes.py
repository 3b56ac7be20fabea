"""The replay workload (worker.py) on emulated hosts of several ranks.

H hosts (network namespaces, netns.py) with L ranks each: the ranks of a host talk through its
loopback (a node's fast link), the hosts through tbf-limited links. Every rank is told its node
(LOCAL_RANK, LOCAL_WORLD_SIZE = L), so gradcomp's routes over nodes group the ranks as the hosts
do and compression="auto" fits the link inside a node and the one between nodes apart. The
contender "auto-flat" is auto told there is one rank per node (LOCAL_WORLD_SIZE = 1): one flat
link, no routes over nodes, as before it calibrated nodes. Prints each contender's median step
(the slowest rank's) and auto's decisions; --json keeps them.

    /usr/bin/python3 bench/cluster/nodes.py --hosts 2 --ranks-per-host 2 --rate 1gbit
"""
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import netns  # noqa: E402
from worker import AUTO  # noqa: E402

PYTHON = "/usr/bin/python3"
WORKER = HERE / "worker.py"
PORT = 29651
DEFAULT_CONTENDERS = [
    "compute", "gradcomp", "gradcomp:none|none|sharded:inner=allreduce",
    "gradcomp:powersgd:rank=4|ef", "gradcomp:fp16|none|sharded:inner=allreduce,intra=fp16",
    "auto-flat", "auto",
]


def rank_env(cluster, rank, ranks_per_host, port, flat):
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cluster.hosts * ranks_per_host),
                LOCAL_RANK="0" if flat else str(rank % ranks_per_host),
                LOCAL_WORLD_SIZE="1" if flat else str(ranks_per_host),
                MASTER_ADDR=cluster.address(0), MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT / "python"))


def run_contender(cluster, args, name, port, out):
    contender = "auto" if name == "auto-flat" else name
    argv = [PYTHON, str(WORKER), "--workload", "replay", "--profile", args.profile, "--warmup",
            str(args.warmup), "--steps", str(args.steps), "--contender", contender,
            "--iface", cluster.ifname, "--out", str(out), "--timeout", str(int(args.timeout))]
    if contender == "auto":
        argv += ["--auto", json.dumps(AUTO)]
    cluster.run(lambda r: argv,
                lambda r: rank_env(cluster, r, args.ranks_per_host, port, name == "auto-flat"),
                args.timeout * 4, out, ranks_per_host=args.ranks_per_host)
    ranks = [json.loads((out / f"rank{r}.json").read_text())
             for r in range(cluster.hosts * args.ranks_per_host)]
    slowest = [max(steps) for steps in zip(*(r["step_s"] for r in ranks))]
    row = {"contender": name, "median_ms": 1e3 * statistics.median(slowest),
           "step_ms": [1e3 * s for s in slowest]}
    if "auto" in ranks[0]:
        d = ranks[0]["auto"]["decision"]
        row["auto"] = {"kept": d["kept_name"], "why": d["why"],
                       "per_node": d.get("per_node", 1), "link": d.get("link"),
                       "intra_link": d.get("intra_link"),
                       "candidates": [{k: c[k] for k in ("name", "summary", "predicted_ms",
                                                         "measured_ms")}
                                      for c in d["candidates"]]}
    return row


def run(args):
    rows = []
    with tempfile.TemporaryDirectory(prefix="gcnodes-") as tmp, \
            netns.Cluster(args.hosts, netns.parse_rate(args.rate)) as cluster:
        print(f"{args.hosts} hosts x {args.ranks_per_host} ranks, links "
              f"{netns.format_rate(cluster.rate_bps)}; replay {Path(args.profile).name}",
              flush=True)
        for i, name in enumerate(args.contenders):
            row = run_contender(cluster, args, name, PORT + i, Path(tmp) / str(i))
            rows.append(row)
            say(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"hosts": args.hosts, "rate": args.rate,
                                               "ranks_per_host": args.ranks_per_host,
                                               "profile": args.profile, "rows": rows},
                                              indent=1) + "\n")


def say(row):
    print(f"{row['contender']:<58} {row['median_ms']:9.1f} ms", flush=True)
    if "auto" in row:
        a = row["auto"]
        print(f"    kept '{a['kept']}' (nodes of {a['per_node']}): {a['why']}")
        for c in a["candidates"]:
            print(f"      {c['name']:<54} predicted {c['predicted_ms']:8.1f}, "
                  f"measured {c['measured_ms']:8.1f} ms  [{c['summary']}]")


def main(argv=None):
    parser = netns.hosts_parser(__doc__.split("\n\n")[0], 300, "write the rows to this file")
    parser.add_argument("--profile", default=str(ROOT / "profiles" / "resnet50.json"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--contenders", type=lambda t: [c for c in t.split(",") if c],
                        default=DEFAULT_CONTENDERS, help="','-separated worker.py contenders")
    return netns.run_on_hosts(run, parser.parse_args(argv), 2)


if __name__ == "__main__":
    sys.exit(main())
