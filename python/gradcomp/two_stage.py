"""What gradcomp's two-stage optimizers share (1-bit Adam, python/gradcomp/onebit_adam.py; 1-bit
LAMB, onebit_lamb.py): each is a distributed optimizer of its own, whose every step is one of
two kinds:

- an exact step: the gradients are averaged uncompressed, and the optimizer's moments take the
  mean gradient (the variance learns the gradients' scale);
- a compressed step: each rank forms its momentum from its own gradient, m_r = b1 m + (1 - b1)
  g_r, and the momenta are averaged through `compression` (by default scaled 1-bit codes, a pair
  of means per 256 elements, with error feedback on the worker and on the server), so every rank
  holds the same m.

A parameter whose variance has learned nothing (first used after the warm-up: no exact step
updated it, or every gradient they saw was 0) takes, on a compressed step, an exact step of its
own instead (_unlearned, _exact_means).

Two engines on one transport carry the two kinds; a subclass says which steps are exact
(`exact`) and how a parameter moves after either kind (`_update`). Parameters may be
channels_last: the kernels step a packed copy, written back.

By default step() hands every parameter's input to the exchange, so the exchange starts after
backward. With overlap=True each parameter's input is handed over as soon as backward has
accumulated its gradient, so the exchange runs during the rest of backward (as
DistributedOptimizer's does): for scripts with one backward pass per step() whose every
gradient is the step's. A second gradient for a parameter before step() (gradient
accumulation, two losses backward in turn, a backward through these parameters for another
optimizer) is refused with an error naming it: the first one has already left."""
import json
import math
import os
import time
import warnings
import weakref

import torch

from gradcomp import _C
from gradcomp._C import Error

# 15% of the steps: DeepSpeed's BERT runs froze the variance after 15-25% of them.
DEFAULT_WARMUP_FRACTION = 0.15
DEFAULT_WARMUP_STEPS = 1000  # when neither warmup_steps nor total_steps is given
DEFAULT_COMPRESSION = "onebit:block=256|ef|twoway"
CHECKPOINT_VERSION = 2


