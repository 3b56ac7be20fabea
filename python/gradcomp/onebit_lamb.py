"""1-bit LAMB (Li et al. 2021): LAMB whose exchange is compressed after a warm-up, by
exchanging the momentum in 1-bit codes with the variance and the layers' trust ratios frozen.
docs/optimizers.md.

    optimizer = gradcomp.torch.OneBitLamb(model.named_parameters(), lr=1e-3, total_steps=N)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

It is a distributed optimizer of its own (do not wrap it in DistributedOptimizer): step()
averages over the ranks, then updates.

- Warm-up (the first warmup_steps steps): the gradients are averaged uncompressed and each
  layer takes LAMB's step (gradcomp.torch.LAMB's); its trust ratio ||x|| / ||r||, within
  [min_coeff, max_coeff], feeds a moving average (decay coeff_beta).
- Compression stage: each rank's momentum b1 m + (1 - b1) g_r is averaged through `compression`
  (scaled 1-bit codes with error feedback on the worker and on the server by default), and v
  stays as it was. The trust ratio of a compressed momentum would swing with its noisy norm, so
  each layer's coefficient is the warm-up's average, frozen, times a factor that follows the
  gradients' scale: the gradient reconstructed from two averaged momenta, (m_t - b1 m_{t-1}) /
  (1 - b1), feeds a fresh variance, and the factor is the largest ratio of the frozen to the
  fresh denominator over the layer (how much larger a step live LAMB would take), within
  [factor_min, factor_max] and within factor_threshold of the last step's factor.

Volume: as 1-bit Adam's, about 1 / (w + (1 - w) / 32) of fp32's bytes for a warm-up share w.
"""
import torch

from gradcomp import _C
from gradcomp.two_stage import (DEFAULT_COMPRESSION, TwoStageOptimizer, fill_unseen,
                                warmup_steps_of)


class OneBitLamb(TwoStageOptimizer):
    """1-bit LAMB over gradcomp's engine (see the module's doc).

    named_parameters: as OneBitAdam's (the model, its named_parameters(), plain parameters or
        parameter groups; the same on every rank; float32 on the CPU).
    lr, betas, eps, weight_decay (decoupled), bias_correction: as gradcomp.torch.LAMB's
        (defaults 1e-3, (0.9, 0.999), 1e-6, 0.01, True).
    warmup_steps: exact LAMB steps before the variance and the coefficients freeze (>= 1).
        Default: 15% of total_steps when that is given, else 1000.
    coeff_beta (0.9), max_coeff (10), min_coeff (0.01): the warm-up's average of the trust
        ratios, and the bounds each ratio is held within before it enters the average.
    factor_max (4), factor_min (0.5), factor_threshold (0.1): the compression stage's factor's
        bounds, and the largest share by which it changes from one step to the next.
    compression, transport, seed, bucket_mb, min_compress_elements, timeline, codec_threads,
        broadcast, overlap, find_unused_parameters: as OneBitAdam's.

    state_dict() holds the moments, the fresh variance, each layer's coefficient and factor, the
    step and gradcomp's state: load_state_dict() resumes bit-exactly in either stage."""

    def __init__(self, named_parameters, lr=1e-3, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, bias_correction=True, warmup_steps=None, total_steps=None,
                 coeff_beta=0.9, max_coeff=10.0, min_coeff=0.01, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, compression=DEFAULT_COMPRESSION, transport=None, seed=0,
                 bucket_mb=25.0, min_compress_elements=16384, timeline=None, codec_threads=1,
                 broadcast=True, overlap=False,
                 find_unused_parameters=False):
        self.warmup_steps = warmup_steps_of(warmup_steps, total_steps, "OneBitLamb")
        knobs = dict(coeff_beta=coeff_beta, max_coeff=max_coeff, min_coeff=min_coeff,
                     factor_max=factor_max, factor_min=factor_min,
                     factor_threshold=factor_threshold)
        for key, value in knobs.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"OneBitLamb: {key} is {value!r}; allowed: a number")
        self.lamb_hyper = _C.OneBitLambHyper(**{k: float(v) for k, v in knobs.items()})
        try:
            self.lamb_hyper.check("OneBitLamb")
        except _C.SpecError as e:
            raise ValueError(str(e)) from None
        self._knobs = {k: float(v) for k, v in knobs.items()}
        super().__init__(named_parameters, (lr, betas, eps, weight_decay, bias_correction),
                         (compression, transport, seed, bucket_mb, min_compress_elements,
                          timeline, codec_threads, broadcast), overlap,
                         find_unused_parameters)

    @property
    def exact(self):
        """Whether the next step is a warm-up step (exchanged exactly, LAMB's)."""
        return self._steps < self.warmup_steps

    @property
    def frozen(self):
        """Whether the warm-up is over: the variance and the coefficients are frozen."""
        return self._steps >= self.warmup_steps

    def _new_state(self, p):
        # lamb_coeff: the trust ratios' moving average; lamb_factor: the compression stage's
        return {**super()._new_state(p), "lamb_coeff": 0.0, "lamb_factor": 1.0}

    def _update(self, p, weights, exchanged, group, exact, threads):
        state = self._state(p)
        state["step"] += 1
        hyper = self._hyper(group)
        if exact:
            state["variance_updates"] += 1
            step = _C.lamb_step(weights, exchanged, state["exp_avg"], state["exp_avg_sq"],
                                state["step"], hyper, threads)
            self._average_ratio(state, step.trust_ratio)
            return
        if "fresh_exp_avg_sq" not in state:  # the first step after the freeze
            fill_unseen(state["exp_avg_sq"])  # it will not learn them any more
            state["fresh_exp_avg_sq"] = state["exp_avg_sq"].clone()
        _, state["lamb_factor"] = _C.onebit_lamb_step(
            weights, exchanged, state["exp_avg"], state["exp_avg_sq"], state["step"], hyper,
            threads, state["fresh_exp_avg_sq"], state["variance_updates"], state["lamb_coeff"],
            state["lamb_factor"], self.lamb_hyper)

    def _average_ratio(self, state, ratio):
        """The warm-up's average of the layer's trust ratio (each held within the bounds),
        which the compression stage starts from; in Python floats, the same on every rank."""
        ratio = min(max(ratio, self._knobs["min_coeff"]), self._knobs["max_coeff"])
        if state["variance_updates"] == 1:
            state["lamb_coeff"] = ratio
        else:
            beta = self._knobs["coeff_beta"]
            state["lamb_coeff"] = beta * state["lamb_coeff"] + (1 - beta) * ratio

    def _settings(self):
        return {"optimizer": "OneBitLamb", "warmup_steps": self.warmup_steps, **self._knobs}
