"""An emulated cluster on one machine, built from Linux network namespaces.

Each of H "hosts" is a network namespace with one interface (``eth0``) that is a
veth link to a bridge in a separate "switch" namespace. Every link is rate
limited in both directions with a tc ``tbf`` qdisc -- on the host end (host
egress) and on the switch end (the switch port towards the host) -- so a link
behaves like a full-duplex NIC of the chosen rate (one for every host, or one per
host: a host behind a slower link). Workers run inside the host namespaces with
``ip netns exec``.

Everything we create is named ``gcbench-<run_id>-...`` so that an aborted run
can be found and removed (``stale_namespaces`` / ``remove_namespaces``), and a
Cluster tears itself down on normal exit, exceptions, SIGINT and SIGTERM.

Needs root, iproute2 (``ip``, ``tc``) and a kernel with sch_tbf. There is no
latency emulation: this kernel has no sch_netem.

Manual use:
    python3 bench/cluster/netns.py up --hosts 3 --rate 1gbit
    python3 bench/cluster/netns.py measure --hosts 4 --rate 1gbit
    python3 bench/cluster/netns.py up --hosts 3 --rate 1gbit,1gbit,100mbit
    python3 bench/cluster/netns.py clean
"""
import argparse
import atexit
import contextlib
import ipaddress
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

PREFIX = "gcbench"

CMD_TIMEOUT = 10.0  # seconds for any single ip/tc command; they normally take milliseconds
MEASURE_PORT = 5299
HZ = 250  # assumed kernel tick rate for sizing the tbf bucket (see _tbf_args)


class ClusterError(Exception):
    """A problem the user can act on; str(e) is the full message to print."""


class WorkerError(ClusterError):
    """A worker failed or the job timed out (raised by Cluster.run).

    rank: the first failing rank, or None on a timeout; returncode: its exit
    code (negative: killed by that signal), or None; log_tail: the last lines
    of its log (on a timeout: of the lowest rank still running); ranks: the
    ranks still running when a timeout hit (empty otherwise).
    """

    def __init__(self, message, rank=None, returncode=None, log_tail="", ranks=()):
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode
        self.log_tail = log_tail
        self.ranks = list(ranks)


# --------------------------------------------------------------------------
# rates

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)\s*([a-z]*)\s*$",
                      re.IGNORECASE)


def parse_rate(text):
    """Rate text in tc's units ("100mbit", "2.5gbit", or bits/s like "1e9") -> bits per second.

    Only tc's bit units are accepted; in particular not "bps", which tc reads as
    *bytes* per second and which would silently be 8x off.
    """
    match = _RATE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or (unit and unit not in _UNITS):
        raise ClusterError(f"rate '{text}' is not understood; use a number with a unit: "
                           "100mbit, 1gbit, 10gbit")
    bps = float(match.group(1)) * _UNITS.get(unit, 1.0)
    if not (bps > 0 and math.isfinite(bps)):
        raise ClusterError(f"rate '{text}' must be positive; use e.g. 100mbit, 1gbit, 10gbit")
    return bps


def _checked_rate(rate):
    """A link rate in bits/s from tc text or a number; a ClusterError unless positive."""
    bps = parse_rate(rate) if isinstance(rate, str) else rate
    if not (isinstance(bps, (int, float)) and bps > 0):
        raise ClusterError(f"rate must be positive, got {rate!r} bits/s")
    return float(bps)


def parse_rates(text):
    """'1gbit' (every host) or '1gbit,1gbit,100mbit' (one rate per host, in host order)."""
    rates = [parse_rate(part.strip()) for part in text.split(",")]
    return rates[0] if len(rates) == 1 else rates


def host_rates(rates, hosts):
    """One checked rate (bits/s) per host, from one rate for every host or a list of one each."""
    rates = list(rates) if isinstance(rates, (list, tuple)) else [rates] * hosts
    if len(rates) != hosts:
        raise ClusterError(f"{len(rates)} link rates given for {hosts} hosts; give one rate "
                           "for every host, or a single rate for all")
    return [_checked_rate(r) for r in rates]


