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

:func:`tiled_forward` is the loop itself, shared with FlashAttention's forward pass
(:mod:`attnlib.attention.flash`), which also keeps each row's log-sum-exp for its backward pass;
:func:`online_softmax_update` is one step of it, the one chapter 15 derives. Learned attention sinks
(gpt-oss, chapter 20) only change where the loop starts: ``m = sink`` and ``denom = exp(sink - m) = 1``
instead of ``-inf`` and 0, as if the sink were a first key whose value is 0.
"""
from __future__ import annotations

import math

import torch

from attnlib._checks import positive_int
from attnlib.attention.functions import check_attention_inputs
from attnlib.attention.masks import modified_scores, score_indices
from attnlib.attention.mods import ScoreMod

__all__ = ["block_scores", "fold_groups", "fold_sinks", "online_softmax", "online_softmax_update", "tiled_attention", "tiled_forward"]


def online_softmax_update(
    m: torch.Tensor,
    denom: torch.Tensor,
    block: torch.Tensor,
    values: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Fold one block of scores into the running max ``m`` and denominator ``denom`` (and, for attention,
    the running weighted sum of the values ``acc``). Chapter 15.

    With ``m' = max(m, max(block))``, ``α = exp(m - m')`` and ``p = exp(block - m')``:
    ``denom' = α · denom + Σ p`` and ``acc' = α · acc + p @ values``. Rows that have seen only
    ``-inf`` so far keep ``m = -inf``, ``denom = 0`` and ``acc = 0`` (no NaN).

    Args:
        m: running max, shape ``(..., 1)``; start with ``-inf``.
        denom: running sum of ``exp(x - m)``, shape ``(..., 1)``; start with ``0``.
        block: the next scores, shape ``(..., n)``.
        values: optional ``(..., n, d_v)`` with ``block``'s leading dims but its last (a batch of rows
            ``(..., T_q, n)`` weighs ``(..., n, d_v)``): the values the block's scores weigh.
        acc: with ``values``: running ``Σ exp(x - m) · v``, ``(..., T_q, d_v)``; start with ``0``.

    Returns:
        ``(m', denom')``, each ``(..., 1)``; with ``values``, ``(m', denom', acc')``.
    """
    m_new = torch.maximum(m, block.amax(dim=-1, keepdim=True))
    # exp(-inf - (-inf)) is NaN: while a row has seen nothing but -inf, subtract 0 instead.
    m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
    p = torch.exp(block - m_safe)  # (..., n): unnormalised weights
    alpha = torch.exp(m - m_safe)  # (..., 1): rescales what was summed against the old max
    denom_new = alpha * denom + p.sum(dim=-1, keepdim=True)
    if values is None:
        return m_new, denom_new
    return m_new, denom_new, alpha * acc + p @ values  # (..., n) @ (..., n, d_v) -> (..., d_v)


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


def fold_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Grouped-query heads in the broadcast layout a tile loop reads: ``(q, k, v, mask)``.

    4-D inputs ``q (B, n_heads, T_q, d)``, ``k, v (B, n_kv_heads, T_k, d)`` become
    ``q (B, n_kv, group, T_q, d)`` against ``k, v (B, n_kv, 1, T_k, d)``: each group of query heads
    reads its key/value head by broadcasting, without copying the whole K/V (a tile's product may still
    expand its tile once per query head of the group). The mask is expanded to the scores' shape as a
    view, so that tiles can be sliced from it. Other ranks pass through unchanged.
    """
    if q.dim() == 4:
        B, H = q.shape[:2]
        n_kv = k.shape[1]
        q = q.reshape(B, n_kv, H // n_kv, *q.shape[2:])  # (B, H, T, d) -> (B, n_kv, group, T, d)
        k, v = k.unsqueeze(2), v.unsqueeze(2)
        if mask is not None:
            mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], n_kv, -1, *mask.shape[2:])
    if mask is not None:
        mask = mask.expand(*q.shape[:-1], k.shape[-2])  # a view
    return q, k, v, mask


def fold_sinks(sinks: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor | None:
    """Sink logits ``(n_heads,)`` in :func:`fold_groups`' layout: ``(n_kv_heads, group, 1, 1)`` (a view), which
    broadcasts against a tile's running statistics ``(B, n_kv, group, Bq, 1)``; ``None`` stays ``None``."""
    return None if sinks is None else sinks.view(k.shape[1], -1, 1, 1)


def block_scores(q_i, k_j, q0: int, k0: int, offset: int, is_causal: bool, mask, score_mod=None, heads=None):
    """The scores of one tile, ``S_ij = (scale · Q_i) K_jᵀ``, modified and masked: the same in every pass.

    ``q_i (..., Bq, d)`` is already scaled; query row ``r`` of the tile sits at absolute position
    ``offset + q0 + r`` (bottom-right causal alignment), key column ``c`` at ``k0 + c``. What may not
    be seen is ``-inf``. ``score_mod`` gets the tile as ``heads + (Bq, Bk)`` (the unfolded
    ``(B, n_heads)``) with the tile's absolute indices.
    """
    s = q_i @ k_j.transpose(-2, -1)  # (..., Bq, d) @ (..., d, Bk) -> (..., Bq, Bk)
    n_q, n_k = s.shape[-2:]
    q_pos = torch.arange(offset + q0, offset + q0 + n_q, device=s.device)[:, None]
    k_pos = torch.arange(k0, k0 + n_k, device=s.device)[None, :]
    if score_mod is not None:
        b, h, _, _ = score_indices(torch.Size((*heads, 1, 1)), s.device)
        s = modified_scores(score_mod, s.reshape(*heads, n_q, n_k), b, h, q_pos, k_pos).reshape(s.shape)
    if is_causal and k0 + n_k - 1 > offset + q0:  # the tile crosses the diagonal: hide the keys after each query
        s = s.masked_fill(k_pos > q_pos, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[..., q0 : q0 + n_q, k0 : k0 + n_k], float("-inf"))
    return s


