"""Masks and the masked softmax: what attention may see (chapter 03).

Convention: a boolean mask, ``True`` = may attend (PyTorch SDPA's). Causal masks are
aligned bottom-right: query ``i`` sits at absolute position ``T_k - T_q + i``. A padding
mask is ``transformers``' ``attention_mask``: ``(B, T_k)``, ``True`` (1) = a real token, the
opposite of ``nn.MultiheadAttention``'s ``key_padding_mask`` (:func:`padding_mask`,
:func:`check_attention_mask`, :func:`mask_positions`; chapters 03 and 19). Mask functions
follow FlexAttention: ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable
from functools import lru_cache

import torch

__all__ = [
    "causal_mask",
    "check_attention_mask",
    "combined_mask",
    "future_mask",
    "mask_from_mod",
    "mask_positions",
    "masked_softmax",
    "padding_mask",
    "score_indices",
]


def _check_length(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")


@lru_cache(maxsize=16)
def future_mask(T_q: int, T_k: int, device: torch.device) -> torch.Tensor:
    """``(T_q, T_k)`` bool, ``True`` where the key lies after the query (bottom-right); cached, never written."""
    return torch.ones(T_q, T_k, dtype=torch.bool, device=device).triu(diagonal=T_k - T_q + 1)


def causal_mask(T_q: int, T_k: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean causal mask ``(T_q, T_k)``, aligned to the bottom-right corner; ``True`` = may attend.

    Query ``i`` sits at absolute position ``T_k - T_q + i`` and may attend to every key at
    or before it. With ``T_q == T_k`` this is the lower triangle; with ``T_q < T_k``
    (decoding with a KV cache) a top-left triangle would hide keys. Chapter 03.

    Raises:
        ValueError: a length that is not an integer >= 0, or ``T_q > T_k``.
    """
    T_k = T_q if T_k is None else T_k
    _check_length("T_q", T_q)
    _check_length("T_k", T_k)
    if T_q > T_k:
        raise ValueError(f"T_q={T_q} > T_k={T_k}: a bottom-right causal mask needs at least as many keys as queries")
    return torch.ones(T_q, T_k, dtype=torch.bool, device=device).tril(diagonal=T_k - T_q)


def padding_mask(lengths: torch.Tensor | list[int], T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Key padding mask ``(B, T)`` from sequence lengths: ``True`` where key ``j < lengths[b]`` is a real token.

    ``nn.MultiheadAttention``'s ``key_padding_mask`` uses the opposite convention (``True`` =
    ignore): pass ``~padding_mask(...)`` there. For scores ``(B, n_heads, T_q, T)`` use
    ``padding_mask(...)[:, None, None, :]``; for single-head scores ``(B, T_q, T)``,
    ``[:, None, :]``. Chapter 03.

    Raises:
        TypeError: ``lengths`` not integer.
        ValueError: ``T < 0``, ``lengths`` not 1-D, or a length outside ``[0, T]``.
    """
    _check_length("T", T)
    if not isinstance(lengths, torch.Tensor):
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (list, tuple)):
            raise TypeError(f"lengths must be a 1-D integer tensor or a list of ints; got {type(lengths).__name__}")
        bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, numbers.Integral)]
        if bad:
            raise TypeError(f"lengths must be integers; got {bad[0]!r} in {lengths!r}")
        lengths = torch.tensor([int(n) for n in lengths], dtype=torch.long)  # [] -> an empty batch, not float
    lengths = lengths.to(device) if device is not None else lengths
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be integers; got dtype {lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D of shape (B,); got shape {tuple(lengths.shape)}")
    if ((lengths < 0) | (lengths > T)).any():
        raise ValueError(f"every length must be in [0, T={T}]; got {lengths.tolist()}")
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]  # (1, T) < (B, 1) -> (B, T)


def score_indices(shape: torch.Size, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Broadcastable ``b, h, q_idx, kv_idx`` index tensors for scores of ``shape`` (``q_idx`` absolute).

    What a FlexAttention-style ``score_mod`` / ``mask_mod`` receives, vectorised: ``b`` and ``h`` index
    the batch and head dims, ``q_idx`` counts from ``T_k - T_q`` (a query's absolute position when the
    keys include a cache), ``kv_idx`` from 0.
    """
    T_q, T_k = shape[-2], shape[-1]
    n = len(shape)
    lead = [torch.arange(s, device=device).view(*([1] * i), s, *([1] * (n - 1 - i))) for i, s in enumerate(shape[:-2])]
    q_idx = torch.arange(T_k - T_q, T_k, device=device).view(*([1] * (n - 2)), T_q, 1)
    kv_idx = torch.arange(T_k, device=device).view(*([1] * (n - 1)), T_k)
    b = lead[0] if n >= 3 else torch.zeros((), dtype=torch.long, device=device)
    h = lead[1] if n >= 4 else torch.zeros((), dtype=torch.long, device=device)
    return b, h, q_idx, kv_idx


def modified_scores(score_mod, scores: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    """``score_mod(scores, b, h, q_idx, kv_idx)``, checked: a floating point tensor of the scores' shape.

    A result of another floating dtype is cast back to the scores' dtype; one that only broadcasts to
    the scores (a row or a column of them) is refused rather than spread over every query or key.

    Raises:
        TypeError: the result is not a tensor, or not floating point.
        ValueError: the result's shape is not the scores'.
    """
    out = score_mod(scores, b, h, q_idx, kv_idx)
    expected = f"a floating point tensor of the scores' shape {tuple(scores.shape)}"
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"score_mod must return {expected}; got {type(out).__name__}")
    if not out.is_floating_point():
        raise TypeError(f"score_mod must return {expected}; got dtype {out.dtype}")
    if out.shape != scores.shape:
        raise ValueError(f"score_mod must return {expected}; got shape {tuple(out.shape)}")
    return out.to(scores.dtype)