def parse_rate_change(text):
    """'RATES@SECONDS' -> (rates as parse_rates reads them, seconds): links that change to
    RATES (one for every host, or one per host) SECONDS into a job."""
    rates, at, seconds = text.partition("@")
    try:
        after = float(seconds) if at else math.nan
    except ValueError:
        after = math.nan
    if not 0 < after < 1e5:
        raise ClusterError(f"'{text}' is not RATE@SECONDS with SECONDS in (0, 1e5), "
                           "e.g. 100mbit@40")
    try:
        return parse_rates(rates), after
    except ClusterError as e:
        raise ClusterError(f"{e}; give RATE@SECONDS, e.g. 100mbit@40") from None


def format_rate(bps):
    """Bits per second -> short text tc accepts: 1e9 -> "1gbit", 2.5e9 -> "2.5gbit"."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps >= _UNITS[unit]:
            return f"{bps / _UNITS[unit]:.12g}{unit}"
    return f"{bps:.12g}bit"


def _tbf_args(rate_bps):
    """tc arguments for a tbf that holds rate_bps for TCP from 100mbit to 10gbit.

    burst: the bucket must refill at least one timer tick's worth of bytes
    (rate/HZ), or tbf cannot reach the rate when its watchdog fires late; and it
    must hold a whole 64 KB GSO super-packet, which veth hands to the qdisc
    unsegmented. So burst = max(64 KB, rate_bytes / HZ): 4 ms of line rate from
    ~130mbit up, too short to change the rate seen over milliseconds.
    limit (bytes queued before tbf drops) = 2 * burst + 1 MB: TCP small queues
    let one socket park up to tcp_limit_output_bytes (1 MB by default, 4 MB on
    our test machine) in the qdisc, and BBR's start-up overshoots. With a 20 ms
    queue (latency 20ms) tbf dropped up to hundreds of packets per 1.5 s test at
    100mbit, and a lost tail costs a 200 ms retransmission timeout: a visible
    dip in throughput. With this limit there were no drops from 100mbit to
    10gbit, and a full queue still adds at most ~90 ms at 100mbit (less above).
    """
    rate_bytes = rate_bps / 8
    burst = int(max(64 * 1024, rate_bytes / HZ))
    limit = 2 * burst + (1 << 20)
    return ["tbf", "rate", format_rate(rate_bps), "burst", str(burst), "limit", str(limit)]


# --------------------------------------------------------------------------
# running ip / tc

def _tool(name):
    """Absolute path of ip or tc, so that spawn() works whatever PATH a worker's env has."""
    path = shutil.which(name)
    if path is None:
        raise ClusterError(f"'{name}' was not found on PATH; it comes with iproute2: "
                           "run `apt-get install iproute2`")
    return path


def _run(argv, check=True, timeout=CMD_TIMEOUT):
    """Runs an ip/tc command; with check, a failure becomes a ClusterError naming it."""
    shown = " ".join(argv)
    try:
        done = subprocess.run([_tool(argv[0])] + list(argv[1:]), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        if check:
            raise ClusterError(f"`{shown}` did not finish within {timeout:g} s") from None
        return subprocess.CompletedProcess(argv, -1, "", "timeout")
    if check and done.returncode != 0:
        raise ClusterError(f"`{shown}` failed: {done.stderr.strip() or done.returncode}")
    return done


def _netns_names():
    """Names of all network namespaces `ip netns list` knows ("name (id: 3)" -> "name")."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(name):
    """Pids of processes inside namespace name (none if it is gone)."""
    done = _run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------
# environment and stale namespaces

def check_environment():
    """Raises ClusterError unless we can build a cluster here: root, iproute2, netns, tbf."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root to create network namespaces; "
                           "run it as root, e.g. `sudo bench/cluster/run.sh ...`")
    _tool("ip")
    _tool("tc")
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        done = _run(["ip", "netns", "add", probe], check=False)
        if done.returncode != 0:
            raise ClusterError(
                f"cannot create a network namespace (`ip netns add {probe}`: "
                f"{done.stderr.strip()}). This needs CAP_SYS_ADMIN and CAP_NET_ADMIN; in a "
                "container, run it privileged (e.g. `docker run --privileged`)")
        done = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root"] + _tbf_args(1e8),
                    check=False)
        if done.returncode != 0:
            raise ClusterError(
                f"cannot add a tbf qdisc (`tc qdisc add ... tbf`: {done.stderr.strip()}); "
                "the kernel needs sch_tbf (CONFIG_NET_SCH_TBF, `modprobe sch_tbf`)")
    finally:
        remove_namespaces([probe])


