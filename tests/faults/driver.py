"""Starts the ranks of one fault-injection job, optionally signals one rank at a chosen moment of
a step, and collects how every rank ended.

Ranks of the Gloo and torch.distributed transports are started directly, with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that each survivor's own error is
seen: gradcomp's launcher would stop the survivors as soon as one rank ends. Open MPI's ranks
are started by mpirun, which reacts to a dead rank itself. Every process of a job is in a
session of its own and is killed when the job is over, whatever happened."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PYTHON = "/usr/bin/python3"  # Debian's, the one with torch
WORKER = Path(__file__).resolve().parent / "fault_worker.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from free_port import free_port  # noqa: E402
TIMEOUT_S = 5  # GRADCOMP_TIMEOUT of every job: how long a collective may wait for a peer
# A survivor must have ended this long after the fault: the transport's timeout, the engine's
# backstop, interpreter shutdown, and slack for a loaded 2-core machine.
DEADLINE_S = 3 * TIMEOUT_S + 30


def environment(rank=None, world=None, port=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADCOMP_", "OMPI_", "PMIX_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}
    env.update(GRADCOMP_TIMEOUT=str(TIMEOUT_S), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if rank is not None:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


@dataclass
class Ending:
    """How one rank ended: its exit code (None: it had to be killed) and its report."""
    rank: int
    returncode: int | None
    report: dict | None
    seconds_after_fault: float | None


@dataclass
class Job:
    transport: str
    world: int
    out: Path
    worker_args: list
    procs: list = field(default_factory=list)  # one per rank, or mpirun alone
    lines: list = field(default_factory=list)  # (seconds since start, line) of all output
    started: float = 0.0
    fault_at: float | None = None
    fault: str = ""

    # --- starting and watching
    def start(self):
        self.started = time.monotonic()
        argv = [PYTHON, str(WORKER), "--out", str(self.out), "--transport", self.transport,
                *map(str, self.worker_args)]
        if self.transport == "mpi":
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(self.world),
                   *argv]
            self._spawn(cmd, environment())
        else:
            port = free_port()
            for rank in range(self.world):
                self._spawn(argv, environment(rank, self.world, port))
        return self

    def _spawn(self, cmd, env):
        proc = subprocess.Popen(cmd, env=env, cwd=self.out, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(proc)
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append((time.monotonic() - self.started, line.rstrip()))

    def steps_done(self, rank):
        """The last step rank `rank` finished (-1: none yet) and when."""
        last, when = -1, None
        for t, line in list(self.lines):
            m = re.fullmatch(r"STEP (\d+) (\d+)", line)
            if m and int(m.group(1)) == rank:
                last, when = int(m.group(2)), t
        return last, when

    def wait_for_step(self, rank, step, limit=120):
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if self.steps_done(rank)[0] >= step:
                return
            if all(p.poll() is not None for p in self.procs):
                raise AssertionError(f"the job ended before rank {rank} reached step {step}:\n"
                                     f"{self.output()}")
            time.sleep(0.01)
        raise AssertionError(f"rank {rank} did not reach step {step} in {limit} s:\n"
                             f"{self.output()}")

    def pid(self, rank):
        return int((self.out / f"rank{rank}.pid").read_text())

    # --- faults
    def inject(self, sig, victim, rng):
        """Sends `sig` to `victim` at a random moment of a step: after a random step between
        2 and 5 ends on the victim, a random fraction of that step's duration later."""
        step = rng.randint(2, 5)
        self.wait_for_step(victim, step)
        duration = self._step_seconds(victim)
        time.sleep(rng.random() * duration)
        os.kill(self.pid(victim), sig)
        self.fault_at = time.monotonic() - self.started
        self.fault = f"{signal.Signals(sig).name} to rank {victim} after step {step} + " \
                     f"{duration:.3f} s x fraction"
        return self

    def _step_seconds(self, rank):
        times = [t for t, line in list(self.lines) if line.startswith(f"STEP {rank} ")]
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.01

    # --- ending
    def finish(self, deadline_s=DEADLINE_S, spare=()):
        """Waits until every process except the ranks in `spare` (a stopped victim) ended, at
        most `deadline_s` after the fault (or the start), then kills whatever is left (the
        spared ranks first). Returns every rank's Ending (not the spared ranks')."""
        origin = self.fault_at if self.fault_at is not None else 0.0
        limit = self.started + origin + deadline_s
        spared = {self.pid(r) for r in spare}
        waiting = [p for p in self.procs if p.pid not in spared]
        while time.monotonic() < limit and any(p.poll() is None for p in waiting):
            time.sleep(0.05)
        ended = {p.pid: p.poll() for p in self.procs}
        end_times = self._end_times()
        for rank in spare:
            self._kill(self.pid(rank))
        for proc in self.procs:
            if proc.poll() is None:
                self._kill_session(proc.pid)
            proc.wait()
        endings = []
        for rank in range(self.world):
            if rank in spare:
                continue
            report = self._report(rank)
            if self.transport == "mpi":  # mpirun's ranks: what their reports say
                code = None if report is None else (3 if "error_type" in report else 0)
            else:
                code = ended.get(self._pid_or_none(rank))
            after = None
            if report and "at" in report and self.fault_at is not None:
                after = end_times.get(rank)
            endings.append(Ending(rank, code, report, after))
        return endings

    def _end_times(self):
        """Seconds from the fault to each rank's report (when it raised)."""
        times = {}
        if self.fault_at is None:
            return times
        fault_wall = time.time() - (time.monotonic() - self.started - self.fault_at)
        for rank in range(self.world):
            report = self._report(rank)
            if report and "at" in report:
                times[rank] = report["at"] - fault_wall
        return times

    def _pid_or_none(self, rank):
        try:
            return self.pid(rank)
        except (OSError, ValueError):
            return None

    def _report(self, rank):
        try:
            return json.loads((self.out / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _kill(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_session(self, sid):
        """The job's whole session: a rank, or mpirun and every rank it started."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                self._kill(int(entry.name))

    def output(self):
        return "\n".join(f"{t:7.2f} {line}" for t, line in list(self.lines)[-60:])

    def describe(self):
        return (f"transport {self.transport}, world {self.world}, worker args "
                f"{' '.join(map(str, self.worker_args))}; fault: {self.fault or 'none'} at "
                f"{self.fault_at}\n--- output (last lines)\n{self.output()}")


def run(tmp_path, transport, world, *worker_args):
    out = Path(tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return Job(transport, world, out, list(worker_args)).start()


def rng_for(name):
    """A random moment that differs per test but is the same on every run of that test
    (GRADCOMP_FAULT_SEED changes it, to search for more)."""
    return random.Random(f"{name}:{os.environ.get('GRADCOMP_FAULT_SEED', '0')}")