class TwoStageOptimizer(torch.optim.Optimizer):
    """The base of OneBitAdam and OneBitLamb (see the module's doc). Subclasses define `exact`,
    `_update(p, weights, exchanged, group, exact, threads)`, `_settings()` (what a checkpoint
    must agree on) and may extend `_new_state(p)`."""

    def __init__(self, named_parameters, adam, exchange, overlap=False,
                 find_unused_parameters=False):
        """adam: (lr, betas, eps, weight_decay, bias_correction); exchange: (compression,
        transport, seed, bucket_mb, min_compress_elements, timeline, codec_threads,
        broadcast); overlap: hand each input over during backward (see the module's doc);
        find_unused_parameters: leave alone a parameter no rank has a gradient for (_leave)."""
        from gradcomp import torch as gt  # the transports and checks DistributedOptimizer uses
        name = type(self).__name__
        lr, betas, eps, weight_decay, bias_correction = adam
        (compression, transport, seed, bucket_mb, min_compress_elements, timeline,
         codec_threads, broadcast) = exchange
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        try:
            _C.AdamHyper(float(defaults["lr"]), float(defaults["betas"][0]),
                         float(defaults["betas"][1]), float(defaults["eps"]),
                         float(defaults["weight_decay"])).check(name)
        except _C.SpecError as e:
            raise ValueError(str(e)) from None
        gt._number("bucket_mb", bucket_mb, 1 / (1 << 20), 1 << 20, integer=False)
        gt._number("min_compress_elements", min_compress_elements, 0, (1 << 62))
        gt._number("seed", seed, 0, (1 << 64) - 1)
        gt._number("codec_threads", codec_threads, 1, 1024)
        named, groups, self._left_out = _named_groups(named_parameters, name)
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
        plan = _C.default_plan(tensors, _without_start(compression, name), bucket_bytes,
                               smallest)
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
        self._names = [n for n, _ in named]
        self._handed = [False] * len(self._params)  # this step's inputs already handed over
        # Parameters whose variance is known to hold more than zeros (_learned): found once,
        # as it never returns to zeros; load_state_dict() forgets them.
        self._learned_variance = [False] * len(self._params)
        # overlap=True: each .grad handed over during backward, and its version then
        self._handed_grads = [None] * len(self._params)
        if not isinstance(overlap, bool):
            raise ValueError(f"{name}: overlap is {overlap!r}; allowed: True or False")
        self.overlap = overlap
        self._accumulators = self._hook_gradients() if overlap else []
        if not isinstance(find_unused_parameters, bool):
            raise ValueError(f"{name}: find_unused_parameters is {find_unused_parameters!r}; "
                             "allowed: True or False")
        self.find_unused_parameters = find_unused_parameters
        self._agree_on_find_unused()

    @property
    def exact(self):
        """Whether the next step exchanges the gradient exactly and updates the variance."""
        raise NotImplementedError

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
        for i in range(len(self._params)):
            if not self._handed[i]:  # all of them, unless backward handed them over
                self._hand_over(i, exact)
        self._handed = [False] * len(self._params)
        engine.synchronize()
        handed_grads, self._handed_grads = self._handed_grads, [None] * len(self._params)
        unused = self._unused_everywhere()
        # After the exchange, so that every rank has taken part in it; before anything moves.
        self._check_trainable(unused)
        self._check_unchanged(handed_grads)
        unlearned = [] if exact else self._unlearned(unused)
        means = self._exact_means(unlearned)
        self._steps += 1
        self._last = engine.last_step()
        if not (self._last["finite"] and all(torch.isfinite(m).all() for m in means)):
            warnings.warn(f"gradcomp: {type(self).__name__}: this step's average is not finite "
                          "(an overflow on some rank): the step is skipped on every rank",
                          RuntimeWarning, stacklevel=2)
            return loss
        mean_of = dict(zip(unlearned, means))
        threads, began = torch.get_num_threads(), time.perf_counter()
        for i, (p, group, exchanged) in enumerate(zip(self._params, groups, self._exchanged)):
            if i in unused:
                self._leave(p, group, exchanged, exact)
                continue
            if i in mean_of:
                self._step_exactly_alone(p, group, exchanged, mean_of[i], threads)
            else:
                self._update_packed(p, exchanged, group, exact, threads)
        self._last["update_seconds"] = time.perf_counter() - began
        return loss

    def _agree_on_find_unused(self):
        """Every rank must take the same number of collectives a step: a rank agreeing on the
        unused parameters while another does not would pair the agreement with the next
        step's exchange. A collective at construction, like the engines'."""
        flag = torch.tensor([float(self.find_unused_parameters)], dtype=torch.float32)
        self._transport.allreduce_(flag)
        if flag.item() not in (0.0, float(self._transport.size)):
            raise Error(f"{type(self).__name__}: the ranks use different "
                        f"find_unused_parameters ({int(flag.item())} of "
                        f"{self._transport.size} ranks True, this rank's "
                        f"{self.find_unused_parameters}); pass the same on every rank")

    def _unused_everywhere(self):
        """find_unused_parameters: the parameters no rank had a gradient for this step, agreed
        by a sum over the ranks (one small collective, after the exchange: the engines are
        idle, and with overlap=True the next backward has not begun)."""
        if not self.find_unused_parameters:
            return set()
        used = torch.tensor([float(p.grad is not None) for p in self._params],
                            dtype=torch.float32)  # whatever torch's default dtype
        self._transport.allreduce_(used)
        return {i for i, n in enumerate(used.tolist()) if n == 0}

    def _leave(self, p, group, exchanged, exact):
        """A parameter no rank used this step keeps its value, its variance and its step count,
        as PyTorch's Adam leaves a parameter without a gradient. What the exchange gave it is
        not dropped: on an exact step every rank handed over zeros, so the mean is 0; on a
        compressed step every rank handed over b1 m, and the mean differs from it by what error
        feedback delivered (the codes' earlier errors), which the momentum keeps:
        m <- m + (mean - b1 m), so the momentum plus the memories still hold all that was
        handed over."""
        if exact:
            return
        beta1 = group["betas"][0]
        m = self._state(p)["exp_avg"]
        m.add_(exchanged - torch.mul(m, beta1))

    def _check_trainable(self, unused):
        """Refuses a step that would move a parameter PyTorch's own optimizer leaves alone, or
        leave one it moves, when requires_grad changed after construction (fine-tuning's
        freezing and unfreezing). Nothing has moved yet: the script can build the optimizer
        again. With find_unused_parameters a frozen parameter that no rank has a gradient for
        is left alone (`unused`), as DDP's option does."""
        name = type(self).__name__
        for pname, p in self._left_out:
            if p.grad is not None:
                raise Error(f"{name}: parameter '{pname}' has a gradient, but it required none "
                            f"when the {name} was built, so it is not exchanged and would never "
                            f"be updated. Build the {name} again after changing requires_grad")
        for i, (pname, p) in enumerate(zip(self._names, self._params)):
            if p.grad is None and not p.requires_grad and i not in unused:
                raise Error(f"{name}: parameter '{pname}' requires no gradient now (frozen "
                            f"after the {name} was built) and has none, so the exchange gave "
                            "it zeros, which the momentum and weight decay would still move it "
                            f"by. Build the {name} again after freezing (frozen parameters are "
                            "left out), or pass find_unused_parameters=True")

    def _check_unchanged(self, handed_grads):
        """overlap=True: refuses a step whose gradients the script changed after backward had
        handed them over (clipping, unscaling or zeroing .grad between backward and step()):
        the exchange took them as they were, so the change would be lost without a word."""
        for i, handed in enumerate(handed_grads):
            grad = self._params[i].grad
            if handed is not None and (grad is not handed[0] or grad._version != handed[1]):
                raise Error(f"{type(self).__name__}: parameter '{self._names[i]}': its .grad "
                            "changed after backward had handed it to the exchange (with "
                            "overlap=True each gradient leaves as soon as backward has it, so "
                            "clipping, unscaling or zeroing it afterwards would be lost); use "
                            "overlap=False to change gradients before step()")

    def _hook_gradients(self):
        """overlap=True: a hook on each parameter's gradient accumulator, which autograd calls
        once the parameter's .grad holds this backward's gradient. The accumulators are kept:
        the hooks live on them."""
        accumulators, me = [], weakref.ref(self)  # the hooks must not keep the engines alive
        for i, p in enumerate(self._params):
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
            accumulator.register_hook(lambda *_, i=i: me() and me()._gradient_ready(i))
            accumulators.append(accumulator)
        return accumulators

    def _gradient_ready(self, i):
        if self._handed[i]:
            raise Error(f"{type(self).__name__}: parameter '{self._names[i]}' got a gradient "
                        "again before step(): with overlap=True each step takes one backward "
                        "pass, and its gradient has already been handed to the exchange (for "
                        "gradient accumulation, or several backward passes per step, use "
                        "overlap=False)")
        self._hand_over(i, self.exact)
        grad = self._params[i].grad
        self._handed_grads[i] = (grad, grad._version)

    def _hand_over(self, i, exact):
        """Forms parameter i's input for this step's kind and hands it to that kind's engine."""
        group = self.param_groups[self._group_index[i]]
        self._local_input(i, self._params[i], group, exact)
        self._handed[i] = True
        (self._exact_engine if exact else self._engine).ready(i, self._exchanged[i])

    def _local_input(self, i, p, group, exact):
        """What rank r hands to the exchange for parameter i: its gradient (zeros when it has
        none) on an exact step, its momentum b1 m + (1 - b1) g_r on a compressed one."""
        out = self._exchanged[i]
        grad = p.grad
        if grad is not None and grad.is_sparse:
            raise Error(f"{type(self).__name__}: parameter {i} has a sparse gradient; not "
                        "supported")
        state = self._state(p)
        if exact:
            if grad is None:
                out.zero_()
            else:
                out.copy_(grad)
            return
        beta1 = group["betas"][0]
        # An unlearned variance: its gradient goes in an exact step of its own (_exact_means).
        if grad is None or not self._learned(i):
            torch.mul(state["exp_avg"], beta1, out=out)
        else:
            torch.lerp(grad, state["exp_avg"], beta1, out=out)  # b1 m + (1 - b1) g

    def _update(self, p, weights, exchanged, group, exact, threads):
        """Moves parameter p, whose values `weights` holds contiguous (p itself, or a packed
        copy written back after), by this step's averaged input `exchanged`."""
        raise NotImplementedError

    def _hyper(self, group):
        beta1, beta2 = group["betas"]
        return _C.AdamHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                            float(group["weight_decay"]), bool(group["bias_correction"]))

    def _state(self, p):
        state = self.state[p]
        if not state:
            state.update(self._new_state(p))
        return state

    def _new_state(self, p):
        return {"step": 0, "variance_updates": 0,
                "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format)}

    def _update_packed(self, p, exchanged, group, exact, threads):
        packed = not p.is_contiguous()  # channels_last weights: the kernels take them packed
        weights = p.data.contiguous() if packed else p.data
        self._update(p, weights, exchanged, group, exact, threads)
        if packed:
            p.data.copy_(weights)

    def _step_exactly_alone(self, p, group, exchanged, mean, threads):
        """An unlearned parameter's exact step of its own, on its `mean` gradient. Its momentum
        holds nothing but what the compressed exchanges gave it beyond its input (the codes'
        error, where its zeros shared a code block with other tensors, kept by _leave while no
        rank used it; error feedback takes it back later), and so does what this step's
        exchange gave beyond b1 m. That goes to the momentum after the exact step, not into the
        step itself: its variance is 0 where the gradient is, and m / (sqrt(v) + eps) would be
        huge there (v fills in before a compressed step divides by it)."""
        m = self._state(p)["exp_avg"]
        carried = exchanged + m * (1 - group["betas"][0])
        m.zero_()
        self._update_packed(p, mean, group, True, threads)
        m.add_(carried)

    def _learned(self, i):
        """Whether parameter i's variance holds more than zeros: some exact step updated it
        with a gradient not all 0. Not so for a parameter first used after the warm-up: with
        find_unused_parameters no exact step updated it; without, they all averaged zeros (no
        rank had a gradient), and so did one whose exact steps were all skipped. A compressed
        step divides by that variance (a step of m / eps, clamped: a sign-like step of about 3
        lr in every coordinate, for the codes' error alone where it has no gradient). The
        same on every rank (the states are)."""
        if not self._learned_variance[i]:
            self._learned_variance[i] = bool(self._state(self._params[i])["exp_avg_sq"].any())
        return self._learned_variance[i]

    def _unlearned(self, unused):
        """On a compressed step: the parameters not left alone (`unused`) whose variance has
        learned nothing (_learned). Each takes an exact step of its own instead; the same list
        on every rank (the states are, and so is `unused`)."""
        return [i for i in range(len(self._params)) if i not in unused and not self._learned(i)]

    def _exact_means(self, unlearned):
        """The mean over the ranks of each unlearned parameter's gradient (zeros where this
        rank has none), uncompressed, as an exact step's exchange would give. These parameters
        handed the compressed exchange b1 m, as one without a gradient does (_local_input), so
        nothing of the gradient goes twice. The ranks first agree which of them some rank has a
        gradient for (one small allreduce): only those are averaged (one allreduce of them
        all); the others' mean is 0, so that a parameter no rank uses (without
        find_unused_parameters) costs no exchange of its zeros at every step."""
        if not unlearned:
            return []
        had = torch.tensor([float(self._params[i].grad is not None) for i in unlearned],
                           dtype=torch.float32)  # whatever torch's default dtype
        self._transport.allreduce_(had)
        means = [torch.zeros(self._params[i].numel(), dtype=torch.float32) for i in unlearned]
        sent = [k for k, n in enumerate(had.tolist()) if n > 0]
        if sent:
            grads = [self._params[unlearned[k]].grad for k in sent]
            flat = torch.cat([means[k] if g is None else g.reshape(-1)
                              for k, g in zip(sent, grads)])
            self._transport.allreduce_(flat)
            flat.div_(self._transport.size)
            for k, m in zip(sent, flat.split([means[k].numel() for k in sent])):
                means[k] = m
        return [m.view_as(self._exchanged[i]) for i, m in zip(unlearned, means)]

    def _settings(self):
        """What a checkpoint holds and a resumed optimizer must agree with."""
        raise NotImplementedError

    def last_step(self):
        """The engine's figures of the last step (bytes_sent, uncompressed_bytes, finite,
        step_seconds, ...) and update_seconds, the time the parameters' update took (absent
        after a skipped step)."""
        return self._last

    def state_dict(self, all_ranks=False):
        """The moments (the same on every rank) and gradcomp's state: the error feedback of
        this rank (every rank saves its own file), or with all_ranks=True of every rank,
        gathered (a collective: every rank calls it), so that rank 0 alone may save one file
        that every rank resumes from."""
        state = super().state_dict()
        engine = ({"engines": self._engine.save_all_states()} if all_ranks
                  else {"engine": self._engine.save_state()})
        state["gradcomp"] = {"version": CHECKPOINT_VERSION, "steps": self._steps,
                             **self._settings(), **engine}
        return state

    def load_state_dict(self, state_dict):
        """All or nothing: a state that does not fit leaves this optimizer as it was."""
        name = type(self).__name__
        state_dict = dict(state_dict)
        ours = state_dict.pop("gradcomp", None)
        if not isinstance(ours, dict) or ours.get("version") != CHECKPOINT_VERSION:
            raise Error(f"{name}.load_state_dict: the state has no gradcomp part of version "
                        f"{CHECKPOINT_VERSION} (was it saved by {name}.state_dict() of this "
                        "version?)")
        for key, value in self._settings().items():
            if key not in ours:
                raise Error(f"{name}.load_state_dict: the state has no {key} (was it saved by "
                            f"another optimizer?)")
            if ours[key] != value:
                raise Error(f"{name}.load_state_dict: the state was saved with {key}="
                            f"{ours[key]!r}, this optimizer has {value!r}")
        if "engines" in ours:  # every rank's (state_dict(all_ranks=True)): this rank's part
            from gradcomp import torch as gt
            mine = gt._rank_part(ours["engines"], self._transport.rank, self._transport.size)
        elif "engine" in ours:
            mine = ours["engine"]
        else:
            raise Error(f"{name}.load_state_dict: the state has no engine state (was it saved by "
                        f"{name}.state_dict()?)")
        before = self._engine.save_state(undo=True)
        self._engine.load_state(mine)
        try:
            super().load_state_dict(state_dict)
        except Exception:
            self._engine.load_state(before)
            raise
        self._steps = int(ours["steps"])
        self._learned_variance = [False] * len(self._params)


def fill_unseen(v):
    """Coordinates whose gradient was always 0 in the warm-up (an embedding row of a token not
    seen yet) have v = 0: frozen so, their first gradient would step by m / eps. They take the
    mean of the tensor's other variances instead, a step of the size the tensor's other
    coordinates take. The mean is numpy's single-threaded pairwise sum in double: torch's
    reduction splits by thread count, and every rank must fill in the same bits."""
    unseen = v == 0
    if unseen.any() and not unseen.all():
        seen = v[~unseen].double().numpy()
        v[unseen] = float(seen.sum() / seen.size)


def warmup_steps_of(warmup_steps, total_steps, name):
    """The warm-up's length: warmup_steps, else 15% of total_steps, else 1000."""
    if warmup_steps is None:
        if total_steps is None:
            return DEFAULT_WARMUP_STEPS
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"{name}: total_steps is {total_steps!r}; allowed: an int >= 1")
        return max(1, math.ceil(DEFAULT_WARMUP_FRACTION * total_steps))
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"{name}: warmup_steps is {warmup_steps!r}; allowed: an int >= 1 "
                         "(the variance must see gradients before it freezes)")
    return warmup_steps


