"""Helpers of exercise check 17.5 (dynamic NTK without the cache's mismatch): the scores, and the slips.

:mod:`ch17` registers the check. :func:`dynamic_scores` is written here in float64, independently of
:func:`attnlib.positional.rope_frequencies`: transformers' rule (``_compute_dynamic_ntk_parameters``) for
the base at a length of ``T`` tokens, half-split RoPE, one query at the newest position.
"""
from __future__ import annotations

import math

import torch


def _turn(x: torch.Tensor, positions: torch.Tensor, theta: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE of ``x`` ``(..., T, d_h)`` at ``positions`` ``(T,)`` (or ``(T, d_h/2)`` angles' positions) in float64."""
    angle = positions.double()[..., None] * theta if positions.dim() == 1 else positions.double() * theta
    if interleaved:
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)


def dynamic_base(base: float, head_dim: int, factor: float, L: int, length: int, *, clamp: bool = True,
                 plain_ratio: bool = False, exponent: float | None = None) -> float:
    """The base dynamic NTK uses for a text of ``length`` tokens (transformers' rule), or a slip of it."""
    n = max(length, L) if clamp else length
    s = n / L if plain_ratio else factor * n / L - (factor - 1)
    return base * s ** (head_dim / (head_dim - 2) if exponent is None else exponent)


def dynamic_scores(q: torch.Tensor, k: torch.Tensor, base: float, factor: float, L: int, *,
                   length: int | None = None, query_at: int | None = None, own_length: bool = False,
                   scale: bool = True, interleaved: bool = False, **rule) -> torch.Tensor:
    """Scores ``(h, T)`` of the query at position ``T - 1`` over keys at ``0 ... T - 1`` (an uncached pass).

    The keywords give the slips: ``length`` the length the base is computed for, ``query_at`` the query's
    position, ``own_length`` each key rotated with the base of its own length (what a cache of keys
    rotated on arrival holds), ``scale=False`` no ``1/sqrt(d_h)``, ``interleaved`` Meta's pairs, ``rule``
    :func:`dynamic_base`'s.
    """
    h, T, d_h = k.shape
    exponents = torch.arange(0, d_h, 2, dtype=torch.float64) / d_h

    def theta(n: int) -> torch.Tensor:
        return dynamic_base(base, d_h, factor, L, n, **rule) ** -exponents  # (d_h/2,)

    now = theta(T if length is None else length)
    if own_length:  # key j rotated when the text had j + 1 tokens
        thetas = torch.stack([theta(j + 1) for j in range(T)])  # (T, d_h/2)
        keys = _turn(k, torch.arange(T)[:, None].expand(T, d_h // 2), thetas, interleaved)
    else:
        keys = _turn(k, torch.arange(T), now, interleaved)  # (h, T, d_h)
    query = _turn(q[:, None, :], torch.tensor([T - 1 if query_at is None else query_at]), now, interleaved)
    scores = (query * keys).sum(-1)  # (h, 1, d_h) * (h, T, d_h) -> (h, T)
    return scores / math.sqrt(d_h) if scale else scores