def tiled_forward(q, k, v, mask, is_causal: bool, scale: float, tile_size: int, score_mod=None, heads=None,
                  sinks=None):
    """The tile loop (FlashAttention-2's order: query tiles outside): ``(O, L)``.

    Inputs in the broadcast layout of :func:`fold_groups` (``sinks``: :func:`fold_sinks`'). ``O (..., T_q, d_v)``
    in ``q``'s dtype; ``L (..., T_q)``, each row's log-sum-exp ``m + log(denom)`` in float32 (or wider),
    ``+inf`` for a row that may see no key (whose output is 0). Half-precision tiles are computed in float32.
    With ``sinks``, each row's statistics start from its head's sink (``m = sink``, ``denom = exp(sink - m)``),
    so ``L`` includes it and a row that sees no key has ``L = sink`` and output 0.
    """
    work = torch.promote_types(q.dtype, torch.float32)
    T_q, T_k = q.shape[-2], k.shape[-2]
    offset = T_k - T_q  # query i sits at absolute position offset + i
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    out = torch.empty(*batch, T_q, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(*batch, T_q, dtype=work, device=q.device)
    for q0 in range(0, T_q, tile_size):
        q1 = min(q0 + tile_size, T_q)
        q_i = q[..., q0:q1, :].to(work) * scale  # (..., Bq, d), scaled once per tile
        if sinks is None:
            m = torch.full((*batch, q1 - q0, 1), float("-inf"), dtype=work, device=q.device)  # running max
            denom = torch.zeros_like(m)  # running Σ exp(S - m)
        else:  # the sink is read first, as a key of value 0: m = sink is a stabiliser only (no gradient)
            sink = sinks.to(work).expand(*batch, q1 - q0, 1)
            m = sink.detach()
            denom = torch.exp(sink - m)  # = 1, with the sink's gradient
        acc = torch.zeros(*batch, q1 - q0, v.shape[-1], dtype=work, device=q.device)  # running Σ exp(S - m) V
        k_stop = min(T_k, offset + q1) if is_causal else T_k  # key tiles after the last query are never needed
        for k0 in range(0, k_stop, tile_size):
            k1 = min(k0 + tile_size, T_k)
            s = block_scores(q_i, k[..., k0:k1, :].to(work), q0, k0, offset, is_causal, mask, score_mod, heads)
            m, denom, acc = online_softmax_update(m, denom, s, v[..., k0:k1, :].to(work), acc)
        empty = denom == 0  # a row that may see no key: output 0 (as attnlib.attention.masks.masked_softmax)
        out[..., q0:q1, :] = (acc / denom.masked_fill(empty, 1.0)).to(out.dtype)
        # L = m + log(denom); +inf for an empty row (FlashAttention-2's convention), so that a backward
        # pass's P = exp(S - L) is 0 there, never exp(-inf + inf) = NaN.
        lse[..., q0:q1] = (m + torch.log(denom)).masked_fill(empty, float("inf")).squeeze(-1)
    return out, lse


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
    sinks: torch.Tensor | None = None,
    tile_size: int = 128,
) -> tuple[torch.Tensor, None]:
    """Exact scaled dot-product attention computed tile by tile with the online softmax (the ``"tiled"`` function).

    Equal to :func:`attnlib.attention.functions.attention` up to float rounding, but it never
    materialises the ``(T_q, T_k)`` scores: its extra memory is ``O(tile_size²)`` per batch
    and head. Dao et al. 2022, Algorithm 1, with the loops swapped (query tiles outside,
    as in FlashAttention-2) so that each query tile's running statistics stay local to it;
    with ``is_causal``, key tiles entirely after a query tile are skipped. Autograd goes back
    through every tile (saving them); :func:`~attnlib.attention.flash.flash_attention` runs the
    same loop with FlashAttention's own backward pass instead. Chapter 15.

    Args:
        q, k, v, mask, is_causal, scale, score_mod, sinks: as :func:`attnlib.attention.functions.attention`
            (grouped K/V heads are read per group through broadcasting, a tile at a time; each sink
            starts its heads' running max and denominator).
        dropout_p: must be 0 (the tiled function is the algorithm, not a training kernel).
        tile_size: queries and keys per tile (positive int). (Not ``block_size``, which is the
            context length everywhere else in the book.)

    Returns:
        ``(output (..., T_q, head_dim_v), None)`` in the dtype of ``q``. Half-precision
        inputs are computed in float32 tile by tile (as the real kernels accumulate).

    Raises:
        TypeError / ValueError: see :func:`attnlib.attention.functions.check_attention_inputs`; a
            ``tile_size`` that is not a positive int, or ``dropout_p > 0``.
    """
    check_attention_inputs(q, k, v, mask, is_causal, scale, dropout_p, score_mod, sinks)
    positive_int("tile_size", tile_size)
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p} is not supported by tiled_attention; use attn_fn='eager' or 'sdpa'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    shape = (*q.shape[:-1], v.shape[-1])
    folded = fold_groups(q, k, v, mask)
    out, _ = tiled_forward(*folded, is_causal, scale, tile_size, score_mod, heads=shape[:-2],
                           sinks=fold_sinks(sinks, k))
    return out.reshape(shape), None
