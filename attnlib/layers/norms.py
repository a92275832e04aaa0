"""Normalisation layers written out: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019). Chapter 10.

Both are equal to PyTorch's ``nn.LayerNorm`` / ``nn.RMSNorm`` (the tests check it); they are
here so the formula is on the page.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib._checks import float_input, positive_int

__all__ = ["LayerNorm", "RMSNorm"]


def _eps(eps: float) -> None:
    """Raise TypeError unless ``eps`` is a real number, ValueError unless it is finite and > 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float; got {eps!r} ({type(eps).__name__})")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps={eps!r} must be a finite number > 0 (it keeps the division away from 0)")


def _check_input(x: object, d: int) -> None:
    """``float_input`` for ``(..., d)`` inputs, 1-D included."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of shape (..., d={d}); got {type(x).__name__}")
    float_input(x if x.dim() > 1 else x[None], d)


class LayerNorm(nn.Module):
    """``(x - mean(x)) / sqrt(var(x) + eps) · γ + β`` over the last dimension (Ba et al. 2016).

    ``var`` is the biased (population) variance, as in ``nn.LayerNorm``.

    Args:
        d: size of the last dimension.
        eps: added to the variance.
        bias: learn ``β`` (``nn.LayerNorm(..., bias=True)``).

    Shapes:
        ``(…, d)`` → ``(…, d)``.

    Raises:
        TypeError: ``d`` not an int, ``eps`` not a number, an input that is not a float tensor.
        ValueError: ``d < 1``, ``eps`` not finite and > 0, an input whose last dimension is not ``d``.
    """

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        positive_int("d", d)
        _eps(eps)
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.d)
        mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
        var = (x - mean).pow(2).mean(dim=-1, keepdim=True)  # (..., 1), biased
        y = (x - mean) * torch.rsqrt(var + self.eps) * self.weight
        return y + self.bias if self.bias is not None else y


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x̂ · γ, r, x̂)`` with ``r = rsqrt(mean(x²) + eps)`` ``(..., 1)`` and ``x̂ = x · r``."""
    r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
    x_hat = x * r
    return x_hat * weight, r, x_hat


class _RMSNormFunction(torch.autograd.Function):
    """``x · rsqrt(mean(x²) + eps) · γ`` with its backward written out: one autograd node, not six.

    The forward is the formula of :class:`RMSNorm`, op for op (the same bits as ``transformers``'
    Llama/Qwen3 RMSNorm). With ``x̂ = x·r``, ``r = rsqrt(mean(x²) + eps)`` and ``g`` the gradient of the
    output, ``∂/∂γ = Σ g ⊙ x̂`` and ``∂/∂x = r · (g γ - x̂ · mean(g γ ⊙ x̂))``: the projection of ``gγ`` off
    ``x̂`` (the rescaling cannot change the output's root mean square), computed in a handful of ops
    where autograd would go back through each step. Second derivatives (``create_graph=True``)
    recompute ``r`` and ``x̂`` from ``x``, so that they too are exact.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, r, x_hat = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, r, x_hat)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, r, x_hat = ctx.saved_tensors
        wants_weight = ctx.needs_input_grad[1]
        g = grad * weight
        if torch.is_grad_enabled():  # create_graph: r and x̂ as functions of x, for second derivatives
            r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + ctx.eps)
            x_hat = x * r
            dx = (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True)) * r
            return dx, (grad * x_hat).sum_to_size(weight.shape) if wants_weight else None, None
        # the same ops in place, one buffer reused: the same bits in two fresh buffers instead of six
        buffer = g * x_hat
        dx = g.sub_(torch.mul(x_hat, buffer.mean(dim=-1, keepdim=True), out=buffer)).mul_(r)
        return dx, torch.mul(grad, x_hat, out=buffer).sum_to_size(weight.shape) if wants_weight else None, None


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · γ`` over the last dimension (Zhang & Sennrich 2019, eq. 4).

    No centring and no ``β``: the input is only rescaled to unit root mean square.
    Note the square root is over ``mean(x²) + eps``; writing ``x / sqrt(RMS(x) + eps)``
    (the root taken twice) is a common slip that leaves outputs of the wrong scale.

    Args:
        d: size of the last dimension.
        eps: added to ``mean(x²)``; ``nn.RMSNorm(d, eps=1e-6)`` is the same layer.

    Shapes:
        ``(…, d)`` → ``(…, d)``.

    Raises:
        TypeError: ``d`` not an int, ``eps`` not a number, an input that is not a float tensor.
        ValueError: ``d < 1``, ``eps`` not finite and > 0, an input whose last dimension is not ``d``.
    """

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        positive_int("d", d)
        _eps(eps)
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.d)
        # x * rsqrt(mean(x²) + eps) * weight, with its backward written out (see _RMSNormFunction); without
        # gradients (generation) the same ops alone, without the autograd node's bookkeeping
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)[0]
