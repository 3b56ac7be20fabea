"""1-bit Adam (Tang et al. 2021): Adam whose exchange is compressed after a warm-up, by freezing
the variance and exchanging the momentum instead of the gradient. docs/optimizers.md.

    optimizer = gradcomp.torch.OneBitAdam(model.named_parameters(), lr=1e-3, total_steps=10_000)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

It is a distributed optimizer of its own (do not wrap it in DistributedOptimizer): step()
averages over the ranks, then updates.

- Warm-up (the first warmup_steps steps): the gradients are averaged uncompressed and AdamW
  steps on them, so the variance v learns the gradients' scale.
- Compression stage: v is frozen. Each rank forms its momentum from its own gradient,
  m_r = b1 m + (1 - b1) g_r, and the momenta are averaged through `compression` (by default
  scaled 1-bit codes, a pair of means per 256 elements, with error feedback on the worker and
  on the server: "onebit:block=256|ef|twoway"), so every rank holds the same m; then
  x -= lr (m^ / (sqrt(v^) + eps) + wd x), each coordinate's step within Adam's own bound. A
  sign code of the momentum loses little, because Adam's step divides by the frozen
  per-coordinate scale and the momentum changes slowly.

Volume: the warm-up sends fp32, the rest about 1 bit per element (1.25 with the blocks' means):
about 1 / (w + (1 - w) / 32) of fp32's bytes for a warm-up fraction w (5.6x at w = 15%).
"""
import json
import math
import warnings

import torch

from gradcomp import _C
from gradcomp._C import Error

