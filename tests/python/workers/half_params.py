"""Half-precision parameters: a bfloat16 model (CPU matmuls run in bfloat16) and float16
parameters used through a cast, trained with DistributedOptimizer; records every step's
averaged gradients and the parameters, so the test can check the mean and the ranks."""
import torch

import common
import gradcomp.torch as gc


class Mixed(torch.nn.Module):
    """bfloat16 layers, and a float16 weight applied in float32 (its gradient is float16)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(64, 256).bfloat16()
        self.gate = torch.nn.Parameter(torch.randn(256, 64).half() * 0.05)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x):
        h = torch.relu(self.first(x.bfloat16())).float()
        return self.head(torch.tanh(h @ self.gate.float()))


def main():
    p = common.parser(__doc__)
    p.add_argument("--compression", default="none")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    rank, _ = common.setup()
    model = Mixed()
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  model.named_parameters(), compression=args.compression)
    steps = []
    for step in range(args.steps):
        x, y = common.batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        steps.append({"grads": [q.grad.clone() for q in model.parameters()],
                      "params": [q.detach().clone() for q in model.parameters()]})
        opt.step()
    common.save(args.out, "half", rank, steps)
    common.report(args.out, rank, {"dtypes": [str(q.dtype) for q in model.parameters()],
                                   "bytes_sent": opt.last_step()["bytes_sent"],
                                   "uncompressed": opt.last_step()["uncompressed_bytes"]})


if __name__ == "__main__":
    main()
