#!/usr/bin/python3
"""Writes the inputs of the validation in docs/simulation.md ("Validation") to profiles/validation/:

    nice /usr/bin/python3 scripts/make_validation_inputs.py [--check]

- codec-costs-v100.json: codec costs of a V100 GPU, derived from the encode/decode times the
  Espresso artifact's decision simulator uses (measured by its authors on V100s), instead of the
  shipped costs of one CPU core of this project's machine;
- resnet101-b64.json: the shipped resnet101 profile (batch 32) at MergeComp's batch of 64;
- synthetic-2000.json: a 2,000-tensor profile for the planner's decision time;
- resnet50-nocompute.json, resnet101-nocompute.json, codec-costs-zero.json: the shipped shapes
  with no compute time, and free codecs, for the utility study's communication-only table.

Everything is computed from the constants below, so a run gives the same bytes; --check fails if
a file under profiles/validation/ differs from what this script builds.
"""
import argparse
import json
import math
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "profiles", "validation")

# --- GPU codec costs -------------------------------------------------------------------------
# Espresso's simulator (scheduler/simulator_espresso.py) prices GPU compression per shard of up
# to 2^20 elements, in microseconds: compress + decompress ("total") and decompress alone.
# Source: ../shared/reference/anchors-mergecomp-espresso.md, section 8.3.
SHARD = 1 << 20
ESPRESSO_US = {  # codec: (total, decode) at one 2^20-element shard
    "randomk": (88, 34),
    "dgc": (390, 34),
    "efsignsgd": (270, 140),
    "onebit": (620, 170),
}
FP16_TOTAL_US = 26  # "option 1": cast to fp16 and back
V100_BYTES_PER_S = 900e9  # HBM2 peak of a V100
# A cast reads 4 and writes 2 bytes per element; what the 13 us of one cast leave beyond that
# traffic is the fixed cost of a kernel call (launch, synchronisation), 6 us.
KERNEL_S = FP16_TOTAL_US / 2 * 1e-6 - 6 * SHARD / V100_BYTES_PER_S
# Codecs that run the same kernels as an anchored one (sign packing and a scale).
SAME_AS = {"signsgd": "efsignsgd", "signum": "efsignsgd", "bf16": "fp16"}


def linear(seconds_at_shard):
    """a + b n through (2^20, t), with a the fixed cost of a kernel call."""
    return {"a": KERNEL_S, "b": max(seconds_at_shard - KERNEL_S, 0) / SHARD}


def streaming(bytes_per_element):
    """A memory-bound kernel: its bytes at the V100's bandwidth, plus a kernel call."""
    return {"a": KERNEL_S, "b": bytes_per_element / V100_BYTES_PER_S}


def with_residual(encode):
    # Fused error feedback writes the residual too: 4 more bytes per element (a read-modify-write
    # of a buffer the encoder already streams). The feedback's own compensate pass is priced
    # apart, as a pass of codec none.
    return {"a": encode["a"], "b": encode["b"] + 4 / V100_BYTES_PER_S}


def anchored_costs():
    costs = {}
    for codec, (total, decode) in ESPRESSO_US.items():
        encode = linear((total - decode) * 1e-6)
        costs[codec] = {"encode": encode, "encode_ef": with_residual(encode),
                        "decode": linear(decode * 1e-6)}
    cast = linear(FP16_TOTAL_US / 2 * 1e-6)
    costs["fp16"] = {"encode": cast, "encode_ef": with_residual(cast), "decode": cast}
    # none: encode copies (8 bytes per element), decode-accumulate reads two arrays and writes
    # one (12): the pass routes make over a bucket (compensate, finalize, write back).
    copy = streaming(8)
    costs["none"] = {"encode": copy, "encode_ef": with_residual(copy), "decode": streaming(12)}
    for codec, model in SAME_AS.items():
        costs[codec] = costs[model]
    return costs


def gpu_speedup(cpu, gpu):
    """How much faster the anchored GPU codecs are than the shipped CPU core, per element
    (geometric mean over the anchored codecs' encode and decode)."""
    logs = [math.log(cpu[c][k]["b"] / gpu[c][k]["b"]) for c in ESPRESSO_US for k in ("encode", "decode")]
    return math.exp(sum(logs) / len(logs))