def delay_unsupported(delay_text):
    """The error for a requested link delay: this kernel cannot add latency."""
    return ClusterError(
        f"a link delay ({delay_text}) was asked for, but this kernel has no netem "
        "(sch_netem), so latency cannot be added to the emulated links; their base round "
        "trip (veth + bridge) is tens of microseconds. Run without the delay option, or on "
        "a kernel with sch_netem")


def stale_namespaces():
    """Our namespaces that exist now, e.g. left behind by an aborted run."""
    return [n for n in _netns_names() if n.startswith(PREFIX + "-")]


def empty_namespaces(names, seconds=5.0):
    """Kills every process inside the namespaces and waits (at most `seconds`) until none is
    listed there: a killed process stays listed until the kernel has finished its exit, which
    on a busy machine can outlast the kill by a while."""
    deadline = time.monotonic() + seconds
    while True:
        left = [pid for name in names for pid in _netns_pids(name)]
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            _kill(pid)
        time.sleep(0.05)


def remove_namespaces(names):
    """Kills every process inside each namespace, then deletes it. Already gone is fine."""
    # A process inside keeps the namespace (and its links) alive after `ip netns del`.
    empty_namespaces(names)
    failures = []
    for name in names:
        done = _run(["ip", "netns", "del", name], check=False)
        if done.returncode != 0 and os.path.exists(f"/run/netns/{name}"):
            failures.append(f"{name} ({done.stderr.strip()})")
    if failures:
        raise ClusterError(f"could not delete network namespaces: {', '.join(failures)}; "
                           "try `ip netns del NAME` by hand")


# --------------------------------------------------------------------------
# the cluster

