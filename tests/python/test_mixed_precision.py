"""Mixed precision: an overflow injected under a dynamic loss scaler is skipped by every rank,
leaves every feedback memory as it was, and the run ends where the run without it ends (within
the noise of one skipped batch); the loss scale reaches error feedback, so a scaled run trains
as an unscaled one."""
import pytest

INJECT = 3
FEEDBACKS = ["topk:ratio=0.01|ef", "powersgd:rank=2|ef", "dgc:ratio=0.01|dgc",
             "qsgd|nesterov:ef=true"]


def train(module_runner, compression, *args):
    return module_runner("amp.py", "--compression", compression, *args).check()


@pytest.mark.parametrize("compression", FEEDBACKS)
def test_an_injected_overflow_is_skipped_and_forgotten(module_runner, compression):
    hit = train(module_runner, compression, "--inject-at", INJECT)
    clean = train(module_runner, compression)
    reports = hit.reports()
    for rank, report in enumerate(reports):
        expected = ["stepped"] * 12
        expected[INJECT] = "skipped"
        assert report["outcomes"] == expected, f"rank {rank}: {report['outcomes']}"
        assert report["finite"]
    # The scaler halved its scale at the overflow; the memory followed the scale.
    assert reports[0]["scales"][INJECT + 1] == reports[0]["scales"][INJECT] / 2
    a, b = hit.loads("amp")
    assert a["params"] == b["params"], "ranks differ after the overflow"
    # One batch fewer: the run learns about as much as the clean run (a poisoned memory would
    # have skipped every later step and learned nothing).
    start = reports[0]["initial_loss"]
    got, want = reports[0]["eval_loss"], clean.report(0)["eval_loss"]
    assert start - got > 0.75 * (start - want), (start, got, want)


@pytest.mark.parametrize("compression", ["topk:ratio=0.01|ef", "dgc:ratio=0.01|dgc"])
def test_a_scaled_run_trains_as_an_unscaled_one(module_runner, compression):
    scaled = train(module_runner, compression).report(0)["eval_loss"]
    plain = train(module_runner, compression, "--scaler", 0).report(0)["eval_loss"]
    assert scaled == pytest.approx(plain, rel=1e-3)
