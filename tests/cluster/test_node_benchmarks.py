"""The benchmarks on emulated hosts of several ranks (bench/cluster/routes.py, nodes.py) run end
to end on real namespaces, group the ranks by host and write what they print (needs root)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cluster"
PYTHON = "/usr/bin/python3"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def run(script, *args):
    return subprocess.run([PYTHON, str(BENCH / script), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@needs_root
def test_routes_on_hosts_of_two_ranks(tmp_path):
    out = tmp_path / "routes.json"
    done = run("routes.py", "--rate", "1gbit", "--sizes", "16", "--repeats", "2", "--cases",
               "none|none|sharded:inner=allreduce", "--json", out)
    assert done.returncode == 0, done.stderr
    assert "2 hosts x 2 ranks" in done.stdout
    result = json.loads(out.read_text())
    assert result["cluster"]["ranks_per_host"] == 2
    # The sharded route's bytes between hosts went over the rate-limited links.
    assert all(sent > 0 for sent in result["cluster"]["link_bytes_sent"])
    assert "none | none | sharded:inner=allreduce" in done.stdout


@needs_root
def test_routes_with_parameter_servers_on_hosts_of_their_own(tmp_path):
    out = tmp_path / "servers.json"
    done = run("routes.py", "--hosts", 2, "--ranks-per-host", 1, "--servers", 2, "--rate", "1gbit",
               "--sizes", "18", "--repeats", "2", "--no-allreduce", "--cases",
               "qsgd|none|servers", "--json", out)
    assert done.returncode == 0, done.stderr
    assert "2 hosts x 1 ranks + 2 server hosts" in done.stdout
    cluster = json.loads(out.read_text())["cluster"]
    assert cluster["server_hosts"] == 2
    sent, received = cluster["link_bytes_sent"], cluster["link_bytes_received"]
    assert len(sent) == len(received) == 4
    # The frames went to the servers' hosts and back: each server host received about what
    # each worker host sent (a worker's shard frames), and sent about what it received.
    for server in (2, 3):
        assert 0.5 * sent[0] < received[server] < 2 * sent[0], cluster
        assert 0.5 * received[server] < sent[server] < 2 * received[server], cluster


@needs_root
def test_replay_on_hosts_of_two_ranks(tmp_path):
    out = tmp_path / "nodes.json"
    done = run("nodes.py", "--contenders", "compute,gradcomp:none|none|sharded:inner=allreduce",
               "--warmup", 1, "--steps", 2, "--json", out)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["contender"] for r in rows] == ["compute",
                                             "gradcomp:none|none|sharded:inner=allreduce"]
    assert all(len(r["step_ms"]) == 2 and r["median_ms"] > 0 for r in rows)
    assert rows[1]["median_ms"] > rows[0]["median_ms"]  # the exchange costs more than nothing


def test_both_refuse_a_single_rank_per_host():
    for script in ("routes.py", "nodes.py"):
        done = run(script, "--ranks-per-host", "1" if script == "nodes.py" else "0")
        assert done.returncode == 1
        assert "need at least 2 hosts" in done.stderr
