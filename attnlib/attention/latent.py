"""Multi-head latent attention (MLA), DeepSeek-V2 §2.1 (DeepSeek-AI 2024). Chapter 07.

Keys and values are decoded from one shared latent ``c_t = W^DKV x_t`` of width
``d_c = kv_latent_dim``: ``k_t = W^UK c_t``, ``v_t = W^UV c_t`` (eqs. 9–11). Only ``c_t``
needs caching: ``d_c`` numbers per token and layer, against ``2 · n_heads · head_dim``
for multi-head attention.

Absorption (§2.1.2): for head ``h``, ``q_h · k_h = q_h · (W^UK_h c) = (W^UK_hᵀ q_h) · c``,
so ``W^UK`` can be folded into the query side and attention computed against the
latents themselves; likewise ``W^UV`` folds into the output projection. Then keys and
values are never materialised. This only works because nothing position-dependent
sits between ``W^UK`` and ``c``: with RoPE on the keys, ``k_t = R_t W^UK c_t`` and the
rotation ``R_t`` (different for every position) blocks the fold. DeepSeek-V2
therefore keeps RoPE on a separate, small, shared key part (decoupled RoPE, §2.1.3);
this model uses learned absolute positions and needs none.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib.attention.multi_head import AttentionBase
from attnlib.config import GPTConfig
from attnlib.functional import attention

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(AttentionBase):
    """Causal multi-head latent attention (registry name ``"mla"``).

    Args:
        config: uses ``d_model, n_heads, kv_latent_dim, block_size, dropout, bias``.
        absorb: compute attention against the latents with ``W^UK`` / ``W^UV`` folded
            into the query and output sides (equal to the naive path; the inference form).

    Attributes:
        q_proj: ``nn.Linear(d_model, d_model)``: queries, ``W^Q``.
        kv_down: ``nn.Linear(d_model, d_c, bias=False)``: the latent, ``W^DKV``.
        k_up, v_up: ``nn.Linear(d_c, d_model, bias=False)``: ``W^UK``, ``W^UV``.
        out_proj: ``nn.Linear(d_model, d_model)``: ``W^O``.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, d_model)``; the latent is ``(B, T, d_c)``.
    """

    def __init__(self, config: GPTConfig, absorb: bool = False) -> None:
        super().__init__(config.d_model, config.n_heads, config.block_size, config.dropout, config.bias, causal=True)
        self.kv_latent_dim = config.kv_latent_dim
        self.absorb = absorb
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.kv_down = nn.Linear(config.d_model, config.kv_latent_dim, bias=False)
        self.k_up = nn.Linear(config.kv_latent_dim, config.d_model, bias=False)
        self.v_up = nn.Linear(config.kv_latent_dim, config.d_model, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The cached quantity ``c = W^DKV x``: ``(B, T, d_model)`` → ``(B, T, d_c)``."""
        return self.kv_down(x)

    def project(self, x: torch.Tensor, cache=None):
        q = self.split_heads(self.q_proj(x))  # (B, n_heads, T, head_dim)
        c = self.latent(x)  # (B, T, d_c)
        if cache is not None:
            (c,) = cache.update(c=c)  # only the latent: d_c numbers per token
        if not self.absorb:
            return q, self.split_heads(self.k_up(c)), self.split_heads(self.v_up(c))  # decode K and V per head
        w_uk = self.k_up.weight.view(self.n_heads, self.head_dim, self.kv_latent_dim)  # (n_heads, hd, d_c)
        q_latent = torch.einsum("bhtd,hdc->bhtc", q, w_uk)  # W^UK_h^T q_h: (B, n_heads, T, d_c)
        c = c.unsqueeze(1)  # (B, 1, T, d_c): one latent shared by all heads, as keys and as values
        return q_latent, c, c

    def attend(self, q, k, v, mask, need_weights):
        if not self.absorb:
            return super().attend(q, k, v, mask, need_weights)
        full = self.full_mask(mask, q.shape[-2], k.shape[-2], q.device)
        dropout_p = self.dropout if self.training else 0.0
        # Scores are q_h . k_h, which live in head_dim: the scale stays 1/sqrt(head_dim), not 1/sqrt(d_c).
        return attention(q, k, v, mask=full, dropout_p=dropout_p, scale=1.0 / math.sqrt(self.head_dim))

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        if not self.absorb:
            return super().merge(y)
        # y: (B, n_heads, T, d_c), weighted latents. W^O_h W^UV_h maps them straight to the output.
        w_uv = self.v_up.weight.view(self.n_heads, self.head_dim, self.kv_latent_dim)  # (n_heads, hd, d_c)
        w_o = self.out_proj.weight.view(self.d_model, self.n_heads, self.head_dim)  # (d_model, n_heads, hd)
        w_absorbed = torch.einsum("hdc,mhd->hcm", w_uv, w_o)  # (n_heads, d_c, d_model)
        out = torch.einsum("bhtc,hcm->btm", y, w_absorbed)  # (B, T, d_model)
        return out if self.out_proj.bias is None else out + self.out_proj.bias

    @staticmethod
    def kv_cache_size(config: GPTConfig) -> int:
        """Numbers cached per token per layer: the latent, ``d_c = kv_latent_dim`` (DeepSeek-V2 Table 1, without RoPE's ``d_h^R``)."""
        return config.kv_latent_dim
