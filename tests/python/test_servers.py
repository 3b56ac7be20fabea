"""Route 'servers': dedicated parameter servers (`gradcomp server`) started by `gradcomp launch
--servers S` or by hand, reached from the workers of gradcomp's Gloo, a torch.distributed process
group, and Open MPI. With as many servers as workers the route computes what the co-located
two-way route does, bit for bit; a dead server or worker is an error on every peer."""
import subprocess

import pytest

from conftest import GRADCOMP, PYTHON, WORKERS, Job, _environment, free_port

SPEC = "topk:ratio=0.01|ef"


@pytest.fixture(scope="module")
def twoway_digests(module_runner):
    """The co-located two-way route's parameters after every step (the reference)."""
    job = module_runner("servers.py", "--compression", f"{SPEC}|twoway", "--steps", "4").check()
    reports = job.reports()
    assert reports[0]["digests"] == reports[1]["digests"]
    return reports[0]["digests"]


@pytest.mark.parametrize("transport", ["default", "pg"])
def test_as_many_servers_as_workers_compute_what_twoway_does(run_workers, twoway_digests,
                                                           transport):
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "4",
                      "--transport", transport, servers=2).check()
    for report in job.reports():
        assert report["routes"] == ["allreduce", "servers"]
        assert report["digests"] == twoway_digests
    # The servers ended on the workers' stop, not on the launcher's SIGTERM after its notice.
    assert "still running" not in job.stderr, job.describe()


def test_the_ddp_hook_over_servers_computes_what_its_twoway_does(run_workers):
    args = ["--ddp", "--steps", "5"]
    twoway = run_workers("servers.py", "--compression", f"{SPEC}|twoway", *args).check()
    servers = run_workers("servers.py", "--compression", f"{SPEC}|servers", *args,
                          servers=2).check()
    want = twoway.report(0)["digests"]
    assert len(set(want)) == 5  # the hook compresses from its third iteration on
    for report in servers.reports():
        assert report["digests"] == want
        assert 0 < report["stats"]["bytes_sent"] < report["stats"]["uncompressed_bytes"]


@pytest.mark.parametrize("world, servers, transport",
                         [(2, 1, "default"), (2, 3, "default"), (4, 2, "pg")])
def test_other_server_counts_train_alike_on_every_rank(run_workers, world, servers, transport):
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "3",
                      "--transport", transport, world=world, servers=servers).check()
    reports = job.reports()
    assert all(r["digests"] == reports[0]["digests"] for r in reports)
    assert len(set(reports[0]["digests"])) == 3  # the parameters moved every step


@pytest.mark.parametrize("case, keys", [("two_optimizers", ["a", "b"]), ("gan", ["g", "d"])])
def test_two_optimizers_of_one_process_use_the_servers_together(run_workers, case, keys):
    """Two live engines over servers (two models under one loss; a GAN's loop): each claims a
    channel of the link, and both compute what they do over the co-located two-way route."""
    def steps(route, servers):
        job = run_workers("coordination.py", "--case", case, "--steps", "4", "--compression",
                          f"{SPEC}|{route}", servers=servers).check()
        return job.loads("steps")
    twoway, over_servers = steps("twoway", 0), steps("servers", 2)
    for rank in range(2):
        for step, (got, want) in enumerate(zip(over_servers[rank], twoway[rank])):
            for key in keys:
                assert got[key] == want[key], f"rank {rank} step {step}: {key} differs"
    assert over_servers[0][-1][keys[0]] != over_servers[0][0][keys[0]]  # they trained


def test_servers_wait_out_a_pause_longer_than_the_timeout(run_workers, twoway_digests):
    """Between steps the servers wait for the workers' next operation however long it takes (an
    evaluation, a checkpoint written): only a collective under way is bound by a timeout, the
    workers' GRADCOMP_TIMEOUT and the servers' --timeout. The pause is longer than both (the
    servers' leaves time for their rendezvous with workers still importing torch)."""
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "4",
                      "--at", "1", "--pause", "18", servers=2,
                      launch_args=["--server-timeout", "15"],
                      env={"GRADCOMP_TIMEOUT": "2"}).check()
    for report in job.reports():
        assert report["error"] is None
        assert report["digests"] == twoway_digests


def test_mpirun_workers_reach_servers_started_by_hand(tmp_path, twoway_digests):
    port = free_port()
    store = f"tcp://127.0.0.1:{port}"
    env = _environment({"GRADCOMP_SERVERS": "2", "GRADCOMP_SERVER_STORE": store})
    servers = [subprocess.Popen([str(GRADCOMP), "server", "--index", str(s), "--servers", "2",
                                 "--workers", "2", "--store", store, "--timeout", "60"],
                                env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
               for s in range(2)]
    try:
        out = tmp_path / "mpi"
        out.mkdir()
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
               "-x", "GRADCOMP_SERVERS", "-x", "GRADCOMP_SERVER_STORE",
               PYTHON, str(WORKERS / "servers.py"), "--out", str(out),
               "--compression", f"{SPEC}|servers", "--steps", "4"]
        done = subprocess.run(cmd, cwd=WORKERS, env=env, text=True, capture_output=True,
                              timeout=150)
        assert done.returncode == 0, done.stdout + done.stderr
        job = Job(0, done.stdout, done.stderr, 0, out, 2, cmd)
        for report in job.reports():
            assert report["digests"] == twoway_digests
        for s in servers:  # the workers' stop at exit ends them
            assert s.wait(timeout=30) == 0, s.stderr.read()
    finally:
        for s in servers:
            if s.poll() is None:
                s.kill()
                s.wait()


