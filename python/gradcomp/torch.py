"""PyTorch front end: DistributedOptimizer and a DistributedDataParallel communication hook.

    import gradcomp.torch as gc
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = gc.DistributedOptimizer(optimizer, model.named_parameters(),
                                        compression="powersgd:rank=4|ef")
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # compressed and sent during backward; when it
                                          # returns, .grad holds the mean over ranks
        optimizer.step()                  # runs your SGD unchanged

Ranks meet through the transport: the default torch.distributed process group when one is
initialized, else gradcomp's own (MPI under mpirun, else Gloo with torchrun's environment:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""
import atexit
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from gradcomp import _C
from gradcomp._C import Error
from gradcomp.optimizers import LAMB, LANS  # noqa: F401 (gradcomp.torch.LAMB, .LANS)
from gradcomp.profile import profile, save_profile  # noqa: F401 (gradcomp.torch.profile)

__all__ = ["DistributedOptimizer", "comm_hook", "get_transport", "broadcast_parameters", "Error",
           "LAMB", "LANS", "OneBitAdam", "OneBitLamb"]

_own_transports = {}
# id(wrapped optimizer) -> the live DistributedOptimizer around it (one at a time, see _Replaced)
_wrapper_of = weakref.WeakValueDictionary()
_group_transports = {}  # id(process group) -> (group, transport): one queue per group


def _launched():
    return any(v in os.environ for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def get_transport(kind=None, timeout=0.0):
    """The transport gradcomp exchanges over.

    kind: None (the default torch.distributed group if initialized, else gradcomp's own),
    "mpi" or "gloo" (gradcomp's own backends), a torch.distributed ProcessGroup, or a transport
    returned earlier. gradcomp's own transports are made once per process and shared.
    """
    if isinstance(kind, _C.Transport):
        return kind
    if kind is None and dist.is_available() and dist.is_initialized():
        kind = dist.distributed_c10d._get_default_group()
    if kind is not None and not isinstance(kind, str):
        # One transport per group: two would issue collectives on it from two threads.
        if id(kind) not in _group_transports:
            device = "cuda" if dist.get_backend(kind) == "nccl" else "cpu"
            if device == "cuda":
                device = f"cuda:{torch.cuda.current_device()}"
            _group_transports[id(kind)] = (kind, _C.process_group_transport(
                kind, device, timeout, _default_store()))
        return _group_transports[id(kind)][1]
    backend = kind or ""
    if backend not in ("", *(_C.transport_names())):
        raise Error(f"transport '{backend}' is unknown; use one of "
                    f"{', '.join(_C.transport_names())}, a torch.distributed process group, or "
                    "None")
    if backend not in _own_transports:
        if _launched():
            _own_transports[backend] = _C.make_transport(backend, timeout,
                                                         _store_beside_torch(backend))
        else:
            # A single process without a launcher: a one-rank group of its own.
            store = tempfile.mkdtemp(prefix="gradcomp-store-")
            atexit.register(shutil.rmtree, store, True)  # the rendezvous' files, not kept
            _own_transports[backend] = _C.make_transport(backend or "gloo", timeout,
                                                         f"file:{store}", 0, 1)
    return _own_transports[backend]


def _store_beside_torch(backend):
    """The rendezvous of gradcomp's own Gloo transport in a job where torch.distributed is
    initialized (DDP with comm_hook(transport="gloo") for the routes over nodes): both would
    serve a store at MASTER_ADDR:MASTER_PORT, where torch's already listens. Rank 0 picks a
    free port and tells the others through torch's store. "" (GRADCOMP_STORE, or
    MASTER_ADDR:MASTER_PORT as usual) otherwise."""
    if (backend != "gloo" or "GRADCOMP_STORE" in os.environ or "MASTER_ADDR" not in os.environ
            or not (dist.is_available() and dist.is_initialized())):
        return ""
    store = _default_store()
    if store is None:
        raise Error("transport 'gloo' beside torch.distributed needs a rendezvous of its own "
                    "(torch's store serves MASTER_PORT): set GRADCOMP_STORE=tcp://host:port "
                    "(another free port on rank 0's host) or file:/shared/directory")
    key = "gradcomp/gloo_store_port"
    if dist.get_rank() == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            store.set(key, str(s.getsockname()[1]))
    port = int(store.get(key))
    return f"tcp://{os.environ['MASTER_ADDR']}:{port}"


def _default_store():
    """torch.distributed's store, through which a failed collective's error names the peers
    that are gone; None where this torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):
        return None


def _warn_if_blas_outnumbers_torch():
    """OpenBLAS's idle threads spin on sched_yield between products: more of them than torch
    was told to use take cores from the exchange and from ranks sharing the machine (docs/
    python.md, "Several ranks on one machine"). Said once per process, at the first engine, as
    a Python warning: the C++ check behind the engines (take_blas_threads_warning, which the
    libtorch front end TORCH_WARNs) then finds it taken."""
    warning = _C.take_blas_threads_warning()
    if warning:
        warnings.warn(warning, RuntimeWarning, stacklevel=_script_level())


