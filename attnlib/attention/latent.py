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

import torch
from torch import nn

from attnlib._checks import positive_int
from attnlib.attention.multi_head import MultiHeadAttention, refuse_options

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(MultiHeadAttention):
    """Multi-head latent attention (registry name ``"mla"``): :class:`MultiHeadAttention` whose
    ``project`` step decodes keys and values from a cached latent.

    Args:
        d_model, n_heads, **options: as :class:`MultiHeadAttention` (``block_size``, ``dropout``, ``bias``,
            ``causal``, ``attn_fn``, ``sliding_window``, ``chunk_size``, ``score_mod``); no RoPE (DeepSeek-V2's
            decoupled RoPE key is not built here), QK-norm, ``n_kv_heads`` or ``head_dim`` (refused, named).
        kv_latent_dim: width ``d_c`` of the latent ``c = W^DKV x``, the only thing cached.
        absorb: compute attention against the latents with ``W^UK`` / ``W^UV`` folded
            into the query and output sides (equal to the naive path; the inference form).

    Attributes:
        q_proj: ``nn.Linear(d_model, d_model)``: queries, ``W^Q``.
        kv_down: ``nn.Linear(d_model, d_c, bias=False)``: the latent, ``W^DKV``.
        k_up, v_up: ``nn.Linear(d_c, d_model, bias=False)``: ``W^UK``, ``W^UV``.
        out_proj: ``nn.Linear(d_model, d_model)``: ``W^O``.
        cache_width: ``d_c`` numbers per token (DeepSeek-V2 Table 1, without RoPE's ``d_h^R``).

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, d_model)``; the latent is ``(B, T, d_c)``.
    """

    def __init__(self, d_model: int, n_heads: int, kv_latent_dim: int, *, absorb: bool = False, **options) -> None:
        positive_int("kv_latent_dim", kv_latent_dim)
        if not isinstance(absorb, bool):
            raise TypeError(f"absorb must be a bool; got {absorb!r}")
        positive_int("d_model", d_model)
        positive_int("n_heads", n_heads)
        refuse_options("MultiHeadLatentAttention", options,
                       {"n_kv_heads": n_heads, "head_dim": d_model // n_heads, "rope": None, "qk_norm": False})
        self.kv_latent_dim, self.absorb = kv_latent_dim, absorb
        super().__init__(d_model, n_heads, **options)

    def build_projections(self, bias: bool) -> None:
        self.q_proj = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.kv_down = nn.Linear(self.d_model, self.kv_latent_dim, bias=False)
        self.k_up = nn.Linear(self.kv_latent_dim, self.d_model, bias=False)
        self.v_up = nn.Linear(self.kv_latent_dim, self.d_model, bias=False)

    @property
    def cache_width(self) -> int:
        """Numbers cached per token: the latent, ``d_c = kv_latent_dim``."""
        return self.kv_latent_dim

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The cached quantity ``c = W^DKV x``: ``(B, T, d_model)`` → ``(B, T, d_c)``."""
        return self.kv_down(x)

    def project(self, x, context=None, cache=None, positions=None):
        source = x if context is None else context
        q = self.split_heads(self.q_proj(x), self.n_heads)  # (B, n_heads, T, head_dim)
        c = self.latent(source)  # (B, T_k, d_c)
        if cache is not None:
            (c,) = cache.update(c)  # only the latent: d_c numbers per token
        if not self.absorb:  # decode K and V per head
            return q, self.split_heads(self.k_up(c), self.n_heads), self.split_heads(self.v_up(c), self.n_heads)
        w_uk = self.k_up.weight.view(self.n_heads, self.head_dim, self.kv_latent_dim)  # (n_heads, hd, d_c)
        q_latent = torch.einsum("bhtd,hdc->bhtc", q, w_uk)  # W^UK_h^T q_h: (B, n_heads, T, d_c)
        c = c.unsqueeze(1)  # (B, 1, T_k, d_c): one latent shared by all heads, as keys and as values
        # The scores q_h . k_h live in head_dim: self.scale stays 1/sqrt(head_dim), not 1/sqrt(d_c).
        return q_latent, c, c

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        if not self.absorb:
            return super().merge(y)
        # y: (B, n_heads, T, d_c), weighted latents. W^O_h W^UV_h maps them straight to the output.
        w_uv = self.v_up.weight.view(self.n_heads, self.head_dim, self.kv_latent_dim)  # (n_heads, hd, d_c)
        w_o = self.out_proj.weight.view(self.d_model, self.n_heads, self.head_dim)  # (d_model, n_heads, hd)
        w_absorbed = torch.einsum("hdc,mhd->hcm", w_uv, w_o)  # (n_heads, d_c, d_model)
        out = torch.einsum("bhtc,hcm->btm", y, w_absorbed)  # (B, T, d_model)
        return out if self.out_proj.bias is None else out + self.out_proj.bias
