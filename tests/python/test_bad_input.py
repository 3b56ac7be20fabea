"""Bad or unusual input: clear errors that name what is wrong, on every rank, and no hang."""
import pytest
import torch

import reference as ref

# Cases that leave the ranks able to go on share one job.
SHARED = ["unknown_codec", "bad_numbers", "bad_plan", "route_and_small_model", "float64_parameter", "frozen_parameter", "unused_parameter",
          "unused_parameter_found", "not_recommended", "same_parameters_twice"]


@pytest.fixture(scope="module")
def shared(module_runner):
    return module_runner("bad_input.py", *[a for c in SHARED for a in ("--case", c)]).check()


def assert_error(error, *words, gradcomp_error=True):
    assert error is not None, "no error was raised"
    kind, message, is_gradcomp_error = error
    for word in words:
        assert word in message, f"{kind}: {message!r} does not mention {word!r}"
    if gradcomp_error:
        assert is_gradcomp_error, f"{kind} is not a gradcomp.Error: {message}"


def test_unknown_codec_lists_the_codecs(shared):
    for report in shared.reports():
        r = report["unknown_codec"]
        assert r["error"][0] == "SpecError", r["error"]
        assert_error(r["error"], "zip", *r["codecs"])
        assert len(r["codecs"]) >= 17


def test_a_route_that_cannot_carry_the_codec_is_a_spec_error(shared):
    for report in shared.reports():
        r = report["route_and_small_model"]["route"]
        assert r[0] == "SpecError", r
        assert_error(r, "compression 'topk:ratio=0.01|ef|allreduce'", "not summable")
        assert "buckets[" not in r[1], r[1]


def test_a_model_too_small_to_compress_warns(shared):
    for report in shared.reports():
        r = report["route_and_small_model"]
        assert any("min_compress_elements" in m for m in r["small"]), r["small"]
        assert not r["large"], r["large"]
        # An optimizer of sparse parameters only: nothing is compressed, and not for the size.
        assert len(r["sparse_only"]) == 1, r["sparse_only"]
        assert "only sparse parameters (weight)" in r["sparse_only"][0], r["sparse_only"]
        assert "min_compress_elements" not in r["sparse_only"][0], r["sparse_only"]


def test_a_codec_that_lost_under_this_optimizer_warns(shared):
    # Rank 0 warns; the others (same options) stay quiet, so the job prints it once.
    for other in shared.reports()[1:]:
        assert not any(other["not_recommended"].values()), other["not_recommended"]
    r = shared.reports()[0]["not_recommended"]
    assert len(r["adamw_topk"]) == 1, r["adamw_topk"]
    for words in ("'topk:ratio=0.01|ef' is not recommended with AdamW",
                  "Adam-family optimizers", "docs/accuracy-lm.md", "fp16"):
        assert words in r["adamw_topk"][0], r["adamw_topk"][0]
    # efsignsgd held under SGD only after a warm-up: without one it warns, saying how.
    assert len(r["sgd_efsignsgd"]) == 1, r["sgd_efsignsgd"]
    for words in ("with SGD as written", "only after an uncompressed warm-up",
                  "docs/accuracy.md", "'efsignsgd|ef|allgather|start=1000'"):
        assert words in r["sgd_efsignsgd"][0], r["sgd_efsignsgd"][0]
    # Under AdamW it lost even with the warm-up.
    assert len(r["adamw_efsignsgd_warm"]) == 1, r["adamw_efsignsgd_warm"]
    assert "lost accuracy under Adam-family" in r["adamw_efsignsgd_warm"][0], r
    # What held, and a plan written by hand, say nothing.
    assert not r["adamw_fp16"] and not r["sgd_topk"] and not r["adamw_plan"], r
    assert not r["sgd_efsignsgd_warm"], r["sgd_efsignsgd_warm"]


def test_numbers_out_of_range_are_named(shared):
    for report in shared.reports():
        errors = report["bad_numbers"]
        for name in ("bucket_mb", "min_compress_elements", "seed", "backward_passes_per_step",
                     "codec_threads"):
            assert_error(errors[name], name, "allowed")
        assert_error(errors["bucket_mb nan"], "bucket_mb", "finite")
        assert_error(errors["seed str"], "seed", "integer")


def test_bad_plans_say_where(shared):
    for report in shared.reports():
        assert_error(report["bad_plan"]["syntax"], "plan", "not valid JSON", "line 1")
        assert_error(report["bad_plan"]["codec"], "buckets[0].codec", "nosuch")
        assert_error(report["bad_plan"]["shape"], "plan tensor '0.weight' has shape [16384], "
                     "the parameter [256, 64]")
        # Every parameter's shape is in the plan (PowerSGD makes each weight its own matrix),
        # and a given plan without shapes gets them.
        shapes = [tuple(s) for _, s in report["bad_plan"]["default_shapes"]]
        assert sorted(shapes) == sorted([(256, 64), (256,), (64, 256), (64,), (8, 64), (8,)])
        assert report["bad_plan"]["filled_shapes"] == report["bad_plan"]["default_shapes"]


