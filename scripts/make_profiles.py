#!/usr/bin/python3
"""Builds the shipped model profiles, profiles/<model>.json (schema: docs/simulation.md).

    nice /usr/bin/python3 scripts/make_profiles.py [--out profiles] [--check]

Shapes are exact: torchvision's definitions for ResNet-50/101 and VGG-16, torch.nn for the
LSTM language model, and the published architectures written out layer by layer (Hugging Face
names) for BERT-base and GPT-2 small; every total is asserted against its published value.
Tensors are listed in backward order, the reverse of registration order, as PyTorch DDP assumes.

Times: one training step on one GPU (forward + backward) comes from a published throughput
(SOURCES below); forward = backward / 2. The backward time is split over the layers in
proportion to each layer's backward FLOPs, computed from the layer shapes and the input size,
and a layer's gradients are ready when its backward ends.

--check rebuilds every profile and fails if a file under --out differs, without writing.
"""
import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torchvision

ROOT = Path(__file__).resolve().parents[1]

# ---- Published anchors (read from the documents named; docs/simulation.md repeats them).

# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
# performance: NVIDIA DGX-1 32GB (8x V100 32GB)", 1 GPU, FP32, pytorch-21.03 NGC container.
RESNET50_V100_IMAGES_PER_S = 356.0
# jcjohnson/cnn-benchmarks README: forward + backward of one batch of 16 at 224x224 on a Pascal
# Titan X with cuDNN 5.1, in ms. Only their ratios are used: how much slower than ResNet-50 a
# model trains on one GPU, applied to the V100 anchor above.
CNN_BENCHMARKS_MS = {"resnet50": 103.58, "resnet101": 156.44, "vgg16": 128.62}
# NVIDIA DeepLearningExamples, TensorFlow/LanguageModeling/BERT/README.md, "Fine-tuning training
# performance for SQuAD v1.1 on DGX-1 32GB": BERT-large, sequence length 384, 1 GPU, FP32,
# batch 10, TensorFlow 20.06-py3 NGC container, in sentences per second. With BERT-large's
# training FLOPs (counted here the same way as for every other model) it gives the effective
# FP32 rate of a V100 on transformer layers, which times BERT-base, GPT-2 and the LSTM.
BERT_LARGE_SQUAD_V100_SEQ_PER_S = 10.42

BATCH = {"resnet50": 64, "resnet101": 32, "vgg16": 32}
BERT_BASE_SHAPE = (2, 512)    # sequences x tokens: Espresso's 1,024 tokens per GPU
GPT2_SHAPE = (1, 1024)        # one sequence of GPT-2's full context
LSTM_SHAPE = (80, 35)         # batch 80 (Espresso's "80"), 35 steps of backpropagation through time

# ---- A model as compute steps in forward (registration) order.


@dataclass
class Step:
    """One layer: its forward and backward FLOPs for the whole batch, and the parameters whose
    gradients are complete when its backward ends (none for parameter-free work such as the
    attention products or a tied output layer)."""
    forward: float
    backward: float
    tensors: list = field(default_factory=list)  # [(name, elements)] in registration order


def weighted(forward, tensors, input_grad=True):
    """A layer with a weight product. Backward computes the input's gradient and the weight's,
    each as costly as forward; the first layer skips the input's (the data needs none)."""
    return Step(forward, forward * (2 if input_grad else 1), tensors)


def norm(name, width, activations):
    """LayerNorm or BatchNorm: about 5 FLOPs per activation (mean, variance, normalize, scale,
    shift); backward taken as twice that, like every other layer."""
    return Step(5.0 * activations, 10.0 * activations,
                [(f"{name}.weight", width), (f"{name}.bias", width)])


def linear(name, n_in, n_out, rows, bias=True, input_grad=True):
    tensors = [(f"{name}.weight", n_in * n_out)] + ([(f"{name}.bias", n_out)] if bias else [])
    return weighted(2.0 * rows * n_in * n_out, tensors, input_grad)


def gather(tensors, rows, width):
    """Embedding lookups: no arithmetic forward; backward scatter-adds one row per token each."""
    return Step(0.0, float(rows * width * len(tensors)), tensors)


# ---- CNNs from torchvision: FLOPs from each layer's output shape at batch 1, times the batch.


def layer_flops(module, out_elements):
    if isinstance(module, torch.nn.Conv2d):
        kh, kw = module.kernel_size
        return 2.0 * out_elements * module.in_channels // module.groups * kh * kw
    if isinstance(module, torch.nn.Linear):
        return 2.0 * out_elements * module.in_features
    raise TypeError(f"no FLOP rule for {type(module).__name__}")


