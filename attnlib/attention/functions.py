"""The eager and SDPA attention functions, and the checks every attention function shares.

Every attention function (these two, :func:`~attnlib.attention.tiled.tiled_attention` and
:func:`~attnlib.attention.flash.flash_attention`) has the signature of Hugging Face's
``AttentionInterface`` functions::

    fn(q, k, v, mask=None, *, is_causal=False, scale=None, dropout_p=0.0, score_mod=None, sinks=None)
        -> (output, weights or None)

and :data:`attnlib.attention.ATTENTION_FUNCTIONS` picks one by name. :func:`attention`
is the readable reference the book teaches (it returns the weights for plotting; chapters
02–04); :func:`sdpa_attention` calls :func:`torch.nn.functional.scaled_dot_product_attention`.
The masks they take: :mod:`attnlib.attention.masks`.

Conventions (chapter 03):

* ``mask``: boolean, ``True`` = may attend (PyTorch SDPA's convention), with exactly
  the rank of the scores ``(..., T_q, T_k)``; each of its dims is 1 or the scores'
  size. A mask of another rank is refused, never read another way.
* ``is_causal``: query ``i`` sits at absolute position ``T_k - T_q + i`` and sees the
  keys up to it (the bottom-right alignment a KV cache needs; SDPA's own
  ``is_causal`` is top-left).
* ``score_mod(scores, b, h, q_idx, kv_idx) -> scores``: FlexAttention's score
  modification, applied to the whole scores tensor with broadcastable index tensors.
* ``sinks``: learned attention sinks (gpt-oss; transformers' ``s_aux``): a float ``(n_heads,)``, one
  logit per query head that joins each row's softmax denominator and is then dropped, so that
  ``weights = exp(s - m) / (Σ_j exp(s_j - m) + exp(sink - m))`` and a row may give less than all of its
  weight to the keys (chapter 20). Not StreamingLLM's sink *tokens* (:class:`~attnlib.cache.SinkLayerCache`),
  which keep the first keys in a windowed cache.
* A padding mask (``attention_mask``) is ``(B, T_k)`` with ``True`` = a real token: the opposite
  of ``nn.MultiheadAttention``'s ``key_padding_mask``, where ``True`` means "ignore"; pass it as
  ``mask=attention_mask[:, None, None, :]``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlib.attention.masks import combined_mask, future_mask, masked_softmax, modified_scores, score_indices
from attnlib.attention.mods import ScoreMod

__all__ = ["attention", "check_attention_inputs", "check_sinks", "sdpa_attention", "sink_softmax"]


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def check_attention_inputs(
    q: object,
    k: object,
    v: object,
    mask: object = None,
    is_causal: object = False,
    scale: object = None,
    dropout_p: object = 0.0,
    score_mod: object = None,
    sinks: object = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` unless the arguments of an attention function fit together.

    Shared by every attention function, so that they all refuse the same inputs before
    any kernel runs: ``q (..., n_heads, T_q, head_dim)``, ``k (..., n_kv_heads, T_k,
    head_dim)``, ``v (..., n_kv_heads, T_k, head_dim_v)`` floating point of one dtype
    and device, equal batch dims, ``n_heads`` a multiple of ``n_kv_heads`` (4-D inputs:
    grouped-query attention), ``T_k >= 1``; a boolean ``mask`` of the scores' rank whose
    dims are 1 or the scores'; ``is_causal`` a bool with ``T_q <= T_k``; ``scale`` finite
    and positive; ``dropout_p`` in [0, 1); ``score_mod`` callable; ``sinks`` ``None`` or a floating point
    tensor ``(n_heads,)`` on ``q``'s device, with 4-D ``q`` (its dtype may differ: it is cast).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor; got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} needs at least 2 dims (..., T, head_dim); got shape {tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not q.dim() == k.dim() == v.dim():
        raise ValueError(f"q, k, v must have the same rank; got shapes {_shape(q)}, {_shape(k)}, {_shape(v)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim; got q {_shape(q)} and k {_shape(k)}")
    if q.shape[-1] == 0:
        raise ValueError(f"head_dim=0: q and k need at least one feature (the scale is 1/sqrt(head_dim)); got q {_shape(q)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in every dim but the last; got k {_shape(k)} and v {_shape(v)}")
    if k.shape[-2] == 0:
        raise ValueError(f"k and v hold no positions (T_k=0): a query needs at least one key; got k {_shape(k)}")
    if q.dim() == 4:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q and k must have the same batch size B; got q {_shape(q)} and k {_shape(k)}")
        n_heads, n_kv_heads = q.shape[1], k.shape[1]
        if n_heads == 0 or n_kv_heads == 0 or n_heads % n_kv_heads:
            raise ValueError(
                f"q's n_heads={n_heads} must be a multiple of k's n_kv_heads={n_kv_heads} "
                f"(grouped-query attention); got q {_shape(q)} and k {_shape(k)}"
            )
    elif q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must have the same batch dims; got q {_shape(q)} and k {_shape(k)}")
    T_q, T_k = q.shape[-2], k.shape[-2]
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {is_causal!r}")
    if is_causal and T_q > T_k:
        raise ValueError(f"is_causal needs T_q <= T_k (bottom-right aligned); got T_q={T_q} > T_k={T_k}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None; got {scale!r}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale={scale!r} must be a finite number > 0")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float; got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} must be in [0, 1)")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score; got {score_mod!r}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a boolean torch.Tensor (True = may attend); got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor (True = may attend); got dtype {mask.dtype}")
        scores = (*q.shape[:-1], T_k)
        if mask.dim() != len(scores) or any(m not in (1, s) for m, s in zip(mask.shape, scores)):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} must have the scores' rank {len(scores)} with each dim 1 or "
                f"equal to the scores' shape {scores} (e.g. a key padding mask (B, T_k) as "
                f"mask[:, None, None, :] for (B, n_heads, T_q, T_k))"
            )
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q on {q.device}")
    if sinks is not None:
        check_sinks(sinks, q)


def check_sinks(sinks: object, q: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``sinks`` is a floating point ``(n_heads,)`` tensor on ``q``'s
    device for a 4-D ``q (B, n_heads, T_q, head_dim)`` (one learned sink logit per query head)."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a floating point torch.Tensor (n_heads,) or None; got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating point tensor (one logit per head); got dtype {sinks.dtype}")
    if q.dim() != 4:
        raise ValueError(f"sinks need 4-D q (B, n_heads, T_q, head_dim) to name the heads; got q {_shape(q)}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape (n_heads,) = ({q.shape[1]},), one logit per query head; "
                         f"got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q on {q.device}")


def sink_softmax(scores: torch.Tensor, keep: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax with one learned sink logit per head in its denominator, the sink's own weight dropped.

    ``weights = exp(s - m) / (Σ_j exp(s_j - m) + exp(sink_h - m))`` with ``m = max(max_j s_j, sink_h)``
    (gpt-oss; transformers' ``s_aux``, which concatenates the sink as a last column, softmaxes and drops
    it: the same numbers). Chapter 20. A row whose every key is hidden gives the sink all its weight:
    zeros, never NaN. ``m`` is only a stabiliser (any value gives the same weights), so autograd does
    not go through it.

    Args:
        scores: float ``(B, n_heads, T_q, T_k)``.
        keep: ``None`` or a bool broadcastable to ``scores``, ``True`` = may attend.
        sinks: float ``(n_heads,)``, cast to the scores' dtype.

    Returns:
        ``(B, n_heads, T_q, T_k)`` weights whose rows sum to ``1 - p_sink`` (< 1).
    """
    logits = scores if keep is None else scores.masked_fill(~keep, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1)  # (n_heads,) -> (1, n_heads, 1, 1)
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink).detach()  # finite: the sink is never hidden
    e = torch.exp(logits - m)  # (B, H, T_q, T_k); 0 where hidden
    return e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - m))


