"""The cost of one optimizer step on one core: gradcomp's fused LAMB and LANS against torch's
AdamW (its loop and its foreach form) on the same tensors, and against a memcpy of the
parameter bytes (the floor of any update that reads and writes them). docs/optimizers.md.

    /usr/bin/python3 bench/optimizers/step_cost.py [--sizes 65536,1048576,16777216] [--repeat 30]

Prints a Markdown table per size: the median milliseconds per step; the step's speed relative
to a memcpy of the parameters (1.0 = as fast as copying the parameters once); and its memory
rate relative to memcpy's, counting the bytes per element the step must move (28 for Adam's
kin: read x, g, m, v, write x, m, v; 16 for 1-bit Adam's frozen-variance step, 32 for 1-bit
LAMB's) against
memcpy's 8: 1.0 = the update streams at memcpy's rate."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
import gradcomp.torch as gc  # noqa: E402
from gradcomp import _C  # noqa: E402


def median_ms(fn, repeat):
    fn()  # first call: allocations, lazy state
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def contenders(n):
    """name -> a function doing one step on a fresh parameter of n elements."""
    def stepper(make):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = torch.randn(n) * 1e-3
        optimizer = make([p])
        return optimizer.step

    def kernel(update):
        p, g = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
        m, v = torch.randn(n) * 1e-3, torch.full((n,), 1e-6)
        counter = [1]

        def step():
            counter[0] += 1
            update(p, g, m, v, counter[0])
        return step

    hyper = _C.AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    src, dst = torch.randn(n), torch.empty(n)
    return {
        "memcpy of the parameters": lambda: dst.copy_(src),
        "torch AdamW": stepper(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)),
        "torch AdamW (foreach)": stepper(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
        "gradcomp LAMB": stepper(lambda ps: gc.LAMB(ps, lr=1e-3)),
        "gradcomp LANS": stepper(lambda ps: gc.LANS(ps, lr=1e-3)),
        "gradcomp AdamW kernel (1-bit Adam's warm-up)": kernel(
            lambda p, g, m, v, t: _C.adamw_step(p, g, m, v, t, hyper, 1)),
        "gradcomp 1-bit Adam's frozen-variance step": kernel(
            lambda p, g, m, v, t: _C.frozen_adam_step(p, None, m, v, t, hyper, 1, 1)),
        "gradcomp 1-bit LAMB's compression-stage step": onebit_lamb_kernel(kernel, n, hyper),
    }


def onebit_lamb_kernel(kernel, n, hyper):
    """1-bit LAMB's step: g is the averaged momentum; the fresh variance and the layer's factor
    carried from step to step."""
    fresh, factor = torch.full((n,), 1e-6), [1.0]
    knobs = _C.OneBitLambHyper(0.9, 10.0, 0.01, 4.0, 0.5, 0.1)

    def update(p, g, m, v, t):
        _, factor[0] = _C.onebit_lamb_step(p, g, m, v, t, hyper, 1, fresh, 1, 0.5, factor[0],
                                           knobs)
    return kernel(update)


# Bytes per element a step must move: read x, g, m, v and write x, m, v (Adam's kin); the
# frozen-variance step reads x, m, v and writes x; 1-bit LAMB's reads x, the momentum, m, v, v'
# and writes x, m, v'.
NECESSARY_BYTES = {"gradcomp 1-bit Adam's frozen-variance step": 16,
                   "gradcomp 1-bit LAMB's compression-stage step": 32}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="65536,1048576,16777216",
                   help="parameter elements, comma-separated")
    p.add_argument("--repeat", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = {}
    for n in sizes:
        for name, fn in contenders(n).items():
            rows.setdefault(name, []).append(median_ms(fn, args.repeat))
    memcpy = rows.pop("memcpy of the parameters")
    print(f"torch {torch.__version__}, 1 thread; memcpy of the parameters: "
          + ", ".join(f"{n:,} elements {t:.3f} ms" for n, t in zip(sizes, memcpy)))
    print()
    print("| step (one core) | elements | ms | x memcpy time | x memcpy memory rate |")
    print("|---|---|---|---|---|")
    for name, times in rows.items():
        for n, t, m in zip(sizes, times, memcpy):
            moved = NECESSARY_BYTES.get(name, 28)
            print(f"| {name} | {n:,} | {t:.3f} | {m / t:.2f} | {m / t * moved / 8:.2f} |")


if __name__ == "__main__":
    main()
