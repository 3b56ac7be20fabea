"""Tests for bench/cluster/netns.py against real network namespaces (needs root).

Every test uses its own run id, and the run_id fixture deletes whatever
namespaces of that id are left, so a failing assertion cannot leak namespaces.
"""
import itertools
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "bench" / "cluster"
sys.path.insert(0, str(CLUSTER_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402
from cluster_testing import NOT_ROOT, alive  # noqa: E402

PYTHON = "/usr/bin/python3"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
_ids = itertools.count()


@pytest.fixture
def run_id():
    rid = f"t{os.getpid()}{next(_ids)}"
    yield rid
    netns.remove_namespaces(ours(rid))


def ours(rid):
    return [n for n in netns.stale_namespaces() if n.startswith(f"{netns.PREFIX}-{rid}-")]


def netns_pids(name):
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr  # the namespace must still exist to be checked
    return done.stdout.split()


def python_in(cluster, i, code, *args, log=None):
    return cluster.spawn(i, [PYTHON, "-c", code, *map(str, args)], log_path=log)


# ---------------------------------------------------------------- rates

@pytest.mark.parametrize("text, bps", [
    ("100mbit", 1e8), ("1gbit", 1e9), ("10gbit", 1e10), ("2.5gbit", 2.5e9),
    ("500kbit", 5e5), ("1e9", 1e9), ("1GBit", 1e9), ("64bit", 64.0), ("1tbit", 1e12)])
def test_parse_and_format_rate(text, bps):
    assert netns.parse_rate(text) == bps
    assert netns.parse_rate(netns.format_rate(bps)) == bps


def test_format_rate_is_short_tc_text():
    assert netns.format_rate(1e9) == "1gbit"
    assert netns.format_rate(1e8) == "100mbit"
    assert netns.format_rate(2.5e9) == "2.5gbit"
    assert netns.format_rate(5e5) == "500kbit"


@pytest.mark.parametrize("text", ["fast", "100mbps", "1 gbyte", "", "-5mbit", "1.2.3gbit"])
def test_parse_rate_rejects_bad_text(text):
    with pytest.raises(netns.ClusterError) as e:
        netns.parse_rate(text)
    assert f"rate '{text}' is not understood" in str(e.value)
    assert "100mbit, 1gbit, 10gbit" in str(e.value)


def test_parse_rate_rejects_zero():
    with pytest.raises(netns.ClusterError, match="positive"):
        netns.parse_rate("0mbit")


def test_delay_unsupported_explains_netem():
    e = netns.delay_unsupported("5ms")
    assert isinstance(e, netns.ClusterError)
    assert "5ms" in str(e) and "netem" in str(e)


def test_cluster_arguments_are_checked():
    with pytest.raises(netns.ClusterError, match="hosts"):
        netns.Cluster(0, 1e9)
    with pytest.raises(netns.ClusterError, match="rate"):
        netns.Cluster(2, 0)
    with pytest.raises(netns.ClusterError, match="subnet"):
        netns.Cluster(2, 1e9, subnet="10.77")
    with pytest.raises(netns.ClusterError, match="2 link rates given for 3 hosts"):
        netns.Cluster(3, [1e9, 1e8])
    with pytest.raises(netns.ClusterError, match="rate must be positive"):
        netns.Cluster(2, [1e9, -1])
    assert netns.parse_rates("1gbit") == 1e9
    assert netns.parse_rates("1gbit,100mbit") == [1e9, 1e8]


# ---------------------------------------------------------------- environment

@needs_root
def test_check_environment_passes_here_and_cleans_its_probe():
    netns.check_environment()
    assert not [n for n in netns.stale_namespaces() if "-probe-" in n]


def check_environment_in_child(prefix_argv, env=None):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import netns\n"
            "try:\n    netns.check_environment()\n"
            "except netns.ClusterError as e:\n    print(e); sys.exit(1)\n")
    return subprocess.run(prefix_argv + [PYTHON, "-B", "-c", code, str(CLUSTER_DIR)],
                          capture_output=True, text=True, timeout=30, env=env)


@needs_root
def test_check_environment_as_non_root_asks_for_root():
    done = check_environment_in_child(NOT_ROOT)
    assert done.returncode == 1, done.stderr
    assert "needs root" in done.stdout and "sudo bench/cluster/run.sh" in done.stdout


@needs_root
def test_check_environment_without_iproute2_says_what_to_install():
    done = check_environment_in_child([], env={"PATH": "/nonexistent"})
    assert done.returncode == 1, done.stderr
    assert "apt-get install iproute2" in done.stdout



@needs_root
def test_check_environment_without_capabilities_reports_why():
    """Root without CAP_SYS_ADMIN, as in an unprivileged container."""
    done = check_environment_in_child(["setpriv", "--inh-caps=-all", "--bounding-set=-all"])
    assert done.returncode == 1, done.stderr
    assert "cannot create a network namespace" in done.stdout
    assert "Operation not permitted" in done.stdout and "CAP_SYS_ADMIN" in done.stdout

# ---------------------------------------------------------------- a running cluster

@needs_root
def test_cluster_links_and_teardown(run_id):
    rate = 1e8
    with netns.Cluster(3, rate, run_id=run_id) as c:
        assert set(ours(run_id)) == set(c.namespaces) | {c.switch}
        assert [c.address(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        assert "rate 100Mbit" in tc_show(c.namespaces[0], "eth0")  # host -> switch
        assert "rate 100Mbit" in tc_show(c.switch, "gcv0")  # switch -> host

        # Every host reaches every other: host 1 echoes, 0 and 2 connect.
        server = python_in(c, 1, ECHO_TWICE)
        clients = [python_in(c, i, CONNECT, c.address(1)) for i in (0, 2)]
        assert [p.wait(timeout=10) for p in clients] == [0, 0]
        assert server.wait(timeout=10) == 0

        before = c.tx_bytes(0)
        measured = c.measure_rate(0.5)
        assert 0.5 * rate < measured <= 1.1 * rate
        assert c.tx_bytes(0) - before > 0.5 * 0.5 * rate / 8  # the ring traffic was counted

        pids = [server.pid] + [p.pid for p in clients]
    assert ours(run_id) == []
    assert not any(alive(pid) for pid in pids)


@needs_root
def test_switch_port_limits_incoming_traffic(run_id):
    """Two hosts sending to one get the link rate together: the switch port shapes too."""
    rate = 1e8
    with netns.Cluster(3, rate, run_id=run_id) as c:
        log = Path(f"/tmp/{run_id}-incast.log")
        try:
            receiver = python_in(c, 1, RECEIVE_TWO, log=log)
            for i in (0, 2):
                python_in(c, i, netns._SENDER, c.address(1), netns.MEASURE_PORT, 4)
            receiver.wait(timeout=15)
            together = float(log.read_text().split()[-1])
        finally:
            log.unlink(missing_ok=True)
    assert 0.5 * rate < together <= 1.1 * rate


@needs_root
def test_set_rate_changes_every_link_both_ways_while_it_runs(run_id):
    with netns.Cluster(2, 1e8, run_id=run_id) as c:
        slow = c.measure_rate(0.5)
        c.set_rate("400mbit")
        for i in range(2):
            assert "rate 400Mbit" in tc_show(c.namespaces[i], "eth0")
            assert "rate 400Mbit" in tc_show(c.switch, f"gcv{i}")
        fast = c.measure_rate(0.5)
        assert c.rate_bps == 4e8
        assert 2 * slow < fast <= 1.1 * 4e8, (slow, fast)
        with pytest.raises(netns.ClusterError, match="rate must be positive"):
            c.set_rate(0)


@needs_root
def test_a_link_made_slower_under_load_keeps_moving(run_id):
    """Packets queued at 1 Gbit/s (64 KB segments, under its 500 KB bucket) are longer than
    100 Mbit/s's bucket: changed in place, the tbf never sent them, and the link stalled."""
    with netns.Cluster(2, "1gbit", run_id=run_id) as c:
        log = Path(f"/tmp/{run_id}-slower.log")
        try:
            receiver = python_in(c, 1, netns._RECEIVER, netns.MEASURE_PORT, 2.0, 1.0, log=log)
            python_in(c, 0, netns._SENDER, c.address(1), netns.MEASURE_PORT, 5)
            time.sleep(1.0)  # the sender fills the 1 Gbit/s link's queue
            c.set_rate("100mbit")
            receiver.wait(timeout=15)
            after = netns._read_rate(log)  # a stalled link: the receiver's timeout, raised
        finally:
            log.unlink(missing_ok=True)
    assert 0.5 * 1e8 < after <= 1.1 * 1e8, after


@needs_root
def test_a_host_behind_a_slower_link_bounds_the_ring_until_its_link_is_changed(run_id):
    with netns.Cluster(3, ["400mbit", "400mbit", "100mbit"], run_id=run_id) as c:
        for i, shown in enumerate(["rate 400Mbit", "rate 400Mbit", "rate 100Mbit"]):
            assert shown in tc_show(c.namespaces[i], "eth0")
            assert shown in tc_show(c.switch, f"gcv{i}")
        assert c.rate_bps == 1e8  # the slowest link
        # No lower bound: traffic to host 2 meets its 100 Mbit/s where it leaves the switch,
        # mid-path, and a half-second measure there may fall into TCP's loss recovery.
        assert c.measure_rate(0.5) <= 1.1 * 1e8
        c.set_rate("400mbit", hosts=[2])
        assert "rate 400Mbit" in tc_show(c.namespaces[2], "eth0")
        assert c.rates == [4e8, 4e8, 4e8]
        assert 1.5 * 1e8 < c.measure_rate(0.5) <= 1.1 * 4e8  # more than the slow link carries
        with pytest.raises(netns.ClusterError, match="from 0 to 2"):
            c.set_rate("1gbit", hosts=[3])


@needs_root
def test_rates_changed_changes_the_links_after_the_start_and_sets_them_back(run_id):
    with netns.Cluster(3, "400mbit", run_id=run_id) as c:
        began = []
        with c.rates_changed(["400mbit", "400mbit", "100mbit"], 0.3, lambda: bool(began)) as ch:
            time.sleep(0.8)
            assert "wall" not in ch and c.rates == [4e8] * 3  # timed from began(), not yet
            began.append(True)
            time.sleep(0.8)
            assert "wall" in ch and c.rates == [4e8, 4e8, 1e8]
            assert "rate 100Mbit" in tc_show(c.switch, "gcv2")
            assert "rate 400Mbit" in tc_show(c.switch, "gcv1")
        assert c.rates == [4e8] * 3 and "rate 400Mbit" in tc_show(c.namespaces[2], "eth0")
        with c.rates_changed("100mbit", 30) as ch:  # the job ends first: nothing changes
            pass
        assert "wall" not in ch and c.rates == [4e8] * 3
        with pytest.raises(netns.ClusterError, match="2 link rates given for 3 hosts"):
            with c.rates_changed([1e9, 1e9], 1):
                pass


def tc_show(ns, dev):
    return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev],
                          capture_output=True, text=True, timeout=10).stdout


ECHO_TWICE = r"""
import socket
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("", 5300)); srv.listen(2); srv.settimeout(8)
for _ in range(2):
    conn, _ = srv.accept(); conn.sendall(conn.recv(16)); conn.close()
"""

CONNECT = r"""
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], 5300), timeout=2); break
    except OSError:
        time.sleep(0.05)
s.sendall(b"hello"); assert s.recv(16) == b"hello"
"""

RECEIVE_TWO = r"""
import socket, threading, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("", 5299)); srv.listen(2); srv.settimeout(8)
conns = [srv.accept()[0] for _ in range(2)]
counts = [0, 0]; start = [None]
def read(k):
    buf = bytearray(1 << 20)
    while start[0] is None or time.monotonic() - start[0] < 1.0:
        n = conns[k].recv_into(buf)
        if not n: break
        if start[0] is not None: counts[k] += n
threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
for t in threads: t.start()
time.sleep(0.7); start[0] = time.monotonic()
for t in threads: t.join()
print(sum(counts) * 8 / (time.monotonic() - start[0]))
"""


# ---------------------------------------------------------------- stale namespaces

@needs_root
def test_up_refuses_leftovers_and_remove_namespaces_cleans_them(run_id):
    stale = f"{netns.PREFIX}-{run_id}-h1"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    assert stale in netns.stale_namespaces()
    cluster = netns.Cluster(2, 1e9, run_id=run_id)
    with pytest.raises(netns.ClusterError) as e:
        cluster.up()
    assert "--clean" in str(e.value) and stale in str(e.value)
    assert ours(run_id) == [stale]  # refused before creating anything
    netns.remove_namespaces([stale])
    assert stale not in netns.stale_namespaces()
    netns.remove_namespaces([stale])  # already gone: no error


# ---------------------------------------------------------------- run()

SLEEP_WITH_CHILD = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"


@needs_root
def test_run_returns_wall_time(run_id, tmp_path):
    with netns.Cluster(2, 1e9, run_id=run_id) as c:
        seconds = c.run(lambda r: [PYTHON, "-c", f"print('rank {r}')"],
                        lambda r: dict(os.environ), timeout=20, log_dir=tmp_path)
    assert 0 < seconds < 20
    assert (tmp_path / "rank1.log").read_text().strip() == "rank 1"


@needs_root
def test_run_places_ranks_per_host_on_their_hosts(run_id, tmp_path):
    with netns.Cluster(2, 1e9, run_id=run_id) as c:
        c.run(lambda r: [PYTHON, "-c", "import os; print(os.readlink('/proc/self/ns/net'))"],
              lambda r: dict(os.environ), timeout=20, log_dir=tmp_path, ranks_per_host=2)
    spaces = [(tmp_path / f"rank{r}.log").read_text().strip() for r in range(4)]
    assert spaces[0] == spaces[1] and spaces[2] == spaces[3]  # ranks 0, 1 on host 0; 2, 3 on 1
    assert spaces[0] != spaces[2] and spaces[0].startswith("net:[")
    with pytest.raises(netns.ClusterError, match="ranks per host"):
        netns.Cluster(2, 1e9, run_id=run_id).run(lambda r: [], lambda r: {}, 1, tmp_path,
                                                  ranks_per_host=0)


@needs_root
def test_run_reports_a_failing_worker_and_kills_the_rest(run_id, tmp_path):
    def argv(rank):
        if rank == 1:
            return [PYTHON, "-c", "import sys; print('boom from rank 1', flush=True); sys.exit(3)"]
        return [PYTHON, "-c", SLEEP_WITH_CHILD]

    with netns.Cluster(3, 1e9, run_id=run_id) as c:
        start = time.monotonic()
        with pytest.raises(netns.WorkerError) as e:
            c.run(argv, lambda r: dict(os.environ), timeout=30, log_dir=tmp_path, grace=1)
        assert time.monotonic() - start < 10
        assert [netns_pids(ns) for ns in c.namespaces] == [[], [], []]
    assert (e.value.rank, e.value.returncode) == (1, 3)
    assert "boom from rank 1" in e.value.log_tail
    assert "rank 1 exited with code 3" in str(e.value)


@needs_root
def test_run_times_out_and_kills_everything(run_id, tmp_path):
    with netns.Cluster(2, 1e9, run_id=run_id) as c:
        start = time.monotonic()
        with pytest.raises(netns.WorkerError) as e:
            c.run(lambda r: [PYTHON, "-c", SLEEP_WITH_CHILD], lambda r: dict(os.environ),
                  timeout=2, log_dir=tmp_path)
        assert time.monotonic() - start < 8
        assert [netns_pids(ns) for ns in c.namespaces] == [[], []]
    assert e.value.rank is None and e.value.ranks == [0, 1]
    assert "still running after 2 s" in str(e.value)


# ---------------------------------------------------------------- signals

SIGNALLED_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1]); import netns
try:
    with netns.Cluster(2, 1e8, run_id=sys.argv[2]) as c:
        sleeper = c.spawn(0, ["sleep", "60"])
        print("READY", sleeper.pid, flush=True)
        time.sleep(60)
finally:
    print("finally ran", flush=True)
"""


@needs_root
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 143)])
def test_signal_tears_the_cluster_down(run_id, signum, code):
    child = subprocess.Popen([PYTHON, "-c", SIGNALLED_CHILD, str(CLUSTER_DIR), run_id],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = read_line(child, timeout=15)
        assert line.startswith("READY"), child.stderr.read() if child.poll() is not None else line
        sleeper = int(line.split()[1])
        assert len(ours(run_id)) == 3
        child.send_signal(signum)
        # SIGINT raises KeyboardInterrupt after cleanup; uncaught, Python then dies of SIGINT.
        assert child.wait(timeout=15) == code
        assert "finally ran" in child.stdout.read()
    finally:
        child.kill()
        child.wait()
    assert ours(run_id) == []
    assert not alive(sleeper)


def read_line(proc, timeout):
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return proc.stdout.readline()
