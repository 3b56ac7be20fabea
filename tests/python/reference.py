"""The uncompressed reference the tests compare workers against, computed in the test process
from the same seeds the workers use (workers/common.py)."""
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import common  # noqa: E402  (the workers' model and data)


@contextlib.contextmanager
def one_thread():
    """Gradients and norms computed with one intra-op thread, as in the workers, so the
    reductions inside them run in the same order and give the same bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def local_gradients(model, rank, step, micro_batches=1):
    """Rank `rank`'s own gradient at `step`, summed over micro-batches in the order autograd
    accumulates them into .grad."""
    total = None
    for micro in range(micro_batches):
        grads = torch.autograd.grad(common.loss_of(model, *common.batch(rank, step, micro)),
                                    list(model.parameters()))
        total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
    return total


def mean(values):
    """The mean the engine computes for W = 2: one rounded sum, then an exact halving (the
    engine multiplies by 1/W, which is exact for a power of two, as is torch's division)."""
    assert len(values) == 2, "a sum of more terms has no single order: use sums_in_any_order"
    return (values[0] + values[1]) * 0.5


def sums_in_any_order(values):
    """Every float32 sum of `values` a commutative reduction can produce: all binary trees
    over them (for 4 terms: 15 different trees). A collective adds in an order of its own,
    possibly a different one for each chunk of the buffer."""
    if len(values) == 1:
        return [values[0]]
    results = []
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            rest = [v for k, v in enumerate(values) if k not in (i, j)]
            results += sums_in_any_order(rest + [values[i] + values[j]])
    return results


def is_mean_in_some_order(result, values):
    """True where each element of `result` equals (sum in some order) / W exactly. Scaling by
    1/W with W a power of two is exact, so only the order of the additions can differ."""
    scale = 1.0 / len(values)
    candidates = torch.stack([s * scale for s in sums_in_any_order(values)])
    return bool((candidates == result).any(dim=0).all())