def test_float64_parameter_is_named(shared):
    for report in shared.reports():
        error = report["float64_parameter"]["error"]
        assert_error(error, "float32")
        assert "'2.weight'" in error[1] or "'2.bias'" in error[1], error[1]
        assert "Double" in error[1] or "float64" in error[1], error[1]


def test_a_second_optimizer_over_the_same_parameters_is_refused(shared):
    reports = [r["same_parameters_twice"] for r in shared.reports()]
    for r in reports:
        assert_error(r["refused"], "is exchanged by another live DistributedOptimizer",
                     "destroy that one")
        assert "parameter '" in r["refused"][1], r["refused"]
    assert reports[0]["params"] == reports[1]["params"]  # both trained alike on every rank


def test_frozen_parameter_is_skipped(shared):
    reports = [r["frozen_parameter"] for r in shared.reports()]
    for r in reports:
        assert "0.weight" not in r["plan_tensors"] and "0.bias" not in r["plan_tensors"]
        assert set(r["plan_tensors"]) == {"2.weight", "2.bias", "4.weight", "4.bias"}
        assert r["frozen_unchanged"]
        assert r["frozen_grads"] == [True, True]  # no gradient was ever made for them
    assert reports[0]["params"] == reports[1]["params"]


def test_unused_parameter_is_averaged_as_zero(shared):
    """extra.weight: no gradient anywhere at step 0, only on rank 0 at step 1. Every rank
    still contributes (zeros), so the mean is rank 0's gradient halved, exactly."""
    steps = shared.loads("unused")
    for rank in range(2):
        assert torch.equal(steps[rank][0]["averaged"], torch.zeros(8, 64))
        assert steps[rank][1]["params"] == steps[0][1]["params"], f"rank {rank} differs"
        assert steps[rank][0]["params"] == steps[0][0]["params"], f"rank {rank} differs"
    assert steps[1][1]["local"] is None  # really unused on rank 1
    local = steps[0][1]["local"]
    assert local.abs().sum() > 0
    for rank in range(2):
        assert torch.equal(steps[rank][1]["averaged"], ref.mean([local, torch.zeros_like(local)]))


def test_find_unused_parameters_leaves_unused_ones_alone(shared):
    """find_unused_parameters=True, AdamW with weight decay: at step 0 extra.weight got no
    gradient on any rank, so .grad stays None on every rank and AdamW leaves it where it was;
    at step 1 rank 0 used it, so both ranks get the mean (rank 0's gradient halved) and step."""
    steps = shared.loads("unused_found")
    for rank in range(2):
        assert steps[rank][0]["grad_is_none"], f"rank {rank}: a gradient for an unused parameter"
        assert not steps[rank][0]["extra_moved"], f"rank {rank}: AdamW moved an unused parameter"
        assert not steps[rank][1]["grad_is_none"] and steps[rank][1]["extra_moved"]
        assert torch.equal(steps[rank][1]["averaged"], steps[0][1]["averaged"])
        for step in range(2):
            assert steps[rank][step]["params"] == steps[0][step]["params"], f"rank {rank} differs"
    assert steps[0][1]["averaged"].abs().sum() > 0


def test_sparse_gradient_is_named(run_workers):
    job = run_workers("bad_input.py", "--case", "sparse_gradient").check()
    for report in job.reports():
        r = report["sparse_gradient"]
        # Raised in the autograd hook: autograd re-raises it as a RuntimeError (gradcomp.Error
        # derives from it) with gradcomp's message.
        assert_error(r["backward"], "'0.weight'", "sparse", gradcomp_error=False)
        assert r["backward"][0] in ("RuntimeError", "Error"), r["backward"]
        # step() refuses to step on the pass that raised, and says why.
        assert_error(r["step"], "backward pass raised", "'0.weight'", "sparse")


def test_backward_twice_without_step_accumulates_means(run_workers):
    job = run_workers("bad_input.py", "--case", "backward_twice").check()
    for report in job.reports():
        case = report["backward_twice"]
        assert case["second"] is None, case["second"]
        assert case["after_first"], "backward() returned before .grad held the mean"
        assert case["after_second"], "the second pass did not add its mean to the first's"


def test_different_models_fail_on_every_rank(run_workers):
    """Rank 1 has another middle layer: every rank fails at construction with an error naming
    a tensor that really differs, long before the 60 s collective timeout."""
    job = run_workers("bad_input.py", "--case", "different_models", timeout=120)
    assert job.returncode != 0, job.describe()
    assert job.seconds < 40, job.describe()
    reports = job.reports()
    shapes = [r["shapes"] for r in reports]
    # Parameters are registered in backward order (the reverse of the model's): 4.bias agrees,
    # 4.weight is the first that differs.
    first = next(n for n in reversed(list(shapes[0])) if shapes[0][n] != shapes[1].get(n))
    assert first == "4.weight"
    for rank, report in enumerate(reports):
        assert report["error"] is not None, f"rank {rank} raised nothing"
        kind, message, is_gradcomp_error = report["error"]
        assert is_gradcomp_error, f"rank {rank}: not a gradcomp.Error: {kind}: {message}"
        assert f"'{first}'" in message, f"rank {rank}: {message!r} does not name {first!r}"
        assert "different" in message, message
        assert message in job.stderr, "the error must reach the user's terminal"
