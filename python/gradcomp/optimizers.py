"""Layer-wise adaptive optimizers: LAMB and LANS (torch ships neither). docs/optimizers.md.

    optimizer = gradcomp.torch.LANS(model.parameters(), lr=2e-3, weight_decay=0.01)
    optimizer = gradcomp.torch.DistributedOptimizer(optimizer, model.named_parameters(),
                                                    compression="onebit|ef|twoway")

Both keep Adam's moments per coordinate and scale each parameter tensor's step by a trust ratio
||x|| / ||step||. They are ordinary torch.optim optimizers: param groups, learning-rate
schedulers, state_dict() / load_state_dict() (which resume bit-exactly) and DistributedOptimizer
work as with AdamW. Contiguous float32 CPU tensors take the fused C++ kernel (gradcomp._C);
other devices and dtypes take the same update written in torch operations, so a GPU model runs
unchanged (slower than a fused kernel would be).
"""
import torch

from gradcomp import SpecError, _C


class _LayerwiseAdam(torch.optim.Optimizer):
    """Adam's moments with a per-layer trust ratio; LAMB and LANS differ in _update."""

    _name = ""

    def __init__(self, params, lr, betas, eps, weight_decay, bias_correction, **extra):
        try:
            _C.AdamHyper(float(lr), float(betas[0]), float(betas[1]), float(eps),
                         float(weight_decay)).check(self._name)
        except SpecError as e:
            raise ValueError(str(e)) from None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction), **extra)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter that has a gradient; returns closure()'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self._name} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # float32 moments for half-precision parameters (their squares underflow)
                    dtype = torch.float32 if p.element_size() < 4 else p.dtype
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype,
                                                        memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype,
                                                           memory_format=torch.contiguous_format)
                state["step"] += 1
                self._update(p, p.grad, state, group)
        return loss

    def _update(self, p, grad, state, group):
        raise NotImplementedError

    @staticmethod
    def _fused(p, grad, state):
        """Whether the C++ kernel takes this layer: float32 on the CPU, contiguous."""
        tensors = (p, grad, state["exp_avg"], state["exp_avg_sq"])
        return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                   for t in tensors)

    @staticmethod
    def _hyper(group):
        beta1, beta2 = group["betas"]
        return _C.AdamHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                            float(group["weight_decay"]), bool(group["bias_correction"]))


def _working_dtype(p):
    """float32 arithmetic for half-precision parameters, their own dtype otherwise."""
    return torch.float32 if p.element_size() < 4 else p.dtype


def _moments(grad, state, group):
    """Adam's moments take grad; returns the bias-corrected m^ and 1 / (sqrt(v^) + eps)."""
    beta1, beta2 = group["betas"]
    m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    first = 1 - beta1 ** t if group["bias_correction"] else 1.0
    second = (1 - beta2 ** t) ** 0.5 if group["bias_correction"] else 1.0
    inverse_scale = (v.sqrt() / second).add_(group["eps"]).reciprocal_()
    return m / first, inverse_scale


def _trust_ratio(param_norm, step_norm):
    """||x|| / ||u||, 1 where either is 0 (as a 0-dim tensor: no device synchronisation)."""
    ok = (param_norm > 0) & (step_norm > 0)
    return torch.where(ok, param_norm / step_norm.clamp_min(1e-38), torch.ones_like(param_norm))


class LAMB(_LayerwiseAdam):
    """LAMB (You et al. 2019): x -= lr * (||x|| / ||r||) * r, with r = m^ / (sqrt(v^) + eps)
    + weight_decay * x per parameter tensor; the ratio is 1 when either norm is 0.

    Args: params; lr (1e-3); betas ((0.9, 0.999)); eps (1e-6); weight_decay (0.01, decoupled
    as in AdamW, put 0 in a param group for biases and norms); bias_correction (True)."""

    _name = "LAMB"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 bias_correction=True):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction)

    def _update(self, p, grad, state, group):
        if self._fused(p, grad, state):
            _C.lamb_step(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                         self._hyper(group), torch.get_num_threads())
            return
        x = p.to(_working_dtype(p))
        m_hat, inverse_scale = _moments(grad.to(x.dtype), state, group)
        r = m_hat.mul_(inverse_scale).add_(x, alpha=group["weight_decay"])
        ratio = _trust_ratio(x.norm(), r.norm())
        p.sub_((r * (ratio * group["lr"])).to(p.dtype))


class LANS(_LayerwiseAdam):
    """LANS (Zheng et al. 2020): LAMB's momentum direction r and the gradient's own direction
    c = g / (sqrt(v^) + eps) + weight_decay * x, each with its trust ratio, blended
    beta1 : (1 - beta1):  x -= lr * (beta1 * ||x||/||r|| * r + (1 - beta1) * ||x||/||c|| * c).
    With normalize_grad (the default) each tensor's gradient is first scaled to unit norm,
    which makes the step independent of the gradient's scale. The optimizer of BytePS-Compress's
    CLAN (docs/optimizers.md).

    Args: those of LAMB, and normalize_grad (True)."""

    _name = "LANS"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 bias_correction=True, normalize_grad=True):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction,
                         normalize_grad=bool(normalize_grad))

    def _update(self, p, grad, state, group):
        if self._fused(p, grad, state):
            _C.lans_step(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                         self._hyper(group), torch.get_num_threads(), group["normalize_grad"])
            return
        x = p.to(_working_dtype(p))
        g = grad.to(x.dtype)
        if group["normalize_grad"]:
            norm = g.norm()
            g = torch.where(norm > 0, g / norm.clamp_min(1e-38), torch.zeros_like(g))
        m_hat, inverse_scale = _moments(g, state, group)
        wd, beta1 = group["weight_decay"], group["betas"][0]
        r = m_hat.mul_(inverse_scale).add_(x, alpha=wd)
        c = (g * inverse_scale).add_(x, alpha=wd)
        x_norm = x.norm()
        step = (r * (_trust_ratio(x_norm, r.norm()) * beta1)).add_(
            c * (_trust_ratio(x_norm, c.norm()) * (1 - beta1)))
        p.sub_((step * group["lr"]).to(p.dtype))