def cnn_steps(model, batch, image=224):
    outputs = {}
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.__setitem__(m, o.numel()))
             for m in model.modules() if list(m.parameters(recurse=False))]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, image, image))
    for h in hooks:
        h.remove()
    steps, first = [], True
    for prefix, m in model.named_modules():
        own = list(m.named_parameters(recurse=False))
        if not own:
            continue
        if isinstance(m, torch.nn.BatchNorm2d):
            steps.append(norm(prefix, m.num_features, batch * outputs[m]))
            continue
        tensors = [(f"{prefix}.{n}", p.numel()) for n, p in own]
        steps.append(weighted(batch * layer_flops(m, outputs[m]), tensors, input_grad=not first))
        first = False
    return steps


# ---- BERT and GPT-2, layer by layer as published (Hugging Face names and shapes).


def attention_core(batch, seq, width):
    """Q K^T and softmax(.) V over all heads: two products of batch x seq x seq x width MACs."""
    return weighted(4.0 * batch * seq * seq * width, [])


def bert_steps(layers, width, ff, batch, seq, vocab=30522, positions=512, pooler=True,
               qa_head=False):
    rows = batch * seq
    emb = "embeddings"
    steps = [gather([(f"{emb}.word_embeddings.weight", vocab * width),
                     (f"{emb}.position_embeddings.weight", positions * width),
                     (f"{emb}.token_type_embeddings.weight", 2 * width)], rows, width),
             norm(f"{emb}.LayerNorm", width, rows * width)]
    for i in range(layers):
        p = f"encoder.layer.{i}"
        steps += [linear(f"{p}.attention.self.{qkv}", width, width, rows)
                  for qkv in ("query", "key", "value")]
        steps += [attention_core(batch, seq, width),
                  linear(f"{p}.attention.output.dense", width, width, rows),
                  norm(f"{p}.attention.output.LayerNorm", width, rows * width),
                  linear(f"{p}.intermediate.dense", width, ff, rows),
                  linear(f"{p}.output.dense", ff, width, rows),
                  norm(f"{p}.output.LayerNorm", width, rows * width)]
    if pooler:  # a dense layer on each sequence's first token
        steps.append(linear("pooler.dense", width, width, batch))
    if qa_head:  # BertForQuestionAnswering: start and end logits for every token
        steps.append(linear("qa_outputs", width, 2, rows))
    return steps


def gpt2_steps(layers=12, width=768, batch=1, seq=1024, vocab=50257, positions=1024):
    rows = batch * seq
    t = "transformer"
    steps = [gather([(f"{t}.wte.weight", vocab * width), (f"{t}.wpe.weight", positions * width)],
                    rows, width)]
    for i in range(layers):
        p = f"{t}.h.{i}"
        steps += [norm(f"{p}.ln_1", width, rows * width),
                  linear(f"{p}.attn.c_attn", width, 3 * width, rows),
                  attention_core(batch, seq, width),  # causal mask, but computed densely
                  linear(f"{p}.attn.c_proj", width, width, rows),
                  norm(f"{p}.ln_2", width, rows * width),
                  linear(f"{p}.mlp.c_fc", width, 4 * width, rows),
                  linear(f"{p}.mlp.c_proj", 4 * width, width, rows)]
    steps.append(norm(f"{t}.ln_f", width, rows * width))
    # lm_head shares wte: the first work of backward, but wte's gradient is complete only after
    # the embedding lookup's backward at the very end.
    steps.append(weighted(2.0 * rows * width * vocab, []))
    return steps


# ---- The 2-layer LSTM language model of Espresso and MergeComp, built in torch.nn.


class LSTMLanguageModel(torch.nn.Module):
    """WikiText-2 word model: embedding 33,278 x 1,500, two 1,500-unit LSTM layers (one
    torch.nn.LSTM each, hence Espresso's names rnns.0 / rnns.1), decoder tied to the embedding."""

    def __init__(self, vocab=33278, width=1500, layers=2, device="meta"):
        super().__init__()
        self.encoder = torch.nn.Embedding(vocab, width, device=device)
        self.rnns = torch.nn.ModuleList(
            [torch.nn.LSTM(width, width, 1, device=device) for _ in range(layers)])
        self.decoder = torch.nn.Linear(width, vocab, device=device)
        self.decoder.weight = self.encoder.weight


