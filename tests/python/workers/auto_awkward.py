"""compression="auto" on a model as users write them, not the shared small one: an embedding
tied to the output layer, a GRU, attention, a frozen layer, a branch used on odd steps only
(find_unused_parameters), gradient accumulation over two backward passes, clipping and a
learning-rate schedule, under AdamW. Every rank starts from its own initialization (the
optimizer broadcasts rank 0's). Records a digest of the parameters after every step and the
plan in force, so the test can compare the ranks bit for bit through every plan change."""
import hashlib

import torch
from torch import nn

import common
import gradcomp.torch as gc

# A search of several plans within the run; no new search from timing noise.
AUTO = {"warmup_steps": 6, "profile_steps": 3, "trial_steps": 3, "max_proposals": 3,
        "verbose": False, "drift": 9.0}
VOCABULARY, WIDTH, HIDDEN = 300, 32, 64


class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.gru = nn.GRU(WIDTH, HIDDEN, batch_first=True)
        self.attention = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.odd_steps_only = nn.Linear(HIDDEN, HIDDEN)
        self.wide = nn.Linear(HIDDEN, 320)
        self.narrow = nn.Linear(320, WIDTH)
        self.output = nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.output.weight = self.embedding.weight  # tied

    def forward(self, tokens, step):
        h, _ = self.gru(self.embedding(tokens))
        h, _ = self.attention(h, h, h)
        h = self.frozen(h)
        if step % 2:
            h = h + self.odd_steps_only(h)
        return self.output(self.narrow(torch.relu(self.wide(h))))


def digest(model):
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    p = common.parser(__doc__)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    rank, _ = common.setup()
    torch.manual_seed(100 + rank)
    model = Awkward()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(adamw, 20, 0.5)
    opt = gc.DistributedOptimizer(adamw, model, compression="auto", auto=AUTO,
                                  backward_passes_per_step=2, min_compress_elements=1000,
                                  bucket_mb=0.02, find_unused_parameters=True)
    frozen = [t.clone() for t in model.frozen.parameters()]  # rank 0's, after the broadcast
    data = torch.Generator().manual_seed(rank)
    record = {"digests": [], "plans": [], "odd_branch_grad": []}
    for step in range(args.steps):
        opt.zero_grad()
        for _ in range(2):
            tokens = torch.randint(0, VOCABULARY, (4, 10), generator=data)
            logits = model(tokens, step)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), tokens.reshape(-1))
            (loss / 2).backward()
        grad = model.odd_steps_only.weight.grad
        record["odd_branch_grad"].append(grad is not None and bool(grad.abs().sum() > 0))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        record["digests"].append(digest(model))
        record["plans"].append(opt.auto_report()["plan"])
    record["report"] = opt.auto_report()
    record["frozen_kept"] = all(torch.equal(a, b) for a, b in zip(frozen, model.frozen.parameters()))
    record["still_tied"] = model.output.weight is model.embedding.weight
    common.report(args.out, rank, record)


if __name__ == "__main__":
    main()
