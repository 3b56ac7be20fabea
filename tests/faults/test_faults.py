"""Fault injection on real processes: a rank killed (SIGKILL) or stopped (SIGSTOP) at a random
moment of a step, for every transport (gradcomp's Gloo, Open MPI, a torch.distributed group),
for the DistributedOptimizer and the DDP hook, at 2 and 4 ranks; and ranks that disagree (a
parameter more, another shape, another order, another plan, another seed, a checkpoint of
another world size). Every surviving rank must end with a clear error within the deadline:
never a hang, never a silent wrong result.

The moment of each fault is drawn from a generator seeded by the test's name, so a failure
repeats; GRADCOMP_FAULT_SEED=N draws other moments."""
import re
import signal

import pytest

from driver import DEADLINE_S, TIMEOUT_S, rng_for, run

TRANSPORTS = ["gloo", "mpi", "pg"]
FRONTENDS = ["optimizer", "hook"]
ENDLESS = 1_000_000  # steps: a job that fails to notice the fault cannot finish instead


def assert_clear_error(ending, job, *words):
    """A rank's report: a gradcomp.Error (not a bare RuntimeError) saying each of `words`."""
    report = ending.report
    assert report is not None, f"rank {ending.rank} left no report\n{job.describe()}"
    assert "error_type" in report, f"rank {ending.rank} finished as if nothing happened " \
                                   f"(a silent wrong result)\n{job.describe()}"
    message = report["message"]
    assert report["is_gradcomp_error"], f"rank {ending.rank}: not a gradcomp error: " \
                                        f"{report['error_type']}: {message}"
    for word in words:
        assert re.search(word, message), f"rank {ending.rank}: {message!r} lacks {word!r}"
    return report


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sig", ["KILL", "STOP"])
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_lost_peer_is_an_error_on_every_survivor(tmp_path, request, transport, frontend, sig,
                                                  world):
    rng = rng_for(request.node.name)
    victim = rng.randrange(world)
    job = run(tmp_path, transport, world, "--frontend", frontend, "--steps", ENDLESS)
    job.inject(getattr(signal, "SIG" + sig), victim, rng)
    endings = job.finish(spare=(victim,) if sig == "STOP" else ())
    survivors = [e for e in endings if e.rank != victim]
    if transport == "mpi" and sig == "KILL":
        # Open MPI's mpirun ends the job itself when a rank dies: it kills the survivors and
        # says which rank died. What matters is that nothing hangs and nothing finishes.
        mpirun = job.procs[0]
        assert mpirun.returncode not in (0, None), job.describe()
        assert re.search(rf"rank {victim}\b.*(signal 9|Killed)", job.output(), re.S), \
            job.describe()
        for ending in survivors:
            assert ending.report is None or "error_type" in ending.report, job.describe()
        return
    # The peer: the roll call names the rank that did not answer (or, when rank 0 is gone,
    # the store it served); over MPI nothing can ask, and a timeout says only that.
    named = rf"\branks? (\d+, )*{victim}(, \d+)* did not answer"
    peer = r"a peer may have died or stopped" if transport == "mpi" else \
        rf"{named}|rank 0, which serves it," if victim == 0 else named
    for ending in survivors:
        assert ending.returncode is not None, f"rank {ending.rank} hangs\n{job.describe()}"
        # An exchange error says 'gradcomp: bucket B, phase P: ...'. (With SIGSTOP, a survivor
        # may see a timeout, or the connection closed by a survivor that timed out first.)
        report = assert_clear_error(ending, job, r"^gradcomp: bucket \d+, phase \w+", peer)
        assert report["is_comm_error"], report
        assert ending.seconds_after_fault is None or ending.seconds_after_fault < DEADLINE_S


VARIANTS = {
    # variant: words the error must say
    "extra": [r"different tensors", r"'\d+\.(weight|bias)'|no tensor"],
    "shape": [r"different tensors", r"elements"],
    "order": [r"different tensors"],
    "plan": [r"different plans"],
    "seed": [r"different seed"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_that_disagree_fail_together(tmp_path, transport, variant):
    job = run(tmp_path, transport, 2, "--variant", variant, "--steps", 3)
    endings = job.finish(deadline_s=TIMEOUT_S + 60)
    for ending in endings:
        assert ending.returncode == 3, f"rank {ending.rank} did not fail\n{job.describe()}"
        report = assert_clear_error(ending, job, *VARIANTS[variant])
        assert report["step"] == 0, f"rank {ending.rank} trained before failing: {report}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_checkpoint_of_another_world_size_is_refused(tmp_path, transport):
    checkpoint = tmp_path / "world4.pt"
    saved = run(tmp_path / "save", transport, 4, "--steps", 2, "--checkpoint", checkpoint)
    for ending in saved.finish(deadline_s=120):
        assert ending.returncode == 0 or transport == "mpi", saved.describe()
        assert ending.report and "digest" in ending.report, saved.describe()
    job = run(tmp_path / "load", transport, 2, "--steps", 2, "--checkpoint", checkpoint)
    for ending in job.finish(deadline_s=TIMEOUT_S + 60):
        report = assert_clear_error(ending, job, "4 ranks", "2",
                                    "go on without the compression state")
        assert report["step"] == 0, report
