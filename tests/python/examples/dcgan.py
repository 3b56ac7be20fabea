"""pytorch/examples' dcgan/main.py with --dataset fake, shrunk, with only what a user changes to
train it data-parallel under gradcomp (each change is marked "gradcomp:"):

  - rank and world size from the launcher's environment, and a DistributedSampler;
  - optimizerD and optimizerG each wrapped in a gradcomp.torch.DistributedOptimizer of its own
    (several optimizers in one process; each construction copies rank 0's parameters: the
    original seeds with a random manualSeed when none is given, so every rank starts from
    another model);
  - rank 0's floating-point buffers (BatchNorm's running statistics, which each rank updates
    from its own batches) broadcast at the end of every epoch, before the checkpoints, as DDP's
    broadcast_buffers would have left them.

Kept from the original: the Generator (ConvTranspose2d, BatchNorm, ReLU ..., Tanh) and the
Discriminator (Conv2d, LeakyReLU, BatchNorm ..., Sigmoid) for 64x64 images, weights_init, BCELoss,
Adam(lr=0.0002, betas=(0.5, 0.999)) for each, and the loop: netD.zero_grad(),
errD_real.backward(), errD_fake.backward() on fake.detach(), optimizerD.step(); netG.zero_grad(),
errG.backward() through netD (which also writes into netD's .grad, zeroed at the next
iteration), optimizerG.step(); every 100th batch the real batch and netG(fixed_noise) saved as
images (in train mode, as the original); the per-epoch checkpoints of both nets. Shrunk: small
ngf/ndf/nz, a few fake images.

At the end every rank writes <out>/final.rank<r>.pt (netG's and netD's parameters and
state_dicts) and <out>/report.rank<r>.json.
"""
import argparse
import os
import random
import sys

import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
import torchvision.datasets as dset
import torchvision.transforms as transforms
import torchvision.utils as vutils
from torch.utils.data.distributed import DistributedSampler

import gradcomp.torch as gc  # gradcomp:

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
import common  # noqa: E402 (the result files the test reads)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def buffers(*nets):
    return [b for net in nets for b in net.buffers()]


def main():
    parser = argparse.ArgumentParser(description="DCGAN, --dataset fake")
    parser.add_argument("--out", required=True, help="directory for the result files")
    parser.add_argument("--dataset", default="fake")
    parser.add_argument("--batchSize", type=int, default=8)
    parser.add_argument("--imageSize", type=int, default=64)
    parser.add_argument("--nz", type=int, default=16)
    parser.add_argument("--ngf", type=int, default=8)
    parser.add_argument("--ndf", type=int, default=8)
    parser.add_argument("--niter", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--manualSeed", type=int)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--compression", default="topk:ratio=0.01|ef")  # gradcomp:
    parser.add_argument("--min-compress-elements", type=int, default=16384)  # gradcomp:
    opt = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share a small machine
    rank = int(os.environ.get("RANK", 0))  # gradcomp: the launcher's
    world = int(os.environ.get("WORLD_SIZE", 1))

    if opt.manualSeed is None:
        opt.manualSeed = random.randint(1, 10000)
    print("Random Seed: ", opt.manualSeed, flush=True)
    random.seed(opt.manualSeed)
    torch.manual_seed(opt.manualSeed)

    dataset = dset.FakeData(size=opt.images, image_size=(3, opt.imageSize, opt.imageSize),
                            transform=transforms.ToTensor())
    nc = 3
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)  # gradcomp:
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize, sampler=sampler)

    nz, ngf, ndf = opt.nz, opt.ngf, opt.ndf
    netG = Generator(nz, ngf, nc)
    netG.apply(weights_init)
    netD = Discriminator(ndf, nc)
    netD.apply(weights_init)

    criterion = nn.BCELoss()
    fixed_noise = torch.randn(opt.batchSize, nz, 1, 1)
    real_label = 1
    fake_label = 0

    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerD = gc.DistributedOptimizer(  # gradcomp:
        optimizerD, netD.named_parameters(), compression=opt.compression,
        min_compress_elements=opt.min_compress_elements)
    optimizerG = gc.DistributedOptimizer(  # gradcomp:
        optimizerG, netG.named_parameters(), compression=opt.compression,
        min_compress_elements=opt.min_compress_elements)

    history = []
    for epoch in range(opt.niter):
        sampler.set_epoch(epoch)  # gradcomp:
        for i, data in enumerate(dataloader, 0):
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            # train with real
            netD.zero_grad()
            real_cpu = data[0]
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)

            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()

            # train with fake
            noise = torch.randn(batch_size, nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()

            print(f"[{epoch}/{opt.niter}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} "
                  f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} D(G(z)): {D_G_z1:.4f} / "
                  f"{D_G_z2:.4f}", flush=True)
            history.append({"errD": errD.item(), "errG": errG.item()})
            if i % 100 == 0:
                vutils.save_image(real_cpu, os.path.join(opt.out, f"real_samples.rank{rank}.png"),
                                  normalize=True)
                fake = netG(fixed_noise)  # in train mode: updates netG's running statistics
                vutils.save_image(fake.detach(), os.path.join(
                    opt.out, f"fake_samples_epoch_{epoch:03d}.rank{rank}.png"), normalize=True)
        gc.broadcast_parameters(buffers(netG, netD))  # gradcomp: as DDP would have
        # do checkpointing
        torch.save(netG.state_dict(), os.path.join(opt.out, f"netG_epoch_{epoch}.rank{rank}.pth"))
        torch.save(netD.state_dict(), os.path.join(opt.out, f"netD_epoch_{epoch}.rank{rank}.pth"))

    final = {"params": {**{"netG." + n: p.detach() for n, p in netG.named_parameters()},
                        **{"netD." + n: p.detach() for n, p in netD.named_parameters()}},
             "state_dict": {**{"netG." + k: v for k, v in netG.state_dict().items()},
                            **{"netD." + k: v for k, v in netD.state_dict().items()}},
             "loss": history[-1]["errD"], "history": history}
    common.save(opt.out, "final", rank, final)
    common.report(opt.out, rank, {
        "history": history, "loss": history[-1]["errD"], "seed": opt.manualSeed,
        "steps": len(history),
        "plan_codecs": {"D": [b["codec"] for b in optimizerD.plan["buckets"]],
                        "G": [b["codec"] for b in optimizerG.plan["buckets"]]}})


if __name__ == "__main__":
    main()