def lstm_steps(model, batch, bptt):
    rows = batch * bptt
    width = model.encoder.embedding_dim
    steps = [gather([("encoder.weight", model.encoder.weight.numel())], rows, width)]
    for i, rnn in enumerate(model.rnns):
        own = [(f"rnns.{i}.{n}", p.numel()) for n, p in rnn.named_parameters()]
        # per token: the four gates' products with the input and with the previous hidden state
        gates = 4 * rnn.hidden_size * (rnn.input_size + rnn.hidden_size)
        steps.append(weighted(2.0 * rows * gates, own))
    vocab = model.decoder.out_features
    steps.append(weighted(2.0 * rows * width * vocab, [("decoder.bias", vocab)]))
    return steps


# ---- From steps to a profile.


def training_flops(steps):
    return sum(s.forward + s.backward for s in steps)


def backward_order(steps, backward_ms):
    """Walks the steps backwards, adding up backward FLOPs; a step's tensors (in reverse
    registration order) are ready when its backward ends, scaled so the last step ends at
    backward_ms."""
    total = sum(s.backward for s in steps)
    done, tensors = 0.0, []
    for step in reversed(steps):
        done += step.backward
        ready = round(backward_ms * done / total, 6)
        tensors += [{"name": n, "elements": e, "ready_ms": ready} for n, e in reversed(step.tensors)]
    return tensors


def make_profile(model, source, batch, step_ms, steps):
    backward_ms = step_ms * 2 / 3  # forward = backward / 2
    return {"format": "gradcomp-profile", "version": 1, "model": model, "source": source,
            "batch_size": batch, "forward_ms": round(step_ms / 3, 6),
            "backward_ms": round(backward_ms, 6), "tensors": backward_order(steps, backward_ms)}


def check(profile, elements, count=None, names=None):
    """The published total (and tensor count, and torch's own parameter list when there is
    one) must come out exactly."""
    got = sum(t["elements"] for t in profile["tensors"])
    assert got == elements, f"{profile['model']}: {got:,} elements, published {elements:,}"
    n = len(profile["tensors"])
    assert count is None or n == count, f"{profile['model']}: {n} tensors, expected {count}"
    if names is not None:  # backward order is the reverse of registration order
        listed = [(t["name"], t["elements"]) for t in profile["tensors"]]
        assert listed == names[::-1], f"{profile['model']}: not torch's parameters reversed"


def torch_parameters(model):
    return [(n, p.numel()) for n, p in model.named_parameters()]


# ---- The six models.


def cnn_profile(name, batch, elements, count, extra):
    model = getattr(torchvision.models, name)()
    ratio = CNN_BENCHMARKS_MS[name] / CNN_BENCHMARKS_MS["resnet50"]
    step_ms = 1e3 * batch / RESNET50_V100_IMAGES_PER_S * ratio
    anchor = (f"NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch README, DGX-1 32GB, 1 V100 "
              f"FP32: {RESNET50_V100_IMAGES_PER_S:g} img/s")
    if name != "resnet50":
        anchor += (f", times {ratio:.4f}, {name}'s training time relative to ResNet-50 in "
                   f"jcjohnson/cnn-benchmarks ({CNN_BENCHMARKS_MS[name]} vs "
                   f"{CNN_BENCHMARKS_MS['resnet50']} ms, Pascal Titan X, cuDNN 5.1)")
    source = (f"Shapes: torchvision {torchvision.__version__.split('a')[0]} {name}{extra}. "
              f"Step time: {anchor}; {batch} images -> {step_ms:.2f} ms, forward = backward/2. "
              f"Ready times: backward split by layer backward FLOPs at 224x224 (2x forward; "
              f"1x for conv1, whose input needs no gradient).")
    profile = make_profile(name, source, batch, step_ms, cnn_steps(model, batch))
    check(profile, elements, count, torch_parameters(model))
    return profile


def transformer_rate():
    """FLOP/s of one V100 in FP32 on BERT-large SQuAD fine-tuning (the anchor)."""
    large = bert_steps(24, 1024, 4096, 1, 384, pooler=False, qa_head=True)
    params = sum(e for s in large for _, e in s.tensors)
    assert params == 335141888 - 1049600 + 2050, params  # BERT-large - pooler + QA head
    return training_flops(large) * BERT_LARGE_SQUAD_V100_SEQ_PER_S


RATE_TEXT = (f"NVIDIA DeepLearningExamples BERT TensorFlow README, SQuAD v1.1 fine-tuning, "
             f"DGX-1 32GB, 1 V100 FP32, BERT-large seq 384 batch 10: "
             f"{BERT_LARGE_SQUAD_V100_SEQ_PER_S} sentences/s")


