"""One rank of the emulated-cluster benchmark (bench/cluster/bench.py starts one per host).

Workloads:
  replay  a model profile (profiles/*.json) drives the step: the model's forward time is spent
          first, then backward produces each gradient, of the profile's exact size, at the
          profile's ready time (an autograd chain whose nodes wait for their time), so the
          exchange and the compression are real and the compute is controlled. Compute waits
          (as a GPU leaves the CPU free), or burns CPU with --burn. With --dilation K every
          compute time is K times longer (the links are K times slower too; bench.py divides
          the measured times by K).
  train   the main job's Fashion-MNIST training, for time to accuracy.
  probe   the cluster's latency as gradcomp's transport sees it: the time of small
          allreduces (thread hand-offs and wake-ups included, which dominate on 2 shared
          cores), for the planner and the simulator.

Contenders (--contender):
  compute                  no exchange at all: the compute-only bound
  ddp                      torch DistributedDataParallel on gloo, 25 MB buckets
  ddp-fp16, ddp-bf16       DDP with its fp16 / bf16 compression hook
  ddp-powersgd:rank=R      DDP with its PowerSGD hook (rank R, its other defaults except the
                           start iteration), each bucket's exchange finished before the hook
                           returns (on gloo the stock hook issues collectives from callbacks,
                           which reorders them across ranks and crashes)
  gradcomp:SPEC            gradcomp.torch.DistributedOptimizer with compression SPEC on the
                           default plan, over gradcomp's own Gloo transport (with
                           --optimizer onebitadam: gradcomp.torch.OneBitAdam, SPEC its
                           compression stage's exchange)
  gradcomp                 the same with the optimizer's own default compression: none for
                           DistributedOptimizer, onebit:block=256|ef|twoway for OneBitAdam
  plan:PATH                gradcomp with the plan in PATH (from `gradcomp plan`)
  auto                     gradcomp with compression="auto" (settings: --auto): unmeasured
                           steps until it has decided (its warm-up, calibration and trials)
                           and one more (the kept plan's first), then the measured steps;
                           its decision goes into the rank's JSON

Optimizers (--optimizer, replay only): what updates the replay's parameters after the exchange,
so that its cost is part of the step.
  none        no update: the step is the exchange only (every result before the option)
  sgd, adamw  torch.optim.SGD (momentum 0.9) / AdamW: under DDP as they are (DDP + AdamW is the
              baseline of docs/optimizers.md), under gradcomp inside DistributedOptimizer
  lans, lamb  gradcomp.torch.LANS / LAMB (fused kernels), likewise; LANS over
              gradcomp:onebit:block=256|ef|twoway is the CLAN recipe
  onebitadam  gradcomp.torch.OneBitAdam, a distributed optimizer of its own (gradcomp
              contenders only), with the "freeze" variance policy: its uncompressed warm-up
              takes the first half of the --warmup steps (rounded up), so every measured step
              is a compressed one (a long run's steps are the compressed ones measured here);
              with overlap=True: each input leaves during backward
  onebitlamb  gradcomp.torch.OneBitLamb (1-bit LAMB), likewise

Ranks meet through torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each rank
writes OUT/rank<r>.json; the workers end with a barrier and exit without tearing gloo down (a
gloo rank can hang in teardown).
"""
import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "examples" / "fashion_mnist"))


class BenchError(Exception):
    """A failure with a message for the user."""


OPTIMIZERS = ["none", "sgd", "adamw", "lans", "lamb", "onebitadam", "onebitlamb"]
# The distributed optimizers of their own: they exchange in step(), after an uncompressed warm-up.
TWO_STAGE = ("onebitadam", "onebitlamb")
# compression="auto"'s settings for the replay: short enough that it decides within 60 steps
# (20 warm-up, then up to 2 + max_proposals + 2 refined plans for 5 steps each); bench.py
# passes the same.
AUTO = {"warmup_steps": 20, "profile_steps": 8, "trial_steps": 5, "max_proposals": 4}
# The training workload's rank 0 makes this file in --out as its first step begins: bench.py
# times a link rate change (--train-rate-change) from it.
TRAINING_BEGAN = "training-began"


