"""The cost of one optimizer step on one core: gradcomp's fused LAMB and LANS against torch's
AdamW (its loop and its foreach form) on the same tensors, and against a memcpy of the
parameter bytes (the floor of any update that reads and writes them). docs/optimizers.md.

    /usr/bin/python3 bench/optimizers/step_cost.py [--sizes 65536,1048576,16777216] [--repeat 30]

Prints a Markdown table per size: the median milliseconds per step; the step's speed relative
to a memcpy of the parameters (1.0 = as fast as copying the parameters once); and its memory
rate relative to memcpy's, counting the 28 bytes per element any Adam-type step must move (read
x, g, m, v; write x, m, v) against memcpy's 8: 1.0 = the update streams at memcpy's rate."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
import gradcomp.torch as gc  # noqa: E402


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

    src, dst = torch.randn(n), torch.empty(n)
    return {
        "memcpy of the parameters": lambda: dst.copy_(src),
        "torch AdamW": stepper(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)),
        "torch AdamW (foreach)": stepper(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
        "gradcomp LAMB": stepper(lambda ps: gc.LAMB(ps, lr=1e-3)),
        "gradcomp LANS": stepper(lambda ps: gc.LANS(ps, lr=1e-3)),
    }


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
            print(f"| {name} | {n:,} | {t:.3f} | {m / t:.2f} | {m / t * 28 / 8:.2f} |")


if __name__ == "__main__":
    main()
