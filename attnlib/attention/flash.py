"""FlashAttention's forward *and backward* in plain PyTorch: the gradient without the T×T matrix.

Dao et al. 2022 (FlashAttention), Algorithms 1 and 2, with the loop orders of
FlashAttention-2 (Dao 2023, Algorithms 1 and 2); chapter 15. The forward pass is the
tile loop of :func:`attnlib.attention.tiled.tiled_attention` (:func:`~attnlib.attention.tiled.tiled_forward`:
query blocks outside, key/value blocks inside), which also keeps, per query row ``i``, the
log-sum-exp of its scores::

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

Learned attention sinks (gpt-oss, chapter 20) add ``exp(sink_h)`` to every row's denominator, so ``L_i``
includes it (the forward loop starts from the sink) and ``P_ij = exp(S_ij - L_i)`` stays right. The
sink's column has no value (``dP_sink = 0``), so ``dS_ij`` keeps its form, and the sink's own gradient is
that column's ``dS``, summed over the rows of its head::

    d sink_h = Σ_(b,i) P_sink,i (0 - D_i) = -Σ_(b,i) exp(sink_h - L_i) D_i

This is the algorithm, not the speed: the real kernels keep the blocks in on-chip SRAM,
which plain PyTorch cannot do (each block here is a few separate kernel calls), so it is
slower than torch's fused SDPA; what it shows is the memory and the arithmetic.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from attnlib._checks import positive_int
from attnlib.attention.functions import check_attention_inputs
from attnlib.attention.mods import ScoreMod
from attnlib.attention.tiled import block_scores, fold_groups, fold_sinks, tiled_forward

__all__ = ["flash_attention"]


def _sink_grad(sinks: torch.Tensor, lse: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``d sink = -Σ exp(sink - L) · D`` over each head's rows (see the module docstring), in ``sinks``' shape."""
    p_sink = torch.exp(sinks.to(lse.dtype) - lse.unsqueeze(-1))  # (..., T_q, 1): the weight each row gave the sink
    return (-(p_sink * D)).sum_to_size(sinks.shape).to(sinks.dtype)


def _backward(q, k, v, out, lse, d_out, mask, is_causal, scale, tile_size):
    """Algorithm 2 (FlashAttention-2 order): ``dQ, dK, dV`` with ``P`` recomputed from ``Q, K, L`` block by block;
    also ``D`` (for the sinks' gradient)."""
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
            s_ij = block_scores(q_i, k_j, q0, k0, offset, is_causal, mask)  # recomputed, never stored
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
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), D


class FlashAttentionFunction(torch.autograd.Function):
    """The autograd node: saves ``Q, K, V, O, L`` (never ``P``); backward is :func:`_backward`.

    Inputs are in the broadcast layout of :func:`~attnlib.attention.tiled.fold_groups`;
    :func:`flash_attention` checks the arguments and groups the heads before calling
    ``FlashAttentionFunction.apply(q, k, v, mask, is_causal, scale, tile_size, sinks)`` (``sinks``: ``None``
    or :func:`~attnlib.attention.tiled.fold_sinks`' layout).
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, tile_size, sinks=None):
        out, lse = tiled_forward(q, k, v, mask, is_causal, scale, tile_size, sinks=sinks)
        # O(T): the inputs, the output and one float per query (and the sinks, one per head, when given)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.mask, ctx.is_causal, ctx.scale, ctx.tile_size = mask, is_causal, scale, tile_size  # the caller's mask
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        sinks = sinks[0] if sinks else None
        dq, dk, dv, D = _backward(q, k, v, out, lse, d_out, ctx.mask, ctx.is_causal, ctx.scale, ctx.tile_size)
        d_sinks = _sink_grad(sinks, lse, D) if sinks is not None and ctx.needs_input_grad[7] else None
        return dq, dk, dv, None, None, None, None, d_sinks


def flash_attention(
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
    tile_size: int = 64,
) -> tuple[torch.Tensor, None]:
    """Exact attention whose forward *and backward* work block by block, saving ``O(T)`` for the gradient
    (the ``"flash"`` function).

    Equal to ``softmax(q kᵀ · scale) v`` (and its gradients to autograd's through eager
    attention) up to float rounding. Forward: Dao et al. 2022, Algorithm 1 in FlashAttention-2's
    order (query blocks outside), which also returns the log-sum-exp ``L`` per query; backward:
    Algorithm 2 in FlashAttention-2's order (key/value blocks outside; Dao 2023, Algorithm 2),
    recomputing the weights from ``Q, K, L``. See the module docstring. Chapter 15.

    Args:
        q, k, v, mask, is_causal, scale: as :func:`attnlib.attention.functions.attention` (4-D inputs:
            grouped-query attention, a group of query heads reading one K/V head; its gradient sums
            the group's contributions). With ``is_causal``, key blocks no query of a block can see are
            skipped in both passes. A query that may see no key gets a zero output and zero
            gradients, never NaN.
        sinks: optional float ``(n_heads,)`` learned sink logits (4-D inputs; chapter 20): ``L`` includes
            them and they get their own gradient (module docstring).
        dropout_p: must be 0; score_mod: must be None (the backward pass here differentiates plain
            scores: use ``"eager"`` or ``"tiled"`` for a score modification).
        tile_size: queries and keys per block (positive int).

    Returns:
        ``(output (..., T_q, head_dim_v), None)`` in ``q``'s dtype (float16/bfloat16 are computed in
        float32 block by block). Differentiable in ``q, k, v`` and ``sinks`` (first derivatives only).

    Raises:
        TypeError / ValueError: see :func:`attnlib.attention.functions.check_attention_inputs` (e.g.
            ``is_causal`` with ``T_q > T_k``); ``tile_size`` not a positive int; ``dropout_p > 0``
            or a ``score_mod`` (named).
    """
    check_attention_inputs(q, k, v, mask, is_causal, scale, dropout_p, score_mod, sinks)
    positive_int("tile_size", tile_size)
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p} is not supported by flash_attention; use attn_fn='eager' or 'sdpa'")
    if score_mod is not None:
        raise ValueError("flash_attention cannot apply a score_mod (its backward pass differentiates plain "
                         "scores); use attn_fn='eager' or 'tiled'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    shape = (*q.shape[:-1], v.shape[-1])
    out = FlashAttentionFunction.apply(*fold_groups(q, k, v, mask), is_causal, scale, tile_size, fold_sinks(sinks, k))
    return out.reshape(shape), None