# ---------------------------------------------------------------------------- arguments

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["replay", "train", "probe"], default="replay")
    p.add_argument("--contender", required=True, help="see the module docstring")
    p.add_argument("--profile", help="replay: a profile JSON path")
    p.add_argument("--warmup", type=int, default=2, help="replay: steps not measured")
    p.add_argument("--steps", type=int, default=8, help="replay: measured steps")
    p.add_argument("--dilation", type=float, default=1.0,
                   help="replay: compute this many times slower (time dilation)")
    p.add_argument("--burn", action="store_true", help="replay: burn CPU instead of waiting")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="none",
                   help="replay: the optimizer that updates the parameters in every step "
                        "(none: no update; see the module docstring)")
    p.add_argument("--auto", type=json.loads, default=dict(AUTO),
                   help="replay, contender auto: its auto= settings as JSON (default "
                        f"{json.dumps(AUTO)})")
    p.add_argument("--epochs", type=float, default=2.0, help="train: epochs")
    p.add_argument("--train-auto", type=json.loads, default=None,
                   help="train, contender auto: its auto= settings as JSON (default: none)")
    p.add_argument("--batch-size", type=int, default=32, help="train: images per rank and step")
    p.add_argument("--train-optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="train: SGD with momentum (the main job's default) or AdamW")
    p.add_argument("--lr", type=float, default=None,
                   help="train: peak learning rate (the main job's: sgd 0.05, adamw 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iface", default="eth0", help="the interface whose bytes are counted")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may take")
    p.add_argument("--out", required=True, help="directory for rank<r>.json")
    args = p.parse_args(argv)
    if args.workload == "replay" and not args.profile:
        p.error("--workload replay needs --profile")
    if args.warmup < 0 or args.steps < 1:
        p.error("--warmup must be >= 0 and --steps >= 1")
    if args.dilation < 1:
        p.error("--dilation must be >= 1")
    if args.optimizer != "none" and args.workload != "replay":
        p.error(f"--optimizer is for the replay workload ({args.workload} has its own)")
    if args.optimizer in TWO_STAGE and args.warmup < 1:
        p.error(f"--optimizer {args.optimizer} needs --warmup >= 1: its uncompressed warm-up "
                "steps must be over before the measured steps begin")
    return args


def parse_contender(text):
    """(kind, argument): ('compute', None), ('ddp', hook or None), ('gradcomp', spec or None),
    ('plan', path)."""
    if text == "compute":
        return "compute", None
    if text == "ddp":
        return "ddp", None
    if text in ("ddp-fp16", "ddp-bf16"):
        return "ddp", text[4:]
    if text.startswith("ddp-powersgd:rank="):
        return "ddp", text[4:]
    if text == "gradcomp":
        return "gradcomp", None
    if text.startswith("gradcomp:"):
        return "gradcomp", text[len("gradcomp:"):]
    if text.startswith("plan:"):
        return "plan", text[len("plan:"):]
    if text == "auto":
        return "auto", None
    raise BenchError(f"contender '{text}' is unknown; use compute, ddp, ddp-fp16, ddp-bf16, "
                     "ddp-powersgd:rank=R, gradcomp, gradcomp:SPEC, plan:PATH or auto")


# ---------------------------------------------------------------------------- environment

def launch_info():
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except KeyError as e:
        raise BenchError(f"{e.args[0]} is not set: start workers with RANK, WORLD_SIZE, "
                         "MASTER_ADDR and MASTER_PORT (bench/cluster/bench.py does)") from None


def link_bytes(iface):
    """(transmitted, received) bytes of `iface` in this network namespace (/proc/net/dev is
    per namespace)."""
    with open("/proc/net/dev", encoding="ascii") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == iface:
                fields = counters.split()
                return int(fields[8]), int(fields[0])
    raise BenchError(f"interface '{iface}' is not in /proc/net/dev of this namespace")


class Exchange:
    """What the contender uses to meet the other ranks: DDP's process group or gradcomp's own
    transport (never both: each would take its own connections)."""

    def __init__(self, kind, timeout):
        rank, world, addr, port = launch_info()
        self.rank, self.world = rank, world
        self.transport = None
        if kind == "ddp":
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                    world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        elif kind in ("gradcomp", "plan", "auto"):
            import gradcomp.torch as gct
            self.transport = gct.get_transport("gloo", timeout=timeout)
        self.kind = kind

    def barrier(self):
        if self.kind == "ddp":
            import torch.distributed as dist
            dist.barrier()
        elif self.transport is not None:
            self.transport.barrier()

    def sum(self, values):
        t = torch.tensor(values, dtype=torch.float64 if self.kind == "ddp" else torch.float32)
        if self.kind == "ddp":
            import torch.distributed as dist
            dist.all_reduce(t)
        elif self.transport is not None:
            self.transport.allreduce_(t)
        return t.tolist()


# ---------------------------------------------------------------------------- DDP and hooks

def wrap_ddp(model, hook):
    """DDP with 25 MB buckets (its default) and the named compression hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    ddp = DDP(model, bucket_cap_mb=25)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        try:
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        except TypeError as e:  # torch 1.13: "... required CUDA 11+ and NCCL 2.10+"
            raise BenchError(f"DDP's bf16 hook cannot run here: {e}") from None
    elif hook and hook.startswith("powersgd:rank="):
        ddp.register_comm_hook(*powersgd_hook(int(hook.split("=", 1)[1])))
    elif hook:
        raise BenchError(f"DDP hook '{hook}' is unknown")
    return ddp


def powersgd_hook(rank):
    """The stock PowerSGD hook with its defaults, except that compression starts at iteration
    2 instead of 1000 (the first iterations are plain allreduce; the benchmark's warm-up covers
    them), and each bucket's exchange is finished before the hook returns: the stock hook starts
    its second and third allreduce from callbacks on gloo's threads, so ranks would issue
    collectives in different orders."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=2)

    def hook(state, bucket):
        future = psgd.powerSGD_hook(state, bucket)
        future.wait()
        return future

    return state, hook


class NoUpdate(torch.optim.Optimizer):
    """--optimizer none: the replay measures the exchange, not the update: an optimizer whose
    step is empty."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def onebit_warmup(warmup):
    """1-bit Adam's uncompressed warm-up: the first half of the replay's unmeasured steps
    (rounded up), so the other half runs its compression stage before the measured steps."""
    return -(-warmup // 2)


def local_optimizer(name, params):
    """The torch optimizer that updates the replay's parameters. Learning rates as the recipes
    of docs/optimizers.md use them (LANS wants a larger one than AdamW); the step's cost does
    not depend on them."""
    if name == "none":
        return NoUpdate(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    import gradcomp.torch as gct
    if name == "lans":
        return gct.LANS(params, lr=1e-2, weight_decay=0.01)
    if name == "lamb":
        return gct.LAMB(params, lr=1e-2, weight_decay=0.01)
    raise BenchError(f"optimizer '{name}' has no local form; use one of "
                     f"{', '.join(o for o in OPTIMIZERS if o not in TWO_STAGE)}")


def check_optimizer(optimizer, kind, contender):
    """Refuses, before any rank meets another, an optimizer the contender cannot run."""
    if optimizer in TWO_STAGE and kind != "gradcomp":
        raise BenchError(f"--optimizer {optimizer} averages over the ranks by itself: use it "
                         f"with a gradcomp or gradcomp:SPEC contender, not '{contender}'")


def make_step(args, kind, argument, model, exchange):
    """(the module the forward pass runs through, the optimizer to step after backward or
    None, the gradcomp optimizer whose last_step() counts the bytes or None)."""
    name = args.optimizer
    if name in TWO_STAGE:
        import gradcomp.torch as gct
        spec = {} if argument is None else {"compression": argument}
        # overlap: the replay takes one backward pass per step, so each input can leave as
        # soon as its gradient is ready (as DDP's and DistributedOptimizer's do)
        common = dict(weight_decay=0.01, warmup_steps=onebit_warmup(args.warmup),
                      transport=exchange.transport, seed=args.seed, broadcast=False,
                      overlap=True, **spec)
        onebit = (gct.OneBitLamb(model.named_parameters(), lr=1e-2, **common)
                  if name == "onebitlamb" else
                  gct.OneBitAdam(model.named_parameters(), lr=1e-3, variance="freeze", **common))
        return model, onebit, onebit
    update = None if name == "none" else local_optimizer(name, model.parameters())
    if kind == "ddp":
        return wrap_ddp(model, argument), update, None
    if kind == "compute":
        return model, update, None
    import gradcomp.torch as gct
    compression = "auto" if kind == "auto" else (
        argument if kind == "gradcomp" and argument is not None else "none")
    distributed = gct.DistributedOptimizer(
        update or NoUpdate(model.parameters()), model.named_parameters(),
        compression=compression, plan=argument if kind == "plan" else None,
        transport=exchange.transport, seed=args.seed, broadcast=False,
        auto=args.auto if kind == "auto" else None)
    return model, distributed, distributed


# ---------------------------------------------------------------------------- replay

class Clock:
    """The profile's timing for one step: when backward started and when each gradient is
    due, in backward order."""

    def __init__(self, forward_s, ready_s, burn):
        self.forward_s, self.ready_s, self.burn = forward_s, ready_s, burn
        self.backward_start = 0.0

    def spend(self, seconds):
        self.until(time.perf_counter() + seconds)

    def until(self, deadline):
        if self.burn:
            while time.perf_counter() < deadline:
                pass
        else:
            left = deadline - time.perf_counter()
            if left > 0:
                time.sleep(left)


class Ready(torch.autograd.Function):
    """Forward passes the chain value on; backward waits until gradient `index` is due, then
    hands it over without a copy: a fresh alias of the rank's gradient buffer, which autograd
    then takes as .grad as it is (a GPU would produce gradients without any CPU work; copying
    100 MB per step would spend the CPU the exchange needs). The exchange writes its result
    into .grad, so later steps replay the previous step's mean: the sizes and the timing, which
    is what the replay is for, stay the same."""

    @staticmethod
    def forward(ctx, chain, param, clock, index, grad):
        ctx.clock, ctx.index, ctx.grad = clock, index, grad
        return chain.clone()

    @staticmethod
    def backward(ctx, chain_grad):
        clock = ctx.clock
        clock.until(clock.backward_start + clock.ready_s[ctx.index])
        return chain_grad, ctx.grad.detach(), None, None, None


def profile_shapes(profile):
    """Each tensor's shape: DDP's PowerSGD hook compresses matrices only, so shapes matter.
    Exact for torchvision models (the CNN profiles come from them); otherwise 1-D for biases
    and norms and (rows, n/rows) with rows the largest divisor <= sqrt(n) for other tensors
    (an approximation: the profile records element counts only)."""
    shapes = {}
    try:
        import torchvision
        builder = getattr(torchvision.models, profile["model"], None)
        if builder is not None:
            model = builder()
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    except ImportError:
        pass
    result = []
    for t in profile["tensors"]:
        shape = shapes.get(t["name"])
        if shape is None or _numel(shape) != t["elements"]:
            shape = _matrix_shape(t["name"], t["elements"])
        result.append(shape)
    return result


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _matrix_shape(name, n):
    if name.endswith("bias") or n < 16384:
        return (n,)
    rows = int(n ** 0.5)
    while n % rows:
        rows -= 1
    return (rows, n // rows)


class ReplayModel(nn.Module):
    """Parameters with the profile's names and sizes, registered in forward order (the reverse
    of backward order), so DDP buckets them as it would the real model."""

    def __init__(self, profile, dilation, burn, seed, rank, init=False):
        super().__init__()
        tensors = profile["tensors"]  # backward order
        shapes = profile_shapes(profile)
        self.order = list(reversed(range(len(tensors))))  # forward order: indices into tensors
        self.params = []
        # With an optimizer (init): weights of a trained model's scale rather than zeros (the
        # layer-wise optimizers' trust ratios see real norms), the same on every rank, as DDP's
        # broadcast would make them.
        weights = torch.Generator().manual_seed(seed)
        for i in self.order:
            value = (torch.randn(shapes[i], generator=weights) * 0.02 if init
                     else torch.zeros(shapes[i]))
            param = nn.Parameter(value)
            self._register(tensors[i]["name"], param)
            self.params.append(param)
        generator = torch.Generator().manual_seed(1_000_003 * seed + rank)
        # Fixed per rank: gradients look like gradients (zero mean, different on every rank)
        # without spending CPU on fresh random numbers each step.
        self.grads = [torch.randn(shapes[i], generator=generator) * 1e-2
                      for i in range(len(tensors))]
        self.clock = Clock(dilation * profile["forward_ms"] / 1e3,
                           [dilation * t["ready_ms"] / 1e3 for t in tensors], burn)

    def _register(self, dotted, param):
        """Registers `param` under its dotted profile name through nested modules, so
        named_parameters() gives the profile's names (plans refer to them)."""
        *path, leaf = dotted.split(".")
        module = self
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, param)

    def forward(self, chain):
        self.clock.spend(self.clock.forward_s)
        for param, i in zip(self.params, self.order):
            chain = Ready.apply(chain, param, self.clock, i, self.grads[i])
        return chain.sum()


