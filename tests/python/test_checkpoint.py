"""Checkpoint and resume of DistributedOptimizer with stateful compression: training resumed
from a checkpoint in new processes ends bit-identical to training without interruption; wrong
checkpoints are refused with a clear gradcomp.Error."""
import pytest

STEPS = 6
CODECS = ["topk:ratio=0.05|ef", "powersgd:rank=2|ef", "randomk:ratio=0.1|ef", "dgc|dgc"]


@pytest.fixture(scope="module")
def runs(module_runner, tmp_path_factory):
    """Three jobs for every codec at once (each job trains each codec in turn): STEPS steps
    straight, saving checkpoints halfway as it goes (each rank its own file, and rank 0 one file
    for all: state_dict(all_ranks=True), the usual pattern); the second half in new processes
    from each rank's own file (and trying wrong ones); the second half from rank 0's file."""
    own = tmp_path_factory.mktemp("checkpoints") / "ckpt"
    one_file = tmp_path_factory.mktemp("one-file") / "ckpt"
    codecs = [a for c in CODECS for a in ("--compression", c)]
    straight = module_runner("resume.py", *codecs, "--end", STEPS, "--save-at", STEPS // 2,
                             "--save", own, "--save-one-file", one_file).check()
    assert not list(one_file.parent.glob("*.rank*.pt")), "only rank 0 should have saved"
    resumed = module_runner("resume.py", *codecs, "--begin", STEPS // 2, "--end", STEPS,
                            "--load", own, "--check-errors").check()
    from_one_file = module_runner("resume.py", *codecs, "--begin", STEPS // 2, "--end", STEPS,
                                  "--load", one_file, "--one-file").check()
    return straight, resumed, from_one_file


@pytest.mark.parametrize("compression", CODECS)
def test_resume_from_one_file_saved_by_rank_0_is_bit_exact(runs, compression):
    straight, _, from_one_file = runs
    for rank, r in enumerate(from_one_file.loads("final")):
        assert r[compression]["full"] == straight.load("final", rank)[compression]["full"], \
            f"rank {rank}: resumed from rank 0's file, training differs"


@pytest.mark.parametrize("compression", CODECS)
def test_resume_is_bit_exact(runs, compression):
    straight, resumed, _ = runs
    # Compression really happened (otherwise the state under test would be empty).
    stats = straight.report(0)[compression]
    assert stats["bytes_sent"] < stats["uncompressed_bytes"]
    final = [f[compression] for f in straight.loads("final")]
    assert final[0]["full"] == final[1]["full"], "ranks disagree after uninterrupted training"
    assert final[0]["at_save"] != final[0]["full"], \
        "the second half must change the parameters"
    for rank, r in enumerate(resumed.loads("final")):
        assert r[compression]["full"] == final[rank]["full"], \
            f"rank {rank}: resumed training differs from uninterrupted training"


def test_resume_without_compression_state_differs(runs):
    """The control: resuming the model and SGD but not gradcomp's state (error-feedback
    residuals, PowerSGD's warm start, DGC's momenta) changes the result, so the bit-identity
    above is not vacuous."""
    straight, resumed, _ = runs
    for compression in CODECS:
        want = straight.load("final", 0)[compression]["full"]
        got = [r[compression]["model_only"] for r in resumed.loads("final")]
        assert got[0] == got[1], compression
        assert got[0] != want, f"{compression}: the compression state made no difference"


def test_wrong_checkpoints_are_refused(runs):
    for rank, report in enumerate(runs[1].reports()):
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
