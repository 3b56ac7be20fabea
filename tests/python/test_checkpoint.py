"""Checkpoint and resume of DistributedOptimizer with stateful compression: training resumed
from a checkpoint in new processes ends bit-identical to training without interruption; wrong
checkpoints are refused with a clear gradcomp.Error."""
import pytest

STEPS = 6
CODECS = ["topk:ratio=0.05|ef", "powersgd:rank=2|ef", "randomk:ratio=0.1|ef", "dgc|dgc"]


@pytest.fixture(scope="module")
def runs(module_runner, tmp_path_factory):
    """Three jobs for every codec at once (each job trains each codec in turn): STEPS steps
    straight; the first half, saving checkpoints; the second half in new processes, loading
    them (and trying wrong ones)."""
    checkpoint = tmp_path_factory.mktemp("checkpoints") / "ckpt"
    codecs = [a for c in CODECS for a in ("--compression", c)]
    straight = module_runner("resume.py", *codecs, "--end", STEPS).check()
    halfway = module_runner("resume.py", *codecs, "--end", STEPS // 2,
                            "--save", checkpoint).check()
    resumed = module_runner("resume.py", *codecs, "--begin", STEPS // 2, "--end", STEPS,
                            "--load", checkpoint, "--check-errors").check()
    return straight, halfway, resumed


@pytest.fixture(scope="module")
def one_file_runs(module_runner, tmp_path_factory, runs):
    """The usual pattern: rank 0 alone saves one checkpoint (state_dict(all_ranks=True)), and
    every rank resumes from that file."""
    checkpoint = tmp_path_factory.mktemp("one-file") / "ckpt"
    codecs = [a for c in CODECS for a in ("--compression", c)]
    module_runner("resume.py", *codecs, "--end", STEPS // 2, "--save", checkpoint,
                  "--one-file").check()
    assert not list(checkpoint.parent.glob("*.rank*.pt")), "only rank 0 should have saved"
    return module_runner("resume.py", *codecs, "--begin", STEPS // 2, "--end", STEPS,
                         "--load", checkpoint, "--one-file").check()


@pytest.mark.parametrize("compression", CODECS)
def test_resume_from_one_file_saved_by_rank_0_is_bit_exact(runs, one_file_runs, compression):
    straight = runs[0]
    for rank, r in enumerate(one_file_runs.loads("final")):
        assert r[compression]["full"] == straight.load("final", rank)[compression]["full"], \
            f"rank {rank}: resumed from rank 0's file, training differs"


@pytest.mark.parametrize("compression", CODECS)
def test_resume_is_bit_exact(runs, compression):
    straight, halfway, resumed = runs
    # Compression really happened (otherwise the state under test would be empty).
    stats = straight.report(0)[compression]
    assert stats["bytes_sent"] < stats["uncompressed_bytes"]
    final = [f[compression] for f in straight.loads("final")]
    assert final[0]["full"] == final[1]["full"], "ranks disagree after uninterrupted training"
    assert halfway.load("final", 0)[compression]["full"] != final[0]["full"], \
        "the second half must change the parameters"
    for rank, r in enumerate(resumed.loads("final")):
        assert r[compression]["full"] == final[rank]["full"], \
            f"rank {rank}: resumed training differs from uninterrupted training"


def test_resume_without_compression_state_differs(runs):
    """The control: resuming the model and SGD but not gradcomp's state (error-feedback
    residuals, PowerSGD's warm start, DGC's momenta) changes the result, so the bit-identity
    above is not vacuous."""
    straight, _, resumed = runs
    for compression in CODECS:
        want = straight.load("final", 0)[compression]["full"]
        got = [r[compression]["model_only"] for r in resumed.loads("final")]
        assert got[0] == got[1], compression
        assert got[0] != want, f"{compression}: the compression state made no difference"


def test_wrong_checkpoints_are_refused(runs):
    for rank, report in enumerate(runs[2].reports()):
        r = report["errors"]
        for case in ("other_rank", "other_plan", "version_99", "flipped_byte"):
            assert r[case] is not None, f"rank {rank}: loading {case} did not fail"
            kind, message, is_gradcomp_error = r[case]
            assert is_gradcomp_error, f"rank {rank}, {case}: {kind}: {message}"
        assert "rank" in r["other_rank"][1], r["other_rank"][1]
        assert "plan" in r["other_plan"][1], r["other_plan"][1]
        plain = r["no_gradcomp"]
        assert plain["error"] is None, plain
        assert any("afresh" in w for w in plain["warnings"]), plain
        assert "99" in r["version_99"][1], r["version_99"][1]
        assert "checksum" in r["flipped_byte"][1], r["flipped_byte"][1]
        assert r["optimizer_refuses"] is not None, "the broken optimizer state loaded"
        assert r["unchanged"], f"rank {rank}: a failed load changed the compression state"
        assert r["own"] is None, f"rank {rank}: its own checkpoint did not load: {r['own']}"
        assert r["own_loaded"]