# 15% of the steps: DeepSpeed's BERT runs froze the variance after 15-25% of them.
DEFAULT_WARMUP_FRACTION = 0.15
DEFAULT_WARMUP_STEPS = 1000  # when neither warmup_steps nor total_steps is given


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam over gradcomp's engine (see the module's doc).

    named_parameters: model.named_parameters() (or the model, or plain parameters: then named
        param.0, param.1, ...), or parameter groups (dicts whose "params" hold those, with
        their own lr, weight_decay, ...). Every rank passes the same parameters in the same
        order; float32, on the CPU.
    lr, betas, eps, weight_decay (decoupled, AdamW's), bias_correction: as AdamW's
        (defaults 1e-3, (0.9, 0.999), 1e-8, 0, True).
    warmup_steps: steps of uncompressed AdamW before the variance freezes (>= 1). Default:
        15% of total_steps when that is given, else 1000.
    compression: the momentum's exchange after the warm-up, "codec|feedback|route"
        ("onebit:block=256|ef|twoway"); tensors under min_compress_elements stay
        uncompressed.
    transport, seed, bucket_mb, min_compress_elements, timeline, codec_threads, broadcast: as
        for DistributedOptimizer (broadcast: rank 0's parameters to every rank, at the start).

    state_dict() holds the moments, the step and gradcomp's state (both sides' error feedback):
    load_state_dict() resumes bit-exactly in either stage."""

    def __init__(self, named_parameters, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, bias_correction=True, warmup_steps=None, total_steps=None,
                 compression="onebit:block=256|ef|twoway", transport=None, seed=0,
                 bucket_mb=25.0, min_compress_elements=16384, timeline=None, codec_threads=1,
                 broadcast=True):
        from gradcomp import torch as gt  # the transports and checks DistributedOptimizer uses
        try:
            _C.AdamHyper(float(lr), float(betas[0]), float(betas[1]), float(eps),
                         float(weight_decay)).check("OneBitAdam")
        except _C.SpecError as e:
            raise ValueError(str(e)) from None
        self.warmup_steps = _warmup(warmup_steps, total_steps)
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
        # One engine for both stages: the option's "|start=N" makes steps before N a plain
        # allreduce, so its step counter is the optimizer's (counted from 0).
        option = _with_start(compression, self.warmup_steps)
        tensors = [(n, p.numel()) for n, p in named]
        plan = _C.default_plan(tensors, option, int(bucket_mb * (1 << 20)),
                               int(min_compress_elements))
        self._transport = gt._exchange_transport(transport)
        self._engine = _C.Engine(self._transport, plan, int(seed), timeline or "", 0,
                                 int(codec_threads))
        self.plan = json.loads(plan)
        if broadcast:
            gt.broadcast_parameters(named, transport=self._transport)
        self._exchanged = [torch.empty_like(p, memory_format=torch.contiguous_format)
                           for p in self._params]
        self._steps = 0  # steps taken (the engine's counter: skipped steps count too)
        self._last = None

    @property
    def frozen(self):
        """Whether the variance is frozen (the compression stage)."""
        return self._steps >= self.warmup_steps

    @torch.no_grad()
    def step(self, closure=None):
        """Averages over the ranks (a collective), then updates. A step whose average is not
        finite (an overflow on some rank) is skipped on every rank, with a warning."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen = self.frozen
        groups = [self.param_groups[g] for g in self._group_index]
        for i, (p, group) in enumerate(zip(self._params, groups)):
            self._local_input(i, p, group, frozen)
            self._engine.ready(i, self._exchanged[i])
        self._engine.synchronize()
        self._steps += 1
        self._last = self._engine.last_step()
        if not self._last["finite"]:
            warnings.warn("gradcomp: OneBitAdam: this step's average is not finite (an overflow "
                          "on some rank): the step is skipped on every rank", RuntimeWarning,
                          stacklevel=2)
            return loss
        for p, group, exchanged in zip(self._params, groups, self._exchanged):
            self._update(p, exchanged, group, frozen)
        return loss

    def _local_input(self, i, p, group, frozen):
        """What rank r hands to the exchange for parameter i: its gradient (zeros when it has
        none) in the warm-up, its momentum b1 m + (1 - b1) g_r after it."""
        out = self._exchanged[i]
        grad = p.grad
        if grad is not None and grad.is_sparse:
            raise Error(f"OneBitAdam: parameter {i} has a sparse gradient; not supported")
        state = self._state(p)
        if not frozen:
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

    def _update(self, p, exchanged, group, frozen):
        state = self._state(p)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        hyper = _C.AdamHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                             float(group["weight_decay"]), bool(group["bias_correction"]))
        threads = torch.get_num_threads()
        if not frozen:
            _C.adamw_step(p.data, exchanged, state["exp_avg"], state["exp_avg_sq"],
                          state["step"], hyper, threads)
            return
        if "frozen_at" not in state:  # v's bias correction stays that of its last update
            state["frozen_at"] = state["step"] - 1
            if state["frozen_at"] < 1:
                raise Error("OneBitAdam: the variance froze before any warm-up step updated it "
                            "(every warm-up step was skipped: non-finite averages)")
            _fill_unseen(state["exp_avg_sq"])
        state["exp_avg"].copy_(exchanged)  # the averaged momentum, the same on every rank
        _C.frozen_adam_step(p.data, None, state["exp_avg"], state["exp_avg_sq"], state["step"],
                            hyper, threads, state["frozen_at"])

    def _state(self, p):
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    def last_step(self):
        """The engine's figures of the last step: bytes_sent, uncompressed_bytes, finite, ..."""
        return self._last

    def state_dict(self):
        state = super().state_dict()
        state["gradcomp"] = {"version": 1, "steps": self._steps,
                             "warmup_steps": self.warmup_steps,
                             "engine": self._engine.save_state()}
        return state

    def load_state_dict(self, state_dict):
        """All or nothing: a state that does not fit leaves this optimizer as it was."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("gradcomp", None)
        if not isinstance(ours, dict) or ours.get("version") != 1:
            raise Error("OneBitAdam.load_state_dict: the state has no gradcomp part of version "
                        "1 (was it saved by OneBitAdam.state_dict()?)")
        if ours["warmup_steps"] != self.warmup_steps:
            raise Error(f"OneBitAdam.load_state_dict: the state was saved with warmup_steps="
                        f"{ours['warmup_steps']}, this optimizer has {self.warmup_steps}")
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


def _with_start(compression, warmup_steps):
    codec, feedback, route, start = _C.parse_option(compression)
    if start:
        raise Error(f"OneBitAdam: compression '{compression}' has its own start=; the "
                    "warm-up is warmup_steps")
    return f"{codec}|{feedback}|{route}|start={warmup_steps}"


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