def flop_timed_profile(name, shape_text, batch, steps, rate, note=""):
    flops = training_flops(steps)
    step_ms = 1e3 * flops / rate
    source = (f"Shapes: {shape_text}. Step time: {flops / 1e12:.3f} TFLOP per step (forward, "
              f"plus backward at 2x forward, counted from the shapes) at {rate / 1e12:.2f} "
              f"TFLOP/s, the effective "
              f"FP32 rate of a V100 derived from {RATE_TEXT}; -> {step_ms:.2f} ms, forward = "
              f"backward/2.{note} Ready times: backward split by layer backward FLOPs.")
    return make_profile(name, source, batch, step_ms, steps)


def nlp_profiles(rate):
    b, s = BERT_BASE_SHAPE
    bert = flop_timed_profile(
        "bert-base",
        f"BERT-base uncased without head (BertModel, HF names, pooler included: a classification "
        f"loss on the pooled output is assumed), 12 layers, 768 wide; {b} sequences x {s} tokens",
        b, bert_steps(12, 768, 3072, b, s), rate)
    check(bert, 109482240, 199)
    b, s = GPT2_SHAPE
    gpt2 = flop_timed_profile(
        "gpt2-small",
        f"GPT-2 small (GPT2LMHeadModel, HF names, lm_head tied to wte), 12 layers, 768 wide; "
        f"{b} sequence x {s} tokens", b, gpt2_steps(batch=b, seq=s), rate)
    check(gpt2, 124439808, 148)  # Espresso's Table 5 counts 148 tensors
    b, t = LSTM_SHAPE
    model = LSTMLanguageModel()
    lstm = flop_timed_profile(
        "lstm",
        f"2-layer LSTM language model on WikiText-2 as in Espresso/MergeComp: vocabulary 33,278, "
        f"embedding 1,500, two 1,500-unit layers (rnns.0, rnns.1), decoder tied to the "
        f"embedding; {b} sequences x {t} steps",
        b, lstm_steps(model, b, t), rate,
        " LSTM kernels usually run below the transformer rate, so this time is optimistic.")
    check(lstm, 85974278, 10, torch_parameters(model))  # Espresso: 10 tensors, 328 MB
    sizes = {t["name"]: t["elements"] for t in lstm["tensors"]}
    assert sizes["encoder.weight"] == 49917000  # Espresso's "49.9M-element" embedding
    assert all(sizes[f"rnns.{i}.weight_{k}_l0"] == 9000000 for i in (0, 1) for k in ("ih", "hh"))
    return [bert, gpt2, lstm]


def all_profiles():
    torch.set_num_threads(1)  # shapes only: keep the machine free for others
    cnns = [cnn_profile("resnet50", BATCH["resnet50"], 25557032, 161, " (ResNet-50 v1.5)"),
            cnn_profile("resnet101", BATCH["resnet101"], 44549160, 314, ""),
            cnn_profile("vgg16", BATCH["vgg16"], 138357544, 32, " (without batch norm)")]
    return cnns + nlp_profiles(transformer_rate())


# ---- Output.


def profile_text(profile):
    """The JSON with one tensor per line: short, and diffs read well."""
    head = {k: v for k, v in profile.items() if k != "tensors"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    rows = ",\n".join(f"    {json.dumps(t)}" for t in profile["tensors"])
    return "{\n" + "\n".join(lines) + '\n  "tensors": [\n' + rows + "\n  ]\n}\n"


def print_table(profiles):
    print(f"{'profile':<11} {'tensors':>7} {'elements':>13} {'MiB':>7} {'batch':>5} "
          f"{'forward ms':>10} {'backward ms':>11} {'first ready':>11}")
    for p in profiles:
        n = sum(t["elements"] for t in p["tensors"])
        print(f"{p['model']:<11} {len(p['tensors']):>7} {n:>13,} {n * 4 / 2**20:>7.1f} "
              f"{p['batch_size']:>5} {p['forward_ms']:>10.2f} {p['backward_ms']:>11.2f} "
              f"{p['tensors'][0]['ready_ms']:>11.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "profiles")
    parser.add_argument("--check", action="store_true",
                        help="fail if a profile under --out differs; write nothing")
    args = parser.parse_args()
    profiles = all_profiles()
    print_table(profiles)
    stale = []
    for p in profiles:
        path = args.out / f"{p['model']}.json"
        text = profile_text(p)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        sys.exit("out of date: " + ", ".join(stale))


if __name__ == "__main__":
    main()
