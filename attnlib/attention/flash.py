"""FlashAttention's forward *and backward* in plain PyTorch: the gradient without the T×T matrix.

Dao et al. 2022 (FlashAttention), Algorithms 1 and 2, with the loop orders of
FlashAttention-2 (Dao 2023, Algorithms 1 and 2); chapter 15. The forward pass is the
online softmax of :func:`attnlib.attention.tiled.tiled_attention` (query blocks outside,
key/value blocks inside) that also keeps, per query row ``i``, the log-sum-exp of its
scores::

    L_i = m_i + log(ℓ_i)        (m_i: the row's max score, ℓ_i: Σ_j exp(S_ij - m_i))

so that ``P_ij = exp(S_ij - L_i)`` is the softmax weight. Autograd is told to save only
``Q, K, V``, the output ``O`` and ``L`` (one float per query): ``O(T)`` memory, where
eager attention saves its ``(T_q, T_k)`` weights. The backward pass recomputes ``S`` and
``P`` block by block from ``Q, K`` and ``L``, with key/value blocks outside (each ``dK_j,
dV_j`` is finished in one sweep over the queries, ``dQ_i`` is accumulated) and::

    D_i   = rowsum(dO_i ∘ O_i)                  (= Σ_j P_ij dP_ij, computed once)
    dV_j += P_ijᵀ dO_i
    dP_ij = dO_i V_jᵀ
    dS_ij = P_ij ∘ (dP_ij - D_i)                (the softmax's Jacobian, row by row)
    dQ_i += dS_ij K_j · scale
    dK_j += dS_ijᵀ Q_i · scale

This is the algorithm, not the speed: the real kernels keep the blocks in on-chip SRAM,
which plain PyTorch cannot do (each block here is a few separate kernel calls), so it is
slower than torch's fused SDPA; what it shows is the memory and the arithmetic.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from attnlib._checks import positive_int
from attnlib.functional import check_attention_inputs

__all__ = ["flash_attention"]


def _block_scores(
    q_i: torch.Tensor, k_j: torch.Tensor, q0: int, k0: int, offset: int, is_causal: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """``S_ij = (scale · Q_i) K_jᵀ`` with what may not be seen set to ``-inf``: identical in both passes.

    ``q_i (..., Bq, d)`` is already scaled; query row ``r`` of the block sits at absolute position
    ``offset + q0 + r`` (bottom-right causal alignment), key column ``c`` at ``k0 + c``.
    """
    s = q_i @ k_j.transpose(-2, -1)  # (..., Bq, d) @ (..., d, Bk) -> (..., Bq, Bk)
    n_q, n_k = s.shape[-2:]
    if is_causal and k0 + n_k - 1 > offset + q0:  # the block crosses the diagonal: hide the keys after each query
        q_pos = torch.arange(offset + q0, offset + q0 + n_q, device=s.device)[:, None]
        k_pos = torch.arange(k0, k0 + n_k, device=s.device)[None, :]
        s = s.masked_fill(k_pos > q_pos, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[..., q0 : q0 + n_q, k0 : k0 + n_k], float("-inf"))
    return s


def _forward(q, k, v, mask, is_causal, scale, tile_size):
    """Algorithm 1 (FlashAttention-2 order): ``O (..., T_q, d_v)`` in q's dtype and ``L (..., T_q)`` in float32+."""
    work = torch.promote_types(q.dtype, torch.float32)  # half-precision blocks are computed in float32
    T_q, T_k = q.shape[-2], k.shape[-2]
    offset = T_k - T_q  # query i sits at absolute position offset + i
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    out = torch.empty(*batch, T_q, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(*batch, T_q, dtype=work, device=q.device)
    for q0 in range(0, T_q, tile_size):
        q1 = min(q0 + tile_size, T_q)
        q_i = q[..., q0:q1, :].to(work) * scale  # (..., Bq, d), scaled once per block
        m_i = torch.full((*batch, q1 - q0, 1), float("-inf"), dtype=work, device=q.device)  # running row max
        l_i = torch.zeros_like(m_i)  # running Σ exp(S - m_i)
        o_i = torch.zeros(*batch, q1 - q0, v.shape[-1], dtype=work, device=q.device)  # running Σ exp(S - m_i) V
        k_stop = min(T_k, offset + q1) if is_causal else T_k  # key blocks after the last query are never needed
        for k0 in range(0, k_stop, tile_size):
            k1 = min(k0 + tile_size, T_k)
            s_ij = _block_scores(q_i, k[..., k0:k1, :].to(work), q0, k0, offset, is_causal, mask)
            m_new = torch.maximum(m_i, s_ij.amax(dim=-1, keepdim=True))
            m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # a row of only -inf so far: exp(-inf - 0) = 0, no NaN
            p_ij = torch.exp(s_ij - m_safe)  # (..., Bq, Bk): P̃_ij, unnormalised
            alpha = torch.exp(m_i - m_safe)  # rescales what was summed against the old max
            l_i = alpha * l_i + p_ij.sum(dim=-1, keepdim=True)
            o_i = alpha * o_i + p_ij @ v[..., k0:k1, :].to(work)  # (..., Bq, Bk) @ (..., Bk, d_v)
            m_i = m_new
        empty = l_i == 0  # a row that may see no key: output 0 (as attnlib.masks.masked_softmax)
        out[..., q0:q1, :] = (o_i / l_i.masked_fill(empty, 1.0)).to(out.dtype)
        # L = m + log ℓ; an empty row gets L = +inf (FlashAttention-2's convention) so that the
        # backward pass's P = exp(S - L) is 0 there, never exp(-inf + inf) = NaN.
        lse[..., q0:q1] = (m_i + torch.log(l_i)).masked_fill(empty, float("inf")).squeeze(-1)
    return out, lse


def _backward(q, k, v, out, lse, d_out, mask, is_causal, scale, tile_size):
    """Algorithm 2 (FlashAttention-2 order): ``dQ, dK, dV`` with ``P`` recomputed from ``Q, K, L`` block by block."""
    work = lse.dtype
    T_q, T_k = q.shape[-2], k.shape[-2]
    offset = T_k - T_q
    d_out = d_out.to(work)
    D = (d_out * out.to(work)).sum(dim=-1, keepdim=True)  # (..., T_q, 1): D_i = rowsum(dO_i ∘ O_i)
    L = lse.unsqueeze(-1)  # (..., T_q, 1)
    dq = torch.zeros(*D.shape[:-1], q.shape[-1], dtype=work, device=q.device)  # accumulated over key blocks
    dk = torch.empty(k.shape, dtype=work, device=k.device)
    dv = torch.empty(v.shape, dtype=work, device=v.device)
    for k0 in range(0, T_k, tile_size):  # outer loop: one key/value block, its dK_j and dV_j finished here
        k1 = min(k0 + tile_size, T_k)
        k_j, v_j = k[..., k0:k1, :].to(work), v[..., k0:k1, :].to(work)
        dk_j = torch.zeros(*D.shape[:-2], k1 - k0, k.shape[-1], dtype=work, device=k.device)
        dv_j = torch.zeros(*D.shape[:-2], k1 - k0, v.shape[-1], dtype=work, device=v.device)
        # Causal: the queries before position k0 never see this block; start at the query block holding the first.
        q_start = (max(0, k0 - offset) // tile_size) * tile_size if is_causal else 0
        for q0 in range(q_start, T_q, tile_size):  # inner loop: every query block that may see K_j
            q1 = min(q0 + tile_size, T_q)
            q_i = q[..., q0:q1, :].to(work) * scale
            s_ij = _block_scores(q_i, k_j, q0, k0, offset, is_causal, mask)  # recomputed, never stored
            p_ij = torch.exp(s_ij - L[..., q0:q1, :])  # (..., Bq, Bk): the softmax weights, exactly
            do_i = d_out[..., q0:q1, :]
            dv_j += p_ij.transpose(-2, -1) @ do_i  # (..., Bk, Bq) @ (..., Bq, d_v)
            dp_ij = do_i @ v_j.transpose(-2, -1)  # (..., Bq, d_v) @ (..., d_v, Bk)
            ds_ij = p_ij * (dp_ij - D[..., q0:q1, :])  # the gradient of the (scaled) scores
            dq[..., q0:q1, :] += (ds_ij @ k_j) * scale  # (..., Bq, Bk) @ (..., Bk, d)
            dk_j += ds_ij.transpose(-2, -1) @ q_i  # q_i carries the scale already
        # Grouped K/V heads (or any broadcast batch dim): sum the contributions of every query head that shared them.
        dk[..., k0:k1, :] = dk_j.sum_to_size(dk[..., k0:k1, :].shape)
        dv[..., k0:k1, :] = dv_j.sum_to_size(dv[..., k0:k1, :].shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionFunction(torch.autograd.Function):
    """The autograd node: saves ``Q, K, V, O, L`` (never ``P``); backward is :func:`_backward`.

    Inputs are in the broadcast layout (``k``/``v``'s batch dims broadcast to ``q``'s);
    :func:`flash_attention` checks the arguments and groups the heads before calling
    ``FlashAttentionFunction.apply(q, k, v, mask, is_causal, scale, tile_size)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, tile_size):
        out, lse = _forward(q, k, v, mask, is_causal, scale, tile_size)
        ctx.save_for_backward(q, k, v, out, lse)  # O(T): the inputs, the output and one float per query
        ctx.mask, ctx.is_causal, ctx.scale, ctx.tile_size = mask, is_causal, scale, tile_size  # the caller's mask
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, d_out, ctx.mask, ctx.is_causal, ctx.scale, ctx.tile_size)
        return dq, dk, dv, None, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    mask: torch.Tensor | None = None,
    tile_size: int = 64,
) -> torch.Tensor:
    """Exact attention whose forward *and backward* work block by block, saving ``O(T)`` for the gradient.

    Equal to ``softmax(q kᵀ · scale) v`` (and its gradients to autograd's through eager
    attention) up to float rounding. Forward: Dao et al. 2022, Algorithm 1 in FlashAttention-2's
    order (query blocks outside), which also returns the log-sum-exp ``L`` per query; backward:
    Algorithm 2 in FlashAttention-2's order (key/value blocks outside; Dao 2023, Algorithm 2),
    recomputing the weights from ``Q, K, L``. See the module docstring. Chapter 15.

    Args:
        q: queries ``(..., T_q, head_dim)``; 4-D: ``(B, n_heads, T_q, head_dim)``.
        k: keys ``(..., T_k, head_dim)``; 4-D: ``(B, n_kv_heads, T_k, head_dim)`` with ``n_kv_heads``
            dividing ``n_heads`` (grouped-query attention: a group of query heads reads one K/V head,
            and its gradient sums the group's contributions).
        v: values ``(..., T_k, head_dim_v)``, like ``k``.
        is_causal: causal attention, bottom-right aligned (query ``i`` sits at ``T_k - T_q + i``);
            key blocks no query of a block can see are skipped in both passes.
        scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
        mask: optional bool ``(..., T_q, T_k)`` of the scores' rank (dims 1 or equal), ``True`` = may
            attend. A query that may see no key gets a zero output and zero gradients (as
            :func:`attnlib.masks.masked_softmax`), never NaN.
        tile_size: queries and keys per block (positive int).

    Returns:
        The output ``(..., T_q, head_dim_v)`` in ``q``'s dtype (float16/bfloat16 are computed in
        float32 block by block). Differentiable in ``q, k, v`` (first derivatives only).

    Raises:
        TypeError / ValueError: see :func:`attnlib.functional.check_attention_inputs` (e.g.
            ``is_causal`` with ``T_q > T_k``); ``tile_size`` not a positive int.
    """
    check_attention_inputs(q, k, v, mask, is_causal, scale, 0.0, None)
    positive_int("tile_size", tile_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    shape = (*q.shape[:-1], v.shape[-1])
    if q.dim() == 4:  # (B, n_kv, group, T, d) against (B, n_kv, 1, T, d): K/V read per group by broadcasting
        B, H, T_q = q.shape[:3]
        n_kv = k.shape[1]
        q = q.reshape(B, n_kv, H // n_kv, T_q, q.shape[-1])
        k, v = k.unsqueeze(2), v.unsqueeze(2)
        if mask is not None:
            mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], n_kv, -1, *mask.shape[2:])
    if mask is not None:
        mask = mask.expand(*q.shape[:-1], k.shape[-2])  # a view: blocks can be sliced from it
    out = FlashAttentionFunction.apply(q, k, v, mask, is_causal, scale, tile_size)
    return out.reshape(shape)
