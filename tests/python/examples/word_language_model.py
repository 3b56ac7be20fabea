"""pytorch/examples' word_language_model/main.py (an LSTM language model), shrunk, with only what
a user changes to train it data-parallel under gradcomp (each change is marked "gradcomp:"):

  - rank and world size from the launcher's environment; every rank trains on its own
    contiguous shard of the training tokens (cut to the same length, so every rank runs the
    same number of steps); validation and test data are the same on every rank;
  - the original updates the parameters by hand (p.data.add_(p.grad, alpha=-lr)), and only an
    optimizer can be wrapped: as users adapting it do, the update is torch.optim.SGD(lr=lr)
    (the same arithmetic), wrapped in gradcomp.torch.DistributedOptimizer; where the original
    divides lr by 4, the optimizer's param_groups get the new lr;
  - the best model is saved to a file of each rank's own (the original's --save path would be
    written by every rank at once).

Kept from the original: RNNModel (Embedding, dropout, LSTM, dropout, Linear decoder,
log_softmax), the Corpus (words split on whitespace, <eos> at the end of every line), batchify,
get_batch with bptt, repackage_hidden, model.zero_grad() before each batch, NLLLoss,
torch.nn.utils.clip_grad_norm_(model.parameters(), clip) right after loss.backward(),
evaluate() under model.eval(), the lr annealing on validation loss, and reloading the best model
for the final test. The corpus is the GNU GPL version 3 text that every Debian system has in
/usr/share/common-licenses.

At the end every rank writes <out>/final.rank<r>.pt and <out>/report.rank<r>.json; the report
holds the total gradient norm clip_grad_norm_ returned at every step.
"""
import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import gradcomp.torch as gc  # gradcomp:

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
import common  # noqa: E402 (the result files the test reads)

TEXT = "/usr/share/common-licenses/GPL-3"


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    """train / valid / test as the original's, from one text: its lines split 80/10/10."""

    def __init__(self, path):
        self.dictionary = Dictionary()
        with open(path, encoding="utf8") as f:
            lines = [line for line in f]
        a, b = int(len(lines) * 0.8), int(len(lines) * 0.9)
        self.train = self.tokenize(lines[:a])
        self.valid = self.tokenize(lines[a:b])
        self.test = self.tokenize(lines[b:])

    def tokenize(self, lines):
        ids = []
        for line in lines:
            for word in line.split() + ["<eos>"]:
                ids.append(self.dictionary.add_word(word))
        return torch.tensor(ids, dtype=torch.int64)


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def main():
    parser = argparse.ArgumentParser(description="PyTorch RNN/LSTM Language Model")
    parser.add_argument("--out", required=True, help="directory for the result files")
    parser.add_argument("--model", type=str, default="LSTM")
    parser.add_argument("--emsize", type=int, default=64)
    parser.add_argument("--nhid", type=int, default=64)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=20)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=10)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--seed", type=int, default=1111)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--compression", default="topk:ratio=0.01|ef")  # gradcomp:
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share a small machine
    torch.manual_seed(args.seed)
    rank = int(os.environ.get("RANK", 0))  # gradcomp: the launcher's
    world = int(os.environ.get("WORLD_SIZE", 1))

    corpus = Corpus(TEXT)
    eval_batch_size = 10
    shard = corpus.train.size(0) // world  # gradcomp: this rank's part of the training text
    train_data = batchify(corpus.train[rank * shard:(rank + 1) * shard], args.batch_size)
    val_data = batchify(corpus.valid, eval_batch_size)
    test_data = batchify(corpus.test, eval_batch_size)

    ntokens = len(corpus.dictionary)
    model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout,
                     args.tied)
    criterion = nn.NLLLoss()
    # gradcomp: the original's p.data.add_(p.grad, alpha=-lr) as an optimizer, wrapped
    optimizer = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                        model.named_parameters(), compression=args.compression)

    def evaluate(data_source):
        model.eval()
        total_loss = 0.
        hidden = model.init_hidden(eval_batch_size)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, args.bptt):
                data, targets = get_batch(data_source, i, args.bptt)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    train_losses, grad_norms = [], []

    def train():
        model.train()
        total_loss = 0.
        hidden = model.init_hidden(args.batch_size)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
            data, targets = get_batch(train_data, i, args.bptt)
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()  # gradcomp: was for p in model.parameters(): p.data.add_(...)
            grad_norms.append(norm.item())
            train_losses.append(loss.item())
            total_loss += loss.item()
            if batch % args.log_interval == 0 and batch > 0:
                cur_loss = total_loss / args.log_interval
                print(f"| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} "
                      f"batches | lr {lr:02.2f} | loss {cur_loss:5.2f} | ppl "
                      f"{math.exp(cur_loss):8.2f}", flush=True)
                total_loss = 0

    lr = args.lr
    best_val_loss = None
    val_losses = []
    save = os.path.join(args.out, f"model.rank{rank}.pt")  # gradcomp: a file per rank
    for epoch in range(1, args.epochs + 1):
        train()
        val_loss = evaluate(val_data)
        val_losses.append(val_loss)
        print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f} | valid ppl "
              f"{math.exp(val_loss):8.2f}", flush=True)
        if not best_val_loss or val_loss < best_val_loss:
            with open(save, "wb") as f:
                torch.save(model, f)
            best_val_loss = val_loss
        else:
            lr /= 4.0
            for group in optimizer.param_groups:  # gradcomp: the optimizer's lr
                group["lr"] = lr

    with open(save, "rb") as f:
        model = torch.load(f)
        model.rnn.flatten_parameters()
    test_loss = evaluate(test_data)
    print(f"| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}",
          flush=True)

    final = {"params": {n: p.detach() for n, p in model.named_parameters()},
             "state_dict": model.state_dict(), "train_losses": train_losses,
             "grad_norms": grad_norms, "loss": test_loss}
    common.save(args.out, "final", rank, final)
    common.report(args.out, rank, {
        "train_losses": train_losses, "grad_norms": grad_norms, "val_losses": val_losses,
        "loss": test_loss, "steps": len(train_losses), "vocabulary": ntokens,
        "clip": args.clip, "plan_codecs": [b["codec"] for b in optimizer.plan["buckets"]]})


if __name__ == "__main__":
    main()