def replay(args, kind, argument):
    profile = json.loads(Path(args.profile).read_text())
    check_optimizer(args.optimizer, kind, args.contender)
    exchange = Exchange(kind, args.timeout)
    rank, world = exchange.rank, exchange.world
    torch.set_num_threads(1)
    model = ReplayModel(profile, args.dilation, args.burn, args.seed, rank,
                        init=args.optimizer != "none")
    step_model, optimizer, counter = make_step(args, kind, argument, model, exchange)
    onebit = args.optimizer in TWO_STAGE

    def one_step():
        model.zero_grad(set_to_none=True)
        loss = step_model(torch.zeros(1))
        model.clock.backward_start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        return backward_end

    for _ in range(args.warmup):
        one_step()
    if kind == "auto":
        decided_after = await_decision(args.auto, optimizer, one_step, args.warmup)
    if onebit and not optimizer.frozen:
        raise BenchError(f"{args.optimizer} is still in its warm-up after {args.warmup} "
                         "steps: the measured steps would not be compressed")
    exchange.barrier()
    tx0, rx0 = link_bytes(args.iface)
    cpu0, busy0, window0, payload = time.process_time(), machine_busy_s(), time.perf_counter(), 0
    step_s, marks, update_s, compressed = [], [], [], 0
    for _ in range(args.steps):
        start = time.perf_counter()
        backward_end = one_step()
        end = time.perf_counter()
        step_s.append(end - start)
        # Machine-wide monotonic times, comparable between ranks: when each phase began.
        marks.append([start, model.clock.backward_start, backward_end, end])
        if counter is not None:
            sent = counter.last_step()
            payload += sent["bytes_sent"]
            compressed += sent["bytes_sent"] < sent["uncompressed_bytes"] / 2
        if args.optimizer != "none":
            update_s.append(update_seconds(optimizer, onebit, end - backward_end))
    cpu = time.process_time() - cpu0
    busy, window = machine_busy_s() - busy0, time.perf_counter() - window0
    tx1, rx1 = link_bytes(args.iface)
    n = args.steps
    result = {
        "workload": "replay", "contender": args.contender, "rank": rank, "world": world,
        "profile": profile["model"], "dilation": args.dilation, "burn": args.burn,
        "warmup": args.warmup, "step_s": step_s,
        "tx_bytes_per_step": (tx1 - tx0) / n, "rx_bytes_per_step": (rx1 - rx0) / n,
        "payload_bytes_per_step": payload / n if counter is not None else None,
        "cpu_s_per_step": cpu / n, "step_marks": marks,
        "compute_s": args.dilation * (profile["forward_ms"] + profile["backward_ms"]) / 1e3,
        "optimizer": args.optimizer, "update_s": update_s or None,
        "machine_busy_s": busy, "window_s": window,
    }
    if counter is not None:
        result["plan_buckets"] = len(counter.plan.get("buckets", []))
    if kind == "auto":
        result["auto"] = auto_record(optimizer.auto_report(), args.auto, decided_after)
        if rank == 0:  # all of it (the calibration, the candidates' plans), beside the JSON
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "auto-report.json").write_text(
                json.dumps(optimizer.auto_report(), indent=1) + "\n")
    if onebit:
        # Said in the output, and checked step by step: the measured steps are compressed.
        result["onebit_warmup_steps"] = optimizer.warmup_steps
        result["onebit_compression"] = optimizer.compression
        result["onebit_compressed_steps"] = compressed
    # What the exchange left: every rank must hold the same bytes (the tests compare them).
    result["grad_sum"] = sum(float(p.grad.double().sum()) for p in model.parameters()
                             if p.grad is not None)
    result["grad_digest"] = grad_digest(model.parameters())
    if args.optimizer != "none":
        # What the updates made of the parameters: the same on every rank after an exchange.
        result["param_sum"] = sum(float(p.detach().double().sum()) for p in model.parameters())
        result["param_digest"] = tensor_digest(p.detach() for p in model.parameters())
    return exchange, result