def test_a_killed_server_is_an_error_on_every_worker(run_workers):
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "20",
                      "--kill-server", "1", "--at", "1", servers=2,
                      env={"GRADCOMP_TIMEOUT": "20"})
    assert job.returncode != 0, job.describe()
    assert job.seconds < 60, job.describe()
    errors = [r["error"] for r in job.reports()]
    for error in errors:
        assert error is not None and error["type"] in ("CommError", "TimeoutError"), errors
        assert "servers" in error["message"] or "bucket" in error["message"], errors
        assert error["step"] <= 3, errors
        assert "ranks 2..3 servers 0..1" in error["message"], errors  # which link rank is which
    assert "server 1" in job.stderr and "killed by signal 9" in job.stderr, job.describe()


def test_a_worker_that_dies_ends_the_servers(run_workers):
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "20",
                      "--exit-rank", "1", "--at", "1", servers=2,
                      env={"GRADCOMP_TIMEOUT": "20"})
    assert job.returncode == 3, job.describe()
    assert job.seconds < 60, job.describe()
    assert "rank 1" in job.stderr and "exited with code 3" in job.stderr, job.describe()


def test_a_rank_s_own_checkpoint_refuses_server_state_with_a_reason(run_workers):
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "1",
                      "--checkpoint", servers=2).check()
    message = job.report(0)["checkpoint"]
    assert "server-side" in message and "all_ranks=True" in message, message
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers:server_feedback=none",
                      "--steps", "1", "--checkpoint", servers=2).check()
    assert job.report(0)["checkpoint"] == "saved"


# The second keeps all compression state on the servers: no worker feedback.
@pytest.mark.parametrize("spec, servers", [(f"{SPEC}|servers", 2),
                                           ("topk:ratio=0.01|none|servers:server_feedback=ef", 3)])
def test_a_checkpoint_of_every_rank_resumes_the_servers_exactly(run_workers, tmp_path, spec,
                                                               servers):
    path = str(tmp_path / "all.pt")
    args = ["servers.py", "--compression", spec, "--steps", "6"]
    whole = run_workers(*args, "--save", path, "--save-after", "3", servers=servers).check()
    want = whole.report(0)["digests"]
    resumed = run_workers(*args, "--load", path, "--begin", "3", servers=servers).check()
    control = run_workers(*args, "--load", path, "--begin", "3", "--model-only",
                          servers=servers).check()
    for report in resumed.reports():
        assert report["digests"] == want[3:]
    # Without the compression state (most of it the servers') the run goes elsewhere.
    assert control.report(0)["digests"][-1] != want[-1]


def test_the_ddp_hook_over_servers_resumes_as_its_twoway_does(run_workers, tmp_path):
    """After a restart the hook averages uncompressed while DDP learns its buckets again, so a
    resumed hook is compared with the co-located route's, resumed alike; they agree only if the
    servers got their state back."""
    def resumed(route, servers):
        path = str(tmp_path / f"{route}.pt")
        args = ["servers.py", "--ddp", "--compression", f"{SPEC}|{route}", "--steps", "10"]
        run_workers(*args, "--save", path, "--save-after", "5", servers=servers).check()
        return run_workers(*args, "--load", path, "--begin", "5", servers=servers).check()
    want = resumed("twoway", 0).report(0)["digests"]
    for report in resumed("servers", 2).reports():
        assert report["digests"] == want


def test_servers_that_never_come_are_an_error_within_the_timeout(run_workers):
    store = f"tcp://127.0.0.1:{free_port()}"
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "1",
                      env={"GRADCOMP_SERVERS": "2", "GRADCOMP_SERVER_STORE": store,
                       "GRADCOMP_TIMEOUT": "5"})
    assert job.returncode != 0
    assert job.seconds < 60, job.describe()
    assert f"reaching the 2 parameter servers through {store}" in job.stderr, job.describe()


def test_without_servers_the_route_says_how_to_start_them(run_workers):
    job = run_workers("servers.py", "--compression", f"{SPEC}|servers", "--steps", "1")
    assert job.returncode != 0
    assert "GRADCOMP_SERVERS is not set" in job.stderr and "--servers" in job.stderr, \
        job.describe()


@pytest.mark.parametrize("args, message", [
    (["--index", "2", "--servers", "2", "--workers", "2", "--store", "tcp://127.0.0.1:1"],
     "index is 2; it must be from 0 to 1"),
    (["--index", "0", "--servers", "2", "--workers", "2"], "no store given"),
    (["--index", "0", "--servers", "0", "--workers", "2", "--store", "tcp://h:1"], "--servers"),
])
def test_server_options_are_checked(args, message):
    done = subprocess.run([str(GRADCOMP), "server", *args], env=_environment({}), text=True,
                          capture_output=True, timeout=30)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr

