"""pytorch/examples' mnist/main.py, shrunk, with only what a user changes to train it data-parallel
under gradcomp (each change is marked "gradcomp:"):

  - rank and world size from the launcher's environment (RANK, WORLD_SIZE);
  - a DistributedSampler, so every rank trains on its own shard;
  - the optimizer wrapped in gradcomp.torch.DistributedOptimizer.

Everything else keeps the original's training loop: the Net (conv, conv, max-pool, dropout, fc,
dropout, fc, log_softmax), Adadelta(lr=1.0) with StepLR(step_size=1, gamma=0.7) stepped every
epoch, nll_loss, optimizer.zero_grad() / loss.backward() / optimizer.step(), and a test pass under
model.eval() and torch.no_grad() after each epoch. The data are the Fashion-MNIST files of Debian's
dataset-fashion-mnist package (the same format as MNIST; no network here), a few hundred images.

At the end every rank writes <out>/final.rank<r>.pt (parameters, buffers, losses) and
<out>/report.rank<r>.json, for tests/python/test_examples.py.
"""
import argparse
import gzip
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gradcomp.torch as gc  # gradcomp:

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
import common  # noqa: E402 (the result files the test reads)

DATA = "/usr/share/datasets/fashion-mnist"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def read_idx(path, dims, count):
    """An idx file (the MNIST format), as examples/fashion_mnist/train.py reads it."""
    with gzip.open(path, "rb") as f:
        header = f.read(4 + 4 * dims)
        shape = [int.from_bytes(header[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
        shape[0] = min(shape[0], count)  # only the first `count` items are read
        raw = f.read(int(np.prod(shape)))
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def dataset(split, count):
    """The first `count` images of a split, as transforms.ToTensor() + Normalize((0.1307,),
    (0.3081,)) would give them."""
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(DATA, f"{prefix}-images-idx3-ubyte.gz"), 3, count)
    labels = read_idx(os.path.join(DATA, f"{prefix}-labels-idx1-ubyte.gz"), 1, count)
    x = (torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1) - 0.1307) / 0.3081
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def train(args, model, train_loader, optimizer, epoch, losses):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.sampler)}]"
                  f"\tLoss: {loss.item():.6f}", flush=True)


def test(model, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/"
          f"{len(test_loader.dataset)}\n", flush=True)
    return test_loss, correct / len(test_loader.dataset)


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--out", required=True, help="directory for the result files")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=4)
    parser.add_argument("--train-images", type=int, default=384)
    parser.add_argument("--test-images", type=int, default=200)
    parser.add_argument("--compression", default="topk:ratio=0.01|ef")  # gradcomp:
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share a small machine
    rank = int(os.environ.get("RANK", 0))  # gradcomp: the launcher's
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(args.seed)

    train_set = dataset("train", args.train_images)
    test_set = dataset("test", args.test_images)
    # gradcomp: each rank its own shard (shuffle=True replaces the DataLoader's)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)

    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    optimizer = gc.DistributedOptimizer(optimizer, model.named_parameters(),  # gradcomp:
                                        compression=args.compression)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    losses, tests = [], []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # gradcomp: a new shuffle each epoch
        train(args, model, train_loader, optimizer, epoch, losses)
        tests.append(test(model, test_loader))
        scheduler.step()

    final = {"params": {n: p.detach() for n, p in model.named_parameters()},
             "state_dict": model.state_dict(), "train_losses": losses,
             "loss": tests[-1][0], "lr": optimizer.param_groups[0]["lr"]}
    common.save(args.out, "final", rank, final)
    common.report(args.out, rank, {"train_losses": losses, "test_losses": [t[0] for t in tests],
                                   "test_accuracy": [t[1] for t in tests], "loss": tests[-1][0],
                                   "steps": len(losses), "lr": optimizer.param_groups[0]["lr"],
                                   "plan_codecs": [b["codec"] for b in optimizer.plan["buckets"]]})


if __name__ == "__main__":
    main()