def _script_level():
    """warnings.warn's stacklevel, for its caller's caller, of the first frame outside this
    package: the script's line, through however many of gradcomp's constructors."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _exchange_transport(kind, timeout=0.0):
    """The transport a new engine exchanges over.

    Over the default torch.distributed group: a new group of all ranks, made here (a
    collective, like the optimizer's construction). Others issue collectives on the default
    group from the training thread while the engine issues its own from its threads, and on
    one group the ranks would see the two in different orders (Gloo aborts on a size mismatch,
    or pairs the wrong messages): DDP during backward (find_unused_parameters, static_graph),
    SyncBatchNorm, the script's own calls, another engine. A group the caller made is used as
    it is (a new group would need every rank of the job, members or not, to make it with us);
    the caller keeps it for gradcomp, and a second engine on it is refused. gradcomp's own
    transports carry nothing but gradcomp's: the first engine takes the chosen one, later ones
    a communicator split from it in C++ (DistributedGradients)."""
    _warn_if_blas_outnumbers_torch()
    link = get_transport(kind, timeout)
    group = next((g for g, t in _group_transports.values() if t is link), None)
    if group is None:
        return link
    if group is not dist.distributed_c10d._get_default_group():
        if _C.transport_in_use(link):
            raise Error("this torch.distributed group already carries another gradcomp "
                        "optimizer's exchange; give each optimizer a group of its own "
                        "(torch.distributed.new_group, made on every rank)")
        return link
    return get_transport(dist.new_group(backend=dist.get_backend(group)), timeout)


def _queue_end_of_backward(end):
    """Runs `end` when the backward pass now running ends (autograd's final callback, as DDP's
    reducer does): a Python callback, so an exchange error reaches the caller of backward()
    with its own type (gradcomp.CommError, gradcomp.TimeoutError). Outside a backward pass it
    runs `end` at once: under DDP's join() a rank out of data matches the others' exchange by
    calling the hook with zero buckets from its forward pass."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(end)
    except RuntimeError as e:
        if "during backward" not in str(e):  # "can only be installed during backward pass"
            raise
        end()


def _gradcomp_error(error):
    """`error` as the user should see it: gradcomp's errors say 'gradcomp:' first (the engine's
    own messages begin with the bucket), keeping their type; others are left as they are."""
    if not isinstance(error, Error) or str(error).startswith("gradcomp"):
        return error
    return type(error)(f"gradcomp: {error}")


def _weakly(method):
    """`method` for the C++ side to call without keeping its object alive: a Python object
    held by C++ is invisible to the garbage collector, so a bound method there would make an
    uncollectable cycle (the optimizer, its C++ gradients, the method) and the optimizer, its
    engine, its threads and its claim on the transport would outlive every reference."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


def _scale_reader(loss_scale):
    """A function giving the current loss scale: from a GradScaler (or anything with
    get_scale()), a callable, or a fixed number; None without one."""
    if loss_scale is None:
        return None
    if hasattr(loss_scale, "get_scale"):
        return lambda: float(loss_scale.get_scale())
    if callable(loss_scale):
        return lambda: float(loss_scale())
    value = _number("loss_scale", loss_scale, 0, integer=False)
    if value <= 0:
        raise Error(f"loss_scale is {value}; it must be above 0")
    return lambda: float(value)


def _number(name, value, low, high=None, integer=True):
    """`value` checked as a number in [low, high], with a message saying what is allowed."""
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise Error(f"{name} must be {kind}, not {type(value).__name__} {value!r}")
    if not integer and not math.isfinite(value):
        raise Error(f"{name} is {value}; it must be a finite number")
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise Error(f"{name} is {value}; allowed: {allowed}")
    return value


def broadcast_parameters(params, root=0, transport=None):
    """Copies rank `root`'s tensors into every rank's, in place, bit for bit, so all ranks
    start from the same model. `params`: model.parameters(), model.buffers() (BatchNorm's
    running statistics and its int64 batch counter too), named_parameters(), or a state_dict.
    A collective: every rank passes the same tensors, in the same order."""
    items = params.items() if isinstance(params, dict) else params
    link = get_transport(transport)
    with torch.no_grad():
        for i, item in enumerate(items):
            name, t = item if isinstance(item, tuple) else (f"tensor {i}", item)
            if t.device.type != "cpu" or t.is_sparse:
                raise Error(f"broadcast_parameters: {name} is a {t.dtype} tensor on {t.device}"
                            f"{' (sparse)' if t.is_sparse else ''}; only dense CPU tensors can "
                            "be broadcast")
            if t.is_contiguous():
                link.broadcast_(t.data, root)
            else:  # channels_last weights, transposed views: sent packed, copied back in place
                packed = t.data.contiguous()
                link.broadcast_(packed, root)
                t.data.copy_(packed)


def _plan_json(plan):
    """A plan given as a dict, a JSON string, or the path of a JSON file."""
    if plan is None:
        return ""
    if isinstance(plan, dict):
        text = json.dumps(plan)
    elif isinstance(plan, str) and plan.lstrip().startswith("{"):
        text = plan
    elif isinstance(plan, (str, os.PathLike)):
        with open(plan, encoding="utf-8") as f:
            text = f.read()
    else:
        raise Error(f"plan must be a dict, a JSON string or a path, not {type(plan).__name__}")
    return _C.validate_plan(text)


_NON_FINITE_STEP = (
    "gradcomp: this step's mean gradient is not finite (an overflow, or a backward pass that "
    "raised on another rank): the optimizer step is skipped on every rank, as a GradScaler does")


def _auto_settings(compression, plan, auto, optimizer):
    """compression="auto": the scheduler's settings (_C.AutoSettings), with the options
    recommended for the optimizer's family as candidates unless auto= names them (those that
    held only after a warm-up of their own, start=N, are left out); else None."""
    if compression != "auto":
        if auto is not None:
            raise Error('auto= sets compression="auto"\'s scheduler; it needs compression="auto"')
        return None
    if plan is not None:
        raise Error('compression="auto" chooses the plan itself: give no plan= with it')
    if auto is not None and not isinstance(auto, dict):
        raise Error(f"auto= is a dict of settings by name (e.g. {{'warmup_steps': 20}}), "
                    f"not a {type(auto).__name__}")
    settings = _C.AutoSettings()
    family = _optimizer_family(optimizer) if optimizer is not None else None
    families = [family] if family else ["sgd", "adam"]
    candidates = [set(_C.recommended_options(f)) for f in families]
    settings.candidates = [o for o in _C.recommended_options(families[0])
                           if o != "none" and "start=" not in o
                           and all(o in c for c in candidates)]
    try:
        text = json.dumps(auto or {}, default=_json_scalar, allow_nan=False)
    except ValueError:  # NaN or infinity: out of every setting's range
        raise Error(f"auto= holds a number that is not finite: {auto}") from None
    try:  # the C++ reader names an unknown key or a value of the wrong type
        return _C.AutoSettings.from_json(text, settings)
    except _C.SpecError as e:
        raise Error(str(e)) from None


def _json_scalar(value):
    """A numpy or torch scalar in auto= as the number it holds (json.dumps' fallback)."""
    if hasattr(value, "item"):
        return value.item()
    raise Error(f"auto= holds a {type(value).__name__}, which is not a JSON value")


def _optimizer_family(optimizer):
    """"lans" for gradcomp's LANS (CLAN's recipes were measured with it), "adam" for optimizers
    that divide each coordinate's step by a running scale of its gradient (Adam, AdamW, and
    their kin, RMSprop, Adagrad, LAMB), "sgd" for SGD, else None."""
    if isinstance(optimizer, LANS):
        return "lans"
    adaptive = (torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop)
    if "betas" in optimizer.defaults or isinstance(optimizer, adaptive):
        return "adam"
    return "sgd" if isinstance(optimizer, torch.optim.SGD) else None


def _warn_if_not_recommended(optimizer, compression):
    """The accuracy tables do not back this compression under this kind of optimizer (the codec
    lost there, or held only after a warm-up the option lacks): say so, and what held."""
    family = _optimizer_family(optimizer)
    if family is None:
        return
    warning = _C.recommendation_warning(compression, family, type(optimizer).__name__)
    if warning:
        warnings.warn(f"gradcomp: {warning} (gradcomp.recommended() lists them)", stacklevel=3)


def _sparse_modules_parameters(model):
    """Names of the parameters of model's nn.Embedding / nn.EmbeddingBag with sparse=True:
    their gradients are sparse."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            names.append(f"{prefix}.weight" if prefix else "weight")
    return names


def _sparse_names(named, sparse_parameters, found):
    """The names to exchange as sparse rows: those given (names or parameters), plus those
    found in the model's sparse embeddings."""
    trainable = {n for n, p in named if p.requires_grad}
    names = [n for n in found if n in trainable]  # a frozen embedding has nothing to exchange
    name_of = {id(p): n for n, p in named}
    for item in sparse_parameters or ():
        if isinstance(item, torch.Tensor):
            if id(item) not in name_of:
                raise Error(f"sparse_parameters holds a tensor of shape {tuple(item.shape)} that "
                            "is not one of the optimizer's parameters")
            item = name_of[id(item)]
        if not isinstance(item, str):
            raise Error(f"sparse_parameters holds {type(item).__name__} {item!r}; give "
                        "parameter names or the parameters themselves")
        if item not in names:
            names.append(item)
    return names


_DDP_TWICE = ("DistributedDataParallel averages every gradient itself (uncompressed) during "
              "backward, and DistributedOptimizer would average them again: register "
              "gradcomp's hook on the DDP model instead (model.register_comm_hook(None, "
              "gradcomp.torch.comm_hook(...))), or give DistributedOptimizer the model without "
              "DDP")


def _refuse_ddp(named_parameters):
    """A DDP model's parameters are averaged by DDP already: gradcomp on top would pay for a
    full uncompressed allreduce and then its own, silently slower than either."""
    if isinstance(named_parameters, torch.nn.parallel.DistributedDataParallel):
        raise Error(f"named_parameters is a DistributedDataParallel model: {_DDP_TWICE}")


def _warn_if_ddp_names(named):
    """DDP's parameter names all begin with "module." (its wrapped model's attribute): if the
    script passed a DDP model's named_parameters(), say what that costs."""
    if named and all(n.startswith("module.") for n, _ in named):
        warnings.warn(f"gradcomp: every parameter name begins with 'module.', as a "
                      f"DistributedDataParallel model's do; if it is one, {_DDP_TWICE}",
                      stacklevel=3)


def _named_parameters(optimizer, named_parameters):
    """(name, parameter) pairs of the optimizer's parameters, checked against each other, and
    every given parameter's name by id (to name one added to the optimizer later)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(params)]
        return named, {id(p): n for n, p in named}
    named = list(named_parameters)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise Error(f"parameter name '{dup}' appears twice in named_parameters")
    known = {id(p) for _, p in named}
    for i, p in enumerate(params):
        if id(p) not in known:
            raise Error(f"the optimizer's parameter {i} (shape {tuple(p.shape)}) is not in "
                        "named_parameters; pass model.named_parameters() of the same model")
    in_optimizer = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in in_optimizer], {id(p): n for n, p in named}


class _Replaced:
    """The exchange of a DistributedOptimizer after another was built around the same optimizer
    (as gradcomp's errors advise after add_param_group or a change of requires_grad). Dropping
    the old exchange frees its engine and ends its hooks, even while something the script
    keeps (an LR scheduler) still holds the old wrapper: else both would exchange every
    gradient, their engines reading and writing the same .grad at once. Anything but its
    parameter groups (which schedulers use) then says so."""

    def __getattr__(self, name):
        raise Error("DistributedOptimizer: another DistributedOptimizer was built around the "
                    "same optimizer and took this one's place (this one exchanges no more); "
                    "call the new one")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch.optim optimizer: gradients are averaged over ranks with compression.

    Each gradient is handed to gradcomp's engine as soon as backward has accumulated it, and
    the exchange finishes when the backward pass ends, as with DDP: when loss.backward()
    returns, every .grad holds the (compressed) mean over ranks, bit-identical on every rank,
    so clipping, unscaling or inspecting gradients right there sees the mean. step() runs the
    wrapped optimizer unchanged (momentum, weight decay, schedulers). A collective: every rank
    constructs it with the same parameters. Several DistributedOptimizers may live in one
    process (a GAN's generator and discriminator): each exchanges over a communicator of its
    own.

    compression: "codec[|feedback[|route]]", e.g. "fp16", "topk:ratio=0.01|ef",
        "powersgd:rank=4|ef"; used for tensors of at least min_compress_elements (smaller ones
        stay uncompressed), fused into buckets of bucket_mb megabytes. "auto": gradcomp
        chooses the plan from what it measures in this job (docs/auto.md; auto_report()).
    auto: compression="auto"'s settings, a dict: candidates (options the plans may use;
        default: those recommended for this optimizer's kind), warmup_steps, profile_steps,
        trial_steps, stop_after, stop_margin, max_proposals, refine_proposals, runoff, drift,
        check_every, drift_checks, link_check_every, link_change, residual_growth,
        residual_checks, verbose.
    named_parameters: model.named_parameters(), or the model itself (then the weights of its
        nn.Embedding and nn.EmbeddingBag with sparse=True are exchanged as sparse rows).
    plan: a gradcomp plan (dict, JSON string or file) instead; its tensors are the parameter
        names (sparse parameters are not in it).
    transport: see gradcomp.torch.get_transport().
    backward_passes_per_step: gradient accumulation; gradients are exchanged during every k-th
        backward pass.
    seed: keys every codec's randomness (the same on all ranks).
    loss_scale: under mixed precision, the loss scaler (a torch.cuda.amp.GradScaler, anything
        with get_scale(), a callable, or a fixed number): read at the start of every backward
        pass, so error feedback keeps its memory in the units of each step's gradient when the
        scale changes. A step whose mean is not finite (an overflow the scaler skips) leaves
        every feedback memory as it was, with or without this.
    timeline: path of a Chrome-trace timeline of this rank's steps.
    broadcast: copy rank 0's parameters to every rank first, as DDP does (a collective).
    find_unused_parameters: as DDP's: a parameter that got no gradient on any rank in a step
        keeps .grad None (so Adam and weight decay leave it alone) instead of the zero mean;
        costs one small collective per step. The same on every rank.
    sparse_parameters: parameters (or their names) whose gradients are sparse, besides those
        found in the model: each is exchanged as rows after the buckets, uncompressed: the
        union of the rows the ranks touched, the mean bit-identical on every rank; .grad is
        then a coalesced sparse tensor (torch.optim.SparseAdam and SGD take it).
    """

    def __init__(self, optimizer, named_parameters=None, compression="none", plan=None,
                 transport=None, backward_passes_per_step=1, seed=0, bucket_mb=25.0,
                 min_compress_elements=16384, timeline=None, codec_threads=1, local_size=0,
                 broadcast=True, loss_scale=None, find_unused_parameters=False,
                 sparse_parameters=None, auto=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise Error(f"optimizer must be a torch.optim.Optimizer, not "
                        f"{type(optimizer).__name__}")
        if isinstance(optimizer, TwoStageOptimizer):
            raise Error(f"{type(optimizer).__name__} averages over the ranks by itself: use it "
                        "instead of DistributedOptimizer, not inside it (its compression= "
                        "argument sets the exchange)")
        _refuse_ddp(named_parameters)
        _number("bucket_mb", bucket_mb, 1 / (1 << 20), 1 << 20, integer=False)
        _number("min_compress_elements", min_compress_elements, 0, (1 << 62))
        _number("backward_passes_per_step", backward_passes_per_step, 1, (1 << 31) - 1)
        _number("seed", seed, 0, (1 << 64) - 1)
        _number("codec_threads", codec_threads, 1, 1024)
        _number("local_size", local_size, 0, 1 << 20)
        self.optimizer = optimizer
        self._loss_scale = _scale_reader(loss_scale)
        found = (_sparse_modules_parameters(named_parameters)
                 if isinstance(named_parameters, torch.nn.Module) else [])
        named, self._names_by_id = _named_parameters(optimizer, named_parameters)
        _warn_if_ddp_names(named)
        self._exchanged_ids = frozenset(id(p) for _, p in named)
        sparse = _sparse_names(named, sparse_parameters, found)
        automatic = _auto_settings(compression, plan, auto, optimizer)
        # Rebuilt, as an error told: the old one must not exchange too. Its exchange ends
        # before this one's begins (a group the script passed is free for one at a time).
        previous = _wrapper_of.get(id(optimizer))
        if previous is not None:
            previous._gradients = _Replaced()
        self._gradients = _C.DistributedGradients(
            named, _exchange_transport(transport), "none" if automatic else compression,
            _plan_json(plan), int(bucket_mb * (1 << 20)), int(min_compress_elements),
            int(backward_passes_per_step), int(seed), timeline or "", int(local_size),
            int(codec_threads), _weakly(self._backward_begins), bool(find_unused_parameters),
            sparse, automatic)
        self._gradients.set_learning_rate(self._lr())
        self._plan_settings = (int(bucket_mb * (1 << 20)), int(min_compress_elements))
        if not automatic:
            self._warn_if_nothing_is_compressed(compression, plan, min_compress_elements, sparse)
        # Every rank has the same options: one warning (rank 0's) is enough.
        if (plan is None and not automatic and self.rank == 0
                and any(b["codec"] != "none" for b in self.plan["buckets"])):
            _warn_if_not_recommended(optimizer, compression)
        if broadcast:
            # As DDP does: every rank starts from rank 0's parameters (frozen ones too).
            broadcast_parameters([p for _, p in named], 0, transport)
        _wrapper_of[id(optimizer)] = self

    # The wrapped optimizer's state, seen through this object (schedulers use these).
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def _lr(self):
        groups = self.optimizer.param_groups
        return float(groups[0].get("lr", 0.0)) if groups else 0.0

    def _warn_if_nothing_is_compressed(self, compression, plan, min_compress_elements, sparse):
        """A small model under the default plan is never compressed: say so once, rather than
        let the user believe it is."""
        if plan is not None or _C.parse_option(compression)[0] == "none":
            return
        if any(b["codec"] != "none" for b in self.plan["buckets"]):
            return
        if sparse and not self.plan["buckets"]:
            warnings.warn(
                f"gradcomp: compression '{compression}' has nothing to compress: this optimizer "
                f"holds only sparse parameters ({', '.join(sparse)}), whose gradients are "
                "exchanged as rows, uncompressed", stacklevel=3)
            return
        warnings.warn(
            f"gradcomp: compression '{compression}' applies to tensors of at least "
            f"min_compress_elements={min_compress_elements} elements, and no parameter is that "
            "large: every gradient is exchanged uncompressed (lower min_compress_elements to "
            "compress this model)", stacklevel=3)

    def _backward_begins(self, end):  # through _weakly: the C++ object must not keep us alive
        """Called by the first gradient hook of each backward pass, before it hands anything
        over: the step's loss scale, then the end-of-backward callback."""
        if self._loss_scale is not None:
            self._gradients.set_loss_scale(self._loss_scale())
        _queue_end_of_backward(end)

    @property
    def rank(self):
        """This process's rank among the ranks that exchange (for sharding data)."""
        return self._gradients.rank

    @property
    def world_size(self):
        """How many ranks exchange."""
        return self._gradients.world_size

    def set_compression(self, compression="none", plan=None):
        """Changes how the gradients travel from the next step on, as the constructor's
        compression= or plan= would have set it (bucket_mb and min_compress_elements as given
        there). Nothing of the gradients is lost: what the old plan's error feedback holds and
        has not delivered (residuals, DGC's accumulated velocity, two-way servers' residuals)
        joins the next exchange; momenta and PowerSGD's warm start begin anew. A collective:
        every rank calls it at the same point of training with the same arguments (ranks that
        differ get a CommError and keep the plan they had), while no exchange is under way: not
        during a backward pass, nor between the passes of an accumulated step (gradcomp.Error).
        state_dict() afterwards belongs to the new plan."""
        self._gradients.set_plan(compression, _plan_json(plan), *self._plan_settings)

    def synchronize(self):
        """Makes every .grad hold the mean over ranks now. Backward passes exchange by
        themselves, so this waits only for what is left: a step cut short during gradient
        accumulation, or a rank that ran no backward pass since the last step (its .grad, or
        zeros, takes part)."""
        self._gradients.synchronize()

    def step(self, closure=None):
        if closure is not None:
            raise Error("DistributedOptimizer.step() takes no closure: a closure would run "
                        "backward again after the gradients were exchanged")
        self._gradients.synchronize()
        refusal = self._gradients.aborted_step() or self._parameter_not_exchanged()
        if refusal:
            self._gradients.step_done()
            raise Error(refusal)
        if not self._gradients.mean_is_finite():
            # Stepping on NaN would ruin the parameters; the mean is the same on every rank, so
            # every rank skips alike (as a GradScaler does), and says so.
            self._gradients.step_done()
            warnings.warn(_NON_FINITE_STEP, RuntimeWarning, stacklevel=2)
            return None
        loss = self.optimizer.step()
        self._gradients.step_done()
        # Feedbacks that correct by the learning-rate ratio see the rate of the coming step.
        self._gradients.set_learning_rate(self._lr())
        return loss

    def _parameter_not_exchanged(self):
        """Why the wrapped optimizer must not step: it holds a parameter it did not hold at
        construction (the script called its add_param_group, as fine-tuning does to train a
        layer from some step on), whose gradient is this rank's own; else ""."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self._exchanged_ids:
                    name = self._names_by_id.get(id(p))
                    what = (f"parameter '{name}'" if name
                            else f"a parameter of shape {tuple(p.shape)}")
                    return (f"DistributedOptimizer: the wrapped optimizer holds {what}, which it "
                            "did not hold when the DistributedOptimizer was built (added by its "
                            "add_param_group?), so its gradient is not exchanged: a step would "
                            "move it by this rank's gradient alone and the ranks would drift "
                            "apart. Build the DistributedOptimizer again around the optimizer "
                            "after adding it (its momenta stay; the compression state starts "
                            "afresh)")
        return ""

    def zero_grad(self, *args, **kwargs):
        # A step skipped after an overflow (GradScaler) or a backward that raised ends here.
        self._gradients.step_done()
        return self.optimizer.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group):
        raise Error("DistributedOptimizer: parameter groups cannot be added after construction "
                    "(the exchange plan is fixed); add them to the optimizer before wrapping it")

    def state_dict(self, all_ranks=False):
        """The wrapped optimizer's state_dict plus the compression state (feedback residuals,
        PowerSGD factors, momenta, step counters) under "gradcomp". Error feedback is per rank:
        by default this rank's own (every rank saves its own file). all_ranks=True gathers
        every rank's (a collective: every rank calls it), so that rank 0 alone may save one
        file that every rank resumes from."""
        state = dict(self.optimizer.state_dict())
        ours = {"version": 1, "plan": self._gradients.plan_json(),
                "auto": self._gradients.save_auto()}
        if all_ranks:
            ours["states"] = self._gradients.save_all_states()
        else:
            ours["state"] = self._gradients.save_state()
        state["gradcomp"] = ours
        return state

    def load_state_dict(self, state_dict):
        """Loads a state_dict of state_dict(), this rank's or all ranks' (then this rank's
        part is taken). A plain optimizer state_dict (without "gradcomp") loads into the
        wrapped optimizer and compression starts afresh, with a warning. All or nothing."""
        state = dict(state_dict)
        ours = state.pop("gradcomp", None)
        if ours is None:
            warnings.warn("gradcomp: this state_dict has no compression state (it was saved "
                          "from the wrapped optimizer); the optimizer's state is loaded and "
                          "compression starts afresh (error-feedback memory empty)",
                          stacklevel=2)
            self.optimizer.load_state_dict(state)
            return
        if not isinstance(ours, dict) or ours.get("version") != 1:
            version = ours.get("version") if isinstance(ours, dict) else type(ours).__name__
            raise Error(f"the state_dict's gradcomp state has version {version!r}; this "
                        "gradcomp reads version 1")
        # compression="auto": its decision first (the kept plan runs again, no new search).
        auto_before = self._gradients.save_auto()
        self._gradients.load_auto(ours.get("auto", "null"))
        if ours.get("plan") != self._gradients.plan_json():
            self._gradients.load_auto(auto_before)
            raise Error("the state_dict was saved with a different plan (other parameters, "
                        "compression or bucket settings); resume with the same settings")
        mine = self._own_state(ours)
        # All or nothing: if the wrapped optimizer refuses its part, the compression state
        # loaded just before is put back (the engine state carries a checksum, so it is
        # checked before anything changes).
        previous = self._gradients.save_state(undo=True)
        self._gradients.load_state(mine)
        try:
            self.optimizer.load_state_dict(state)
        except Exception:
            self._gradients.load_state(previous)
            raise

    def _own_state(self, ours):
        if "states" not in ours:
            return ours["state"]
        return _rank_part(ours["states"], self.rank, self.world_size)

    @property
    def plan(self):
        """The plan being executed, as a dict."""
        return json.loads(self._gradients.plan_json())

    def auto_report(self):
        """compression="auto": what the scheduler measured and decided (a dict: its phase,
        every decision with the candidates' predicted and measured step times, the one kept
        and why, the search's cost in steps and seconds, the calibrated link and profile);
        None otherwise."""
        return json.loads(self._gradients.auto_report())

    def write_auto_calibration(self, directory):
        """compression="auto", after its first decision: writes what it measured in the formats
        `gradcomp plan` and `gradcomp simulate` read (profile.json, cluster.json,
        codec-costs.json in `directory`), and the correction its trials fitted to the model
        (correction.json), so the decision can be replayed offline:
        gradcomp plan --profile profile.json --cluster cluster.json --costs codec-costs.json
        --codecs <report's planner_codecs> --small-tensors <min_compress_elements>
        --one-lossy-step, and
        gradcomp simulate ... --correction correction.json --plan <a candidate's plan> predicts
        what the corrected model predicted. Returns the four paths."""
        report = self.auto_report()
        if report is None or report.get("cluster") is None:
            raise Error('write_auto_calibration: nothing calibrated yet (compression="auto" '
                        "calibrates when its warm-up ends)")
        os.makedirs(directory, exist_ok=True)
        paths = []
        for key, name in (("profile", "profile.json"), ("cluster", "cluster.json"),
                          ("codec_costs", "codec-costs.json"),
                          ("model_correction", "correction.json")):
            path = os.path.join(directory, name)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(report[key], f, indent=1)
            paths.append(path)
        return paths

    def last_step(self):
        """What the last step did on this rank: bytes_sent, uncompressed_bytes, step_seconds,
        exchange_seconds."""
        return self._gradients.last_step()

    def set_timeline(self, path):
        self._gradients.set_timeline(path or "")

    def __getstate__(self):
        raise Error("DistributedOptimizer cannot be pickled; save state_dict() instead")

    def __repr__(self):
        return f"gradcomp.torch.DistributedOptimizer({self.optimizer!r})"


_SPARSE = "sparse"  # a DDP bucket's entry in the hook's layout when it holds a sparse gradient


# The first synchronized iteration in which DDP's bucket layout is final: DDP rebuilds its
# buckets before its second such iteration, or its third with static_graph=True.
_DDP_LAYOUT_FINAL = 3


class CommHook:
    """A DistributedDataParallel communication hook running gradcomp's codecs and routes on
    DDP's buckets: ddp_model.register_comm_hook(None, gradcomp.torch.comm_hook(...)).

    DDP rebuilds its buckets once, in the order gradients arrived: before its second
    synchronized iteration, or before its third with static_graph=True (whose first iteration
    is delayed to the end of backward, and not recorded). So buckets are averaged uncompressed,
    as PyTorch's own PowerSGD hook does in its first iterations, until the layout is final: the
    same in two iterations in a row, the third or a later one; then one engine is built for the
    layout (collectively, in the same iteration on every rank) and every later bucket is
    compressed, sent while backward continues, and written back in place.

    Over the default torch.distributed group the engine exchanges over a new group of its own
    (_exchange_transport): DDP issues its own collectives on its group during backward
    (find_unused_parameters, static_graph). A group passed as `transport` is used as it is.

    DDP puts a sparse gradient (nn.Embedding(sparse=True)) in a bucket of its own; such a bucket
    is exchanged as rows (uncompressed, the union of the ranks' rows, bit-identical on every
    rank), after the engine's buckets, when backward ends.
    """

    def __init__(self, compression="none", transport=None, seed=0, min_compress_elements=16384,
                 timeline=None, codec_threads=1, local_size=0, auto=None, loss_scale=None,
                 optimizer=None):
        # compression="auto": the scheduler of DistributedOptimizer's "auto" (docs/auto.md),
        # driven from the end of each backward pass, with the options recommended under the
        # optimizer's family; without `optimizer` the hook does not know it, and takes those
        # recommended under both SGD and Adam-family optimizers.
        self._auto_settings = _auto_settings(compression, None, auto, optimizer)
        self._auto = None
        if self._auto_settings is not None:
            self._auto_settings.min_compress_elements = int(min_compress_elements)
            self._auto_settings.local_size = int(local_size)  # the nodes the engine will run
        _C.parse_option("none" if self._auto_settings else compression)
        self.__name__ = self.__qualname__ = "gradcomp_comm_hook"  # DDP logs a hook's name
        self.compression = compression
        self._loss_scale = _scale_reader(loss_scale)  # read as each backward's exchange begins
        self.min_compress_elements = int(min_compress_elements)
        self._transport = _exchange_transport(transport)  # not DDP's default group
        if (optimizer is not None and self._auto_settings is None and compression != "none"
                and self._transport.rank == 0):  # one warning for the job, as the optimizer's
            _warn_if_not_recommended(optimizer, compression)
        self._seed = int(seed)
        self._timeline = timeline or ""
        self._codec_threads = int(codec_threads)
        self._local_size = int(local_size)
        self._engine = None
        # A codec that compresses each tensor on its own (PowerSGD: one matrix per layer) gets
        # the bucket's parameters one by one; the others get the bucket as one tensor.
        # (auto may choose any codec: it gets them one by one too.)
        self._per_tensor = (self._auto_settings is not None
                            or _C.codec_uses_layout(_C.parse_option(compression)[0]))
        self._layout = None        # per bucket, the shapes of its gradients, of the engine's plan
        self._first_tensor = []    # per bucket, the plan index of its first tensor
        self._previous = None      # sizes seen in the last iteration
        self._iterations = 0       # synchronized iterations seen (DDP calls the hook in those)
        self._current = []         # sizes seen so far in this iteration
        self._futures = []
        self._sparse = []          # (future, bucket index, tensor) of this pass's sparse buckets
        self._pending_state = None
        self._failed = None        # the first error of the backward pass in progress
        self._clock = None         # auto: this step's times (step start, ready per tensor)

    def plan(self, layout):
        """The plan for DDP buckets of these layouts (per bucket, the shapes of its gradients):
        one gradcomp bucket per DDP bucket, holding the bucket as one tensor, or its gradients
        one by one, with their shapes, for a codec that compresses each tensor on its own."""
        buckets = []
        for i, shapes in enumerate(layout):
            if shapes == _SPARSE:
                continue  # exchanged as rows, outside the engine
            if self._per_tensor:
                buckets.append([(f"ddp_bucket.{i}.{j}", math.prod(s), list(s))
                                for j, s in enumerate(shapes)])
            else:
                buckets.append([(f"ddp_bucket.{i}", sum(math.prod(s) for s in shapes), [])])
        compression = "none" if self._auto_settings else self.compression
        return json.loads(_C.bucketed_plan(buckets, compression, self.min_compress_elements))

    def __call__(self, state, bucket):
        """DDP calls this for each bucket during backward. An error (a dead peer, a bad
        bucket) is raised by a callback at the end of backward, before DDP's own: raised here
        or through the future, DDP would turn it into a RuntimeError, losing its type."""
        try:
            self._check_state(state)
            return self._exchange(bucket)
        except Exception as e:  # noqa: BLE001 (re-raised at the end of backward, typed)
            error = _gradcomp_error(e)
            self._raise_at_end_of_backward(error)
            fut = torch.futures.Future()
            fut.set_exception(error)
            return fut

    def _check_state(self, state):
        """PyTorch's own hooks take DDP's process group as the state of register_comm_hook;
        this hook exchanges over its transport, so a group of another size there means DDP
        averages over other ranks than the hook would (a data-parallel subgroup)."""
        if isinstance(state, dist.ProcessGroup) and state.size() != self._transport.size:
            raise Error(f"register_comm_hook's state is a process group of {state.size()} "
                        f"ranks, but the hook exchanges over {self._transport.size}: pass the "
                        "hook transport= a group of DDP's ranks (torch.distributed.new_group, "
                        "made on every rank)")

    def _exchange(self, bucket):
        tensor = bucket.buffer() if hasattr(bucket, "buffer") else bucket.get_tensor()
        index = bucket.index()
        if index == 0:
            self._current = []
        self._current.append(_SPARSE if tensor.is_sparse
                             else tuple(tuple(g.shape) for g in bucket.gradients()))
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise Error(f"DDP bucket {index} is {tensor.dtype} on {tensor.device}; the gradcomp "
                        "hook exchanges float32 CPU buckets")
        if self._engine is not None:
            return self._compressed(index, tensor, bucket)
        fut = torch.futures.Future()
        if tensor.is_sparse:
            fut.set_result(_C.sparse_rows_mean(self._transport, f"ddp_bucket.{index}",
                                               tensor)[0])
        else:
            self._transport.allreduce_(tensor)
            tensor.div_(self._transport.size)
            fut.set_result(tensor)
        if bucket.is_last():
            self._learn_layout()
        return fut

    def _compressed(self, index, tensor, bucket):
        if index >= len(self._layout) or self._layout[index] != self._current[-1]:
            expected = self._layout[index] if index < len(self._layout) else "no bucket"
            raise Error(f"DDP bucket {index} holds gradients of shapes {self._current[-1]}; the "
                        f"hook's plan expected {expected} (DDP changed its bucket layout after "
                        "the hook fixed it)")
        if index == 0 and self._loss_scale is not None:  # DDP hands bucket 0 over first
            self._engine.set_loss_scale(self._loss_scale())
        fut = torch.futures.Future()
        if tensor.is_sparse:
            # After the engine's buckets (in _finish): collectives issued here, from this
            # thread, would interleave with the engine's differently on different ranks.
            self._sparse.append((fut, index, tensor))
        else:
            self._futures.append((fut, tensor))
            if self._auto is not None:
                self._clock_ready(index, len(bucket.gradients()))
            if self._per_tensor:  # views of the bucket's buffer: the mean is written through them
                for j, grad in enumerate(bucket.gradients()):
                    self._engine.ready(self._first_tensor[index] + j, grad)
            else:
                self._engine.ready(self._first_tensor[index], tensor)
        if bucket.is_last():
            # The last bucket: the exchange finishes when backward ends, in a callback queued
            # before DDP's (which waits for these futures), as the optimizer's does.
            futures, self._futures = self._futures, []
            sparse, self._sparse = self._sparse, []
            _queue_end_of_backward(lambda: self._finish(futures, sparse))
        return fut

    def _finish(self, futures, sparse):
        try:
            self._engine.synchronize()
            means = [_C.sparse_rows_mean(self._transport, f"ddp_bucket.{i}", t)[0]
                     for _, i, t in sparse]
        except Exception as e:
            error = _gradcomp_error(e)
            for f in [f for f, _ in futures] + [f for f, _, _ in sparse]:
                f.set_exception(error)
            raise error from e
        for f, t in futures:
            f.set_result(t)
        for (f, _, _), mean in zip(sparse, means):
            f.set_result(mean)
        if self._auto is not None:
            self._auto_step_end()

    def _clock_ready(self, index, count):
        """auto: the gradients of DDP bucket `index` are ready now."""
        now = time.monotonic()
        clock = self._clock
        clock["first"] = clock["first"] or now
        clock["last"] = now
        first = self._first_tensor[index]
        clock["ready"][first:first + count] = [now] * count

    def _auto_step_end(self):
        """auto: the end of an exchanged backward pass is the scheduler's step boundary (the
        optimizer's step of the iteration before falls into the next step's forward part)."""
        now, c = time.monotonic(), self._clock
        plan = self._auto.on_step_end(c["start"], c["first"], c["last"], now, now, c["ready"])
        if plan is not None:
            self._engine.set_plan(plan, trial=self._auto.in_trial())
        self._clock = self._new_clock()

    def _new_clock(self):
        return {"start": time.monotonic(), "first": 0.0, "last": 0.0,
                "ready": [0.0] * sum(len(s) for s in self._layout if s != _SPARSE)}

    def _raise_at_end_of_backward(self, error):
        if self._failed is None:  # the first error of this backward pass is the one to tell
            self._failed = error

            def end():
                failed, self._failed = self._failed, None
                raise failed
            _queue_end_of_backward(end)

    def _learn_layout(self):
        layout = list(self._current)
        self._iterations += 1
        if layout == self._previous and self._iterations >= _DDP_LAYOUT_FINAL:
            self._layout = layout
            counts = [0 if shapes == _SPARSE else len(shapes) if self._per_tensor else 1
                      for shapes in layout]
            self._first_tensor = [sum(counts[:i]) for i in range(len(counts))]
            plan = json.dumps(self.plan(layout))
            if self._auto_settings is not None:
                self._auto = _C.AutoScheduler(self._transport, plan, self._auto_settings)
                plan = self._auto.initial_plan()
                self._clock = self._new_clock()
            self._engine = _C.Engine(self._transport, plan, self._seed, self._timeline,
                                     self._local_size, self._codec_threads)
            if self._auto is not None:
                self._auto.watch(self._engine)
            if self._pending_state is not None:
                self._load(*self._pending_state)
                self._pending_state = None
        self._previous = layout

    def last_step(self):
        return self._engine.last_step() if self._engine else None

    def set_timeline(self, path):
        """Starts writing the Chrome trace to `path` (per rank, as the constructor's timeline),
        or with None closes it, leaving a complete file. Before DDP's layout is known (the
        engine is built at the end of the third iteration), the path is kept for it."""
        self._timeline = path or ""
        if self._engine is not None:
            self._engine.set_timeline(self._timeline)

    def auto_report(self):
        """compression="auto": what the scheduler decided (see DistributedOptimizer.auto_report);
        None before DDP's layout is known, or without auto."""
        return json.loads(self._auto.report()) if self._auto is not None else None

    def state_dict(self, all_ranks=False):
        """This rank's compression state (every rank saves its own); all_ranks=True gathers
        every rank's (a collective: every rank calls it), so that rank 0 alone may save one
        file every rank resumes from. Parameter servers' state (route 'servers') needs it."""
        state = {"version": 1, "layout": self._layout,
                 "auto": self._auto.save() if self._auto is not None else None}
        if all_ranks:
            state["states"] = self._engine.save_all_states() if self._engine else None
        else:
            state["state"] = self._engine.save_state() if self._engine else None
        return state

    def load_state_dict(self, state):
        """Restores the state into the engine once DDP's layout is known again (DDP re-buckets
        after a restart: its first iteration is averaged uncompressed); with auto, its decision
        first (the kept plan runs again, without a new search)."""
        mine = state.get("state")
        if state.get("states") is not None:
            mine = _rank_part(state["states"], self._transport.rank, self._transport.size)
        if mine is None:
            return
        if self._engine is not None:
            self._load(mine, state.get("auto"))
        else:
            self._pending_state = (mine, state.get("auto"))

    def _load(self, engine_state, auto_state):
        if auto_state is not None and self._auto is not None:
            plan = self._auto.restore(auto_state)
            if plan is not None:
                self._engine.set_plan(plan, trial=self._auto.in_trial())
        self._engine.load_state(engine_state)


def _rank_part(states, rank, world_size):
    """This rank's part of a state saved with all_ranks=True (one per rank)."""
    if len(states) != world_size:
        raise Error(f"the state_dict holds the compression state of {len(states)} ranks; "
                    f"this job has {world_size}: resume with the same world size, or go on "
                    "without the compression state (it starts afresh; a DistributedOptimizer "
                    "loads a state_dict without its 'gradcomp' entry so)")
    return states[rank]


def comm_hook(compression="none", transport=None, seed=0, min_compress_elements=16384,
              timeline=None, codec_threads=1, local_size=0, auto=None, loss_scale=None,
              optimizer=None):
    """A DDP communication hook: ddp.register_comm_hook(None, comm_hook("fp16")), or
    comm_hook("auto") (docs/auto.md). Arguments as for DistributedOptimizer (loss_scale: a
    GradScaler, so that feedback memory follows its scale; optimizer: the one the model trains
    with, whose kind picks auto's candidates and warns of a compression the accuracy tables do
    not back under it, as DistributedOptimizer does); see CommHook."""
    return CommHook(compression, transport, seed, min_compress_elements, timeline,
                    codec_threads, local_size, auto, loss_scale, optimizer)


from gradcomp.onebit_adam import OneBitAdam  # noqa: E402,F401 (it uses this module's helpers)
from gradcomp.onebit_lamb import OneBitLamb  # noqa: E402,F401
from gradcomp.two_stage import TwoStageOptimizer  # noqa: E402
