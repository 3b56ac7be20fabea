"""pytorch/examples' imagenet/main.py run with --dummy (torchvision's FakeData), shrunk, with only
what a user changes when moving it from DistributedDataParallel to gradcomp (each change is
marked "gradcomp:"):

  - rank and world size from the launcher's environment; the process group is initialized as the
    original does in distributed mode (gloo), so gradcomp exchanges over it;
  - the model is not wrapped in DDP; the optimizer is wrapped in
    gradcomp.torch.DistributedOptimizer instead (its construction copies rank 0's parameters to
    every rank, as DDP's does: the model is initialized unseeded, differently on each rank);
  - DDP also broadcast rank 0's buffers (BatchNorm's running statistics) at every forward; the
    optimizer wrapper only handles parameters, so rank 0's floating-point buffers are broadcast
    before each evaluation and checkpoint (the same result as DDP's: rank 0's statistics depend
    only on rank 0's batches and the shared parameters);
  - the checkpoint that rank 0 saves, and every rank loads with --resume, holds
    optimizer.state_dict(all_ranks=True), which every rank calls (docs/python.md): the
    original's optimizer.state_dict() on rank 0 alone would carry only rank 0's error-feedback
    state, and rank 1's load_state_dict() refuses it ("engine state was saved by rank 0 of 2").

Kept from the original: torchvision's resnet18, CrossEntropyLoss, SGD with momentum and weight
decay, StepLR stepped every epoch, a DistributedSampler with set_epoch, BatchNorm in train mode
during training and eval mode in validate(), the validation meters all-reduced over the ranks,
rank 0 saving {epoch, arch, state_dict, best_acc1, optimizer, scheduler} every epoch, and
--resume (every rank loads that file). Shrunk:
32x32 images, 10 classes, a handful of steps, StepLR(step_size=1) so that it steps within the run.

At the end every rank writes <out>/final.rank<r>.pt and <out>/report.rank<r>.json.
"""
import argparse
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import gradcomp.torch as gc  # gradcomp:

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
import common  # noqa: E402 (the result files the test reads)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0) * 100.0 / target.size(0) for k in topk]


def train(train_loader, model, criterion, optimizer, epoch, args, losses):
    model.train()
    for i, (images, target) in enumerate(train_loader):
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if i % args.print_freq == 0:
            print(f"Epoch: [{epoch}][{i}/{len(train_loader)}] Loss {loss.item():.4e} "
                  f"Acc@1 {acc1.item():6.2f} Acc@5 {acc5.item():6.2f}", flush=True)


def validate(val_loader, model, criterion, args):
    model.eval()
    totals = torch.zeros(3)  # loss sum, top-1 hits, samples (the original's meters)
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            loss = criterion(output, target)
            acc1, = accuracy(output, target, topk=(1,))
            totals += torch.tensor([loss.item() * images.size(0),
                                    acc1.item() * images.size(0) / 100.0, images.size(0)])
    if args.distributed:
        dist.all_reduce(totals)  # the original's top1.all_reduce(), losses.all_reduce()
    loss, acc1 = (totals[0] / totals[2]).item(), (100.0 * totals[1] / totals[2]).item()
    print(f" * Acc@1 {acc1:.3f} Loss {loss:.4f}", flush=True)
    return acc1, loss


def buffers_differ(model):
    """Whether any rank's floating-point buffers differ from rank 0's (for the report)."""
    mine = torch.cat([b.reshape(-1) for b in model.buffers() if b.is_floating_point()])
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    flag = torch.tensor([0.0 if torch.equal(mine, theirs) else 1.0])
    dist.all_reduce(flag)
    return bool(flag.item())


def main():
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (--dummy)")
    parser.add_argument("--out", required=True, help="directory for the result files")
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("-b", "--batch-size", type=int, default=16,
                        help="total over the ranks, as in the original")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--resume", default="", type=str, metavar="PATH")
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--dummy", action="store_true", default=True)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--train-images", type=int, default=32)
    parser.add_argument("--val-images", type=int, default=16)
    parser.add_argument("--compression", default="topk:ratio=0.01|ef")  # gradcomp:
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share a small machine
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)

    args.rank = int(os.environ.get("RANK", 0))  # gradcomp: the launcher's
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.distributed = args.world_size > 1
    if args.distributed:
        dist.init_process_group(backend="gloo", world_size=args.world_size, rank=args.rank)

    model = models.__dict__[args.arch](num_classes=args.num_classes)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    optimizer = gc.DistributedOptimizer(optimizer, model.named_parameters(),  # gradcomp:
                                        compression=args.compression)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.1)
    best_acc1 = 0
    if args.resume:
        print(f"=> loading checkpoint '{args.resume}'", flush=True)
        checkpoint = torch.load(args.resume)
        args.start_epoch = checkpoint["epoch"]
        best_acc1 = checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    args.batch_size = args.batch_size // args.world_size

    size = (3, args.image_size, args.image_size)
    train_dataset = datasets.FakeData(args.train_images, size, args.num_classes,
                                      transforms.ToTensor())
    val_dataset = datasets.FakeData(args.val_images, size, args.num_classes,
                                    transforms.ToTensor())
    train_sampler = val_sampler = None
    if args.distributed:
        train_sampler = DistributedSampler(train_dataset)
        val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size,
                              shuffle=(train_sampler is None), sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False,
                            sampler=val_sampler)

    losses, differed = [], []
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, args, losses)
        if args.distributed:
            differed.append(buffers_differ(model))
            gc.broadcast_parameters(model.buffers())  # gradcomp: what DDP did
        acc1, val_loss = validate(val_loader, model, criterion, args)
        scheduler.step()
        best_acc1 = max(acc1, best_acc1)
        # gradcomp: error feedback is per rank, and every rank resumes from rank 0's file:
        # every rank gathers all ranks' compression state (a collective), rank 0 saves it.
        optimizer_state = optimizer.state_dict(all_ranks=True)
        if args.rank == 0:
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.state_dict(),
                        "best_acc1": best_acc1, "optimizer": optimizer_state,
                        "scheduler": scheduler.state_dict()},
                       os.path.join(args.out, "checkpoint.pth.tar"))

    final = {"params": {n: p.detach() for n, p in model.named_parameters()},
             "state_dict": model.state_dict(), "train_losses": losses, "loss": val_loss}
    common.save(args.out, "final", args.rank, final)
    common.report(args.out, args.rank, {
        "train_losses": losses, "loss": val_loss, "acc1": acc1, "steps": len(losses),
        "lr": optimizer.param_groups[0]["lr"], "buffers_differed_before_broadcast": differed,
        "plan_codecs": [b["codec"] for b in optimizer.plan["buckets"]]})


if __name__ == "__main__":
    main()
