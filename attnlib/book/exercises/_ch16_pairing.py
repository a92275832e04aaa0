"""Helpers of exercise check 16.2 (Meta's interleaved RoPE pairing): both RoPEs, the scores, the slips.

:mod:`ch16` registers the check; the reference rotations here are written independently of
:class:`attnlib.RotaryEmbedding` (complex numbers for Meta's pairing, float64 for both).
"""
from __future__ import annotations

import torch

from attnlib.layers.norms import RMSNorm

_NAMES = ("w_q", "w_k", "q_gain", "k_gain")


def _order(head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # evens, then odds


def _per_head(weight: torch.Tensor, n_heads: int, order: torch.Tensor) -> torch.Tensor:
    rows = weight.shape[0]
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim, *weight.shape[1:])[:, order].reshape(weight.shape)


def _interleaved_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Meta's Llama RoPE: pairs (x[2i], x[2i+1]) as complex numbers times e^{i m θ_i}."""
    head_dim = x.shape[-1]
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = positions[:, None].double() * theta
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], head_dim // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)


def _half_split_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE on pairs (x[i], x[i + d_h/2]), as transformers and attnlib.RotaryEmbedding (in float64)."""
    half = x.shape[-1] // 2
    theta = 1.0 / base ** (torch.arange(0, x.shape[-1], 2, dtype=torch.float64) / x.shape[-1])
    angle = positions[:, None].double() * theta
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)


def _scores(x, w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads, rotate):
    """Attention scores (n_heads, T, T) of one sequence x (T, d): QK-norm, then RoPE."""
    T = x.shape[0]
    head_dim = w_q.shape[0] // n_heads
    q = (x @ w_q.T).view(T, n_heads, head_dim).transpose(0, 1)  # (h, T, d_h)
    k = (x @ w_k.T).view(T, n_kv_heads, head_dim).transpose(0, 1)  # (n_kv, T, d_h)
    norm = RMSNorm(head_dim, 1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(q_gain)
        q = norm(q)
        norm.weight.copy_(k_gain)
        k = norm(k)
    positions = torch.arange(T)
    q, k = rotate(q, positions), rotate(k, positions)
    k = k.repeat_interleave(n_heads // n_kv_heads, dim=0)
    return q @ k.transpose(-2, -1)


def _pairing_mistakes(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    head_dim = w_q.shape[0] // n_heads
    order, inverse = _order(head_dim), torch.argsort(_order(head_dim))
    right = (_per_head(w_q, n_heads, inverse), _per_head(w_k, n_kv_heads, inverse), q_gain[inverse], k_gain[inverse])
    mistakes = [
        ((_per_head(w_q, n_heads, order), _per_head(w_k, n_kv_heads, order), q_gain[order], k_gain[order]),
         "you applied P (evens, then odds) again; that is the way in, from interleaved to half-split. "
         "Going back needs its inverse, torch.argsort(P)"),
        ((right[0], right[1], q_gain, k_gain), "the QK-norm gains multiply the coordinates of each head one by one, "
         "so they must be reordered like the rows of W_q and W_k"),
        ((w_q[_per_head(torch.arange(w_q.shape[0]), 1, torch.argsort(_order(w_q.shape[0])))],
          w_k[_per_head(torch.arange(w_k.shape[0]), 1, torch.argsort(_order(w_k.shape[0])))], *right[2:]),
         "you reordered all the rows as one block; the permutation acts inside each head of d_h rows"),
        ((w_q, w_k, q_gain, k_gain), "you returned the weights unchanged"),
    ]
    if n_kv_heads != n_heads and (w_k.shape[0] // n_heads) % 2 == 0:
        inv_small = torch.argsort(_order(w_k.shape[0] // n_heads))
        mistakes.append(((right[0], _per_head(w_k, n_heads, inv_small), *right[2:]),
                         f"W_k has n_kv_heads={n_kv_heads} heads of d_h rows, not n_heads={n_heads}: "
                         "permute it head by head with n_kv_heads"))
    if w_q.shape[1] % 2 == 0 and w_q.shape[1] >= 4:
        cols = torch.argsort(_order(w_q.shape[1]))
        mistakes.append(((w_q[:, cols], w_k[:, cols], *right[2:]),
                         "you reordered the columns (the inputs); RoPE rotates the outputs of the projection, "
                         "so reorder the rows"))
    return right, mistakes
