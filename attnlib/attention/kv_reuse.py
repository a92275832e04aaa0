"""Attention that reuses keys and values: Gemma 4's layer (transformers' ``Gemma4TextAttention``). Chapter 20.

:class:`KVReuseAttention` is :class:`~attnlib.attention.multi_head.MultiHeadAttention` with three changes,
each a switch:

* ``k_eq_v``: no value projection; the values are the key projection's output, taken before the key's
  norm and RoPE (``attention_k_eq_v``, on Gemma 4's global layers): the fused projection is ``[W_q; W_k]``;
* ``value_norm``: an RMSNorm without scale over each value head (Gemma 4's ``v_norm``);
* ``kv_source``: the layer computes no keys or values at all (cross-layer KV sharing, Brandon et al. 2024):
  its projection is ``W_q`` alone, and it attends with the keys and values another layer (``kv_source``)
  produced in the same forward pass. Those reach it through its cache, a
  :class:`~attnlib.cache.SharedLayerCache` over the source layer's cache, whose ``update()`` takes nothing
  and returns what the source's last update returned: the decoder links them
  (:meth:`attnlib.cache.KVCache.for_model`; without a cache, :func:`attnlib.cache.forward_caches`).
  Such a layer keeps no cache of its own: its ``cache_width`` is 0.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import non_negative_int
from attnlib.attention.multi_head import MultiHeadAttention

__all__ = ["KVReuseAttention"]


class KVReuseAttention(MultiHeadAttention):
    """Causal self-attention whose values are its keys (``k_eq_v``), normalised (``value_norm``), or another
    layer's keys and values (``kv_source``). Chapter 20.

    Args:
        d_model, n_heads, n_kv_heads, **options: as :class:`~attnlib.attention.multi_head.MultiHeadAttention`
            (causal self-attention only; ``head_dim``, ``rope``, ``qk_norm``, ``scale``, windows, ...).
        k_eq_v: values from the key projection, before the key norm and RoPE.
        value_norm: ``v / sqrt(mean(v²) + norm_eps)`` over each value head, no scale.
        kv_source: None, or the index of the layer whose keys and values this one attends with (it then has
            neither key/value projections nor ``k_norm``, and takes neither ``k_eq_v`` nor ``value_norm``).

    Shapes: ``(B, T, d_model)`` → ``(B, T, d_model)``; queries ``(B, n_heads, T, head_dim)``, keys and values
    ``(B, n_kv_heads, T_k, head_dim)``.

    Raises:
        TypeError / ValueError: as MultiHeadAttention; ``causal=False``; a flag that is not a bool; ``kv_source``
            not an int >= 0 or given with ``k_eq_v`` / ``value_norm``; at the forward pass, a shared layer
            without the cache that brings its source's keys and values, or a cache that renumbers positions.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, k_eq_v: bool = False,
                 value_norm: bool = False, kv_source: int | None = None, **options) -> None:
        for name, value in (("k_eq_v", k_eq_v), ("value_norm", value_norm)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {value!r}")
        if kv_source is not None:
            non_negative_int("kv_source", kv_source)
            if k_eq_v or value_norm:
                raise ValueError(f"kv_source={kv_source}: a shared layer computes no keys or values, so it takes "
                                 f"neither k_eq_v={k_eq_v} nor value_norm={value_norm}")
        if options.get("causal", True) is not True:
            raise ValueError(f"causal={options['causal']!r}: KVReuseAttention is causal self-attention")
        self._switches = (k_eq_v, kv_source)  # read by build_projections, which the parent's constructor calls
        super().__init__(d_model, n_heads, n_kv_heads, **options)
        self.k_eq_v, self.value_norm, self.kv_source = k_eq_v, value_norm, kv_source
        self.value_eps = options.get("norm_eps", 1e-6)
        if kv_source is not None:
            self.k_norm = None  # the source normalised its keys

    def build_projections(self, bias: bool) -> None:
        """The fused projection: ``[W_q; W_k; W_v]``, ``[W_q; W_k]`` (``k_eq_v``) or ``W_q`` (``kv_source``)."""
        k_eq_v, kv_source = self._switches
        kv_heads = 0 if kv_source is not None else self.n_kv_heads * (1 if k_eq_v else 2)
        self.qkv = nn.Linear(self.d_model, (self.n_heads + kv_heads) * self.head_dim, bias=bias)

    @property
    def cache_width(self) -> int:
        """Numbers cached per token: none for a shared layer, else a key and a value per key/value head."""
        return 0 if self.kv_source is not None else 2 * self.n_kv_heads * self.head_dim

    def new_cache(self, block_size: int, windows: bool = True):
        """The cache of a layer with its own keys and values (a shared layer's is linked by the model's cache)."""
        if self.kv_source is not None:
            raise ValueError(f"this layer reads layer {self.kv_source}'s keys and values: it has no cache of its "
                             "own (KVCache.for_model links it to its source's)")
        return super().new_cache(block_size, windows)

    def _rotate(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return t if self.rope is None else self.rope.rotate(t, positions)

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None, cache=None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, n_heads, T, head_dim)``; keys and values ``(B, n_kv_heads, T_k, head_dim)``: this layer's
        (QK-norm, value norm, then RoPE at ``positions`` or ``cache.length, …``, then the cache), or its
        source's, as its cache returns them."""
        if cache is not None and cache.renumbers:
            raise ValueError("KVReuseAttention does not take a cache that renumbers positions (a sink cache)")
        B, T, _ = x.shape
        if positions is None:
            start = 0 if cache is None else cache.length
            positions = torch.arange(start, start + T, device=x.device)  # absolute positions of the new tokens
        else:
            positions = positions[:, None, :]  # (B, T) -> (B, 1, T): the same positions in every head
        kv_heads = 0 if self.kv_source is not None else self.n_kv_heads * (1 if self.k_eq_v else 2)
        heads = self.qkv(x).view(B, T, self.n_heads + kv_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, hd)
        q = heads[:, :self.n_heads]
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self._rotate(q, positions)
        if self.kv_source is not None:
            if cache is None:
                raise ValueError(f"this layer attends with layer {self.kv_source}'s keys and values: it needs the "
                                 "cache that brings them (model.new_cache(), or the model's forward pass)")
            k, v = cache.update()  # the source's keys and values of this forward pass, as its cache returned them
            return q, k, v
        k = heads[:, self.n_heads:self.n_heads + self.n_kv_heads]
        v = k if self.k_eq_v else heads[:, self.n_heads + self.n_kv_heads:]  # keys as values: before norm and RoPE
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.value_norm:  # RMSNorm without scale (Gemma 4's v_norm)
            v = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + self.value_eps)
        k = self._rotate(k, positions)
        if cache is not None:
            k, v = cache.update(k, v)  # keys cached rotated
        return q, k, v
