"""Records the profile of a PyTorch model on this machine, for the planner and the simulator.

    import gradcomp.torch as gc
    x, y = next(iter(loader))
    p = gc.profile(model, x, loss_fn=lambda out: torch.nn.functional.cross_entropy(out, y))
    gc.save_profile(p, "my.json")        # then: gradcomp plan --profile my.json ...

A profile (schema in docs/simulation.md, "Profiles") lists the trainable parameters in the
order their gradients become ready in the backward pass, with element counts and ready times
(ms after backward starts), plus the forward and backward times of one step on one worker
without communication.
"""
import json
import platform
import statistics
import time
import warnings

import torch

__all__ = ["profile", "save_profile", "validate_profile"]

FORMAT = "gradcomp-profile"
VERSION = 1


def profile(model, example_batch, loss_fn=None, steps=5, warmup=2, name=None, batch_size=None):
    """Times `steps` training steps of `model` on `example_batch` (after `warmup` untimed ones)
    and returns the profile as a dict in the profile JSON schema.

    example_batch: the model's input: a tensor (model(x)), a tuple or list (model(*batch)) or a
        dict (model(**batch)), on the model's device.
    loss_fn: output -> scalar loss; default: the output's `.loss` if it has one (Hugging Face
        models), else the sum of every floating-point tensor in the output.
    name: the profile's "model" field (default: the model's class name).
    batch_size: default: the first dimension of the first tensor in example_batch.

    Times are medians over the timed steps. No optimizer runs: parameters are unchanged, and
    gradients and buffers (batch-norm statistics) are restored to what they were before.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, not {steps} and {warmup}")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    loss_fn = loss_fn or _default_loss
    saved = _save_state(model)
    recorder = _ReadyRecorder([p for _, p in params])
    try:
        runs = [_timed_step(model, example_batch, loss_fn, recorder)
                for _ in range(warmup + steps)][warmup:]
    finally:
        recorder.remove()
        _restore_state(model, saved)
    return _make_profile(params, runs, name or type(model).__name__,
                         batch_size or _batch_size(example_batch), steps, warmup)


def save_profile(profile_dict, path):
    """Checks `profile_dict` against the schema and writes it as JSON, one tensor per line."""
    validate_profile(profile_dict)
    head = {k: v for k, v in profile_dict.items() if k != "tensors"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    rows = ",\n".join(f"    {json.dumps(t)}" for t in profile_dict["tensors"])
    with open(path, "w") as f:
        f.write("{\n" + "\n".join(lines) + '\n  "tensors": [\n' + rows + "\n  ]\n}\n")


# ---- Timing one step.


class _ReadyRecorder:
    """Notes when each parameter's gradient has been accumulated into .grad, through a hook on
    its gradient accumulator (the node DDP hooks too): a Tensor hook would fire before the
    accumulation, and gradients are ready for communication only after it."""

    def __init__(self, params):
        self.start = 0.0
        self.times = [None] * len(params)
        self._nodes, self._handles = [], []
        for i, p in enumerate(params):
            with torch.enable_grad():  # the accumulator is reached through a graph edge
                node = p.expand_as(p).grad_fn.next_functions[0][0]
            self._nodes.append(node)  # the hook lives on this node: keep it alive
            self._handles.append(node.register_hook(self._hook(i, p.device)))

    def _hook(self, i, device):
        def record(grad_inputs, grad_outputs):
            if device.type == "cuda":  # the kernels were only queued: wait for them
                torch.cuda.synchronize(device)
            self.times[i] = time.perf_counter() - self.start
        return record

    def begin(self, start):
        self.start = start
        self.times = [None] * len(self.times)

    def remove(self):
        for handle in self._handles:
            handle.remove()


def _call(model, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _tensors(value):
    """Every tensor in a (nested) output or batch, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _default_loss(output):
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    parts = [t.float().sum() for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ValueError("the model's output has no floating-point tensor that needs a gradient; "
                         "pass loss_fn")
    return torch.stack(parts).sum()


def _synchronize(model):
    for p in model.parameters():
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
            return


def _timed_step(model, batch, loss_fn, recorder):
    """(forward seconds, backward seconds, each parameter's ready time or None)."""
    model.zero_grad(set_to_none=True)
    _synchronize(model)
    t0 = time.perf_counter()
    loss = loss_fn(_call(model, batch))  # the loss belongs to forward, as in training
    _synchronize(model)
    t1 = time.perf_counter()
    recorder.begin(t1)
    loss.backward()
    _synchronize(model)
    return t1 - t0, time.perf_counter() - t1, list(recorder.times)


def _save_state(model):
    grads = {p: (None if p.grad is None else p.grad.clone()) for p in model.parameters()}
    buffers = [(b, b.clone()) for b in model.buffers()]
    return grads, buffers


def _restore_state(model, saved):
    grads, buffers = saved
    with torch.no_grad():
        for p, grad in grads.items():
            p.grad = grad
        for buffer, value in buffers:
            buffer.copy_(value)


# ---- The profile dict.


def _batch_size(batch):
    first = next(_tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else 1


def _ms(seconds):
    """Milliseconds at nanosecond resolution, as the C++ side writes them."""
    return round(seconds * 1e3, 6)


def _ready_medians(params, runs):
    """The median ready time of every parameter; a parameter that never got a gradient (unused
    in this forward) counts as ready when backward ends, with a warning."""
    unused = [n for i, (n, _) in enumerate(params) if all(r[2][i] is None for r in runs)]
    if unused:
        warnings.warn(f"no gradient reached {', '.join(unused)}; listed as ready at the end of "
                      "backward")
    return [statistics.median(r[2][i] if r[2][i] is not None else r[1] for r in runs)
            for i in range(len(params))]


def _device_text(params):
    device = params[0][1].device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"{platform.processor() or platform.machine()} CPU, "
            f"{torch.get_num_threads()} threads")


def _make_profile(params, runs, name, batch_size, steps, warmup):
    ready = _ready_medians(params, runs)
    # Ready order; ties (one layer's weight and bias) in reverse registration order, as DDP.
    order = sorted(range(len(params)), key=lambda i: (ready[i], -i))
    source = (f"recorded by gradcomp.torch.profile on {_device_text(params)}, torch "
              f"{torch.__version__}: medians of {steps} steps after "
              f"{warmup} warm-up steps")
    return {
        "format": FORMAT, "version": VERSION, "model": name, "source": source,
        "batch_size": batch_size,
        "forward_ms": _ms(statistics.median(r[0] for r in runs)),
        # every run's backward ends after its own ready times, so the medians keep that order
        "backward_ms": _ms(statistics.median(r[1] for r in runs)),
        "tensors": [{"name": params[i][0], "elements": params[i][1].numel(),
                     "ready_ms": _ms(ready[i])} for i in order],
    }


# ---- The schema, checked as the C++ loader checks it (same messages).

_FIELDS = ("format", "version", "model", "source", "batch_size", "forward_ms", "backward_ms",
           "tensors")
_TENSOR_FIELDS = ("name", "elements", "ready_ms")


def _field(obj, path, key):
    if key not in obj:
        raise ValueError(f"missing field '{path}{key}'")
    return obj[key]


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _check_ms(value, path):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{path} must be a non-negative number of milliseconds")


def _check_tensor(t, i, previous, seen):
    path = f"tensors[{i}]"
    if not isinstance(t, dict):
        raise ValueError(f"{path} must be an object")
    for key in t:
        if key not in _TENSOR_FIELDS:
            raise ValueError(f"unknown field '{path}.{key}'; allowed: {', '.join(_TENSOR_FIELDS)}")
    name, elements, ready = (_field(t, path + ".", k) for k in _TENSOR_FIELDS)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}.name must be a non-empty string")
    if name in seen:
        raise ValueError(f"{path}.name '{name}' is also tensors[{seen[name]}].name: names must "
                         "be unique")
    seen[name] = i
    if not _is_int(elements) or elements < 0:
        raise ValueError(f"{path}.elements must be a non-negative integer")
    _check_ms(ready, f"{path}.ready_ms")
    if previous is not None and ready < previous:
        raise ValueError(f"{path}.ready_ms is before tensors[{i - 1}].ready_ms: ready times must "
                         "not decrease in backward order")


