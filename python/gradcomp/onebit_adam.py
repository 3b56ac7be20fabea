"""1-bit Adam: Adam whose exchange is compressed by exchanging the momentum, in 1-bit codes,
while the variance changes only on the few steps that exchange the gradient exactly.
docs/optimizers.md.

    optimizer = gradcomp.torch.OneBitAdam(model.named_parameters(), lr=1e-3)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

It is a distributed optimizer of its own (do not wrap it in DistributedOptimizer): step()
averages over the ranks, then updates. Each step is one of two kinds:

- an exact step: the gradients are averaged uncompressed, and Adam's moments m and v take the
  mean gradient (the variance v learns the gradients' scale);
- a compressed step: each rank forms its momentum from its own gradient, m_r = b1 m +
  (1 - b1) g_r, and the momenta are averaged through `compression` (by default scaled 1-bit
  codes, a pair of means per 256 elements, with error feedback on the worker and on the server:
  "onebit:block=256|ef|twoway"), so every rank holds the same m; v stays as it is. A sign code
  of the momentum loses little: the momentum changes slowly, and Adam's step divides it by the
  per-coordinate scale.
Either way x -= lr (m^ / (sqrt(v^) + eps) + wd x), each coordinate's step within Adam's own
bound, v^ corrected by its own number of updates.

Which steps are exact is the variance policy:
- "freeze" (the default; 1-bit Adam as published, Tang et al. 2021): the first warmup_steps
  steps, then v is frozen for good.
- "doubling" (0/1 Adam's schedule, Lu et al. 2022): the first variance_interval steps, then
  every 2nd step for variance_interval more, every 4th, ...: v keeps following the gradients'
  scale while the share of exact steps shrinks (74 of the first 400 steps, 201 of the first
  100,000, with variance_interval = 16). It won on short runs and lost on a longer one
  (docs/optimizers.md).

Volume: exact steps send fp32, the others about 1 bit per element (1.25 with the blocks' means):
about 1 / (w + (1 - w) / 32) of fp32's bytes for a share w of exact steps.
"""
import torch

from gradcomp import _C
from gradcomp.two_stage import (DEFAULT_COMPRESSION, TwoStageOptimizer, fill_unseen,
                                warmup_steps_of)

# 0/1 Adam's kappa: exact steps per interval before the interval doubles (its paper's 16).
DEFAULT_VARIANCE_INTERVAL = 16
VARIANCE_POLICIES = ("freeze", "doubling")


