"""Llama 4's two changes to the queries and keys of a softmax layer (chapter 20).

* :class:`L2Norm`: QK-norm without a weight, ``x / sqrt(mean(x²) + eps)`` over ``head_dim`` (Llama 4's
  ``Llama4TextL2Norm``, on its RoPE layers); :func:`qk_norm_layer` builds it or Qwen3's RMSNorm by name
  (:data:`QK_NORMS`).
* :class:`AttentionTemperature`: attention temperature tuning on layers without RoPE (Llama 4's
  ``attn_temperature_tuning``, after Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"): the
  query at position ``p`` is multiplied by ``log(floor((p + 1) / floor_scale) + 1) · attn_scale + 1``,
  so that far into a long context the softmax stays peaked rather than flattening over many keys.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import finite_number
from attnlib.layers.norms import RMSNorm

__all__ = ["QK_NORMS", "AttentionTemperature", "L2Norm", "check_temperature", "qk_norm_layer", "qk_norms"]

#: QK-norm's kinds: ``"rmsnorm"`` (a learned weight per channel, Qwen3, Gemma 3) and ``"l2"`` (none, Llama 4).
QK_NORMS = ("rmsnorm", "l2")


class L2Norm(nn.Module):
    """``x · rsqrt(mean(x²) + eps)`` over the last dim, computed in float32, returned in ``x``'s dtype.

    No weight: RMSNorm with its gain fixed at 1 (``transformers``' ``Llama4TextL2Norm``). Any shape
    ``(..., width)``. A rotation of pairs (RoPE) keeps ``mean(x²)``, so it commutes with RoPE: Llama 4
    applies it after RoPE, attnlib before, with the same result (to rounding).

    Raises:
        ValueError: ``eps`` not a finite number > 0.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        if finite_number("eps", eps) <= 0:
            raise ValueError(f"eps={eps!r} must be > 0")
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


def qk_norm_layer(kind: str, width: int, eps: float) -> nn.Module:
    """QK-norm over ``width`` channels: ``"rmsnorm"`` (:class:`~attnlib.layers.norms.RMSNorm`, a learned weight)
    or ``"l2"`` (:class:`L2Norm`, none).

    Raises:
        ValueError: ``kind`` not one of :data:`QK_NORMS` (named ``qk_norm_type``).
    """
    if not isinstance(kind, str) or kind not in QK_NORMS:
        raise ValueError(f"qk_norm_type={kind!r} is not one of {QK_NORMS}")
    return RMSNorm(width, eps) if kind == "rmsnorm" else L2Norm(eps)


def qk_norms(qk_norm: bool, kind: str, width: int, eps: float) -> tuple[nn.Module | None, nn.Module | None]:
    """The query and key norms of a layer (two of :func:`qk_norm_layer`), or ``(None, None)`` without ``qk_norm``;
    ``kind`` is checked either way (ValueError naming ``qk_norm_type``)."""
    qk_norm_layer(kind, 1, 1.0)
    return (qk_norm_layer(kind, width, eps), qk_norm_layer(kind, width, eps)) if qk_norm else (None, None)


def check_temperature(floor_scale: object, attn_scale: object) -> None:
    """Raise TypeError / ValueError (named) unless ``floor_scale`` is a finite number > 0 and ``attn_scale`` >= 0."""
    if finite_number("floor_scale", floor_scale) <= 0:
        raise ValueError(f"floor_scale={floor_scale!r} must be > 0")
    if finite_number("attn_scale", attn_scale) < 0:
        raise ValueError(f"attn_scale={attn_scale!r} must be >= 0")


class AttentionTemperature(nn.Module):
    """Scale queries by their position: ``q · (log(floor((p + 1) / floor_scale) + 1) · attn_scale + 1)``.

    Llama 4's attention temperature tuning (``transformers``' ``Llama4TextAttention``, NoPE layers only).
    The factor is 1 for the first ``floor_scale - 1`` positions and grows like ``log p`` after. No parameters.

    Args:
        floor_scale: positions per step of the factor, a finite number > 0 (Llama 4: 8192).
        attn_scale: the factor's growth per ``log`` step, a finite number >= 0 (Llama 4: 0.1).

    Raises:
        ValueError: a value out of range, named.
    """

    def __init__(self, floor_scale: float = 8192.0, attn_scale: float = 0.1) -> None:
        super().__init__()
        check_temperature(floor_scale, attn_scale)
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def factors(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 factors, the shape of the integer ``positions`` (0 = the first token)."""
        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def forward(self, q: torch.Tensor, positions: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """``q`` ``(B, n_heads, T, head_dim)`` scaled at ``positions`` ``(B, T)`` (per row) or, when None, at
        ``start, …, start + T - 1``; returned in ``q``'s dtype."""
        if positions is None:
            positions = torch.arange(start, start + q.shape[-2], device=q.device)
        f = self.factors(positions)  # (T,) or (B, T)
        f = f[:, None, :, None] if f.dim() == 2 else f[:, None]  # -> (B, 1, T, 1) or (T, 1)
        return (q * f).to(q.dtype)

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale}, attn_scale={self.attn_scale}"