def _exact_trace(timeline):
    """The exact steps' Chrome trace: next to the compressed steps' ("trace.json" ->
    "trace-exact.json"), not over it; "" when there is none."""
    if not timeline:
        return ""
    stem, ext = os.path.splitext(timeline)
    return f"{stem}-exact{ext}"


def _without_start(compression, name):
    """The compressed steps' option; a start= of its own would make some of them exact."""
    _, _, _, start = _C.parse_option(compression)
    if start:
        raise Error(f"{name}: compression '{compression}' has its own start=; which steps "
                    "are exact is the optimizer's schedule (warmup_steps, variance_interval)")
    return compression


def _named_groups(named_parameters, name):
    """(name, parameter) pairs in exchange order, torch parameter groups of plain tensors, and
    the (name, parameter) pairs left out (requiring no gradient).
    named_parameters: the model, its named_parameters(), plain parameters, or a list of group
    dicts whose "params" hold either (then named param.0, param.1, ... where plain)."""
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    items = list(named_parameters)
    given = items if items and isinstance(items[0], dict) else [{"params": items}]
    named, groups, left_out = [], [], []
    for group in given:
        entries = []
        for item in list(group["params"]):
            pname, p = (item if isinstance(item, tuple)
                        else (f"param.{len(named) + len(left_out)}", item))
            if p.requires_grad:
                entries.append((pname, p))
                named.append((pname, p))
            else:
                left_out.append((pname, p))
        groups.append({**group, "params": [p for _, p in entries]})
    if not named:
        raise Error(f"{name}: no parameters that require gradients")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise Error(f"{name}: parameter name '{next(n for n in names if names.count(n) > 1)}'"
                    " appears twice")
    for n, p in named:
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise Error(f"{name}: parameter '{n}' is {p.dtype} on {p.device}; float32 CPU "
                        "parameters only (convert the model with .float())")
    return named, [g for g in groups if g["params"]], left_out