class Cluster:
    """H host namespaces, each linked at its rate (full duplex) to a bridge in a switch namespace.

    rate_bps is every link's rate, or a list of one rate per host (a host behind a slower
    link than the others: a node in another rack, a cheaper instance). `rates` holds each
    host's; `rate_bps` is the slowest, the rate a ring over every host runs at.
    """

    def __init__(self, hosts, rate_bps, run_id=None, subnet="10.77.0", ifname="eth0"):
        if not isinstance(hosts, int) or not 1 <= hosts <= 253:
            raise ClusterError(f"hosts must be a whole number from 1 to 253, got {hosts!r}")
        rates = host_rates(rate_bps, hosts)
        run_id = str(os.getpid()) if run_id is None else str(run_id)
        if not re.fullmatch(r"[A-Za-z0-9_.]+", run_id):
            raise ClusterError(f"run id '{run_id}' may only use letters, digits, '_' and '.'")
        try:
            ipaddress.ip_network(f"{subnet}.0/24")
        except ValueError:
            raise ClusterError(f"subnet '{subnet}' must be the first three parts of an IPv4 "
                               "address, e.g. 10.77.0") from None
        if not 1 <= len(ifname) <= 15 or "/" in ifname or " " in ifname:
            raise ClusterError(f"interface name '{ifname}' must be 1-15 characters, no '/' or spaces")
        self.hosts = hosts
        self.rates = rates
        self._swaps = [0] * hosts  # rate changes of each host's link (set_rate)
        self.run_id = run_id
        self.subnet = subnet
        self.ifname = ifname
        self.switch = f"{PREFIX}-{run_id}-sw"
        self.namespaces = [f"{PREFIX}-{run_id}-h{i}" for i in range(hosts)]
        self._procs = []  # everything spawn() started
        self._made = []  # namespaces we (may) have created; only these are deleted
        self._old_handlers = {}
        self._cleanup_registered = False

    @property
    def rate_bps(self):
        return min(self.rates)

    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def address(self, i):
        return f"{self.subnet}.{i + 1}"

    # ---- bring up

    def up(self):
        """Creates the switch and the hosts; on any failure removes what was made and raises."""
        existing = sorted(set([self.switch] + self.namespaces) & set(_netns_names()))
        if existing:
            raise ClusterError(
                "a previous run was aborted and left these network namespaces: "
                f"{', '.join(existing)}. Remove them with `sudo bench/cluster/run.sh --clean` "
                "(or `python3 bench/cluster/netns.py clean`), then run again")
        self._register_cleanup()  # first, so that Ctrl-C during setup cleans up too
        try:
            self._make_switch()
            for i in range(self.hosts):
                self._make_host(i)
        except BaseException as e:
            self.down()
            if isinstance(e, (ClusterError, KeyboardInterrupt, SystemExit)):
                raise
            raise ClusterError(f"setting up the emulated cluster failed: {e}") from e

    def _add_namespace(self, name):
        self._made.append(name)  # before adding: an interrupted `ip netns add` may have made it
        _run(["ip", "netns", "add", name])

    def _make_switch(self):
        sw = self.switch
        self._add_namespace(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        # addrgenmode none: no IPv6 link-local address, so no chatter (DAD, router
        # solicitations) on the links that would show up in the byte counters.
        _run(["ip", "-n", sw, "link", "set", "br0", "addrgenmode", "none", "up"])

    def _make_host(self, i):
        ns, sw, port = self.namespaces[i], self.switch, f"gcv{i}"
        self._add_namespace(ns)
        # Created directly inside the two namespaces under their final names, so no
        # temporary interface ever exists in the root namespace (nothing to leak there).
        _run(["ip", "link", "add", self.ifname, "netns", ns, "type", "veth",
              "peer", "name", port, "netns", sw])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", self.ifname])
        _run(["ip", "-n", ns, "link", "set", self.ifname, "addrgenmode", "none", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "addrgenmode", "none", "up"])
        tbf = _tbf_args(self.rates[i])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", self.ifname, "root"] + tbf)  # host -> switch
        _run(["tc", "-n", sw, "qdisc", "add", "dev", port, "root"] + tbf)  # switch -> host

    def set_rate(self, rate_bps, hosts=None):
        """Changes the links' rate, both ways, while the cluster runs (a link getting faster
        or slower under a job): every host's link, or those of the host indices `hosts`.
        Connections stay up.

        Each tbf is swapped for a new one (another handle), not changed in place: a tbf
        never sends a packet longer than its bucket, and the packets queued under a faster
        rate's larger bucket (64 KB segments the host's TCP hands down whole) would stall
        the link for good under a slower rate's smaller one. The new tbf starts empty; TCP
        sends what the old one held again."""
        rate_bps = _checked_rate(rate_bps)
        hosts = range(self.hosts) if hosts is None else list(hosts)
        if not all(isinstance(i, int) and 0 <= i < self.hosts for i in hosts):
            raise ClusterError(f"hosts {hosts!r}: each must be a host index from 0 to "
                               f"{self.hosts - 1}")
        tbf = _tbf_args(rate_bps)
        for i in hosts:
            self._swaps[i] += 1
            root = ["root", "handle", f"{1 + self._swaps[i] % 2}:"]  # not the one in place
            _run(["tc", "-n", self.namespaces[i], "qdisc", "replace", "dev", self.ifname]
                 + root + tbf)
            _run(["tc", "-n", self.switch, "qdisc", "replace", "dev", f"gcv{i}"] + root + tbf)
            self.rates[i] = rate_bps

    @contextlib.contextmanager
    def rates_changed(self, rates, seconds, began=None):
        """Runs the body on the links as they are, changed to `rates` (one for every host, or
        a list of one per host) `seconds` after began() first returns true (polled every
        20 ms; from the body's start without it): a link that gets faster or slower during a
        job. Yields a dict that gets "wall", the wall-clock time of the change, once it is
        made. Every link is back at its rate afterwards, so the next job sees the same links."""
        before, after = list(self.rates), host_rates(rates, self.hosts)
        changed, stop = {}, threading.Event()

        def change_later():
            while began is not None and not began():
                if stop.wait(0.02):
                    return
            if not stop.wait(seconds):
                self._set_rates(after)
                changed["wall"] = time.time()

        thread = threading.Thread(target=change_later, daemon=True)
        thread.start()
        try:
            yield changed
        finally:
            stop.set()
            thread.join()
            self._set_rates(before)

    def _set_rates(self, rates):
        for i, rate in enumerate(rates):
            if rate != self.rates[i]:
                self.set_rate(rate, hosts=[i])

    # ---- cleanup

    def _register_cleanup(self):
        if self._cleanup_registered:
            return
        self._cleanup_registered = True
        atexit.register(self.down)
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: atexit and the caller's down() remain
                pass

    def _on_signal(self, signum, frame):
        """Tears down, then lets the signal have its usual effect on the caller."""
        self.down()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # the caller's finally blocks still run
        sys.exit(128 + signum)  # SIGTERM -> 143

    def down(self):
        """Kills our processes and deletes our namespaces. Idempotent, never raises, bounded."""
        # Block Ctrl-C/SIGTERM while tearing down so a second Ctrl-C cannot leave
        # half a cluster behind; a signal that arrives meanwhile is delivered after.
        blocked = _block_signals()
        try:
            for proc in self._procs:
                _kill_group(proc)
            self._procs = []
            remove_namespaces(self._made)
            self._made = []
        except Exception as e:  # report, but cleanup must not raise
            print(f"warning: cleaning up the emulated cluster: {e}", file=sys.stderr)
        finally:
            self._unregister_cleanup()
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def _unregister_cleanup(self):
        if not self._cleanup_registered:
            return
        self._cleanup_registered = False
        atexit.unregister(self.down)
        for signum, handler in self._old_handlers.items():
            try:
                signal.signal(signum, handler)
            except ValueError:
                pass
        self._old_handlers = {}

    # ---- processes

    def spawn(self, i, argv, env=None, log_path=None):
        """Starts argv inside host i, in its own session (so its whole group can be killed)."""
        cmd = [_tool("ip"), "netns", "exec", self.namespaces[i]] + [str(a) for a in argv]
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT,
                                    env=dict(os.environ) if env is None else env,
                                    start_new_session=True)
        finally:
            if log_path:
                out.close()
        self._procs.append(proc)
        return proc

    def _kill_hosts(self, procs):
        """Kills procs' process groups and anything else left in the host namespaces, and
        waits until the namespaces are empty."""
        for proc in procs:
            _kill_group(proc)
        self._procs = [p for p in self._procs if p not in procs]
        empty_namespaces(self.namespaces)

    def run(self, argv_for_rank, env_for_rank, timeout, log_dir, grace=20.0, ranks_per_host=1,
            extra=()):
        """Runs ranks_per_host workers per host and waits for all; returns the wall seconds.

        Rank r runs on host r // ranks_per_host (ranks of one host talk through its own
        loopback, unlimited: a node's fast link; between hosts through the rate-limited
        links). `extra` lists processes of the job on hosts of their own, (host, argv, env),
        started first (parameter servers): the ranks run on the hosts before the first of
        them, and the extra ones are waited for like ranks (logs extra<i>.log). Raises
        WorkerError if a worker fails (after giving the others `grace` seconds to finish)
        or if the job runs longer than `timeout`. Either way no worker process is left
        afterwards.
        """
        if not isinstance(ranks_per_host, int) or ranks_per_host < 1:
            raise ClusterError(f"ranks per host must be a whole number >= 1, not {ranks_per_host!r}")
        worker_hosts = min([host for host, _, _ in extra], default=self.hosts)
        ranks = worker_hosts * ranks_per_host
        os.makedirs(log_dir, exist_ok=True)
        logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(ranks)]
        logs += [os.path.join(log_dir, f"extra{i}.log") for i in range(len(extra))]
        procs = []
        start = time.monotonic()
        try:
            for i, (host, argv, env) in enumerate(extra):
                procs.append(self.spawn(host, argv, env, logs[ranks + i]))
            for r in range(ranks):
                procs.append(self.spawn(r // ranks_per_host, argv_for_rank(r), env_for_rank(r),
                                        logs[r]))
            procs = procs[len(extra):] + procs[:len(extra)]  # ranks first, as the logs
            failed, running = _wait(procs, start + timeout, grace)
            seconds = time.monotonic() - start
        finally:
            self._kill_hosts(procs)
        if failed is not None:
            raise _failure(failed, procs[failed].returncode, logs[failed], running, grace)
        if running:
            raise _timeout(running, timeout, logs)
        return seconds

    # ---- measurements

    def tx_bytes(self, i):
        """Bytes sent so far by host i's interface (from /proc/net/dev inside its namespace)."""
        return self._link_bytes(i)[1]

    def rx_bytes(self, i):
        """Bytes received so far by host i's interface."""
        return self._link_bytes(i)[0]

    def _link_bytes(self, i):
        """(received, sent) bytes of host i's interface."""
        done = _run(["ip", "netns", "exec", self.namespaces[i], "cat", "/proc/net/dev"])
        for line in done.stdout.splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == self.ifname:
                fields = counters.split()
                return int(fields[0]), int(fields[8])  # 8 receive columns, then transmit
        raise ClusterError(f"interface {self.ifname} not found in {self.namespaces[i]}")

    def measure_rate(self, seconds=1.0):
        """Minimum TCP throughput (bits/s) over the links while every host i sends to i+1."""
        if self.hosts == 1:
            return self.rate_bps
        warm = 0.5  # BBR's start-up settles within ~0.5 s on these links
        with tempfile.TemporaryDirectory(prefix="gcbench-measure-") as tmp:
            logs = [os.path.join(tmp, f"recv{i}.log") for i in range(self.hosts)]
            procs = []
            try:
                for i in range(self.hosts):
                    procs.append(self.spawn(i, [sys.executable, "-c", _RECEIVER, str(MEASURE_PORT),
                                                str(warm), str(seconds)], log_path=logs[i]))
                for i in range(self.hosts):
                    dst = self.address((i + 1) % self.hosts)
                    procs.append(self.spawn(i, [sys.executable, "-c", _SENDER, dst,
                                                str(MEASURE_PORT), str(warm + seconds + 5)]))
                deadline = time.monotonic() + warm + seconds + 15
                for proc in procs[:self.hosts]:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ClusterError("measuring the link rate did not finish in time; "
                                   "is the machine overloaded?") from None
            finally:
                self._kill_hosts(procs)
            return min(_read_rate(path) for path in logs)


