"""The readable eager attention reference and the masks it takes.

Everything here is plain PyTorch so that a reader can follow each line; the tests
pin :func:`attention` to :func:`torch.nn.functional.scaled_dot_product_attention`.

Mask convention (the same as PyTorch SDPA): a boolean tensor where ``True`` means
"this query may attend to this key".
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["attention", "causal_mask", "padding_mask"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, written out: ``softmax(q k^T * scale) v``.

    Vaswani et al. 2017, §3.2.1 (derived in chapter 02, masked in chapter 03).

    Args:
        q: queries, shape ``(..., T_q, head_dim)``, floating point.
        k: keys, shape ``(..., T_k, head_dim)``, same dtype as ``q``.
        v: values, shape ``(..., T_k, head_dim_v)``, same dtype as ``q``.
        mask: optional boolean tensor broadcastable to ``(..., T_q, T_k)``;
            ``True`` = may attend (PyTorch SDPA's convention).
        dropout_p: probability of zeroing an attention weight (applied whenever
            it is > 0, as in SDPA: pass 0.0 at evaluation time).
        scale: factor applied to the logits; defaults to ``1 / sqrt(head_dim)``.

    Returns:
        ``(output, weights)``: output of shape ``(..., T_q, head_dim_v)`` and the
        attention weights of shape ``(..., T_q, T_k)`` (after dropout). A query
        row whose mask is all ``False`` has nothing to attend to: its weights and
        its output are zeros, never NaN.

    Raises:
        TypeError: if ``mask`` is not boolean or the inputs are not floating point.
        ValueError: if the shapes do not fit together or ``dropout_p`` is not in [0, 1).
    """
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise TypeError(f"q, k, v must be floating point tensors; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise ValueError(
            f"q, k, v need at least 2 dims (..., T, head_dim); got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length T_k; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")

    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., T_q, d) @ (..., d, T_k) -> (..., T_q, T_k)

    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor (True = may attend); got dtype {mask.dtype}")
        try:
            torch.broadcast_shapes(mask.shape, scores.shape)
        except RuntimeError:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape {tuple(scores.shape)}"
            ) from None
        scores = scores.masked_fill(~mask, float("-inf"))

    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        # A fully masked row is softmax(all -inf) = NaN; it has nothing to attend to, so it gets zeros.
        weights = weights.masked_fill(~mask, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights  # (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)


def _check_length(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def causal_mask(T_q: int, T_k: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean causal mask, aligned to the bottom-right corner.

    Query ``i`` sits at absolute position ``T_k - T_q + i``; it may attend to every
    key at or before that position. With ``T_q == T_k`` this is the usual lower
    triangle; with ``T_q < T_k`` (decoding with a KV cache: a few new queries over
    all cached keys) it stays right, where a top-left triangle would hide keys.
    Chapter 03.

    Args:
        T_q: number of queries.
        T_k: number of keys (defaults to ``T_q``); must be ``>= T_q``.
        device: where to create the mask.

    Returns:
        Boolean tensor of shape ``(T_q, T_k)``, ``True`` = may attend.

    Raises:
        ValueError: if a length is not a positive integer or ``T_q > T_k``.
    """
    T_k = T_q if T_k is None else T_k
    _check_length("T_q", T_q)
    _check_length("T_k", T_k)
    if T_q > T_k:
        raise ValueError(f"T_q={T_q} > T_k={T_k}: a bottom-right causal mask needs at least as many keys as queries")
    return torch.ones(T_q, T_k, dtype=torch.bool, device=device).tril(diagonal=T_k - T_q)


def padding_mask(lengths: torch.Tensor | list[int], T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Key padding mask from sequence lengths: key ``j`` of sequence ``b`` is real iff ``j < lengths[b]``.

    Chapter 03. Combine with a causal mask by ``&``:
    ``causal_mask(T) & padding_mask(lengths, T)`` has shape ``(B, T, T)``.

    Args:
        lengths: integer tensor or list of shape ``(B,)``, each in ``[0, T]``.
        T: padded length of the key sequence.
        device: where to create the mask (defaults to the device of ``lengths``).

    Returns:
        Boolean tensor of shape ``(B, 1, T)``: it broadcasts against single-head
        scores ``(B, T_q, T)``; use ``.unsqueeze(1)`` for ``(B, n_heads, T_q, T)``.

    Raises:
        ValueError: if ``T`` is not positive, ``lengths`` is not 1-D, or a length is outside ``[0, T]``.
        TypeError: if ``lengths`` is not integer.
    """
    _check_length("T", T)
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be integers; got dtype {lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D of shape (B,); got shape {tuple(lengths.shape)}")
    if ((lengths < 0) | (lengths > T)).any():
        raise ValueError(f"every length must be in [0, T={T}]; got {lengths.tolist()}")
    positions = torch.arange(T, device=lengths.device)
    return (positions[None, :] < lengths[:, None]).unsqueeze(1)  # (B, T) -> (B, 1, T)