def mask_from_mod(mask_mod: Callable[..., torch.Tensor], shape: tuple[int, ...], device=None) -> torch.Tensor:
    """A boolean mask of ``shape`` ``(B, n_heads, T_q, T_k)`` from a FlexAttention mask function.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` may see key
    ``kv_idx``; it is called once on broadcastable index tensors (``q_idx`` counts from
    ``T_k - T_q``, as a cached decode does), like ``torch.nn.attention.flex_attention.create_mask``.
    Example: the causal mask is ``mask_from_mod(lambda b, h, q, kv: q >= kv, (1, 1, T, T))``.

    Raises:
        TypeError: ``mask_mod`` not callable or not returning a boolean tensor.
        ValueError: ``shape`` not four non-negative integers with ``T_q <= T_k``; a result that does not
            broadcast to ``shape``.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool; got {mask_mod!r}")
    if len(shape) != 4:
        raise ValueError(f"shape must be (B, n_heads, T_q, T_k); got {shape!r}")
    for name, s in zip(("B", "n_heads", "T_q", "T_k"), shape):
        _check_length(name, s)
    if shape[2] > shape[3]:
        raise ValueError(f"T_q={shape[2]} > T_k={shape[3]} in shape {shape!r}")
    out = mask_mod(*score_indices(torch.Size(shape), torch.device(device or "cpu")))
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a boolean tensor; got {getattr(out, 'dtype', type(out).__name__)}")
    if out.dim() > 4 or any(o not in (1, s) for o, s in zip(out.shape[::-1], shape[::-1])):
        raise ValueError(f"mask_mod returned shape {tuple(out.shape)}, which does not broadcast to the mask's "
                         f"{tuple(shape)} (B, n_heads, T_q, T_k): compute it from the index tensors it is given")
    return out.expand(shape)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax`` over the last dim with masked entries (``mask`` False) exactly 0 and empty rows all 0.

    A row whose every key is masked has nothing to attend to: ``softmax`` of all ``-inf``
    would be NaN; here it is zeros (and so is its gradient). Chapter 03.

    Args:
        scores: float ``(..., T_q, T_k)``.
        mask: optional bool broadcastable to ``scores``, ``True`` = keep.
    """
    if mask is None:
        return torch.softmax(scores, dim=-1)
    logits = scores.masked_fill(~mask, float("-inf"))
    empty = ~mask.any(dim=-1, keepdim=True)  # (..., T_q, 1): rows with nothing to attend to
    if empty.device.type != "meta" and not empty.any():  # the short path needs the data (meta has none)
        return torch.softmax(logits, dim=-1)
    # softmax(all -inf) would be NaN: give empty rows finite logits (any value), then zero every masked
    # weight, so that neither the forward nor the backward pass meets a NaN.
    return torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(~mask, 0.0)


def combined_mask(mask: torch.Tensor | None, is_causal: bool, T_q: int, T_k: int, device) -> torch.Tensor | None:
    """The caller's bool ``mask`` ``&`` the bottom-right causal mask when ``is_causal``; ``None`` if neither."""
    if not is_causal:
        return mask
    causal = ~future_mask(T_q, T_k, torch.device(device))
    return causal if mask is None else mask & causal


def check_attention_mask(attention_mask: object, shape: tuple[int, int], device: torch.device | None = None,
                         *, left_padded: bool = False) -> torch.Tensor:
    """Check a padding mask and return it.

    Args:
        attention_mask: ``(B, T)`` bool, ``True`` = a real token.
        shape: the ``(B, T)`` it must have (the tokens it describes, cached ones included).
        device: the device it must be on (the tokens'), or ``None``.
        left_padded: also require left padding: no padding after a real token in any row.

    Returns:
        ``attention_mask`` unchanged.

    Raises:
        TypeError: not a bool tensor (``transformers`` uses 0/1 integers: convert with ``.bool()``).
        ValueError: another shape or device; a row with no real token (named: it would have nothing to
            attend to and no last token to continue); with ``left_padded``, padding after a real token.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise TypeError("attention_mask must be a bool tensor (B, T), True = a real token; got "
                        f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)} (use mask.bool())")
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have shape (B, T) = {tuple(shape)}; got {tuple(attention_mask.shape)}")
    if device is not None and attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device} but the tokens are on {device}")
    if attention_mask.device.type == "meta":  # shapes only: no values to check
        return attention_mask
    empty = (~attention_mask.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask row {empty[0]} is all padding (rows {empty} hold no real token); "
                         "every prompt needs at least one real token")
    if left_padded:
        late = (attention_mask[:, 1:] < attention_mask[:, :-1]).any(dim=-1).nonzero().flatten().tolist()
        if late:
            raise ValueError(f"attention_mask row {late[0]} has padding after a real token; prompts must be "
                             "left-padded (the last column of every row a real token)")
    return attention_mask


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token: ``(B, T)`` bool → ``(B, T)`` int64.

    Real tokens get ``0, 1, …`` in order; a pad gets the position of the last real token before it
    (0 before the first): it is never attended to, so any position in range does.

    Raises:
        TypeError: not a bool tensor. ValueError: not 2-D ``(B, T)``.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise TypeError("attention_mask must be a bool tensor (B, T), True = a real token; got "
                        f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)} (use mask.bool())")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape (B, T); got {tuple(attention_mask.shape)}")
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