# Receiver for measure_rate: accepts one connection, skips a warm-up (TCP slow
# start), then counts the bytes that arrive in the next `seconds` and prints bits/s.
_RECEIVER = r"""
import socket, sys, time
port, warm, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("", port)); srv.listen(1); srv.settimeout(10)
conn, _ = srv.accept(); conn.settimeout(10)
buf = bytearray(1 << 20)
t0 = time.monotonic()
while time.monotonic() - t0 < warm:
    conn.recv_into(buf)
conn.recv_into(buf)
t1 = now = time.monotonic(); n = 0
while now - t1 < seconds:
    k = conn.recv_into(buf)
    if not k:
        break
    n += k; now = time.monotonic()
print(n * 8 / (now - t1), flush=True)
"""

# Sender for measure_rate: connects (retrying until the receiver listens) and
# sends until the receiver hangs up or `stop` seconds pass.
_SENDER = r"""
import socket, sys, time
host, port, stop = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + stop
while True:
    try:
        s = socket.create_connection((host, port), timeout=1); break
    except OSError:
        if time.monotonic() > end: sys.exit(2)
        time.sleep(0.05)
s.settimeout(5)
buf = bytes(1 << 20)
try:
    while time.monotonic() < end:
        s.sendall(buf)
except OSError:
    pass
"""


