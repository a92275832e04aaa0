"""Tiled ("flash-style") attention in plain PyTorch: exact attention that never holds the T×T matrix.

Dao et al. 2022 (FlashAttention), Algorithm 1; chapter 15. The keys are read in
blocks; for each block of queries three running quantities are kept and rescaled
whenever a larger score appears (the *online softmax*):

* ``m``: the largest score seen so far in each query row,
* ``denom``: the sum of ``exp(score - m)`` over the keys seen so far,
* ``acc``: the sum of ``exp(score - m) · v`` over the keys seen so far.

After the last key block, ``acc / denom`` is exactly ``softmax(scores) @ v``. The
extra memory is a few ``(tile_size, tile_size)`` tiles instead of a
``(T_q, T_k)`` matrix, so it grows linearly with the sequence length, not
quadratically. This is the algorithm, not the speed: the real kernels keep the
tiles in on-chip memory, which plain PyTorch cannot do.
"""
from __future__ import annotations

import math

import torch

from attnlib._checks import positive_int
from attnlib.functional import ScoreMod, check_attention_inputs
from attnlib.masks import score_indices

__all__ = ["online_softmax", "online_softmax_update", "tiled_attention"]


def online_softmax_update(
    m: torch.Tensor, denom: torch.Tensor, block: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block of scores into the running max ``m`` and running denominator ``denom``.

    With ``m' = max(m, max(block))``: ``denom' = denom · exp(m - m') + Σ exp(block - m')``.
    Rows that have seen only ``-inf`` so far keep ``m = -inf`` and ``denom = 0`` (no NaN).
    Chapter 15.

    Args:
        m: running max, shape ``(..., 1)``; start with ``-inf``.
        denom: running sum of ``exp(x - m)``, shape ``(..., 1)``; start with ``0``.
        block: the next scores, shape ``(..., n)``.

    Returns:
        ``(m', denom')``, each ``(..., 1)``.
    """
    m_new = torch.maximum(m, block.amax(dim=-1, keepdim=True))
    # exp(-inf - (-inf)) is NaN: while a row has seen nothing but -inf, subtract 0 instead.
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    denom_new = denom * torch.exp(m - m_safe) + torch.exp(block - m_safe).sum(dim=-1, keepdim=True)
    return m_new, denom_new


def online_softmax(x: torch.Tensor, tile_size: int) -> torch.Tensor:
    """Softmax over the last dimension, computed by reading ``x`` in tiles of ``tile_size`` columns.

    One pass over the blocks finds the max and the denominator with
    :func:`online_softmax_update`; a second pass writes ``exp(x - m) / denom``. Equal to
    ``torch.softmax(x, dim=-1)``; a row that is all ``-inf`` gives zeros. Chapter 15.

    Args:
        x: float tensor ``(..., n)``, ``n >= 1``.
        tile_size: columns per tile (positive int).

    Returns:
        A tensor of ``x``'s shape and dtype.

    Raises:
        TypeError: ``x`` not a floating point tensor, or ``tile_size`` not an int.
        ValueError: ``tile_size < 1`` or an empty last dimension.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating point tensor; got {type(x).__name__} {getattr(x, 'dtype', '')}")
    positive_int("tile_size", tile_size)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dimension; got shape {tuple(x.shape)}")
    m = torch.full((*x.shape[:-1], 1), float("-inf"), dtype=x.dtype, device=x.device)
    denom = torch.zeros_like(m)
    for start in range(0, x.shape[-1], tile_size):  # pass 1: statistics, one block at a time
        m, denom = online_softmax_update(m, denom, x[..., start : start + tile_size])
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)  # an all -inf row: exp(-inf) / 1 = 0
    return torch.cat(  # pass 2: normalise each block with the final statistics
        [torch.exp(x[..., s : s + tile_size] - m) / denom for s in range(0, x.shape[-1], tile_size)], dim=-1
    )


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    tile_size: int = 128,
) -> tuple[torch.Tensor, None]:
    """Exact scaled dot-product attention computed tile by tile with the online softmax (the ``"tiled"`` function).

    Equal to :func:`attnlib.functional.attention` up to float rounding, but it never
    materialises the ``(T_q, T_k)`` scores: its extra memory is ``O(tile_size²)`` per batch
    and head. Dao et al. 2022, Algorithm 1, with the loops swapped (query tiles outside,
    as in FlashAttention-2) so that each query tile's running statistics stay local to it;
    with ``is_causal``, key tiles entirely after a query tile are skipped. Chapter 15.

    Args:
        q, k, v, mask, is_causal, scale, score_mod: as :func:`attnlib.functional.attention`
            (grouped K/V heads are read per group through broadcasting, a tile at a time).
        dropout_p: must be 0 (the tiled function is the algorithm, not a training kernel).
        tile_size: queries and keys per tile (positive int). (Not ``block_size``, which is the
            context length everywhere else in the book.)

    Returns:
        ``(output (..., T_q, head_dim_v), None)`` in the dtype of ``q``. Half-precision
        inputs are computed in float32 tile by tile (as the real kernels accumulate).

    Raises:
        TypeError / ValueError: see :func:`attnlib.functional.check_attention_inputs`; a
            ``tile_size`` that is not a positive int, or ``dropout_p > 0``.
    """
    check_attention_inputs(q, k, v, mask, is_causal, scale, dropout_p, score_mod)
    positive_int("tile_size", tile_size)
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p} is not supported by tiled_attention; use attn_fn='eager' or 'sdpa'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    T_q, T_k = q.shape[-2], k.shape[-2]
    work = torch.promote_types(q.dtype, torch.float32)  # float16/bfloat16 tiles are computed in float32
    shape = (*q.shape[:-1], v.shape[-1])
    if q.dim() == 4:  # (B, n_kv, group, T, d): a group of query heads against its K/V head, broadcast per tile
        B, H = q.shape[:2]
        q = q.reshape(B, k.shape[1], H // k.shape[1], T_q, q.shape[-1])
        k, v = k.unsqueeze(2), v.unsqueeze(2)
        if mask is not None:
            mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], k.shape[1], -1, *mask.shape[2:])
    if mask is not None:
        mask = mask.expand(*q.shape[:-1], T_k)  # a view: tiles can be sliced from it
    batch = q.shape[:-2]
    offset = T_k - T_q  # query i sits at absolute position offset + i
    out = torch.empty(*batch, T_q, v.shape[-1], dtype=q.dtype, device=q.device)
    for q0 in range(0, T_q, tile_size):
        q1 = min(q0 + tile_size, T_q)
        q_tile = q[..., q0:q1, :].to(work) * scale  # (..., Bq, head_dim), scaled once per tile
        m = torch.full((*batch, q1 - q0, 1), float("-inf"), dtype=work, device=q.device)  # running max
        denom = torch.zeros_like(m)  # running sum of exp(score - m)
        acc = torch.zeros(*batch, q1 - q0, v.shape[-1], dtype=work, device=q.device)  # running sum of exp(.) v
        k_stop = min(T_k, offset + q1) if is_causal else T_k  # later keys are never needed
        for k0 in range(0, k_stop, tile_size):
            k1 = min(k0 + tile_size, T_k)
            s = q_tile @ k[..., k0:k1, :].to(work).transpose(-2, -1)  # (..., Bq, d) @ (..., d, Bk) -> (..., Bq, Bk)
            q_pos = torch.arange(offset + q0, offset + q1, device=q.device)[:, None]
            k_pos = torch.arange(k0, k1, device=q.device)[None, :]
            if score_mod is not None:
                b, h, _, _ = score_indices(torch.Size((*shape[:-2], 1, 1)), q.device)
                s = score_mod(s.reshape(*shape[:-2], q1 - q0, k1 - k0), b, h, q_pos, k_pos).reshape(s.shape)
            if is_causal and k1 - 1 > offset + q0:  # the tile crosses the diagonal: mask what lies after it
                s = s.masked_fill(k_pos > q_pos, float("-inf"))
            if mask is not None:
                s = s.masked_fill(~mask[..., q0:q1, k0:k1], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (..., Bq, 1)
            # A row that has seen only -inf so far subtracts 0 instead (exp(-inf - -inf) would be NaN).
            m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
            p = torch.exp(s - m_safe)  # (..., Bq, Bk): unnormalised weights
            alpha = torch.exp(m - m_safe)  # (..., Bq, 1): rescales what was summed against the old max
            denom = alpha * denom + p.sum(dim=-1, keepdim=True)
            acc = alpha * acc + p @ v[..., k0:k1, :].to(work)  # (..., Bq, Bk) @ (..., Bk, d_v) -> (..., Bq, d_v)
            m = m_new
        # A row with nothing to attend to has denom 0 and acc 0: its output is 0.
        out[..., q0:q1, :] = (acc / denom.masked_fill(denom == 0, 1.0)).to(out.dtype)
    return out.reshape(shape), None