def auto_search_steps(settings):
    """The most steps compression="auto" can take before it decides: its warm-up, then up to
    2 + max_proposals + refine_proposals + max(runoff + 1, 2) trials of trial_steps each
    (uncompressed, over nodes the planner's best uncompressed plan, the proposals, then the
    runoff: the plans within the noise of the fastest, and a lossless one whose loss the noise
    may hide; the scheduler's defaults where unset)."""
    runoff = max(settings.get("runoff", 3) + 1, 2)
    plans = 2 + settings.get("max_proposals", 4) + settings.get("refine_proposals", 2) + runoff
    return settings.get("warmup_steps", 30) + plans * settings.get("trial_steps", 6)


def await_decision(settings, optimizer, one_step, done):
    """Steps on, unmeasured, until compression="auto" has decided, then takes the kept plan's
    first step unmeasured too (a plan change's step: the scheduler's trials skip it as well).
    Every rank decides at the same step (the scheduler agrees on what it measured first), so
    every rank takes as many steps. Returns the steps taken until the decision, `done`
    included."""
    steps, limit = done, auto_search_steps(settings)
    while optimizer.auto_report()["phase"] != "decided":
        if steps >= limit:
            raise BenchError(f"compression=\"auto\" has not decided after {steps} steps (at "
                             f"most {limit} with {json.dumps(settings)}); its phase: "
                             f"{optimizer.auto_report()['phase']}")
        one_step()
        steps += 1
    one_step()
    return steps


