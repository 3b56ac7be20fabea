"""`gradcomp bench routes` on an emulated cluster of multi-rank nodes.

H hosts (network namespaces, netns.py) with L ranks each: the ranks of one host talk through
that host's own loopback (unlimited: a node's fast link), the hosts through rate-limited links
(tbf, both ways: the slow link between nodes). Every rank runs `gradcomp bench routes` over
the Gloo transport with the local size L, so the node routes (hierarchical, sharded) group the
ranks as the hosts do. Rank 0's table is printed; --json keeps it; each host's bytes sent on
its link over the whole run are printed after it.

    /usr/bin/python3 bench/cluster/routes.py --hosts 2 --ranks-per-host 2 --rate 1gbit --sizes 22

With --servers S, S more hosts each run a `gradcomp server` (dedicated parameter servers, for
cases of route 'servers'), on links of the same rate:

    /usr/bin/python3 bench/cluster/routes.py --hosts 4 --ranks-per-host 1 --servers 4 \
        --cases 'topk:ratio=0.01|ef|twoway;topk:ratio=0.01|ef|servers'
"""
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import netns  # noqa: E402

GRADCOMP = ROOT / "build" / "bin" / "gradcomp"
PORT = 29611
SERVER_PORT = 29612  # the servers' rendezvous store, which rank 0 serves

# The leader route and the sharded route side by side, uncompressed, cast to fp16 and
# compressed between nodes, next to the flat ring of every rank.
DEFAULT_CASES = [
    "none|none|allreduce",
    "none|none|hierarchical",
    "none|none|sharded:inner=allreduce",
    "fp16|none|hierarchical:inner=allreduce,intra=fp16",
    "fp16|none|sharded:inner=allreduce,intra=fp16",
    "topk:ratio=0.01|ef|hierarchical:inner=allgather",
    "topk:ratio=0.01|ef|sharded:inner=allgather",
]


def rank_env(cluster, rank, args, store):
    host = rank // args.ranks_per_host
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.hosts * args.ranks_per_host),
               LOCAL_RANK=str(rank % args.ranks_per_host),
               LOCAL_WORLD_SIZE=str(args.ranks_per_host), GRADCOMP_STORE=f"file:{store}",
               GRADCOMP_GLOO_ADDR=cluster.address(host), GRADCOMP_TIMEOUT=str(int(args.timeout)),
               GRADCOMP_STREAMS=str(args.streams))
    if args.servers:
        env.update(GRADCOMP_SERVERS=str(args.servers),
                   GRADCOMP_SERVER_STORE=f"tcp://{cluster.address(0)}:{SERVER_PORT}")
    return env


def servers(cluster, args):
    """The servers' processes, one per host after the workers' (Cluster.run's `extra`)."""
    out = []
    for s in range(args.servers):
        host = args.hosts + s
        argv = [str(GRADCOMP), "server", "--index", str(s), "--servers", str(args.servers),
                "--workers", str(args.hosts * args.ranks_per_host), "--store",
                f"tcp://{cluster.address(0)}:{SERVER_PORT}", "--timeout", str(int(args.timeout))]
        out.append((host, argv, dict(os.environ, GRADCOMP_GLOO_ADDR=cluster.address(host))))
    return out


def run(args):
    if not GRADCOMP.exists():
        raise netns.ClusterError(f"{GRADCOMP} is missing; build it first (cmake --build build)")
    rate = netns.parse_rate(args.rate)
    json_path = Path(args.json).resolve() if args.json else None
    argv = [str(GRADCOMP), "bench", "routes", "--transport", "gloo", "--local-size",
            str(args.ranks_per_host), "--sizes", args.sizes, "--repeats", str(args.repeats),
            "--buckets", str(args.buckets), "--cases", ";".join(args.cases)] \
        + (["--no-allreduce"] if args.no_allreduce else [])
    hosts = args.hosts + args.servers
    with tempfile.TemporaryDirectory(prefix="gcroutes-") as tmp, \
            netns.Cluster(hosts, rate) as cluster:
        measured = cluster.measure_rate()
        print(f"{args.hosts} hosts x {args.ranks_per_host} ranks"
              + (f" + {args.servers} server hosts" if args.servers else "")
              + f"; links {netns.format_rate(rate)} each way (measured "
              f"{netns.format_rate(round(measured, -5))}); inside a host: loopback", flush=True)
        store = Path(tmp) / "store"
        store.mkdir()
        sent_before = [cluster.tx_bytes(i) for i in range(hosts)]
        received_before = [cluster.rx_bytes(i) for i in range(hosts)]
        argv_for = lambda r: argv + (["--json", str(json_path)] if r == 0 and json_path else [])
        seconds = cluster.run(argv_for, lambda r: rank_env(cluster, r, args, store),
                              args.timeout, tmp, ranks_per_host=args.ranks_per_host,
                              extra=servers(cluster, args))
        sent = [cluster.tx_bytes(i) - sent_before[i] for i in range(hosts)]
        received = [cluster.rx_bytes(i) - received_before[i] for i in range(hosts)]
        print((Path(tmp) / "rank0.log").read_text(), end="")
    print(f"{seconds:.1f} s; bytes sent on each host's link over the whole run: "
          + ", ".join(f"host {i} {b / 1e6:.1f} MB" for i, b in enumerate(sent)))
    print("bytes received: "
          + ", ".join(f"host {i} {b / 1e6:.1f} MB" for i, b in enumerate(received)))
    if json_path:
        result = json.loads(json_path.read_text())
        result["cluster"] = {"hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
                             "server_hosts": args.servers,
                             "rate_bps": rate, "measured_bps": measured, "link_bytes_sent": sent,
                             "link_bytes_received": received}
        json_path.write_text(json.dumps(result, indent=1) + "\n")


def main(argv=None):
    parser = netns.hosts_parser(__doc__.split("\n\n")[0], 600,
                                "write rank 0's results (and the cluster) to this file")
    parser.add_argument("--sizes", default="22", help="log2 of the bucket sizes, e.g. 20,22")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--buckets", type=int, default=1,
                        help="cut each size into this many buckets, exchanged in one step")
    parser.add_argument("--no-allreduce", action="store_true",
                        help="skip the transport's allreduce, so each host's link bytes are the "
                             "cases' alone")
    parser.add_argument("--streams", type=int, default=2,
                        help="the engine's streams (GRADCOMP_STREAMS): buckets exchanged at once")
    parser.add_argument("--servers", type=int, default=0,
                        help="hosts of dedicated parameter servers, after the workers'")
    parser.add_argument("--cases", type=lambda t: [c for c in t.split(";") if c],
                        default=DEFAULT_CASES, help="'codec|feedback|route' cases, ';'-separated")
    return netns.run_on_hosts(run, parser.parse_args(argv), 1)


if __name__ == "__main__":
    sys.exit(main())
