"""Compression "none" against the uncompressed reference: the averaged gradients are the mean
of every rank's local gradient, and the wrapped optimizer (momentum, weight decay, a scheduler,
clipping, accumulation) steps exactly as the same optimizer fed those means."""
import pytest
import torch

import reference as ref
from reference import common


def replay(steps, world, lr=0.05, momentum=0.9, weight_decay=1e-3, step_lr=0, clip=0.0,
           accum=1):
    """The same training as workers/train_reference.py, without gradcomp: every rank's local
    gradient computed here, averaged, fed to a plain SGD. Yields, per step, the mean, the
    clipped mean, the learning rate used, the parameters and the momentum buffers."""
    model = common.make_model()
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_lr, 0.5) if step_lr else None
    for step in range(steps):
        local = [ref.local_gradients(model, r, step, accum) for r in range(world)]
        mean = [ref.mean(list(per_rank)) for per_rank in zip(*local)]
        for p, g in zip(params, mean):
            p.grad = g.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        clipped = [p.grad.clone() for p in params]
        lr_used = sgd.param_groups[0]["lr"]
        sgd.step()
        if scheduler:
            scheduler.step()
        yield {"local": local, "averaged": mean, "clipped": clipped, "lr": lr_used,
               "params": [p.detach().clone() for p in params],
               "momentum": [sgd.state[p]["momentum_buffer"].clone() for p in params]}


