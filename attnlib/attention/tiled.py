"""Tiled ("flash-style") attention in plain PyTorch: exact attention that never holds the T×T matrix.

Dao et al. 2022 (FlashAttention), Algorithm 1; chapter 15. The keys are read in
blocks; for each block of queries three running quantities are kept and rescaled
whenever a larger score appears (the *online softmax*):

* ``m``: the largest score seen so far in each query row,
* ``denom``: the sum of ``exp(score - m)`` over the keys seen so far,
* ``acc``: the sum of ``exp(score - m) · v`` over the keys seen so far.

After the last key block, ``acc / denom`` is exactly ``softmax(scores) @ v``. The
extra memory is a few ``(block_size_q, block_size_k)`` tiles instead of a
``(T_q, T_k)`` matrix, so it grows linearly with the sequence length, not
quadratically. This is the algorithm, not the speed: the real kernels keep the
tiles in on-chip memory, which plain PyTorch cannot do.
"""
from __future__ import annotations

import math

import torch

from attnlib._checks import positive_int

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


def online_softmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Softmax over the last dimension, computed by reading ``x`` in blocks of ``block_size`` columns.

    One pass over the blocks finds the max and the denominator with
    :func:`online_softmax_update`; a second pass writes ``exp(x - m) / denom``. Equal to
    ``torch.softmax(x, dim=-1)``; a row that is all ``-inf`` gives zeros. Chapter 15.

    Args:
        x: float tensor ``(..., n)``, ``n >= 1``.
        block_size: columns per block (positive int).

    Returns:
        A tensor of ``x``'s shape and dtype.

    Raises:
        TypeError: ``x`` not a floating point tensor, or ``block_size`` not an int.
        ValueError: ``block_size < 1`` or an empty last dimension.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating point tensor; got {type(x).__name__} {getattr(x, 'dtype', '')}")
    positive_int("block_size", block_size)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dimension; got shape {tuple(x.shape)}")
    m = torch.full((*x.shape[:-1], 1), float("-inf"), dtype=x.dtype, device=x.device)
    denom = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):  # pass 1: statistics, one block at a time
        m, denom = online_softmax_update(m, denom, x[..., start : start + block_size])
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)  # an all -inf row: exp(-inf) / 1 = 0
    return torch.cat(  # pass 2: normalise each block with the final statistics
        [torch.exp(x[..., s : s + block_size] - m) / denom for s in range(0, x.shape[-1], block_size)], dim=-1
    )


def _check_inputs(q: object, k: object, v: object) -> torch.Size:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor; got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} needs at least 2 dims (..., T, head_dim); got shape {tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length T_k; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"sequences must not be empty; got T_q={q.shape[-2]}, T_k={k.shape[-2]}")
    try:
        return torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the batch dims of q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not broadcast"
        ) from None


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    block_size_q: int = 128,
    block_size_k: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact scaled dot-product attention computed tile by tile with the online softmax.

    Equal to ``F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T_q, T_k))``
    (or without a mask) up to float rounding, but it never materialises the
    ``(T_q, T_k)`` scores: its extra memory is ``O(block_size_q · block_size_k)``
    per batch and head. Dao et al. 2022, Algorithm 1, with the two loops swapped
    (query blocks outside, as in FlashAttention-2) so that each query block's running
    statistics stay local to it; with ``causal``, key blocks entirely after a query
    block are skipped and only blocks crossing the diagonal are masked. Chapter 15.

    Args:
        q: queries ``(..., T_q, head_dim)``, floating point.
        k: keys ``(..., T_k, head_dim)``, same dtype as ``q``.
        v: values ``(..., T_k, head_dim_v)``, same dtype as ``q``. The batch dims
            ``...`` of the three must broadcast.
        causal: mask future keys, aligned bottom-right like
            :func:`attnlib.functional.causal_mask`: query ``i`` sits at position
            ``T_k - T_q + i`` and sees the keys up to it (needs ``T_q <= T_k``).
        block_size_q: queries per tile (positive int).
        block_size_k: keys per tile (positive int).
        scale: factor applied to the scores; defaults to ``1 / sqrt(head_dim)``.

    Returns:
        ``(..., T_q, head_dim_v)`` in the dtype of ``q``. Half-precision inputs are
        computed in float32 tile by tile (as the real kernels accumulate).

    Raises:
        TypeError: inputs not floating point tensors of one dtype, a block size not an int,
            or ``scale`` not a number.
        ValueError: shapes that do not fit together, an empty sequence, a block size < 1,
            or ``causal`` with ``T_q > T_k``.
    """
    batch = _check_inputs(q, k, v)
    positive_int("block_size_q", block_size_q)
    positive_int("block_size_k", block_size_k)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None; got {scale!r}")
    T_q, T_k = q.shape[-2], k.shape[-2]
    if causal and T_q > T_k:
        raise ValueError(f"causal attention needs T_q <= T_k (bottom-right aligned); got T_q={T_q} > T_k={T_k}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    work = torch.promote_types(q.dtype, torch.float32)  # float16/bfloat16 tiles are computed in float32
    offset = T_k - T_q  # query i sits at absolute position offset + i
    out = torch.empty(*batch, T_q, v.shape[-1], dtype=q.dtype, device=q.device)

    for q0 in range(0, T_q, block_size_q):
        q1 = min(q0 + block_size_q, T_q)
        q_tile = q[..., q0:q1, :].to(work) * scale  # (..., Bq, head_dim), scaled once per tile
        m = torch.full((*batch, q1 - q0, 1), float("-inf"), dtype=work, device=q.device)  # running max
        denom = torch.zeros_like(m)  # running sum of exp(score - m)
        acc = torch.zeros(*batch, q1 - q0, v.shape[-1], dtype=work, device=q.device)  # running sum of exp(.) v
        # Causal: the last query of this tile sits at offset + q1 - 1; later keys are never needed.
        k_stop = min(T_k, offset + q1) if causal else T_k
        for k0 in range(0, k_stop, block_size_k):
            k1 = min(k0 + block_size_k, T_k)
            s = q_tile @ k[..., k0:k1, :].to(work).transpose(-2, -1)  # (..., Bq, d) @ (..., d, Bk) -> (..., Bq, Bk)
            if causal and k1 - 1 > offset + q0:  # the tile crosses the diagonal: mask what lies after it
                q_pos = torch.arange(offset + q0, offset + q1, device=q.device)
                k_pos = torch.arange(k0, k1, device=q.device)
                s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            # Key 0 is visible to every query and the first tile holds it, so m is finite from the first tile
            # on: exp(m - m_new) never meets -inf - (-inf).
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (..., Bq, 1)
            p = torch.exp(s - m_new)  # (..., Bq, Bk): unnormalised weights
            alpha = torch.exp(m - m_new)  # (..., Bq, 1): rescales what was summed against the old max
            denom = alpha * denom + p.sum(dim=-1, keepdim=True)
            acc = alpha * acc + p @ v[..., k0:k1, :].to(work)  # (..., Bq, Bk) @ (..., Bk, d_v) -> (..., Bq, d_v)
            m = m_new
        out[..., q0:q1, :] = (acc / denom).to(q.dtype)
    return out
