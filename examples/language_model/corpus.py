"""The language model's text: the fortune cookies of Debian's `fortunes` package, as word tokens.

    apt-get install fortunes                 # scripts/setup.sh installs it
    /usr/bin/python3 examples/language_model/corpus.py            # what it holds
    /usr/bin/python3 examples/language_model/corpus.py --out build/lm-data/fortunes.pt

/usr/share/games/fortunes holds 46 files of short texts (quotations, jokes, poems, program
fragments) separated by lines holding only '%': about 2.6 MB, 15,000 fortunes. Preparation,
deterministic, so every rank builds the same tensors on its own in a second or two:

  1. every fortune of every file (sorted by name; the '.dat' indexes and '.u8' links skipped),
     backspace overstriking removed, whitespace runs outside line breaks made one space;
  2. the fortunes split 95% / 5% into training and validation by a hash of their text (stable
     when files are added, and never a fortune in both);
  3. words: runs of letters, digits and apostrophes, each other visible character on its own,
     and the line break as a token '\\n'; a fortune ends with '<eos>';
  4. the vocabulary: the most frequent training tokens (ties by text), the rest '<unk>'.

`--out` writes the token tensors and the vocabulary as one torch file (train.py can read it with
--data instead of preparing again).
"""
import argparse
import collections
import hashlib
import os
import re

import torch

DEFAULT_DIR = "/usr/share/games/fortunes"
UNK, EOS, NEWLINE = "<unk>", "<eos>", "\n"
_WORD = re.compile(r"[A-Za-z0-9']+|[^\sA-Za-z0-9']|\n")
_OVERSTRIKE = re.compile(r".\x08")


def read_fortunes(directory=DEFAULT_DIR):
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is missing: install Debian's 'fortunes' package "
                                "(apt-get install fortunes, or scripts/setup.sh)")
    fortunes = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith((".dat", ".u8")) or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = _OVERSTRIKE.sub("", f.read())
        for piece in re.split(r"^%\s*$", text, flags=re.M):
            lines = [re.sub(r"[ \t]+", " ", line).strip() for line in piece.strip().splitlines()]
            if any(lines):
                fortunes.append("\n".join(lines))
    if not fortunes:
        raise ValueError(f"{directory} holds no fortunes")
    return fortunes


def is_validation(fortune, percent=5):
    digest = hashlib.blake2b(fortune.encode(), digest_size=2).digest()
    return int.from_bytes(digest, "little") % 100 < percent


def tokens_of(fortune):
    return _WORD.findall(fortune) + [EOS]


def build(directory=DEFAULT_DIR, vocab_size=4096):
    """Returns dict(train=LongTensor, valid=LongTensor, vocab=[str]): token ids in reading
    order, vocab[0] is '<unk>'."""
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be at least 3 (<unk>, <eos> and a word), not "
                         f"{vocab_size}")
    split = collections.defaultdict(list)
    for fortune in read_fortunes(directory):
        split["valid" if is_validation(fortune) else "train"].extend(tokens_of(fortune))
    counts = collections.Counter(split["train"])
    counts.pop(UNK, None)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    vocab = [UNK] + [word for word, _ in ranked[:vocab_size - 1]]
    index = {word: i for i, word in enumerate(vocab)}
    return dict(vocab=vocab, **{name: torch.tensor([index.get(t, 0) for t in toks],
                                                   dtype=torch.long)
                                for name, toks in split.items()})


def load(path_or_dir=DEFAULT_DIR, vocab_size=4096):
    """A prepared file (from --out) or the fortunes directory."""
    if os.path.isfile(path_or_dir):
        data = torch.load(path_or_dir)
        if len(data["vocab"]) != vocab_size:
            raise ValueError(f"{path_or_dir} has a vocabulary of {len(data['vocab'])} words, "
                             f"not {vocab_size}")
        return data
    return build(path_or_dir, vocab_size)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"the fortunes ({DEFAULT_DIR})")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (4096)")
    p.add_argument("--out", help="write the prepared tensors here (a torch file)")
    args = p.parse_args()
    data = build(args.dir, args.vocab)
    unk = sum(int((data[s] == 0).sum()) for s in ("train", "valid"))
    total = len(data["train"]) + len(data["valid"])
    print(f"fortunes: {len(data['train']):,} training and {len(data['valid']):,} validation "
          f"tokens, vocabulary {len(data['vocab']):,} ({100 * unk / total:.1f}% of tokens "
          "<unk>)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        torch.save(data, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