def assert_same(actual, expected, what):
    """Value-exact equality, tensor by tensor. torch.equal compares values, so +0 and -0 are
    equal: the engine's mean is (0 + sum) * 1/W, which turns a -0 sum into +0."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        diff = (a - e).abs().max().item()
        assert torch.equal(a, e), f"{what}: tensor {i} differs (max abs difference {diff:g})"


def assert_ranks_bit_identical(records, key):
    for step, per_rank in enumerate(zip(*(r["steps"] for r in records))):
        first = b"".join(t.numpy().tobytes() for t in per_rank[0][key])
        for rank, rec in enumerate(per_rank[1:], 1):
            mine = b"".join(t.numpy().tobytes() for t in rec[key])
            assert mine == first, f"step {step}: rank {rank}'s {key} differ from rank 0's"


@pytest.mark.parametrize("launcher,world,transport", [
    ("launch", 2, "own"), ("launch", 4, "own"), ("launch", 2, "pg"), ("mpirun", 2, "own")])
def test_none_is_the_exact_mean(run_workers, launcher, world, transport):
    """How exact: "none" without feedback allreduces the float32 buffer in place (a sum whose
    kernels are exactly commutative), then writes (0 + sum) * (1/W). At W = 2 the sum is one
    correctly rounded addition, whichever rank adds, and 1/2 is an exact scale: the result is
    (a + b) / 2 bit for bit, on every transport (but for the sign of a zero: the engine's
    0 + sum makes -0 into +0, hence torch.equal, which compares values). At W = 4 the collective adds four terms in an
    order of its own, different per chunk (ring algorithms), and under cancellation two orders
    can differ by far more than 1 ulp of the result; so the tightest true statement is that each
    element is exactly the mean for one of the 15 possible addition trees, not a tolerance."""
    job = run_workers("train_reference.py", "--steps", 2, "--transport", transport,
                      world=world, launcher=launcher).check()
    records = job.loads("train")
    assert_ranks_bit_identical(records, "averaged")
    with ref.one_thread():
        model = common.make_model()
        # Step 0 starts from the same parameters everywhere: recompute each rank's gradient.
        local = [ref.local_gradients(model, r, 0) for r in range(world)]
    for rank, rec in enumerate(records):
        # The worker's own gradient is what this process computes for it (same bits): the
        # reference below really is the input the engine saw.
        assert_same(rec["steps"][0]["local"], local[rank], f"rank {rank}'s local gradient")
    assert not torch.equal(local[0][0], local[1][0]), "ranks must see different data"
    for step, rec in enumerate(records[0]["steps"]):
        per_tensor = [[records[r]["steps"][step]["local"][i] for r in range(world)]
                      for i in range(len(rec["local"]))]
        for i, values in enumerate(per_tensor):
            if world == 2:
                # One addition, then an exact halving: the same bits as the reference.
                assert torch.equal(rec["averaged"][i], ref.mean(values)), f"step {step} t {i}"
            else:
                # W = 4: the collective adds four terms in an order of its own (per chunk);
                # the result is still exactly the mean for one of the possible orders.
                assert ref.is_mean_in_some_order(rec["averaged"][i], values), \
                    f"step {step}, tensor {i}: not the mean of the local gradients in any order"
    stats = job.report(0)["last_step"]
    # "none" sends every gradient uncompressed.
    assert stats["bytes_sent"] == stats["uncompressed_bytes"] > 0


def run_and_replay(run_workers, steps, explicit_sync=1, **options):
    args = ["--steps", steps, "--explicit-sync", explicit_sync]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", value]
    records = run_workers("train_reference.py", *args).check().loads("train")
    assert_ranks_bit_identical(records, "params")
    with ref.one_thread():
        expected = list(replay(steps, 2, **options))
    for rank, rec in enumerate(records):
        for step, (got, want) in enumerate(zip(rec["steps"], expected)):
            where = f"rank {rank}, step {step}"
            assert got["lr"] == want["lr"], where
            assert_same(got["averaged"], want["averaged"], f"{where}: averaged gradients")
            assert_same(got["clipped"], want["clipped"], f"{where}: clipped gradients")
            assert_same(got["params"], want["params"], f"{where}: parameters")
            assert_same(got["momentum"], want["momentum"], f"{where}: momentum buffers")
    return records, expected


def test_momentum_weight_decay_and_scheduler(run_workers):
    _, expected = run_and_replay(run_workers, 5, momentum=0.9, weight_decay=1e-3, step_lr=2)
    # StepLR(step_size=2, gamma=0.5) acted through the wrapper: 0.05, 0.05, 0.025, ...
    assert [s["lr"] for s in expected] == [0.05, 0.05, 0.025, 0.025, 0.0125]
    # The momentum buffers carry history: they are not just the last (decayed) gradient.
    last = expected[-1]
    assert not torch.equal(last["momentum"][0], last["clipped"][0])


@pytest.mark.parametrize("explicit_sync", [1, 0])
def test_clipping_clips_the_mean(run_workers, explicit_sync):
    """With synchronize() before clipping, or (as most scripts do) right after backward():
    backward() returns with the mean in .grad, as DDP does."""
    clip = 0.05
    _, expected = run_and_replay(run_workers, 3, explicit_sync=explicit_sync, clip=clip)
    for s in expected:
        norm = torch.norm(torch.stack([torch.norm(g) for g in s["averaged"]]))
        assert norm > clip, "the mean must be long enough for clipping to act"
        clipped_norm = torch.norm(torch.stack([torch.norm(g) for g in s["clipped"]]))
        assert clipped_norm == pytest.approx(clip, rel=1e-5)
    # Clipping each rank's gradient before averaging would give something else: the match
    # above really shows that the averaged gradients were clipped.
    first = expected[0]
    pre_clipped = []
    for local in first["local"]:
        grads = [g.clone() for g in local]
        norm = torch.norm(torch.stack([torch.norm(g) for g in grads]))
        pre_clipped.append([g * min(1.0, clip / (norm.item() + 1e-6)) for g in grads])
    other = [ref.mean(list(v)) for v in zip(*pre_clipped)]
    assert not all(torch.equal(a, b) for a, b in zip(other, first["clipped"]))


def test_accumulation_is_one_step_on_the_sum(run_workers):
    records, expected = run_and_replay(run_workers, 3, accum=2)
    # The averaged gradient is the mean of the sums of both micro-batches, not of the first
    # micro-batch alone.
    with ref.one_thread():
        first_only = [ref.local_gradients(common.make_model(), r, 0) for r in range(2)]
        sums = [ref.local_gradients(common.make_model(), r, 0, 2) for r in range(2)]
    assert not torch.equal(records[0]["steps"][0]["averaged"][0], ref.mean([first_only[0][0],
                                                                           first_only[1][0]]))
    assert torch.equal(records[0]["steps"][0]["averaged"][0], ref.mean([sums[0][0],
                                                                       sums[1][0]]))
