"""Sparse embedding gradients are exchanged as rows: the mean of the ranks' rows, bit-identical
on every rank, the same training as with a dense embedding, for far fewer bytes."""
import sys

import pytest
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "workers"))
import sparse_embedding  # noqa: E402


def local_embed_grad(rank, step, params, shared):
    """Rank `rank`'s own embedding gradient at `step`, recomputed from the parameters."""
    model = sparse_embedding.Bag(sparse=False)
    with torch.no_grad():
        for dst, src in zip(model.parameters(), params):
            dst.copy_(src)
    x = sparse_embedding.tokens(rank, step, shared)
    y = __import__("common").batch(rank, step)[1][:16]
    torch.nn.functional.mse_loss(model(x), y).backward()
    return model.embed.weight.grad


def check_mean(job, steps, shared):
    runs = job.loads("sparse")
    world = len(runs)
    torch.set_num_threads(1)
    for step in range(steps):
        first = runs[0][step]
        assert first["sparse"], "the mean is not a sparse tensor"
        for other in runs[1:]:
            assert torch.equal(first["embed_grad"], other[step]["embed_grad"]), \
                f"step {step}: ranks differ"
            for a, b in zip(first["params"], other[step]["params"]):
                assert torch.equal(a, b), f"step {step}: parameters differ"
        local = [local_embed_grad(r, step, first["params"], shared) for r in range(world)]
        want = sum(local[1:], local[0]) / world
        assert torch.allclose(first["embed_grad"], want, rtol=1e-6, atol=1e-9), f"step {step}"
        touched = set()
        for r in range(world):
            touched |= set(runs[r][step]["tokens"].flatten().tolist())
        rows = first["embed_grad"].abs().sum(dim=1).nonzero().flatten().tolist()
        assert set(rows) <= touched and len(touched) > 0


@pytest.mark.parametrize("world,shared", [(2, False), (4, True)])
def test_sparse_mean_is_the_rows_mean_on_every_rank(run_workers, world, shared):
    # 2 ranks with their own tokens: the rows are allgathered; 4 ranks with the same tokens:
    # the union is 4x smaller than all the rows, so it is summed block by block.
    args = ["--steps", 3] + (["--shared-tokens"] if shared else [])
    job = run_workers("sparse_embedding.py", *args, world=world).check()
    check_mean(job, 3, shared)


def test_sparse_trains_like_dense_for_fewer_bytes(run_workers):
    sparse = run_workers("sparse_embedding.py", "--steps", 6).check().loads("sparse")[0]
    dense = run_workers("sparse_embedding.py", "--steps", 6, "--dense").check().loads("sparse")[0]
    for step in range(6):
        assert sparse[step]["loss"] == pytest.approx(dense[step]["loss"], rel=1e-5, abs=1e-7)
        for a, b in zip(sparse[step]["params"], dense[step]["params"]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # The table has 5000 x 16 floats; a step touches at most 60 rows on each rank.
    assert sparse[-1]["bytes"] < dense[-1]["bytes"] / 10


def test_sparse_adam_and_adam_two_optimizers(run_workers):
    job = run_workers("sparse_embedding.py", "--split", "--steps", 3,
                      "--compression", "topk:ratio=0.25|ef").check()
    a, b = job.loads("sparse")
    for step in range(3):
        for x, y in zip(a[step]["params"], b[step]["params"]):
            assert torch.equal(x, y), f"step {step}: parameters differ"
    assert a[2]["params"][0].ne(a[0]["params"][0]).any(), "SparseAdam did not move the table"


def test_ddp_hook_exchanges_sparse_buckets_as_rows(run_workers):
    # The hook averages uncompressed until DDP's layout repeats, then builds its engine: the
    # sparse bucket is exchanged as rows in both phases, after the engine's buckets in the second.
    job = run_workers("sparse_embedding.py", "--ddp", "--compression", "topk:ratio=0.25|ef",
                      "--steps", 5).check()
    runs = job.loads("sparse")
    hooked = [s["hooked"] for s in runs[0]]
    assert not hooked[0] and hooked[-2:] == [True, True], hooked
    check_mean(job, 5, shared=False)


def test_an_undeclared_sparse_gradient_says_how_to_declare_it(run_workers):
    job = run_workers("sparse_embedding.py", "--undeclared", "--steps", 1)
    assert job.returncode != 0
    assert "sparse gradient" in job.output and "sparse_parameters" in job.output, job.describe()
