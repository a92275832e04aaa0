"""DeepSeek Sparse Attention (DSA): the lightning indexer choosing the keys of MLA. Chapter 21.

DeepSeek-V3.2-Exp (DeepSeek-AI 2025, §2.1) keeps DeepSeek-V3's multi-head latent attention and puts a
small scorer in front of it, the *lightning indexer*. For a query token ``t`` and every token ``s``::

    I_{t,s} = Σ_{j=1}^{H_I} w_{t,j} · ReLU(q^I_{t,j} · k^I_s)                                  (eq. 1)

with ``H_I`` indexer heads of width ``d_I``: queries ``q^I_{t,j}`` and weights ``w_{t,j}`` from the query
token, one key ``k^I_s`` per token shared by the heads. The attention then uses only each query's ``top_k``
keys of highest index score (``k = 2048`` in the paper, eq. 2)::

    u_t = Attn(h_t, {c_s : I_{t,s} ∈ Top-k(I_{t,:})}),   s <= t (causal)

:func:`lightning_index` is eq. 1, :func:`causal_topk_mask` the selection (never a future key; a query with
fewer than ``k`` past keys keeps them all), :class:`DSAIndexer` the module (the indexer's own projections, its
LayerNorm on keys and its RoPE) and :class:`DSAttention` MLA (:class:`~attnlib.attention.latent.DeepSeekLatentAttention`)
restricted to the chosen keys. As in transformers' ``deepseek_v32``, the reference these equal:

* ``q^I = W^IQ c^Q_t`` from MLA's normalised query latent ``c^Q``; ``k^I = LayerNorm(W^IK h_s)``; RoPE
  (half-split, not interleaved as MLA's) on their first ``d_R = qk_rope_head_dim`` numbers;
* ``w_t = W^w h_t / √H_I``, and the dot products scaled by ``1/√d_I`` inside the ReLU;
* DeepSeek's Hadamard rotation of ``q^I``, ``k^I`` (orthogonal: dot products unchanged) and its FP8 scoring
  (a precision choice) are left out; scores are computed in float32 at least.

Cost: the indexer still scores every pair (``T²/2 · H_I · d_I`` multiply-adds, cheap and FP8 in DeepSeek's
kernels), the attention only ``T · k`` pairs. Memory: the cache keeps ``k^I`` (``d_I`` numbers per token) beside
MLA's latent and RoPE key (``d_c + d_R``): 704 against 576 numbers for V3.2's sizes (:func:`dsa_cache_bytes`).
No gradient reaches the indexer through the top-k: DeepSeek trains it to match the dense attention's
distribution (a KL loss, §2.1.1), which is not built here.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import non_negative_int, positive_int
from attnlib.attention.latent import DeepSeekLatentAttention
from attnlib.attention.sparse import topk_mask
from attnlib.positional.rotary import RotaryEmbedding

__all__ = ["DSAIndexer", "DSAttention", "causal_topk_mask", "dsa_cache_bytes", "lightning_index"]


def _float(name: str, t: object, dim: int, what: str) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor {what}; got {getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have shape {what}; got {tuple(t.shape)}")


def lightning_index(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor,
                    scale: float = 1.0) -> torch.Tensor:
    """The index scores ``I_{t,s} = Σ_j w_{t,j} · ReLU(scale · q_{t,j} · k_s)`` (DeepSeek-V3.2-Exp eq. 1).

    Args:
        q_idx: ``(B, T_q, H_I, d_I)`` the indexer's queries, one per head.
        k_idx: ``(B, T_k, d_I)`` its keys, one per token, shared by the heads.
        weights: ``(B, T_q, H_I)`` each query's weight on each head (may be negative).
        scale: on the dot products, inside the ReLU (transformers: ``1/√d_I``).

    Returns:
        ``(B, T_q, T_k)`` scores in ``q_idx``'s dtype (no causal mask: :func:`causal_topk_mask` applies it).

    Raises:
        TypeError: an input that is not a float tensor. ValueError: shapes that do not fit (named).
    """
    _float("q_idx", q_idx, 4, "(B, T_q, H_I, d_I)")
    _float("k_idx", k_idx, 3, "(B, T_k, d_I)")
    _float("weights", weights, 3, "(B, T_q, H_I)")
    B, T_q, H, d = q_idx.shape
    if k_idx.shape[0] != B or k_idx.shape[-1] != d:
        raise ValueError(f"k_idx must have shape (B={B}, T_k, d_I={d}); got {tuple(k_idx.shape)}")
    if tuple(weights.shape) != (B, T_q, H):
        raise ValueError(f"weights must have shape (B, T_q, H_I) = {(B, T_q, H)}; got {tuple(weights.shape)}")
    dots = (q_idx @ k_idx.unsqueeze(1).transpose(-1, -2)) * scale  # (B, T_q, H, d) @ (B, 1, d, T_k) -> (B, T_q, H, T_k)
    return (weights.unsqueeze(-2) @ dots.relu()).squeeze(-2)  # Σ_j w_{t,j} ReLU(.): (B, T_q, 1, H) @ (..., H, T_k)


def causal_topk_mask(scores: torch.Tensor, top_k: int, offset: int | None = None,
                     allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The keys each query keeps: its ``top_k`` highest-scoring keys at or before its own position.

    Query ``t`` sits at position ``offset + t`` and key ``s`` at ``s``; keys ``s > offset + t`` are never kept,
    and a query with fewer than ``top_k`` visible keys keeps all of them. Ties are broken as ``torch.topk``
    breaks them (as transformers does). The selection itself is :func:`attnlib.attention.sparse.topk_mask`.

    Args:
        scores: ``(..., T_q, T_k)`` float index scores (:func:`lightning_index`).
        top_k: keys per query, >= 1.
        offset: the first query's position; default ``T_k - T_q`` (the queries are the last tokens, as with a
            KV cache).
        allowed: optional bool mask broadcastable to ``scores`` (e.g. padding ``(B, 1, T_k)``), ``True`` = may be
            chosen; combined with causality.

    Returns:
        bool ``(..., T_q, T_k)``, ``True`` = kept: at most ``top_k`` per row, never a future or disallowed key.

    Raises:
        TypeError: ``scores`` not a float tensor, ``top_k`` / ``offset`` not ints, ``allowed`` not bool.
        ValueError: ``top_k < 1``, ``offset < 0``, an ``allowed`` that does not broadcast (named).
    """
    positive_int("top_k", top_k)
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() < 2:
        raise TypeError(f"scores must be a float tensor (..., T_q, T_k); got {getattr(scores, 'shape', type(scores))}")
    T_q, T_k = scores.shape[-2:]
    offset = T_k - T_q if offset is None else offset
    non_negative_int("offset", offset)
    query_pos = offset + torch.arange(T_q, device=scores.device)  # (T_q,)
    causal = torch.arange(T_k, device=scores.device) <= query_pos[:, None]  # (T_q, T_k)
    if allowed is not None:
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise TypeError(f"allowed must be a bool tensor; got {getattr(allowed, 'dtype', type(allowed).__name__)}")
        if allowed.dim() > scores.dim() or any(a not in (1, s) for a, s in zip(allowed.shape[::-1], scores.shape[::-1])):
            raise ValueError(f"allowed {tuple(allowed.shape)} does not broadcast to scores {tuple(scores.shape)}")
        causal = causal & allowed
    return topk_mask(scores, top_k, causal)


class DSAIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (DeepSeek-AI 2025, §2.1): scores every key, keeps each query's top-k.

    Equal to transformers' ``DeepseekV32Indexer`` (parameters named alike). Chapter 21.

    Args:
        d_model: the layer's input width (``h_t``).
        q_lora_rank: width of MLA's query latent ``c^Q`` (the indexer's queries are read from it).
        index_n_heads, index_head_dim: ``H_I`` and ``d_I``.
        qk_rope_head_dim: ``d_R <= d_I`` numbers of ``q^I``, ``k^I`` that RoPE turns (even).
        index_topk: keys kept per query, >= 1.
        rope_theta: RoPE's base.

    Attributes:
        wq_b: ``nn.Linear(q_lora_rank, H_I · d_I)``, ``W^IQ``. wk: ``nn.Linear(d_model, d_I)``, ``W^IK``.
        k_norm: ``nn.LayerNorm(d_I, eps=1e-6)`` on the keys. weights_proj: ``nn.Linear(d_model, H_I)``, ``W^w``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``qk_rope_head_dim`` odd or above
            ``index_head_dim`` (named).
    """

    def __init__(self, d_model: int, q_lora_rank: int, *, index_n_heads: int, index_head_dim: int,
                 qk_rope_head_dim: int, index_topk: int, rope_theta: float = 10000.0) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("q_lora_rank", q_lora_rank), ("index_n_heads", index_n_heads),
                            ("index_head_dim", index_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                            ("index_topk", index_topk)):
            positive_int(name, value)
        if qk_rope_head_dim > index_head_dim:
            raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be <= index_head_dim={index_head_dim}")
        self.d_model, self.n_heads, self.head_dim = d_model, index_n_heads, index_head_dim
        self.qk_rope_head_dim, self.index_topk = qk_rope_head_dim, index_topk
        self.wq_b = nn.Linear(q_lora_rank, index_n_heads * index_head_dim, bias=False)
        self.wk = nn.Linear(d_model, index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(d_model, index_n_heads, bias=False)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE (half-split) on the first ``d_R`` numbers of ``x (…, T, d_I)``; the rest pass unturned."""
        turned, rest = x.split([self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
        return torch.cat([self.rotary.rotate(turned, positions), rest], dim=-1)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``k^I = RoPE(LayerNorm(W^IK x))``: ``x (B, T, d_model)``, positions ``(T,)`` or ``(B, T)`` → ``(B, T, d_I)``."""
        return self.rope(self.k_norm(self.wk(x)), positions)

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Index scores ``(B, T_q, T_k)`` (float32 at least) of the queries ``x (B, T_q, d_model)`` with query latent
        ``q_resid (B, T_q, q_lora_rank)`` at ``positions`` against ``keys (B, T_k, d_I)`` (:meth:`keys`, cached)."""
        B, T, _ = x.shape
        q = self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H_I, T, d_I)
        q = self.rope(q, positions if positions.dim() == 1 else positions[:, None, :]).transpose(1, 2)  # (B, T, H_I, d_I)
        dtype = torch.promote_types(q.dtype, torch.float32)
        w = self.weights_proj(x).to(dtype) * self.n_heads ** -0.5  # w_{t,j}: (B, T, H_I)
        return lightning_index(q.to(dtype), keys.to(dtype), w, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The kept keys, bool ``(B, T_q, T_k)`` (:func:`causal_topk_mask` of :meth:`scores`, queries last)."""
        return causal_topk_mask(self.scores(x, q_resid, keys, positions), self.index_topk, allowed=allowed)


class DSAttention(DeepSeekLatentAttention):
    """DeepSeek Sparse Attention: MLA in which each query attends to its ``index_topk`` keys chosen by a
    :class:`DSAIndexer` (DeepSeek-V3.2-Exp §2.1). Chapter 21.

    Equal to transformers' ``DeepseekV32Attention`` (same parameter names, ``o_proj`` = ``out_proj``): the same
    keys chosen, the same output. With ``index_topk >= T`` it is dense MLA (:class:`DeepSeekLatentAttention`).

    Args:
        d_model, n_heads, **kwargs: as :class:`~attnlib.attention.latent.DeepSeekLatentAttention`.
        index_topk, index_n_heads, index_head_dim: the indexer's ``k``, ``H_I`` and ``d_I`` (:class:`DSAIndexer`).

    Attributes:
        indexer: the :class:`DSAIndexer`.
        cache_width: ``d_c + d_R + d_I`` numbers per token: the indexer's keys are cached beside MLA's latent
            and RoPE key (one layer cache, three tensors); ``mla_cache_width`` is MLA's ``d_c + d_R``.

    Shapes:
        ``x (B, T, d_model)`` → ``(B, T, d_model)``; a layer cache holds ``c^KV (B, T, d_c)``, ``k^R (B, T, d_R)``
        and ``k^I (B, T, d_I)``. A padding ``attention_mask`` also keeps padded keys from being chosen; an extra
        ``mask`` only applies after the choice (as in transformers, whose indexer reads the first head's mask).

    Raises:
        TypeError / ValueError: as :class:`DeepSeekLatentAttention` and :class:`DSAIndexer` (named).
    """

    def __init__(self, d_model: int, n_heads: int, *, index_topk: int, index_n_heads: int, index_head_dim: int,
                 **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.indexer = DSAIndexer(d_model, self.q_lora_rank, index_n_heads=index_n_heads,
                                  index_head_dim=index_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                                  index_topk=index_topk, rope_theta=self.rope_theta)

    @property
    def mla_cache_width(self) -> int:
        """Numbers MLA alone caches per token: ``d_c + d_R``."""
        return super().cache_width

    @property
    def cache_width(self) -> int:
        """Numbers cached per token: MLA's ``d_c + d_R`` and the indexer's key, ``d_I``."""
        return self.mla_cache_width + self.indexer.head_dim

    def cached_tensors(self, x, c, k_rope, positions):
        """``c^KV``, ``k^R`` and the indexer's keys ``k^I (B, T, d_I)``, cached together."""
        return c, k_rope, self.indexer.keys(x, positions)

    def select_keys(self, x, q_resid, cached, positions, attention_mask, T_k):
        """The indexer's top-k, bool ``(B, T_q, T_k)``; padded keys (``attention_mask``) are never chosen."""
        allowed = None if attention_mask is None else attention_mask[:, None, :]  # (B, 1, T_k)
        return self.indexer(x, q_resid, cached[2], positions, allowed)


def dsa_cache_bytes(kv_lora_rank: int = 512, qk_rope_head_dim: int = 64, index_head_dim: int = 128, *,
                    dtype: torch.dtype = torch.bfloat16, index_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes cached per token and layer by MLA and by DSA (defaults: DeepSeek-V3.2-Exp's sizes).

    MLA keeps ``d_c + d_R`` numbers (the latent and the RoPE key); DSA adds the indexer's key, ``d_I``
    numbers, in ``index_dtype`` (default ``dtype``; DeepSeek keeps it in FP8, ``torch.float8_e4m3fn``, whose
    per-block scales are not counted here). In bf16: ``{"mla": 1152, "indexer": 256, "dsa": 1408}``.

    Raises:
        TypeError / ValueError: a size that is not a positive int; a dtype that is not a ``torch.dtype``.
    """
    for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim),
                        ("index_head_dim", index_head_dim)):
        positive_int(name, value)
    index_dtype = dtype if index_dtype is None else index_dtype
    for name, value in (("dtype", dtype), ("index_dtype", index_dtype)):
        if not isinstance(value, torch.dtype):
            raise TypeError(f"{name} must be a torch.dtype; got {value!r}")
    mla = (kv_lora_rank + qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()
    indexer = index_head_dim * torch.empty((), dtype=index_dtype).element_size()
    return {"mla": mla, "indexer": indexer, "dsa": mla + indexer}
