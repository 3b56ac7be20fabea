"""gradcomp's DDP communication hook: the same gradients as DistributedOptimizer for the same
plan, and with "none" the same as DDP's own allreduce."""
import json

import pytest
import torch

# Deterministic: no feedback; PowerSGD's randomness is shared (the seed), and it compresses the
# weight as its own 64 x 512 matrix on both paths.
CODECS = ["fp16", "topk:ratio=0.05", "powersgd:rank=2"]
GRAPH_MODE_CODECS = ["none", "topk:ratio=0.05|ef"]
GRAPH_MODES = ["find_unused_parameters", "static_graph", "static_graph_unused"]


@pytest.fixture(scope="module")
def job(module_runner):
    codecs = [a for c in CODECS for a in ("--compression", c)]
    modes = [a for c in GRAPH_MODE_CODECS for a in ("--graph-modes", c)]
    return module_runner("hook_vs_optimizer.py", *codecs, *modes).check()


def raw(tensors):
    return b"".join(t.numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("compression", CODECS)
def test_hook_and_optimizer_agree_bit_for_bit(job, compression):
    for rank, results in enumerate(job.loads("grads")):
        r = results[compression]
        # The hook compressed (its layout is fixed: one DDP bucket of the one weight), and the
        # optimizer's plan is one bucket with the same codec.
        assert r["layout"] == [((64, 512),)], r["layout"]
        assert len(r["plan"]["buckets"]) == 1
        for stats in (r["hook_stats"], r["optimizer_stats"]):
            assert 0 < stats["bytes_sent"] < stats["uncompressed_bytes"], stats
        assert r["hook_stats"]["bytes_sent"] == r["optimizer_stats"]["bytes_sent"]
        if compression.startswith("powersgd"):
            # The weight as its own 64 x 512 matrix: P (64 x 2) and Q (512 x 2) float32 payloads
            # (one matrix of 32768 fused elements would be 171 x 192: 2904 bytes).
            assert r["optimizer_stats"]["bytes_sent"] == 4 * 2 * (64 + 512)
        for step, (hook, opt) in enumerate(zip(r["hook"], r["optimizer"])):
            assert raw(hook) == raw(opt), f"rank {rank}, step {step}: the gradients differ"
    # Compression changed the gradients: the comparison above is between compressed results.
    fp16, topk, powersgd = (job.load("grads", 0)[c]["hook"][0][0] for c in CODECS)
    assert torch.linalg.matrix_rank(powersgd) <= 2
    assert not torch.equal(fp16, topk)
    assert (topk != 0).float().mean() < 0.2  # top-k keeps 5% per rank, at most 10% together


def test_none_hook_equals_plain_ddp(job):
    """Exact for W = 2: plain DDP scales each gradient by 1/2 before its allreduce, gradcomp
    sums and then scales; halving is exact in float32 (no subnormals here), so both give
    a/2 + b/2 = (a + b)/2 with the same single rounding in the sum. (For W not a power of two,
    or more than two summands in an order of the collective's choosing, they would agree only
    to a few ulp.)"""
    for rank, results in enumerate(job.loads("grads")):
        r = results["none_vs_ddp"]
        assert r["layout"] is not None and len(r["layout"]) > 1, r["layout"]
        for step, (plain, hooked) in enumerate(zip(r["plain"], r["hooked"])):
            for i, (a, b) in enumerate(zip(plain, hooked)):
                assert torch.equal(a, b), f"rank {rank}, step {step}, parameter {i}"


def test_hook_plan_keeps_the_start_step():
    # "|start=N" must reach the hook's plan (it builds the plan itself), not be dropped.
    from gradcomp import _C
    from gradcomp.torch import CommHook
    warm = CommHook("topk:ratio=0.01|ef||start=7", min_compress_elements=100).plan(
        [((1000,),), ((10,),)])
    assert warm["buckets"][0]["start_step"] == 7
    assert "start_step" not in warm["buckets"][1]  # uncompressed: nothing to warm up
    _C.validate_plan(json.dumps(warm))
    plain = CommHook("topk:ratio=0.01|ef", min_compress_elements=100).plan(
        [((1000,),), ((10,),)])
    assert all("start_step" not in b for b in plain["buckets"])


def test_hook_plan_gives_powersgd_every_parameter_with_its_shape():
    """PowerSGD compresses each layer as its own matrix, so the hook's plan lists the DDP
    bucket's gradients one by one with their shapes; other codecs get the bucket as one."""
    from gradcomp import _C
    from gradcomp.torch import CommHook
    layout = [((20, 50), (50,)), ((10,),)]
    plan = CommHook("powersgd:rank=2|ef", min_compress_elements=100).plan(layout)
    assert plan["version"] == 2
    assert [(t["elements"], t["shape"]) for t in plan["tensors"]] == [
        (1000, [20, 50]), (50, [50]), (10, [10])]
    assert [b["tensors"] for b in plan["buckets"]] == [[0, 1], [2]]
    assert plan["buckets"][0]["codec"].startswith("powersgd")
    assert plan["buckets"][1]["codec"] == "none"
    _C.validate_plan(json.dumps(plan))
    fused = CommHook("topk:ratio=0.01|ef", min_compress_elements=100).plan(layout)
    assert [t["elements"] for t in fused["tensors"]] == [1050, 10]
    assert "shape" not in fused["tensors"][0]


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_hook_under_ddp_modes_with_collectives_or_late_buckets_of_their_own(job, mode):
    """find_unused_parameters has DDP allreduce its map of used parameters during backward, on
    its own group: the hook's engine, exchanging from its threads on that group too, made the
    ranks see the collectives in different orders (Gloo aborted the job). static_graph delays
    DDP's first iteration and rebuilds its buckets one iteration later than usual: the hook
    had fixed the layout before and then refused every bucket."""
    none = [job.load("grads", r)["graph_modes"]["none"][mode] for r in range(job.world)]
    for rank, r in enumerate(none):
        assert r["layout"] is not None and len(r["layout"]) > 1, r["layout"]  # the engine ran
        assert len(r["hooked"]) == len(r["plain"]) > 0
        for step, (plain, hooked) in enumerate(zip(r["plain"], r["hooked"])):
            for i, (a, b) in enumerate(zip(plain, hooked)):
                if a is None or b is None:  # the unused head: None on both paths
                    assert a is None and b is None, f"rank {rank}, step {step}, parameter {i}"
                else:
                    assert torch.equal(a, b), f"rank {rank}, step {step}, parameter {i}"
    lossy = [job.load("grads", r)["graph_modes"]["topk:ratio=0.05|ef"][mode]
             for r in range(job.world)]
    assert lossy[0]["parameters"] == lossy[1]["parameters"]
    for r in lossy:
        assert 0 < r["stats"]["bytes_sent"] < r["stats"]["uncompressed_bytes"], r["stats"]


def test_hook_under_join_with_uneven_inputs(job):
    """A rank out of data under DDP's join() calls the hook with zero buckets outside backward;
    the hook queued its end-of-backward callback there and the job died ("Final callbacks can
    only be installed during backward pass")."""
    runs = [job.load("grads", r)["uneven_inputs"] for r in range(job.world)]
    for r in runs:  # uncompressed: exactly what DDP's own allreduce gives under join()
        assert r["none"]["hooked"] == r["none"]["plain"]
    lossy = [r["topk:ratio=0.05|ef"] for r in runs]
    assert lossy[0]["hooked"] == lossy[1]["hooked"]
    assert lossy[0]["hooked"] != lossy[0]["plain"]
    for r in lossy:
        assert 0 < r["stats"]["bytes_sent"] < r["stats"]["uncompressed_bytes"], r["stats"]


def test_hook_feedback_follows_the_loss_scale_when_given_the_scaler(job):
    """loss_scale= on the hook, as on the optimizer: with a scale that changes every step the
    hook's compressed (scaled) gradients equal the optimizer's bit for bit; without it the
    memory carried over is in the last step's units, and they differ."""
    for rank, results in enumerate(job.loads("grads")):
        r = results["scaled"]
        for step, (hook, opt) in enumerate(zip(r["hook"], r["optimizer"])):
            assert raw(hook) == raw(opt), f"rank {rank}, step {step}: the gradients differ"
        assert any(raw(h) != raw(o) for h, o in zip(r["hook_without_scale"][1:], r["optimizer"][1:]))