def _read_rate(path):
    with open(path, errors="replace") as f:
        text = f.read()
    try:
        return float(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ClusterError(f"measuring the link rate failed; the receiver said:\n{text}") from None


# --------------------------------------------------------------------------
# helpers for run() and down()

def _block_signals():
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        return True
    except (ValueError, OSError):
        return False


def _kill_group(proc):
    """SIGKILLs proc's whole process group (it leads one: start_new_session) and reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _wait(procs, deadline, grace):
    """Polls until all exit, or one fails and `grace` passes, or the deadline.

    Returns (first failing rank or None, ranks still running).
    """
    failed, give_up = None, deadline
    while True:
        codes = [p.poll() for p in procs]
        running = [r for r, c in enumerate(codes) if c is None]
        if failed is None:
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed, give_up = bad[0], min(deadline, time.monotonic() + grace)
        if not running or time.monotonic() >= give_up:
            return failed, running
        time.sleep(0.05)


def _describe_exit(code):
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail(path, lines=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _failure(rank, code, log, running, grace):
    tail = _tail(log)
    text = f"worker rank {rank} {_describe_exit(code)}"
    if running:
        text += (f"; ranks {', '.join(map(str, running))} were still running "
                 f"{grace:g} s later and were killed")
    text += f". Last lines of {log}:\n{tail}"
    return WorkerError(text, rank=rank, returncode=code, log_tail=tail)


def _timeout(running, timeout, logs):
    tail = _tail(logs[running[0]])
    text = (f"the job timed out: ranks {', '.join(map(str, running))} were still running after "
            f"{timeout:g} s and were killed. Raise the timeout if the job is just slow. "
            f"Last lines of {logs[running[0]]}:\n{tail}")
    return WorkerError(text, rank=None, returncode=None, log_tail=tail, ranks=running)


# --------------------------------------------------------------------------
# benchmarks on hosts of several ranks (routes.py, nodes.py)

def hosts_parser(description, timeout, json_help):
    """An argument parser with the cluster's shape (--hosts, --ranks-per-host, --rate), the
    job's --timeout in seconds and the --json file it writes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="link rate between hosts, tc units")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--json", help=json_help)
    return parser


def run_on_hosts(body, args, min_ranks_per_host):
    """Checks the cluster's shape and this machine, then body(args); a ClusterError is printed
    and gives exit status 1."""
    try:
        if args.hosts < 2 or args.ranks_per_host < min_ranks_per_host:
            raise ClusterError(f"need at least 2 hosts of at least {min_ranks_per_host} "
                               f"rank{'s' if min_ranks_per_host > 1 else ''} each")
        check_environment()
        body(args)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------
# command line

def _cmd_up(args):
    with Cluster(args.hosts, parse_rates(args.rate)) as cluster:
        print(f"switch: {cluster.switch}")
        for i, ns in enumerate(cluster.namespaces):
            print(f"host {i}: {ns}  {cluster.address(i)}  link {format_rate(cluster.rates[i])} "
                  f"each way  (enter: ip netns exec {ns} bash)")
        print("Ctrl-C to tear down.", flush=True)
        while True:
            time.sleep(3600)


def _cmd_measure(args):
    if args.hosts == 1:
        print("one host has no links to measure; use --hosts 2 or more")
        return
    with Cluster(args.hosts, parse_rates(args.rate)) as cluster:
        bps = cluster.measure_rate(args.seconds)
    print(f"measured {format_rate(round(bps, -5))} per link "
          f"({bps / cluster.rate_bps:.1%} of {format_rate(cluster.rate_bps)})")


def _cmd_clean(args):
    names = stale_namespaces()
    remove_namespaces(names)
    print(f"removed {', '.join(names)}" if names else "nothing to remove")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Emulated cluster of network namespaces.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("up", "create a cluster and keep it until Ctrl-C"),
                       ("measure", "create a cluster and measure the ring throughput")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--hosts", type=int, default=3)
        p.add_argument("--rate", default="1gbit",
                       help="link rate in tc units, e.g. 100mbit, 10gbit; or one per host, "
                            "comma-separated")
        if name == "measure":
            p.add_argument("--seconds", type=float, default=1.0)
    sub.add_parser("clean", help=f"remove every {PREFIX}-* namespace (also those of a running run)")
    args = parser.parse_args(argv)
    try:
        check_environment()
        {"up": _cmd_up, "measure": _cmd_measure, "clean": _cmd_clean}[args.command](args)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
