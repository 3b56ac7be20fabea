"""Every rank holds bit-identical parameters after every step, for codecs of every kind, every
route, and every transport: gradcomp's own Gloo, a torch.distributed gloo process group, and
Open MPI (under mpirun)."""
import pytest

# (spec, route the plan's compressed buckets must take)
SPECS = [
    ("none", "allreduce"),
    ("fp16", "allreduce"),
    ("intq:bits=4", "allreduce"),
    ("powersgd:rank=2|ef", "allreduce"),
    ("topk:ratio=0.05|ef|allgather", "allgather"),
    ("signsgd||allgather", "allgather"),
    ("dgc|dgc", "allgather"),
    ("qsgd||twoway", "twoway"),
    ("randomk:ratio=0.1|ef|twoway", "twoway"),
    ("fp16||hierarchical", "hierarchical"),
    ("qsgd|ef|hierarchical:inner=allgather", "hierarchical"),
]

# (launcher, world, --transport, local size for the hierarchical route)
JOBS = {
    "gloo-2": ("launch", 2, "gloo", 1),
    "gloo-4": ("launch", 4, "default", 2),
    "pg-2": ("launch", 2, "pg", 1),
    "mpi-2": ("mpirun", 2, "default", 1),
    "mpi-4": ("mpirun", 4, "mpi", 2),
}


@pytest.fixture(scope="module")
def jobs(module_runner):
    """One job per transport and world size, each training every spec in turn (lazily, so
    selecting one test starts only its job)."""
    done = {}

    def get(name):
        if name not in done:
            launcher, world, transport, local_size = JOBS[name]
            specs = [a for s, _ in SPECS for a in ("--compression", s)]
            done[name] = module_runner("agree.py", *specs, "--transport", transport,
                                       "--local-size", local_size, world=world,
                                       launcher=launcher).check()
        return done[name]

    return get


@pytest.mark.parametrize("job_name", list(JOBS))
def test_ranks_agree_after_every_step(jobs, job_name):
    job = jobs(job_name)
    reports = job.reports()
    expected_transport = {"gloo": "gloo", "pg": "torch.distributed", "mpi": "mpi"}[job_name.split("-")[0]]
    for rank, report in enumerate(reports):
        assert report["world"] == job.world
        assert expected_transport in report["transport"].lower(), report["transport"]
    for spec, route in SPECS:
        per_rank = [r["results"][spec] for r in reports]
        if job_name.startswith("pg") and route == "hierarchical":
            # A torch.distributed process group cannot be split into nodes by gradcomp: a
            # clear refusal on every rank, and the job goes on.
            for result in per_rank:
                assert "hierarchical" in (result["error"] or ""), (spec, result)
            continue
        for rank, result in enumerate(per_rank):
            assert result["error"] is None, f"{spec}: rank {rank}: {result['error']}"
            assert result["moved"], f"{spec}: rank {rank}'s parameters did not change"
            assert any(r.split(":")[0] == route for r in result["routes"]), \
                f"{spec}: plan routes {result['routes']}"
            assert result["digests"] == per_rank[0]["digests"], \
                f"{spec}: rank {rank}'s parameters differ from rank 0's"
        # Every step changed the parameters (no step was skipped).
        assert len(set(per_rank[0]["digests"])) == len(per_rank[0]["digests"]), spec
        stats = per_rank[0]["stats"]
        # A node leader of the hierarchical route also counts its uncompressed traffic inside
        # the node, so only the flat routes must send less than uncompressed.
        if spec != "none" and route != "hierarchical":
            assert stats["bytes_sent"] < stats["uncompressed_bytes"], (spec, stats)
