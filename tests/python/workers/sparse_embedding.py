"""Sparse embedding gradients (nn.Embedding(sparse=True)) under DistributedOptimizer: a bag of
token embeddings and a dense head; records every step's embedding gradient (made dense), the
parameters, the loss and the bytes sent, so the test can check the mean, the ranks and the cost
against the same model with a dense embedding."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import gradcomp.torch as gc

VOCAB, DIM = 5000, 16


class Bag(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.head = torch.nn.Linear(DIM, 8)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))


def tokens(rank, step, shared):
    """A few rows per step (duplicates included); with `shared`, the same on every rank."""
    g = torch.Generator().manual_seed(7919 * step + (0 if shared else 31 * rank + 1))
    return torch.randint(0, 60, (16, 6), generator=g) * 37 % VOCAB


def main():
    p = common.parser(__doc__)
    p.add_argument("--dense", action="store_true", help="nn.Embedding(sparse=False)")
    p.add_argument("--split", action="store_true",
                   help="SparseAdam for the embedding and Adam for the head, two optimizers")
    p.add_argument("--undeclared", action="store_true",
                   help="pass model.named_parameters(), which says nothing of sparsity")
    p.add_argument("--ddp", action="store_true",
                   help="DistributedDataParallel with gradcomp's comm hook, plain SGD")
    p.add_argument("--shared-tokens", action="store_true")
    p.add_argument("--compression", default="none")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    rank, _ = common.setup()
    model = Bag(sparse=not args.dense)
    forward, hook = model, None
    if args.ddp:
        dist.init_process_group("gloo")
        forward = DDP(model)
        hook = gc.comm_hook(args.compression, min_compress_elements=64)
        forward.register_comm_hook(None, hook)
        opts = [torch.optim.SGD(model.parameters(), lr=0.5)]
    elif args.split:
        opts = [gc.DistributedOptimizer(torch.optim.SparseAdam(list(model.embed.parameters()),
                                                               lr=0.01),
                                        model.embed),
                gc.DistributedOptimizer(torch.optim.Adam(model.head.parameters(), lr=0.01),
                                        model.head, compression=args.compression,
                                        min_compress_elements=64)]
    else:
        named = model.named_parameters() if args.undeclared else model
        opts = [gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named,
                                        compression=args.compression, min_compress_elements=64)]
    steps = []
    for step in range(args.steps):
        x = tokens(rank, step, args.shared_tokens)
        y = common.batch(rank, step)[1][:16]
        for opt in opts:
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x), y)
        loss.backward()
        grad = model.embed.weight.grad
        steps.append({"embed_grad": None if grad is None else grad.to_dense().clone(),
                      "sparse": grad is not None and grad.is_sparse,
                      "tokens": x, "loss": loss.item(),
                      "bytes": 0 if args.ddp else sum(o.last_step()["bytes_sent"] for o in opts),
                      "hooked": hook is not None and hook._engine is not None,
                      "params": [q.detach().clone() for q in model.parameters()]})
        for opt in opts:
            opt.step()
    common.save(args.out, "sparse", rank, steps)
    common.report(args.out, rank, {"final": [q.detach().clone().tolist()[:1]
                                             for q in model.parameters()]})


if __name__ == "__main__":
    main()
