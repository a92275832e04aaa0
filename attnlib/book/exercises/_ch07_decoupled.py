"""The reference pieces of exercise 07.3: chapter 07's rotation, a decoupled-RoPE MLA layer and its naive
computation, with the known mistakes it can compute instead."""
from __future__ import annotations

import math

import torch
from torch import nn


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of chapter 07: pairs ``(x[..., 2i], x[..., 2i+1])`` turned by ``t * base**(-2i/w)``.

    Args:
        x: ``(..., T, w)``, ``w`` even.
        positions: ``(T,)`` integer positions of the ``T`` rows.

    Returns:
        ``(..., T, w)``, the rotated rows.
    """
    width = x.shape[-1]
    theta = base ** (-torch.arange(0, width, 2, dtype=x.dtype) / width)  # (w/2,)
    angles = positions.to(x.dtype)[:, None] * theta  # (T, w/2)
    cos, sin = angles.cos(), angles.sin()
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2)


class _DecoupledLayer(nn.Module):
    """The weights of chapter 07's ``DecoupledRopeLatentAttention``, under the same names."""

    def __init__(self, d_model: int, n_heads: int, d_c: int, rope_dim: int, g: torch.Generator) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.kv_latent_dim, self.rope_dim = d_c, rope_dim
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_down = nn.Linear(d_model, d_c, bias=False)
        self.k_up = nn.Linear(d_c, d_model, bias=False)
        self.v_up = nn.Linear(d_c, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model)
        self.q_rope = nn.Linear(d_model, n_heads * rope_dim, bias=False)
        self.k_rope = nn.Linear(d_model, rope_dim, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _split(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    B, T, _ = t.shape
    return t.view(B, T, n_heads, -1).transpose(1, 2)  # (B, T, n_heads*w) -> (B, n_heads, T, w)


def _naive_decoupled(layer: _DecoupledLayer, x: torch.Tensor, variant: str = "right") -> torch.Tensor:
    """Causal decoupled-RoPE MLA on the whole sequence, keys and values decoded: (B, T, d_model).

    ``variant`` computes a known mistake instead: ``"scale_head_dim"``, ``"scale_d_c"``,
    ``"no_rope"``, ``"query_shift_-1"`` / ``"query_shift_1"`` / ``"query_at_0"`` (the new query
    rotated at the wrong position), ``"no_self"`` (each token attends only to the tokens before it).
    """
    B, T, d = x.shape
    h, hd, rd = layer.n_heads, layer.head_dim, layer.rope_dim
    pos = torch.arange(T)
    c = layer.kv_down(x)  # (B, T, d_c)
    k_r = rope(layer.k_rope(x), pos)  # (B, T, rd): one per token, shared by the heads
    q_pos = {"query_shift_-1": pos - 1, "query_shift_1": pos + 1, "query_at_0": pos * 0}.get(variant, pos)
    q_r = rope(_split(layer.q_rope(x), h), q_pos)  # (B, h, T, rd)
    q_c, k_c, v = _split(layer.q_proj(x), h), _split(layer.k_up(c), h), _split(layer.v_up(c), h)
    scores = q_c @ k_c.transpose(-2, -1)
    if variant != "no_rope":
        scores = scores + q_r @ k_r.unsqueeze(1).transpose(-2, -1)  # (B, h, T, T)
    width = {"scale_head_dim": hd, "scale_d_c": layer.kv_latent_dim + rd}.get(variant, hd + rd)
    future = torch.ones(T, T, dtype=torch.bool).triu(0 if variant == "no_self" else 1)
    w = (scores / math.sqrt(width)).masked_fill(future, float("-inf")).softmax(-1)
    return layer.out_proj((w @ v).transpose(1, 2).reshape(B, T, d))


_DECODE_CASES = [  # (B, d_model, n_heads, d_c, rope_dim, T)
    (2, 32, 4, 24, 4, 6),  # d_c = 3 head_dim: a scale by the wrong width shows
    (1, 48, 6, 16, 4, 5),
    (3, 16, 2, 12, 8, 4),
]


def _decode_cost(B: int, T: int, layer: _DecoupledLayer) -> int:
    """FLOPs of decoding the keys of T cached latents (what the absorbed form never does)."""
    return 2 * B * T * layer.kv_latent_dim * layer.n_heads * layer.head_dim
