"""Starts real worker processes for the front-end tests and collects what they leave behind.

Workers run as `gradcomp launch -n W -- python worker.py --out DIR ...` (torchrun's environment,
gradcomp's own Gloo or a torch.distributed process group) or under mpirun (MPI). Every
collective is bounded by GRADCOMP_TIMEOUT=60 and every job by a subprocess timeout, so a
hang is a failure, not a stuck test run."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GRADCOMP = ROOT / "build" / "bin" / "gradcomp"
PYTHON = "/usr/bin/python3"  # Debian's, the one with torch
WORKERS = Path(__file__).resolve().parent / "workers"

sys.path.insert(0, str(ROOT / "tests" / "support"))
from free_port import free_port  # noqa: E402,F401  (the tests import it from here)


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    out: Path
    world: int
    command: list = field(default_factory=list)

    @property
    def output(self):
        return self.stdout + self.stderr

    def describe(self):
        return (f"command: {' '.join(map(str, self.command))}\nexit code {self.returncode} "
                f"after {self.seconds:.1f} s\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n"
                f"{self.stderr[-6000:]}")

    def check(self):
        """Asserts the job succeeded; returns itself."""
        assert self.returncode == 0, self.describe()
        return self

    def report(self, rank):
        return json.loads((self.out / f"report.rank{rank}.json").read_text())

    def reports(self):
        return [self.report(r) for r in range(self.world)]

    def load(self, name, rank):
        return torch.load(self.out / f"{name}.rank{rank}.pt")

    def loads(self, name):
        return [self.load(name, r) for r in range(self.world)]


def _command(launcher, world, argv, servers=0, launch_args=()):
    if launcher == "launch":
        extra = (["--servers", str(servers), "--server-port", str(free_port())] if servers
                 else []) + list(launch_args)
        return [str(GRADCOMP), "launch", "-n", str(world), "--master-port", str(free_port()),
                *extra, "--"] + argv
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world)] + argv
    if launcher == "none":  # a single process without any launcher
        assert world == 1
        return argv
    raise ValueError(f"unknown launcher {launcher}")


def _environment(extra):
    env = dict(os.environ)
    # Nothing inherited may place the workers in another job or slow them down.
    for name in list(env):
        if name.startswith(("GRADCOMP_", "OMPI_", "PMIX_", "TORCHELASTIC_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
            del env[name]
    env.update(GRADCOMP_TIMEOUT="60", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def _stop(proc):
    """Stops a job that outlived its timeout. SIGTERM first: the launcher (or mpirun) forwards
    it to the ranks, which it started in process groups of their own, and kills them after a
    grace period; SIGKILL to the job's session only if that does not end it."""
    proc.terminate()
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        for pid in _session_members(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return proc.communicate()


def _session_members(sid):
    """The processes of session `sid` (field 6 of /proc/PID/stat), which the job started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
            pids.append(int(entry.name))
    return pids


class Runner:
    """runner(script, *args, world=2, launcher="launch", timeout=150, env=None, servers=0,
    launch_args=()) runs workers/<script> on `world` ranks (and `servers` parameter servers
    beside them, and `launch_args` to `gradcomp launch`: launch only) and returns a Job; each
    call gets its own --out dir under `base`."""

    def __init__(self, base):
        self.base = Path(base)
        self.calls = 0

    def __call__(self, script, *args, world=2, launcher="launch", timeout=150, env=None,
                 servers=0, launch_args=()):
        out = self.base / f"job{self.calls}"
        self.calls += 1
        out.mkdir(parents=True)
        argv = [PYTHON, str(WORKERS / script), "--out", str(out), *map(str, args)]
        cmd = _command(launcher, world, argv, servers, launch_args)
        start = time.monotonic()
        # A session of its own, so that _stop can reach whatever the job left behind.
        proc = subprocess.Popen(cmd, cwd=WORKERS, env=_environment(env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _stop(proc)
            pytest.fail(f"job did not end within {timeout} s: {' '.join(cmd)}\n{stdout}\n"
                        f"{stderr}")
        return Job(proc.returncode, stdout, stderr, time.monotonic() - start, out, world, cmd)


@pytest.fixture
def run_workers(tmp_path):
    """A Runner for one test (see Runner)."""
    return Runner(tmp_path)


@pytest.fixture(scope="module")
def module_runner(tmp_path_factory):
    """A Runner shared by a module's tests: one job may serve several parametrized tests."""
    return Runner(tmp_path_factory.mktemp("jobs"))


def pytest_configure(config):
    if not GRADCOMP.exists():
        sys.exit(f"{GRADCOMP} is missing: build gradcomp first (scripts/setup.sh)")
