import os
import sys

import torch
import gradcomp.torch as gc

if "--process-group" in sys.argv:
    torch.distributed.init_process_group("gloo")  # gradcomp then exchanges over this group
torch.manual_seed(0)  # the same initial model on every rank
model = torch.nn.Sequential(torch.nn.Linear(20, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
optimizer = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    model.named_parameters(), compression="topk:ratio=0.1|ef")
torch.manual_seed(1 + int(os.environ["RANK"]))  # different data on every rank
for step in range(30):
    x = torch.randn(32, 20)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step in (0, 29):
        print(f"rank {os.environ['RANK']} step {step} loss {loss.item():.4f}", flush=True)