class OneBitAdam(TwoStageOptimizer):
    """1-bit Adam over gradcomp's engine (see the module's doc).

    named_parameters: model.named_parameters() (or the model, or plain parameters: then named
        param.0, param.1, ...), or parameter groups (dicts whose "params" hold those, with
        their own lr, weight_decay, ...). Every rank passes the same parameters in the same
        order; float32, on the CPU.
    lr, betas, eps, weight_decay (decoupled, AdamW's), bias_correction: as AdamW's
        (defaults 1e-3, (0.9, 0.999), 1e-8, 0, True).
    variance: which steps are exact and update the variance: "freeze" (the default) or
        "doubling" (see the module's doc).
    variance_interval: "doubling": exact steps at each interval before it doubles (16).
    warmup_steps: "freeze": exact steps before the variance freezes (>= 1). Default: 15% of
        total_steps when that is given, else 1000.
    compression: the momentum's exchange on compressed steps, "codec|feedback|route"
        ("onebit:block=256|ef|twoway"); tensors under min_compress_elements stay
        uncompressed.
    transport, seed, bucket_mb, min_compress_elements, timeline, codec_threads, broadcast: as
        for DistributedOptimizer (broadcast: rank 0's parameters to every rank, at the start;
        timeline, or GRADCOMP_TIMELINE: the compressed steps' trace, the exact steps' in a file
        beside it, "trace.json" -> "trace-exact.json", each per rank as usual).
    overlap: hand each parameter's input to the exchange as soon as backward has its gradient,
        so the exchange overlaps the rest of backward (False: all of them in step()). For one
        backward pass per step(); a second gradient before step() is an error
        (python/gradcomp/two_stage.py).
    find_unused_parameters: as DDP's: a parameter whose .grad is None on every rank in a step
        keeps its value, variance and step count, as torch's Adam leaves it (False: it moves by
        its momentum and weight decay, as if its gradient were 0); one small collective a step,
        the same on every rank. A parameter first used after the warm-up takes an exact step
        of its own at its first use (its variance is learned there; docs/optimizers.md).

    state_dict() holds the moments, the step and gradcomp's state (both sides' error feedback):
    load_state_dict() resumes bit-exactly after a step of either kind."""

    def __init__(self, named_parameters, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, bias_correction=True, variance="freeze",
                 variance_interval=DEFAULT_VARIANCE_INTERVAL, warmup_steps=None, total_steps=None,
                 compression=DEFAULT_COMPRESSION, transport=None, seed=0, bucket_mb=25.0,
                 min_compress_elements=16384, timeline=None, codec_threads=1, broadcast=True,
                 overlap=False, find_unused_parameters=False):
        self.variance = _variance_policy(variance, variance_interval, warmup_steps)
        self.variance_interval = variance_interval
        # None under "doubling" (total_steps then sets nothing)
        self.warmup_steps = (warmup_steps_of(warmup_steps, total_steps, "OneBitAdam")
                             if variance == "freeze" else None)
        super().__init__(named_parameters, (lr, betas, eps, weight_decay, bias_correction),
                         (compression, transport, seed, bucket_mb, min_compress_elements,
                          timeline, codec_threads, broadcast), overlap,
                         find_unused_parameters)

    @property
    def exact(self):
        """Whether the next step exchanges the gradient exactly and updates the variance."""
        if self.variance == "freeze":
            return self._steps < self.warmup_steps
        return is_exact_step(self._steps, self.variance_interval)

    @property
    def frozen(self):
        """Whether the variance is frozen for good ("freeze", after the warm-up)."""
        return self.variance == "freeze" and self._steps >= self.warmup_steps

    def _update(self, p, weights, exchanged, group, exact, threads):
        state = self._state(p)
        state["step"] += 1
        hyper = self._hyper(group)
        if exact:  # m and v take the mean gradient
            state["variance_updates"] += 1
            if state["variance_updates"] == state["step"]:  # every step so far was exact
                _C.adamw_step(weights, exchanged, state["exp_avg"], state["exp_avg_sq"],
                              state["step"], hyper, threads)
                return
            _C.zero_one_adam_step(weights, exchanged, state["exp_avg"], state["exp_avg_sq"],
                                  state["step"], hyper, threads, state["variance_updates"], True)
            return
        if self.frozen and not state.get("filled"):
            fill_unseen(state["exp_avg_sq"])  # it will not learn them any more
            state["filled"] = True
        state["exp_avg"].copy_(exchanged)  # the averaged momentum, the same on every rank
        _C.frozen_adam_step(weights, None, state["exp_avg"], state["exp_avg_sq"], state["step"],
                            hyper, threads, state["variance_updates"])

    def _settings(self):
        return {"variance": self.variance, "variance_interval": self.variance_interval,
                "warmup_steps": self.warmup_steps}


def is_exact_step(step, interval):
    """Whether step (counted from 0) is exact under the "doubling" policy: every step for the
    first `interval` exact steps, then every 2nd step for `interval` more, every 4th, ..."""
    begin, every = 0, 1
    while step >= begin + interval * every:
        begin += interval * every
        every *= 2
    return (step - begin) % every == 0


def _variance_policy(variance, interval, warmup_steps):
    if variance not in VARIANCE_POLICIES:
        raise ValueError(f"OneBitAdam: variance is {variance!r}; allowed: "
                         f"{', '.join(map(repr, VARIANCE_POLICIES))}")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ValueError(f"OneBitAdam: variance_interval is {interval!r}; allowed: an int >= 1")
    if variance == "doubling" and warmup_steps is not None:
        raise ValueError("OneBitAdam: warmup_steps applies to variance=\"freeze\"; the "
                         "\"doubling\" policy's exact steps are set by variance_interval")
    return variance
