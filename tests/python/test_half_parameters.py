"""float16 and bfloat16 parameters are accepted: their gradients travel in float32 (error
feedback too) and the float32 mean is rounded into .grad, the same bits on every rank."""
import sys

import pytest
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "workers"))
import common  # noqa: E402
import half_params  # noqa: E402


def local_grads(rank, step, params):
    model = half_params.Mixed()
    with torch.no_grad():
        for dst, src in zip(model.parameters(), params):
            dst.copy_(src)
    x, y = common.batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [q.grad for q in model.parameters()]


def test_half_gradients_are_the_rounded_float32_mean(run_workers):
    job = run_workers("half_params.py", "--steps", 3).check()
    assert sorted(job.report(0)["dtypes"]) == ["torch.bfloat16", "torch.bfloat16",
                                               "torch.float16", "torch.float32",
                                               "torch.float32"]
    steps = job.loads("half")
    torch.set_num_threads(1)
    for step in range(3):
        for a, b in zip(steps[0][step]["grads"], steps[1][step]["grads"]):
            assert a.dtype == b.dtype and torch.equal(a, b), f"step {step}: ranks differ"
        params = steps[0][step]["params"]
        local = [local_grads(r, step, params) for r in range(2)]
        for i, got in enumerate(steps[0][step]["grads"]):
            want = ((local[0][i].float() + local[1][i].float()) * 0.5).to(got.dtype)
            assert torch.equal(got, want), f"step {step}, parameter {i}"


@pytest.mark.parametrize("compression", ["topk:ratio=0.05|ef", "fp16"])
def test_half_parameters_compress_and_agree(run_workers, compression):
    job = run_workers("half_params.py", "--compression", compression, "--steps", 4).check()
    a, b = job.loads("half")
    for step in range(4):
        for x, y in zip(a[step]["params"], b[step]["params"]):
            assert torch.equal(x, y), f"step {step}: parameters differ"
            assert bool(torch.isfinite(x.float()).all())
    assert job.report(0)["bytes_sent"] < job.report(0)["uncompressed"]
