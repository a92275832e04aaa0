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
:class:`MultiHeadLatentAttention` uses learned absolute positions and needs none.

:class:`DeepSeekLatentAttention` is the full DeepSeek-V2/V3 layer (chapter 21): a low-rank query
``c^Q = RMSNorm(W^DQ x)``, the normalised latent ``c^KV`` and the decoupled RoPE key ``k^R`` (cached side by
side: ``d_c + d_R`` numbers per token), equal to transformers' ``DeepseekV3Attention``; it is the dense
base of DeepSeek-V3.2's sparse attention (:class:`attnlib.attention.indexer.DSAttention`).
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import finite_number, positive_int
from attnlib.attention.inputs import check_layer_inputs, visible_mask
from attnlib.attention.multi_head import MultiHeadAttention, refuse_options
from attnlib.layers.norms import RMSNorm
from attnlib.positional.rotary import RotaryEmbedding

__all__ = ["DeepSeekLatentAttention", "MultiHeadLatentAttention", "deinterleave"]


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


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(…, d)`` → ``(…, d)``: the even entries, then the odd ones. DeepSeek rotates the interleaved pairs
    ``(x[2i], x[2i+1])``; after this, :class:`~attnlib.positional.RotaryEmbedding`'s half-split rotation turns the
    same pairs by the same angles, in transformers' ``apply_rotary_pos_emb_interleave``'s output layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepSeekLatentAttention(MultiHeadAttention):
    """DeepSeek-V2/V3's MLA with a low-rank query and a decoupled RoPE key (DeepSeek-V2 §2.1.2–2.1.3, eqs. 12–19).

    For each token ``x_t`` (``d_model``), with ``d_c = kv_lora_rank``, ``d_R = qk_rope_head_dim``::

        c^Q_t  = RMSNorm(W^DQ x_t)                          (q_lora_rank)        q_a_proj, q_a_layernorm
        [q^C_{t,i}; q^R_{t,i}] = W^UQ c^Q_t, q^R ← RoPE      per head i          q_b_proj
        [c^KV_t; k^R_t] = W^DKV x_t, c^KV ← RMSNorm, k^R ← RoPE (one shared key)   kv_a_proj_with_mqa
        [k^C_{t,i}; v_{t,i}] = W^UKV c^KV_t                                       kv_b_proj
        o_{t,i} = Σ_s softmax_s([q^C; q^R]·[k^C_s; k^R_s] / √(d_nope + d_R)) v_{s,i},  u_t = W^O [o_{t,1}; …]

    Only ``c^KV`` and ``k^R`` are cached (:attr:`cache_width` ``= d_c + d_R`` numbers per token). RoPE pairs are
    interleaved, as DeepSeek's weights expect (:func:`deinterleave`). Subclasses change two steps:
    :meth:`cached_tensors` (what else is cached per token) and :meth:`select_keys` (a mask on the keys).
    Equal to transformers' ``DeepseekV3Attention`` (``rope_interleave=True``, default RoPE), parameters named
    alike except ``o_proj`` = :attr:`out_proj`. Chapter 21.

    Args:
        d_model, n_heads: width and query heads (as many key/value heads: MLA decodes one per query head).
        q_lora_rank, kv_lora_rank: widths of ``c^Q`` and ``c^KV``.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per head, the widths of ``q^C``/``k^C``, of ``q^R``/``k^R``
            (even) and of ``v``.
        rope_theta: RoPE's base (no scaling; DeepSeek-V3's YaRN is not built).
        **options: :class:`MultiHeadAttention`'s ``block_size``, ``dropout``, ``bias`` (on ``q_a_proj``,
            ``kv_a_proj_with_mqa`` and ``out_proj``, transformers' ``attention_bias``), ``attn_fn``, ``score_mod``;
            ``n_kv_heads``, ``head_dim``, ``rope``, ``qk_norm``, ``scale``, windows and ``causal=False`` are refused.

    Shapes:
        ``x (B, T, d_model)`` → ``(B, T, d_model)``; a layer cache holds ``c^KV (B, T, d_c)`` and ``k^R (B, T, d_R)``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, an odd ``qk_rope_head_dim``, a refused option
            (named); in forward, as :meth:`MultiHeadAttention.forward`, and a ``context`` or a cache that keeps
            only some positions.
    """

    def __init__(self, d_model: int, n_heads: int, *, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, rope_theta: float = 10000.0, **options) -> None:
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("q_lora_rank", q_lora_rank),
                            ("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            positive_int(name, value)
        finite_number("rope_theta", rope_theta, above=1)
        refuse_options("DeepSeekLatentAttention", options,
                       {"n_kv_heads": n_heads, "head_dim": v_head_dim, "rope": None, "qk_norm": False, "scale": None,
                        "sliding_window": None, "chunk_size": None, "causal": True, "temperature": None})
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.kv_latent_dim = kv_lora_rank  # caches that keep per-head keys refuse a layer with this attribute
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim, self.rope_theta = qk_nope_head_dim + qk_rope_head_dim, float(rope_theta)
        super().__init__(d_model, n_heads, head_dim=v_head_dim, scale=self.qk_head_dim ** -0.5, **options)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta)  # on q^R and k^R only

    def build_projections(self, bias: bool) -> None:
        h, d_c, d_R = self.n_heads, self.kv_lora_rank, self.qk_rope_head_dim
        self.q_a_proj = nn.Linear(self.d_model, self.q_lora_rank, bias=bias)  # W^DQ
        self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(self.q_lora_rank, h * self.qk_head_dim, bias=False)  # W^UQ and W^QR
        self.kv_a_proj_with_mqa = nn.Linear(self.d_model, d_c + d_R, bias=bias)  # W^DKV and W^KR
        self.kv_a_layernorm = RMSNorm(d_c, eps=1e-6)
        self.kv_b_proj = nn.Linear(d_c, h * (self.qk_nope_head_dim + self.v_head_dim), bias=False)  # W^UK and W^UV

    @property
    def cache_width(self) -> int:
        """Numbers cached per token: the latent and the RoPE key, ``d_c + d_R`` (DeepSeek-V2 Table 1)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cached_tensors(self, x: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor,
                       positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the cache keeps of the new tokens: ``c^KV (B, T, d_c)`` and ``k^R (B, T, d_R)``."""
        return c, k_rope

    def select_keys(self, x, q_resid, cached, positions, attention_mask, T_k: int) -> torch.Tensor | None:
        """A bool ``(B, T_q, T_k)`` mask of the keys each query may use beyond causality; here ``None`` (all)."""
        return None

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None, positions: torch.Tensor | None = None,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal self-attention of ``x (B, T, d_model)``, arguments as :meth:`MultiHeadAttention.forward`.

        ``positions`` ``(B, T)`` rotate ``q^R``, ``k^R`` (default ``cache.length, …``); the causal mask is aligned
        bottom-right. Returns ``(B, T, d_model)`` (and the weights ``(B, n_heads, T, T_k)`` with ``return_weights``).
        """
        if context is not None:
            raise ValueError(f"{type(self).__name__} is causal self-attention; it takes no context")
        T_k = check_layer_inputs(self, x, None, mask, attention_mask, cache, positions)
        B, T, _ = x.shape
        past = 0 if cache is None else cache.length
        pos = torch.arange(past, past + T, device=x.device) if positions is None else positions  # (T,) or (B, T)
        head_pos = pos if pos.dim() == 1 else pos[:, None, :]  # broadcast over heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # c^Q: (B, T, q_lora_rank)
        q = self.split_heads(self.q_b_proj(q_resid), self.n_heads)  # (B, h, T, d_nope + d_R)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)  # c^KV: (B, T, d_c)
        q_rope = self.rotary.rotate(deinterleave(q_rope), head_pos)  # (B, h, T, d_R)
        k_rope = self.rotary.rotate(deinterleave(k_rope), pos)  # (B, T, d_R): one key shared by the heads
        cached = self.cached_tensors(x, c, k_rope, pos)
        if cache is not None:
            cached = cache.update(*cached)  # the past and the new, (B, T_k, width) each
            if cache.key_positions.numel() != T_k:
                raise ValueError(f"{type(self).__name__} needs a cache that keeps every position; "
                                 f"{type(cache).__name__} returned {cache.key_positions.numel()} of {T_k}")
        c, k_rope = cached[:2]
        kv = self.split_heads(self.kv_b_proj(c), self.n_heads)  # (B, T_k, h·(d_nope + d_v)) -> (B, h, T_k, ...)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, self.n_heads, -1, -1)], dim=-1)  # (B, h, T_k, d_qk)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, h, T, d_nope + d_R)
        visible = visible_mask(self, mask, attention_mask, cache, T, T_k, x.device)  # (B|1, h|1, T, T_k) or None
        keep = self.select_keys(x, q_resid, cached, pos, attention_mask, T_k)  # (B, T, T_k) or None
        if keep is not None:
            visible = keep[:, None] if visible is None else visible & keep[:, None]
        y, weights = self.attend(q, k, v, visible, True, return_weights)  # (B, h, T, d_v)
        y = self.resid_dropout(self.merge(y))
        return (y, weights) if return_weights else y
