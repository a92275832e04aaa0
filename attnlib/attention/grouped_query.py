"""Grouped-query attention (GQA) and its extreme, multi-query attention (MQA).

``n_heads`` query heads share ``n_kv_heads`` key/value heads: query head ``i`` reads
key/value head ``i // (n_heads // n_kv_heads)``. ``n_kv_heads == n_heads`` is
multi-head attention; ``n_kv_heads == 1`` is MQA (Shazeer 2019). The KV cache
shrinks by ``n_heads / n_kv_heads``. Ainslie et al. 2023; chapter 06.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, positive_int
from attnlib.attention.multi_head import AttentionBase
from attnlib.config import GPTConfig
from attnlib.functional import attention

__all__ = ["KV_SHARING", "GroupedQueryAttention", "MultiQueryAttention"]

#: The three ways to let a group of query heads read one key/value head; they give equal outputs.
KV_SHARING = ("repeat_interleave", "expand", "sdpa")


class GroupedQueryAttention(AttentionBase):
    """Causal attention with ``n_kv_heads`` key/value heads shared by groups of query heads.

    Args:
        config: uses ``d_model, n_heads, n_kv_heads, block_size, dropout, bias``.
        kv_sharing: how a group reads its shared head:

            * ``"repeat_interleave"``: copy each K/V head ``n_heads // n_kv_heads`` times
              (``torch.repeat_interleave``), then ordinary attention: simple, but the
              copies cost memory;
            * ``"expand"``: fold each group of query heads into the query axis,
              ``(B, n_kv_heads, group · T, head_dim)``, and attend against the K/V heads as
              they are: no copy of K/V (broadcasting ``k.unsqueeze(2)`` instead would
              look copy-free, but ``matmul`` materialises the broadcast);
            * ``"sdpa"``: ``F.scaled_dot_product_attention(..., enable_gqa=True)``.

    Attributes:
        qkv: ``nn.Linear(d_model, (n_heads + 2 · n_kv_heads) · head_dim)``; rows
            ``[W_q; W_k; W_v]``. With ``n_kv_heads == n_heads`` it is exactly the
            ``qkv`` of :class:`MultiHeadAttention`, so the weights load across.
        out_proj: ``nn.Linear(d_model, d_model)``.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, d_model)``.

    Raises:
        ValueError: ``n_heads`` not divisible by ``n_kv_heads``, or an unknown ``kv_sharing``.
    """

    def __init__(self, config: GPTConfig, kv_sharing: str = "sdpa", n_kv_heads: int | None = None) -> None:
        super().__init__(config.d_model, config.n_heads, config.block_size, config.dropout, config.bias, causal=True)
        n_kv_heads = config.n_kv_heads if n_kv_heads is None else n_kv_heads
        positive_int("n_kv_heads", n_kv_heads)
        divisible("n_heads", config.n_heads, "n_kv_heads", n_kv_heads)
        if kv_sharing not in KV_SHARING:
            raise ValueError(f"kv_sharing={kv_sharing!r} is not one of {KV_SHARING}")
        self.n_kv_heads, self.kv_sharing = n_kv_heads, kv_sharing
        self.group_size = config.n_heads // n_kv_heads
        kv_width = n_kv_heads * self.head_dim
        self.qkv = nn.Linear(config.d_model, config.d_model + 2 * kv_width, bias=config.bias)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def project(self, x: torch.Tensor, cache=None):
        kv_width = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([self.d_model, kv_width, kv_width], dim=-1)
        # q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, T, head_dim)
        q, k, v = self.split_heads(q), self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)
        if cache is not None:
            k, v = cache.update(k=k, v=v)  # only the shared heads: 2 * n_kv_heads * head_dim per token
        return q, k, v

    def attend(self, q, k, v, mask, need_weights):
        if self.kv_sharing == "repeat_interleave":
            k = k.repeat_interleave(self.group_size, dim=1)  # (B, n_kv, T, hd) -> (B, n_heads, T, hd): copies
            v = v.repeat_interleave(self.group_size, dim=1)
            return super().attend(q, k, v, mask, need_weights)
        if self.kv_sharing == "sdpa" and not need_weights:
            dropout_p = self.dropout if self.training else 0.0
            mask, is_causal = self.sdpa_mask(mask, q.shape[-2], k.shape[-2], q.device)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=True
            )
            return y, None
        # "expand" (and weights on request): fold each group of query heads into the query axis, so
        # every K/V head is used as it is. (Broadcasting k.unsqueeze(2) against grouped queries would
        # look copy-free, but matmul materialises the broadcast: chapter 06 measures it.)
        B, _, T_q, hd = q.shape
        T_k = k.shape[-2]
        q = q.reshape(B, self.n_kv_heads, self.group_size * T_q, hd)  # (B, n_heads, T_q, hd) -> (B, n_kv, group*T_q, hd)
        full = self.full_mask(mask, T_q, T_k, q.device)
        if full is not None:
            full = full.reshape((1,) * (4 - full.dim()) + tuple(full.shape))  # as (B|1, n_heads|1, T_q, T_k)
            b, h = full.shape[:2]
            if h > 1:  # one mask per query head: (b, n_heads, T_q, T_k) -> (b, n_kv, group*T_q, T_k)
                full = full.expand(b, self.n_heads, T_q, T_k).reshape(b, self.n_kv_heads, self.group_size * T_q, T_k)
            else:  # the same mask for every head: repeat it over the group's stacked queries (a small bool copy)
                full = full.expand(b, 1, T_q, T_k).repeat(1, 1, self.group_size, 1)
        y, weights = attention(q, k, v, mask=full, dropout_p=self.dropout if self.training else 0.0)
        return y.view(B, self.n_heads, T_q, hd), weights.view(B, self.n_heads, T_q, T_k)

    @staticmethod
    def kv_cache_size(config: GPTConfig) -> int:
        """Numbers cached per token per layer: ``2 · n_kv_heads · head_dim``."""
        return 2 * config.n_kv_heads * config.head_dim


class MultiQueryAttention(GroupedQueryAttention):
    """Multi-query attention (Shazeer 2019): every query head shares one key/value head.

    :class:`GroupedQueryAttention` with ``n_kv_heads = 1`` whatever the config says
    (registry name ``"mqa"``). Chapter 06.
    """

    def __init__(self, config: GPTConfig, kv_sharing: str = "sdpa") -> None:
        super().__init__(config, kv_sharing=kv_sharing, n_kv_heads=1)

    @staticmethod
    def kv_cache_size(config: GPTConfig) -> int:
        """Numbers cached per token per layer: ``2 · head_dim``."""
        return 2 * config.head_dim
