"""What an attention layer checks before any kernel runs, and the mask it then attends with.

Shared by every layer built on :class:`~attnlib.attention.multi_head.MultiHeadAttention`:
:func:`check_layer_inputs` refuses bad arguments with the argument and value named;
:func:`visible_mask` combines the caller's ``mask`` and ``attention_mask`` with the layer's rule
(a sliding window, a chunk) and a cache's own rule (a sink cache's window), evaluated at the
positions of the keys the cache returned. Chapters 03, 08, 17, 19.
"""
from __future__ import annotations

import torch

from attnlib.attention.masks import mask_positions

__all__ = ["check_layer_inputs", "check_positions", "visible_mask"]


def check_positions(positions: object, x: torch.Tensor) -> None:
    """Raise unless ``positions`` is a ``(B, T)`` integer tensor on ``x``'s device, every entry >= 0."""
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor (B, T); got {getattr(positions, 'dtype', type(positions).__name__)}")
    if tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(f"positions must have shape (B, T) = {tuple(x.shape[:2])}; got {tuple(positions.shape)}")
    if positions.device != x.device:
        raise ValueError(f"positions is on {positions.device} but x is on {x.device}")
    if positions.numel() and positions.device.type != "meta" and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0; got a minimum of {int(positions.min())}")


def _check_floats(layer, x, context) -> None:
    weight = layer.out_proj.weight
    for name, t in (("x", x), ("context", context)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, T, d_model); got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor; got dtype {t.dtype}")
        if t.dim() != 3 or t.shape[-1] != layer.d_model:
            raise ValueError(f"{name} must have shape (B, T, d_model={layer.d_model}); got {tuple(t.shape)}")
        if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
            raise TypeError(f"{name} is {t.dtype} but the module's weights are {weight.dtype}; convert one of them")
        if t.device != weight.device and weight.device.type != "meta":
            raise ValueError(f"{name} is on {t.device} but the module's weights are on {weight.device}")


def check_layer_inputs(layer, x, context, mask, attention_mask, cache, positions) -> int:
    """Validate every argument of an attention layer's ``forward``; return ``T_k``, the keys' length.

    ``T_k`` counts every position the keys cover: the context's, or the cached positions plus the new
    ones. ``mask`` must broadcast to ``(B, n_heads, T_q, T_k)`` and ``attention_mask`` be ``(B, T_k)``:
    both describe the whole sequence, also when a cache returns only some of its keys.
    """
    _check_floats(layer, x, context)
    B, T_q = x.shape[0], x.shape[1]
    if context is not None:
        if layer.causal:
            raise ValueError("a causal layer attends over its own sequence; build it with causal=False for a context")
        if cache is not None:
            raise ValueError("cache is for self-attention; a context's keys and values are not cached here")
        if context.shape[0] != B:
            raise ValueError(f"x and context must have the same batch size; got {tuple(x.shape)} and {tuple(context.shape)}")
        if layer.rope is not None:
            raise ValueError("a layer with RoPE rotates positions of one sequence; it takes no context "
                             "(build the cross-attention layer without rope)")
        if context.shape[1] == 0 and T_q:
            raise ValueError(f"context holds no positions; got shape {tuple(context.shape)}")
    if cache is not None:
        if not callable(getattr(cache, "update", None)) or not hasattr(cache, "check_layer"):
            raise TypeError(f"cache must be a layer cache (attnlib.cache.LayerCache, ...); got {type(cache).__name__}")
        cache.check_layer(layer, masked=mask is not None or attention_mask is not None)
    past = 0 if cache is None else cache.length
    if layer.block_size is not None and past + T_q > layer.block_size and not getattr(cache, "renumbers", False):
        raise ValueError(f"sequence length T={past + T_q} (cached {past} + new {T_q}) exceeds block_size={layer.block_size}")
    T_k = context.shape[1] if context is not None else past + T_q
    if T_k == 0:
        raise ValueError(f"x holds no positions and nothing is cached; got shape {tuple(x.shape)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor (True = may attend); got {getattr(mask, 'dtype', type(mask).__name__)}")
        target = (B, layer.n_heads, T_q, T_k)
        if mask.dim() != 4 or any(m not in (1, s) for m, s in zip(mask.shape, target)):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} must be 4-D and broadcast to (B, n_heads, T_q, T_k) = {target} "
                f"with each dim 1 or equal (a padding mask goes in attention_mask=(B, T_k))"
            )
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
        if mask.shape[1] != 1 and not layer.per_head_masks:
            raise ValueError(f"{type(layer).__name__} mixes heads and cannot honour a per-head mask; got {tuple(mask.shape)}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            raise TypeError(
                "attention_mask must be a boolean tensor, True = a real token (transformers' convention; "
                "nn.MultiheadAttention's key_padding_mask is the opposite); got "
                f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}"
            )
        if attention_mask.device != x.device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but x is on {x.device}")
        if tuple(attention_mask.shape) != (B, T_k):
            raise ValueError(f"attention_mask must have shape (B, T_k) = {(B, T_k)}; got {tuple(attention_mask.shape)}")
    if positions is not None:
        check_positions(positions, x)
    return T_k


def _and(mask: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if mask is None else mask & other


def visible_mask(layer, mask, attention_mask, cache, T_q: int, T_total: int, device) -> torch.Tensor | None:
    """The bool mask ``(B|1, n_heads|1, T_q, T_k)`` the layer attends with (``None``: causality alone).

    ``mask`` and ``attention_mask`` cover the whole sequence, ``T_total`` positions; a cache may return
    only some of them (``cache.key_positions``), whose columns are taken. The layer's ``mask_mod``
    (window, chunk) and the cache's own are evaluated at the keys' positions (each row's own, counted
    from its first real token, when there is an ``attention_mask``), the queries being the last ``T_q``
    keys.
    """
    rules = [rule for rule in (layer.mask_mod, getattr(cache, "mask_mod", None)) if rule is not None]
    if mask is None and attention_mask is None and not rules:
        return None
    positions = None
    if rules:  # (B, T_total) per row, or (T_total,) for every row
        positions = mask_positions(attention_mask) if attention_mask is not None else torch.arange(T_total, device=device)
    kept = None if cache is None else cache.key_positions
    if kept is not None and kept.numel() != T_total:  # the cache kept only these positions
        columns = kept.to(device)
        mask = mask.index_select(-1, columns) if mask is not None and mask.shape[-1] != 1 else mask
        attention_mask = None if attention_mask is None else attention_mask.index_select(1, columns)
        positions = None if positions is None else positions.index_select(-1, columns)
    if attention_mask is not None:
        mask = _and(mask, attention_mask[:, None, None, :])  # (B, T_k) -> (B, 1, 1, T_k): every head, every query
    for rule in rules:
        seen = rule(None, None, positions[..., -T_q:, None], positions[..., None, :])  # (B?, T_q, T_k)
        mask = _and(mask, seen[None, None] if seen.dim() == 2 else seen[:, None])
    return mask