def validate_profile(d):
    """Raises ValueError naming the field if `d` is not a valid profile."""
    if not isinstance(d, dict):
        raise ValueError("a profile must be a JSON object")
    if _field(d, "", "format") != FORMAT:
        raise ValueError(f"format must be '{FORMAT}', not {json.dumps(d['format'])}")
    if not _is_int(_field(d, "", "version")):
        raise ValueError("version must be an integer")
    if d["version"] != VERSION:
        raise ValueError(f"version {d['version']} is not supported; this gradcomp reads profile "
                         f"version {VERSION}")
    for key in d:
        if key not in _FIELDS:
            raise ValueError(f"unknown field '{key}'; allowed: {', '.join(_FIELDS)}")
    for key in ("model", "source"):
        if not isinstance(_field(d, "", key), str):
            raise ValueError(f"{key} must be a string")
    if not _is_int(_field(d, "", "batch_size")) or d["batch_size"] <= 0:
        raise ValueError("batch_size must be a positive integer")
    for key in ("forward_ms", "backward_ms"):
        _check_ms(_field(d, "", key), key)
    tensors = _field(d, "", "tensors")
    if not isinstance(tensors, list) or not tensors:
        raise ValueError("tensors must be a non-empty array")
    seen = {}
    for i, t in enumerate(tensors):
        _check_tensor(t, i, tensors[i - 1]["ready_ms"] if i else None, seen)
    if d["backward_ms"] < tensors[-1]["ready_ms"]:
        raise ValueError(f"backward_ms is before tensors[{len(tensors) - 1}].ready_ms: backward "
                         "ends when its last gradient is ready or later")