def attention(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention written out: ``softmax(q kᵀ · scale) v`` (the ``"eager"`` function).

    Vaswani et al. 2017, §3.2.1 (derived in chapter 02, masked in chapter 03). ``q`` is
    scaled before the product (``T·d`` multiplications instead of ``T²``, and no float16
    overflow that SDPA would not also have); masking writes into the fresh scores in place.

    Args:
        q: queries ``(..., T_q, head_dim)``; for 4-D inputs ``(B, n_heads, T_q, head_dim)``.
        k: keys ``(..., T_k, head_dim)``; 4-D: ``(B, n_kv_heads, T_k, head_dim)``, ``n_kv_heads``
            dividing ``n_heads``: each group of ``n_heads // n_kv_heads`` query heads reads one
            key/value head in place (grouped-query attention, chapter 06; no copy of K/V).
        v: values ``(..., T_k, head_dim_v)``, like ``k``.
        mask: optional bool of the scores' rank ``(..., T_q, T_k)`` (dims 1 or equal), ``True`` = may attend.
        is_causal: add the bottom-right causal mask.
        scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
        dropout_p: probability of zeroing a weight (whenever > 0: pass 0.0 at evaluation).
        score_mod: FlexAttention-style ``(scores, b, h, q_idx, kv_idx) -> scores`` before masking.
        sinks: optional float ``(n_heads,)`` learned sink logits (4-D inputs): :func:`sink_softmax`.

    Returns:
        ``(output (..., T_q, head_dim_v), weights (..., T_q, T_k))``, the weights after
        dropout (with ``sinks``, without the sink's column: a row sums to less than 1). A query with
        nothing to attend to gets zero weights and a zero output, never NaN (with ``sinks``: the sink
        takes all its weight).

    Raises:
        TypeError / ValueError: see :func:`check_attention_inputs`; a ``score_mod`` result that is not a floating
            point tensor of the scores' shape (:func:`~attnlib.attention.masks.modified_scores`).
    """
    check_attention_inputs(q, k, v, mask, is_causal, scale, dropout_p, score_mod, sinks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    T_q, T_k = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1] if q.dim() == 4 else 1
    if group > 1:  # fold each group of query heads into the query axis: K/V heads are read as they are
        B, H = q.shape[:2]
        q = q.reshape(B, k.shape[1], group * T_q, q.shape[-1])  # (B, H, T_q, d) -> (B, n_kv, group*T_q, d)
    # float16 scores overflow past 65504 where SDPA's kernels, which accumulate in float32, stay finite:
    # float16 scores and softmax are computed in float32 (no-op casts for every other dtype).
    work = torch.float32 if q.dtype == torch.float16 else q.dtype
    scores = (q.to(work) * scale) @ k.to(work).transpose(-2, -1)  # (..., T_q, d) @ (..., d, T_k) -> (..., T_q, T_k)
    if group > 1:
        scores = scores.view(B, H, T_q, T_k)  # back to one row block per query head (a view)
    full = combined_mask(mask, is_causal, T_q, T_k, scores.device)
    if score_mod is not None:
        scores = modified_scores(score_mod, scores, *score_indices(scores.shape, scores.device))
        # A score_mod may hide keys too (-inf): a row it leaves empty gets zeros, as one a mask empties.
        seen = scores != float("-inf")
        full = seen if full is None else full & seen
    if sinks is not None:
        weights = sink_softmax(scores, full, sinks)
    elif score_mod is not None:
        weights = masked_softmax(scores, full)
    elif full is None:
        weights = torch.softmax(scores, dim=-1)
    elif mask is None:  # causal only: no row is empty; fill the fresh scores in place
        future = future_mask(T_q, T_k, scores.device)
        # In place on the fresh product (matmul's backward does not need it).
        weights = torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1)
    else:
        weights = masked_softmax(scores, full)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    weights = weights.to(v.dtype)
    if group > 1:
        out = weights.view(B, k.shape[1], group * T_q, T_k) @ v  # (B, n_kv, g*T_q, T_k) @ (B, n_kv, T_k, d_v)
        return out.view(B, H, T_q, v.shape[-1]), weights
    return weights @ v, weights  # (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)


def sdpa_attention(
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
) -> tuple[torch.Tensor, None]:
    """:func:`attention` through ``F.scaled_dot_product_attention`` (the ``"sdpa"`` function); no weights.

    Same arguments, checks and results as :func:`attention` (grouped K/V heads through
    SDPA's ``enable_gqa``; rows with nothing to attend to give zeros, not NaN). SDPA's
    fused ``is_causal`` is used where it is right (``T_q == T_k`` without another mask), no mask
    where causality hides nothing (one query, a decode step, sees every key); otherwise the
    bottom-right causal mask is passed explicitly.

    Raises:
        TypeError / ValueError: see :func:`check_attention_inputs`; a ``score_mod``
            (SDPA cannot modify scores: use the ``"eager"`` or ``"tiled"`` function); ``sinks`` (SDPA's
            softmax has no extra term in its denominator: use ``"eager"``, ``"tiled"`` or ``"flash"``).
    """
    check_attention_inputs(q, k, v, mask, is_causal, scale, dropout_p, score_mod, sinks)
    if score_mod is not None:
        raise ValueError("sdpa_attention cannot apply a score_mod; use attn_fn='eager' or 'tiled'")
    if sinks is not None:
        raise ValueError("sdpa_attention cannot add sinks to its softmax's denominator; use attn_fn='eager', "
                         "'tiled' or 'flash'")
    T_q, T_k = q.shape[-2], k.shape[-2]
    gqa = q.dim() == 4 and q.shape[1] != k.shape[1]
    kwargs = dict(dropout_p=dropout_p, scale=scale, enable_gqa=gqa) if gqa else dict(dropout_p=dropout_p, scale=scale)
    if mask is None and (not is_causal or T_q == T_k or T_q == 1):  # one query (a decode step) sees every key
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal and T_q == T_k, **kwargs), None
    full = combined_mask(mask, is_causal, T_q, T_k, q.device)
    empty = ~full.any(dim=-1, keepdim=True)  # rows with nothing to attend to (only a caller's mask makes them)
    if mask is not None and (empty.device.type == "meta" or empty.any()):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=full | empty, **kwargs)  # no all-masked row
        return out.masked_fill(empty, 0.0), None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=full, **kwargs), None