def auto_record(report, settings, decided_after):
    """What bench.py reports of compression="auto": its settings and candidate options, when
    it decided, and its (first) decision: every candidate's predicted and measured step (and
    the steps behind it) and its CPU time per step, the one kept and why, the candidates its
    runoff measured twice, the search's cost, the machine the ranks share. More than one
    decision means it searched again during the measured steps."""
    first = report["decisions"][0]
    decision = {k: first.get(k) for k in ("step", "reason", "kept", "kept_name", "why",
                                          "search_steps", "search_seconds", "planner_ms",
                                          "link", "per_node", "intra_link", "machine",
                                          "search_cost_seconds", "payback_steps", "remeasured")
                if k in first}
    decision["candidates"] = [{k: c[k] for k in ("name", "summary", "predicted_ms",
                                                 "measured_ms", "measured_steps", "first_step",
                                                 "cpu_ms")}
                              for c in first["candidates"]]
    return {"settings": settings, "options": report["candidates"],
            "decided_after_steps": decided_after, "phase": report["phase"],
            "decisions": len(report["decisions"]), "plan": report["plan"],
            "decision": decision}


def machine_busy_s():
    """CPU seconds the whole machine has spent in processes (user, nice, system: /proc/stat is
    not per namespace), so that bench.py can tell how much of it was not the workers': another
    job sharing the cores slows every contender measured meanwhile."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()  # "cpu user nice system idle ..."
    return sum(int(v) for v in fields[1:4]) / os.sysconf("SC_CLK_TCK")


def update_seconds(optimizer, onebit, after_backward_s):
    """The optimizer's update in one step: all of step() after a backward pass that ended with
    the exchange (DDP, DistributedOptimizer, compute only); for 1-bit Adam and 1-bit LAMB,
    whose step() also finishes the exchange, the update's own time, which they report."""
    if not onebit:
        return after_backward_s
    return optimizer.last_step()["update_seconds"]