def v100_costs():
    with open(os.path.join(ROOT, "profiles", "codec-costs.json")) as f:
        cpu = json.load(f)["codecs"]
    costs = anchored_costs()
    factor = gpu_speedup(cpu, costs)
    # No published GPU time for the rest (top-k, the stochastic quantizers, PowerSGD, intq):
    # our CPU core's per-element cost divided by the anchored codecs' mean GPU speed-up.
    scaled = sorted(set(cpu) - set(costs))
    for codec in scaled:
        costs[codec] = {k: {"a": KERNEL_S, "b": v["b"] / factor} for k, v in cpu[codec].items()}
    source = (
        "V100-like codec costs for the validation in docs/simulation.md, made by "
        "scripts/make_validation_inputs.py. randomk, dgc, efsignsgd, onebit: the GPU encode and "
        "decode times of Espresso's decision simulator at one 2^20-element shard (total - decode "
        "= encode), as a + b n with a = %.1f us, the fixed cost of a kernel call (the simulator's "
        "13 us fp16 cast of 2^20 elements minus its 6 bytes per element at 900 GB/s), through the "
        "simulator's point at 2^20; signsgd and signum as efsignsgd, bf16 as fp16; none: 8 (encode) "
        "and 12 (decode) bytes per element at 900 GB/s; encode_ef: 4 more bytes per element. "
        "%s: no published GPU time; this machine's CPU-core cost divided by %.2f, the mean "
        "GPU speed-up of the anchored codecs." % (KERNEL_S * 1e6, ", ".join(scaled), factor))
    return {"source": source, "command": "scripts/make_validation_inputs.py", "codecs": costs}


# --- Profiles --------------------------------------------------------------------------------
def scaled_profile(name, factor, batch):
    """A shipped profile at another batch size: every time scaled by `factor` (a V100 at batch
    32 is near its peak throughput, so time grows about linearly with the batch)."""
    with open(os.path.join(ROOT, "profiles", name + ".json")) as f:
        p = json.load(f)
    p["model"] = "%s-b%d" % (name, batch)
    p["source"] = ("profiles/%s.json (batch %d) with every time x%g for batch %d "
                   "(scripts/make_validation_inputs.py); shapes unchanged. " % (
                       name, p["batch_size"], factor, batch)) + p["source"]
    p["batch_size"] = batch
    p["forward_ms"] = round(p["forward_ms"] * factor, 6)
    p["backward_ms"] = round(p["backward_ms"] * factor, 6)
    for t in p["tensors"]:
        t["ready_ms"] = round(t["ready_ms"] * factor, 6)
    return p


def nocompute_profile(name):
    """A shipped profile's shapes with every time 0: the model then prices communication only."""
    p = scaled_profile(name, 0, 0)
    p["model"] = name + "-nocompute"
    p["batch_size"] = 1
    p["source"] = "profiles/%s.json with every time 0 (scripts/make_validation_inputs.py)" % name
    return p


def zero_costs():
    with open(os.path.join(ROOT, "profiles", "codec-costs.json")) as f:
        names = sorted(json.load(f)["codecs"])
    free = {"a": 0.0, "b": 0.0}
    return {"source": "every codec free (scripts/make_validation_inputs.py)",
            "codecs": {n: {"encode": free, "encode_ef": free, "decode": free} for n in names}}


def synthetic_profile(tensors, seed):
    """`tensors` gradients of log-uniform sizes (2^6 to 2^22 elements), ready at random gaps
    over a 500 ms backward pass: a large model's shape, for timing the planner."""
    rng = random.Random(seed)
    sizes = [int(2 ** rng.uniform(6, 22)) for _ in range(tensors)]
    gaps = [rng.random() for _ in range(tensors)]
    scale = 500.0 / sum(gaps)
    ready, t = [], 0.0
    for g in gaps:
        t += g * scale
        ready.append(round(min(t, 500.0), 6))
    return {
        "format": "gradcomp-profile", "version": 1, "model": "synthetic-%d" % tensors,
        "source": "scripts/make_validation_inputs.py: random sizes and ready times (seed %d), "
                  "for the planner's decision time only" % seed,
        "batch_size": 1, "forward_ms": 250.0, "backward_ms": 500.0,
        "tensors": [{"name": "t%d" % i, "elements": n, "ready_ms": r}
                    for i, (n, r) in enumerate(zip(sizes, ready))],
    }


def dump(doc, one_per_line=None):
    """JSON with 2-space indent; the list `one_per_line` (tensors) one element per line."""
    if one_per_line is None:
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"
    head = {k: v for k, v in doc.items() if k != one_per_line}
    text = json.dumps(head, indent=2)[:-2] + ',\n  "%s": [\n' % one_per_line
    text += ",\n".join("    " + json.dumps(t) for t in doc[one_per_line])
    return text + "\n  ]\n}\n"


def outputs():
    return {
        "codec-costs-v100.json": dump(v100_costs()),
        "resnet101-b64.json": dump(scaled_profile("resnet101", 2, 64), "tensors"),
        "synthetic-2000.json": dump(synthetic_profile(2000, 2000), "tensors"),
        "resnet50-nocompute.json": dump(nocompute_profile("resnet50"), "tensors"),
        "resnet101-nocompute.json": dump(nocompute_profile("resnet101"), "tensors"),
        "codec-costs-zero.json": dump(zero_costs()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file differs")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    stale = []
    for name, text in outputs().items():
        path = os.path.join(OUT, name)
        if args.check:
            if not os.path.exists(path) or open(path).read() != text:
                stale.append(path)
            continue
        with open(path, "w") as f:
            f.write(text)
        print("wrote", os.path.relpath(path, ROOT))
    if stale:
        sys.exit("differs from what the script builds: " + ", ".join(stale))


if __name__ == "__main__":
    main()
