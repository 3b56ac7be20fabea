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
import json
import math
import os
import warnings

import torch

from gradcomp import _C
from gradcomp._C import Error

# 15% of the steps: DeepSpeed's BERT runs froze the variance after 15-25% of them.
DEFAULT_WARMUP_FRACTION = 0.15
DEFAULT_WARMUP_STEPS = 1000  # when neither warmup_steps nor total_steps is given
# 0/1 Adam's kappa: exact steps per interval before the interval doubles (its paper's 16).
DEFAULT_VARIANCE_INTERVAL = 16
VARIANCE_POLICIES = ("freeze", "doubling")


class OneBitAdam(torch.optim.Optimizer):
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

    state_dict() holds the moments, the step and gradcomp's state (both sides' error feedback):
    load_state_dict() resumes bit-exactly after a step of either kind."""

    def __init__(self, named_parameters, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, bias_correction=True, variance="freeze",
                 variance_interval=DEFAULT_VARIANCE_INTERVAL, warmup_steps=None, total_steps=None,
                 compression="onebit:block=256|ef|twoway", transport=None, seed=0,
                 bucket_mb=25.0, min_compress_elements=16384, timeline=None, codec_threads=1,
                 broadcast=True):
        from gradcomp import torch as gt  # the transports and checks DistributedOptimizer uses
        try:
            _C.AdamHyper(float(lr), float(betas[0]), float(betas[1]), float(eps),
                         float(weight_decay)).check("OneBitAdam")
        except _C.SpecError as e:
            raise ValueError(str(e)) from None
        self.variance = _variance_policy(variance, variance_interval, warmup_steps)
        self.variance_interval = variance_interval
        # None under "doubling" (total_steps then sets nothing)
        self.warmup_steps = _warmup(warmup_steps, total_steps) if variance == "freeze" else None
        gt._number("bucket_mb", bucket_mb, 1 / (1 << 20), 1 << 20, integer=False)
        gt._number("min_compress_elements", min_compress_elements, 0, (1 << 62))
        gt._number("seed", seed, 0, (1 << 64) - 1)
        gt._number("codec_threads", codec_threads, 1, 1024)
        named, groups = _named_groups(named_parameters)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        super().__init__(groups, defaults)
        self._params = [p for _, p in named]
        # Each parameter's group, by index: load_state_dict() replaces the group dicts.
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        self._group_index = [group_of[id(p)] for p in self._params]
        self.compression = compression
        # Two engines on one transport, one per kind of step. Only one of them is busy at a
        # time (step() waits for it), and every rank picks the same one for a step.
        tensors = [(n, p.numel()) for n, p in named]
        bucket_bytes, smallest = int(bucket_mb * (1 << 20)), int(min_compress_elements)
        plan = _C.default_plan(tensors, _without_start(compression), bucket_bytes, smallest)
        exact_plan = _C.default_plan(tensors, "none", bucket_bytes, smallest)
        self._transport = gt._exchange_transport(transport)
        timeline = timeline or os.environ.get("GRADCOMP_TIMELINE", "")
        self._engine = _C.Engine(self._transport, plan, int(seed), timeline, 0,
                                 int(codec_threads))
        self._exact_engine = _C.Engine(self._transport, exact_plan, int(seed),
                                       _exact_trace(timeline), 0, int(codec_threads))
        self.plan = json.loads(plan)
        if broadcast:
            gt.broadcast_parameters(named, transport=self._transport)
        self._exchanged = [torch.empty_like(p, memory_format=torch.contiguous_format)
                           for p in self._params]
        self._steps = 0  # steps taken (skipped steps count too: the schedule's clock)
        self._last = None

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

    @torch.no_grad()
    def step(self, closure=None):
        """Averages over the ranks (a collective), then updates. A step whose average is not
        finite (an overflow on some rank) is skipped on every rank, with a warning."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        exact = self.exact
        engine = self._exact_engine if exact else self._engine
        groups = [self.param_groups[g] for g in self._group_index]
        for i, (p, group) in enumerate(zip(self._params, groups)):
            self._local_input(i, p, group, exact)
            engine.ready(i, self._exchanged[i])
        engine.synchronize()
        self._steps += 1
        self._last = engine.last_step()
        if not self._last["finite"]:
            warnings.warn("gradcomp: OneBitAdam: this step's average is not finite (an overflow "
                          "on some rank): the step is skipped on every rank", RuntimeWarning,
                          stacklevel=2)
            return loss
        threads = torch.get_num_threads()
        for p, group, exchanged in zip(self._params, groups, self._exchanged):
            self._update(p, exchanged, group, exact, threads)
        return loss

    def _local_input(self, i, p, group, exact):
        """What rank r hands to the exchange for parameter i: its gradient (zeros when it has
        none) on an exact step, its momentum b1 m + (1 - b1) g_r on a compressed one."""
        out = self._exchanged[i]
        grad = p.grad
        if grad is not None and grad.is_sparse:
            raise Error(f"OneBitAdam: parameter {i} has a sparse gradient; not supported")
        state = self._state(p)
        if exact:
            if grad is None:
                out.zero_()
            else:
                out.copy_(grad)
            return
        beta1 = group["betas"][0]
        if grad is None:
            torch.mul(state["exp_avg"], beta1, out=out)
        else:
            torch.lerp(grad, state["exp_avg"], beta1, out=out)  # b1 m + (1 - b1) g

    def _update(self, p, exchanged, group, exact, threads):
        state = self._state(p)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        hyper = _C.AdamHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                             float(group["weight_decay"]), bool(group["bias_correction"]))
        if exact:  # m and v take the mean gradient
            state["variance_updates"] += 1
            if state["variance_updates"] == state["step"]:  # every step so far was exact
                _C.adamw_step(p.data, exchanged, state["exp_avg"], state["exp_avg_sq"],
                              state["step"], hyper, threads)
                return
            _C.zero_one_adam_step(p.data, exchanged, state["exp_avg"], state["exp_avg_sq"],
                                  state["step"], hyper, threads, state["variance_updates"], True)
            return
        if state["variance_updates"] < 1:
            raise Error("OneBitAdam: a compressed step came before any exact step updated the "
                        "variance (every exact step so far was skipped: non-finite averages)")
        if self.frozen and not state.get("filled"):
            _fill_unseen(state["exp_avg_sq"])  # it will not learn them any more
            state["filled"] = True
        state["exp_avg"].copy_(exchanged)  # the averaged momentum, the same on every rank
        _C.frozen_adam_step(p.data, None, state["exp_avg"], state["exp_avg_sq"], state["step"],
                            hyper, threads, state["variance_updates"])

    def _state(self, p):
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["variance_updates"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    def last_step(self):
        """The engine's figures of the last step: bytes_sent, uncompressed_bytes, finite, ..."""
        return self._last

    def state_dict(self):
        state = super().state_dict()
        state["gradcomp"] = {"version": 2, "steps": self._steps, "variance": self.variance,
                             "variance_interval": self.variance_interval,
                             "warmup_steps": self.warmup_steps,
                             "engine": self._engine.save_state()}
        return state

    def load_state_dict(self, state_dict):
        """All or nothing: a state that does not fit leaves this optimizer as it was."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("gradcomp", None)
        if not isinstance(ours, dict) or ours.get("version") != 2:
            raise Error("OneBitAdam.load_state_dict: the state has no gradcomp part of version "
                        "2 (was it saved by OneBitAdam.state_dict() of this version?)")
        for key in ("variance", "variance_interval", "warmup_steps"):
            if ours[key] != getattr(self, key):
                raise Error(f"OneBitAdam.load_state_dict: the state was saved with {key}="
                            f"{ours[key]!r}, this optimizer has {getattr(self, key)!r}")
        before = self._engine.save_state()
        self._engine.load_state(ours["engine"])
        try:
            super().load_state_dict(state_dict)
        except Exception:
            self._engine.load_state(before)
            raise
        self._steps = int(ours["steps"])


def _fill_unseen(v):
    """Coordinates whose gradient was always 0 in the warm-up (an embedding row of a token not
    seen yet) have v = 0: frozen so, their first gradient would step by m / eps. They take the
    mean of the tensor's other variances instead, a step of the size the tensor's other
    coordinates take. The mean is numpy's single-threaded pairwise sum in double: torch's
    reduction splits by thread count, and every rank must fill in the same bits."""
    unseen = v == 0
    if unseen.any() and not unseen.all():
        seen = v[~unseen].double().numpy()
        v[unseen] = float(seen.sum() / seen.size)


def _exact_trace(timeline):
    """The exact steps' Chrome trace: next to the compressed steps' ("trace.json" ->
    "trace-exact.json"), not over it; "" when there is none."""
    if not timeline:
        return ""
    stem, ext = os.path.splitext(timeline)
    return f"{stem}-exact{ext}"


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


def _warmup(warmup_steps, total_steps):
    if warmup_steps is None:
        if total_steps is None:
            return DEFAULT_WARMUP_STEPS
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"OneBitAdam: total_steps is {total_steps!r}; allowed: an int >= 1")
        return max(1, math.ceil(DEFAULT_WARMUP_FRACTION * total_steps))
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"OneBitAdam: warmup_steps is {warmup_steps!r}; allowed: an int >= 1 "
                         "(Adam's variance must see gradients before it freezes)")
    return warmup_steps


def _without_start(compression):
    """The compressed steps' option; a start= of its own would make some of them exact."""
    _, _, _, start = _C.parse_option(compression)
    if start:
        raise Error(f"OneBitAdam: compression '{compression}' has its own start=; which steps "
                    "are exact is the variance policy's (warmup_steps, variance_interval)")
    return compression


def _named_groups(named_parameters):
    """(name, parameter) pairs in exchange order, and torch parameter groups of plain tensors.
    named_parameters: the model, its named_parameters(), plain parameters, or a list of group
    dicts whose "params" hold either (then named param.0, param.1, ... where plain)."""
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    items = list(named_parameters)
    given = items if items and isinstance(items[0], dict) else [{"params": items}]
    named, groups = [], []
    for group in given:
        entries = []
        for item in list(group["params"]):
            name, p = item if isinstance(item, tuple) else (f"param.{len(named)}", item)
            if p.requires_grad:
                entries.append((name, p))
                named.append((name, p))
        groups.append({**group, "params": [p for _, p in entries]})
    if not named:
        raise Error("OneBitAdam: no parameters that require gradients")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise Error(f"OneBitAdam: parameter name '{next(n for n in names if names.count(n) > 1)}'"
                    " appears twice")
    for n, p in named:
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise Error(f"OneBitAdam: parameter '{n}' is {p.dtype} on {p.device}; float32 CPU "
                        "parameters only (convert the model with .float())")
    return named, [g for g in groups if g["params"]]