def grad_digest(params):
    return tensor_digest(p.grad for p in params if p.grad is not None)


def tensor_digest(tensors):
    import hashlib
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------- train

def train(args, kind, argument):
    """Fashion-MNIST as in the main job (examples/fashion_mnist/train.py: its model, data,
    sharding and schedule), timed per epoch; evaluation is not counted as training time."""
    import torch.nn.functional as F
    import train as mainjob

    if kind in ("compute", "plan"):
        raise BenchError(f"contender '{args.contender}' is for the replay workload only")
    torch.set_num_threads(1)
    train_x, train_y = mainjob.load_split(mainjob.DEFAULT_DATA, "train")
    test_x, test_y = mainjob.load_split(mainjob.DEFAULT_DATA, "test")
    exchange = Exchange(kind, args.timeout)
    rank, world = exchange.rank, exchange.world
    torch.manual_seed(args.seed)
    model = mainjob.Net()
    lr = args.lr if args.lr is not None else mainjob.DEFAULT_LR[args.train_optimizer]
    if args.train_optimizer == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    step_model, optimizer = model, inner
    if kind == "ddp":
        step_model = wrap_ddp(model, argument)
    else:
        import gradcomp.torch as gct
        # auto as a user would run it: compression="auto" and nothing else (its default
        # settings and candidates, the search counted in the training time).
        optimizer = gct.DistributedOptimizer(inner, model.named_parameters(),
                                             compression="auto" if kind == "auto" else argument,
                                             transport=exchange.transport, seed=args.seed,
                                             auto=args.train_auto if kind == "auto" else None)
    per_rank = len(train_y) // world
    steps_per_epoch = -(-per_rank // args.batch_size)
    total_steps = max(1, round(args.epochs * steps_per_epoch))
    schedule = mainjob.make_schedule(inner, "cosine", total_steps)
    exchange.barrier()
    tx0, _ = link_bytes(args.iface)
    # The wall clock of the first step and of each evaluation (its start and end), so that the
    # bench can time a link change from the first step and place it on the training time.
    began = time.time()
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / TRAINING_BEGAN).touch()
    evaluations = []
    # Test accuracy every half epoch (not counted as training time), for time to accuracy.
    eval_every = max(1, steps_per_epoch // 2)
    step, epoch, trained = 0, 0, 0.0
    eval_epochs, eval_seconds, eval_accuracy = [], [], []
    while step < total_steps:
        order = mainjob.shard_indices(len(train_y), rank, world, args.seed, epoch)
        start = time.perf_counter()
        for first in range(0, per_rank, args.batch_size):
            if step == total_steps:
                break
            idx = order[first:first + args.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(step_model(train_x[idx]), train_y[idx]).backward()
            optimizer.step()
            schedule.step()
            step += 1
            if step % eval_every == 0 or step == total_steps:
                trained += time.perf_counter() - start
                eval_epochs.append(step / steps_per_epoch)
                eval_seconds.append(trained)
                paused = time.time()
                eval_accuracy.append(mainjob.evaluate(model, test_x, test_y, exchange))
                evaluations.append([paused, time.time()])
                start = time.perf_counter()
        epoch += 1
    tx1, _ = link_bytes(args.iface)
    return exchange, {
        "workload": "train", "contender": args.contender, "rank": rank, "world": world,
        "optimizer": args.train_optimizer, "epochs": args.epochs, "steps": step, "eval_epochs": eval_epochs,
        "epoch_seconds": eval_seconds, "epoch_accuracy": eval_accuracy,
        "training_wall": {"began": began, "evaluations": evaluations},
        "tx_bytes_per_step": (tx1 - tx0) / step,
        **({"auto": train_auto_record(optimizer.auto_report())} if kind == "auto" else {}),
    }


def train_auto_record(report):
    """What compression="auto" decided during training: the options it chose among (those
    recommended for the optimizer), each search's step, what it kept and why, every
    candidate's measured step, the candidates its runoff measured twice."""
    return {"phase": report["phase"], "plan": report["plan"],
            "options": report.get("planner_codecs"),
            "decisions": [{"step": d.get("step"), "reason": d.get("reason"),
                           "kept": d.get("kept_name"), "why": d.get("why"),
                           "remeasured": d.get("remeasured", []),
                           "candidates": [{"name": c["name"], "summary": c.get("summary"),
                                           "measured_ms": c.get("measured_ms")}
                                          for c in d.get("candidates", [])]}
                          for d in report.get("decisions", [])]}


# ---------------------------------------------------------------------------- probe

def probe(args, kind, argument):
    """Times allreduces of one word and of 1024 floats (a compressed bucket's size) on
    gradcomp's Gloo transport: the median of 60 after 10 unmeasured, each."""
    exchange = Exchange("gradcomp", args.timeout)
    result = {"workload": "probe", "rank": exchange.rank, "world": exchange.world}
    for name, elements in (("word", 1), ("4k", 1024)):
        data = torch.zeros(elements)
        for _ in range(10):
            exchange.transport.allreduce_(data)
        exchange.barrier()
        times = []
        for _ in range(60):
            start = time.perf_counter()
            exchange.transport.allreduce_(data)
            times.append(time.perf_counter() - start)
        times.sort()
        result[f"allreduce_{name}_s"] = times[len(times) // 2]
        result[f"allreduce_{name}_p90_s"] = times[int(0.9 * len(times))]
    return exchange, result


# ---------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    try:
        kind, argument = parse_contender(args.contender)
        run = {"replay": replay, "train": train, "probe": probe}[args.workload]
        exchange, result = run(args, kind, argument)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1) + "\n")
        exchange.barrier()  # every rank has written; nobody waits on a rank that left
    except BenchError as e:
        print(f"worker: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's teardown, which can hang


if __name__ == "__main__":
    main()
