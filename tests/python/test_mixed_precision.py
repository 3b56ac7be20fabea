"""Mixed precision: an overflow injected under a dynamic loss scaler is skipped by every rank,
leaves every feedback memory as it was, and the run ends where the run without it ends (within
the noise of one skipped batch); the loss scale reaches error feedback, so a scaled run trains
as an unscaled one."""
import pytest

INJECT = 3
FEEDBACKS = ["topk:ratio=0.01|ef", "powersgd:rank=2|ef", "dgc:ratio=0.01|dgc",
             "qsgd|nesterov:ef=true"]
UNSCALED = ["topk:ratio=0.01|ef", "dgc:ratio=0.01|dgc"]


def train(module_runner, codecs, *args):
    """One job training each codec in turn (a fresh model each): a Python start-up per rank
    is most of a short job's cost."""
    codec_args = [a for c in codecs for a in ("--compression", c)]
    return module_runner("amp.py", *codec_args, *args).check()


@pytest.fixture(scope="module")
def runs(module_runner):
    """Every codec with the overflow injected, and without it."""
    return (train(module_runner, FEEDBACKS, "--inject-at", INJECT),
            train(module_runner, FEEDBACKS))


@pytest.mark.parametrize("compression", FEEDBACKS)
def test_an_injected_overflow_is_skipped_and_forgotten(runs, compression):
    hit, clean = runs
    reports = [report[compression] for report in hit.reports()]
    for rank, report in enumerate(reports):
        expected = ["stepped"] * 12
        expected[INJECT] = "skipped"
        assert report["outcomes"] == expected, f"rank {rank}: {report['outcomes']}"
        assert report["finite"]
    # The scaler halved its scale at the overflow; the memory followed the scale.
    assert reports[0]["scales"][INJECT + 1] == reports[0]["scales"][INJECT] / 2
    a, b = (params[compression] for params in hit.loads("amp"))
    assert a == b, "ranks differ after the overflow"
    # One batch fewer: the run learns about as much as the clean run (a poisoned memory would
    # have skipped every later step and learned nothing).
    start = reports[0]["initial_loss"]
    got, want = reports[0]["eval_loss"], clean.report(0)[compression]["eval_loss"]
    assert start - got > 0.75 * (start - want), (start, got, want)


@pytest.fixture(scope="module")
def unscaled(module_runner):
    """Every codec without loss scaling, in the clean run's order (so each optimizer is built
    as the one it is compared with)."""
    return train(module_runner, FEEDBACKS, "--scaler", 0)


@pytest.mark.parametrize("compression", UNSCALED)
def test_a_scaled_run_trains_as_an_unscaled_one(runs, unscaled, compression):
    _, scaled = runs  # the clean runs are scaled
    plain = unscaled.report(0)[compression]["eval_loss"]
    assert scaled.report(0)[compression]["eval_loss"] == pytest.approx(plain, rel=1e-3)
