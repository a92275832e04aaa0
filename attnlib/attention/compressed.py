"""Compressed attention: DeepSeek-V4's compressed sparse (CSA) and heavily compressed (HCA) attention. Chapter 21.

DeepSeek-V4 (DeepSeek-AI 2026, technical report §2.3) keeps the keys of long contexts small by
**compressing** them: every ``m`` consecutive tokens become one key/value entry. Token ``j`` gives a
content ``C_j = x_j W^KV`` and a gate ``Z_j = x_j W^Z``; the entry of group ``w`` (tokens ``wm … wm+m-1``)
is their gated average, one softmax per channel over the group (§2.3.2, eqs. 20–23)::

    C^Comp_w = RMSNorm( Σ_{j in group w} softmax_j(Z_j + B_{j mod m}) ⊙ C_j ),   RoPE at position w·m

(``B``: a learned bias per slot of the group). Three layer types combine it with a window
(:data:`LAYER_TYPES`, ``transformers``' strings):

* ``"sliding_attention"``: the last ``sliding_window`` tokens only;
* ``"heavily_compressed_attention"`` (HCA, ``m = 128``): the window + *every* compressed entry made so far;
* ``"compressed_sparse_attention"`` (CSA, ``m = 4``): the window + the ``index_topk`` entries a lightning
  indexer scores highest (§2.3.1, eqs. 13–17; DeepSeek-V3.2's indexer, :mod:`attnlib.attention.sparse`,
  run over compressed keys): ``I_{t,s} = Σ_h w_{t,h} · ReLU(q^I_{t,h} · K^I_s)``. CSA's groups overlap:
  ``C, Z`` are ``2 · head_dim`` wide, and entry ``w`` pools the first half of group ``w - 1``'s tokens with
  the second half of group ``w``'s (2m slots, stride m).

A query at position ``t`` may read entry ``w`` only once its group is complete: ``(w + 1)·m - 1 <= t``
(:func:`entries_visible`); a partial group waits in the cache (:class:`~attnlib.cache.CompressedLayerCache`).
The window and the chosen entries share **one** softmax, with a learned sink per head
(:func:`~attnlib.attention.functions.sink_softmax`). Keys are values (one shared head, MQA); queries come
through a low-rank ``q_a → RMSNorm → q_b``, are RMS-normalised per head, and RoPE (interleaved pairs, on the
last ``rope_head_dim`` channels) turns queries and keys; the output is turned back by ``-t`` (values carry
RoPE too), then projected per group of heads (``o_a``) and mixed (``o_b``). Chapter 21.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import float_input, positive_int
from attnlib.attention.registry import get_attention_function
from attnlib.attention.sparse import topk_mask
from attnlib.cache.compressed import CompressedLayerCache
from attnlib.cache.layer import LayerCache
from attnlib.cache.windowed import RingLayerCache
from attnlib.layers.norms import RMSNorm
from attnlib.positional.rotary import RotaryEmbedding

__all__ = ["LAYER_TYPES", "CompressedAttention", "Compressor", "Indexer", "compress", "entries_visible",
           "index_scores", "rope_interleaved"]

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_DEFAULT_RATE = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE with interleaved pairs ``(x[2i], x[2i+1])`` on the last ``2·angles.shape[-1]`` channels of ``x``.

    ``x (..., T, width)``, ``angles (T, r/2)`` (float32; negate them to turn back). The first ``width - r``
    channels pass unchanged (V4 lays a head out as ``[nope | rope]``). Computed in float32.
    """
    r = 2 * angles.shape[-1]
    keep, rot = x[..., :-r], x[..., -r:].float()
    x1, x2 = rot[..., 0::2], rot[..., 1::2]  # (..., T, r/2) each
    cos, sin = angles.cos(), angles.sin()
    turned = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)  # pairs back in place
    return torch.cat([keep, turned.to(x.dtype)], dim=-1)


def compress(c: torch.Tensor, z: torch.Tensor, bias: torch.Tensor, compress_rate: int, *,
             overlap: bool = False) -> torch.Tensor:
    """Pool each group of ``m = compress_rate`` tokens into one entry: ``Σ_j softmax_j(Z_j + B_j) ⊙ C_j``.

    Args:
        c, z: ``(B, n·m, w)`` contents and gates of ``n`` whole groups, the first token at a group's start.
        bias: ``(m, w)``, added to the gates of each group's slots.
        compress_rate: ``m``.
        overlap: CSA's overlapping groups: ``w = 2d``; entry ``i`` pools the first ``d`` channels of group
            ``i - 1`` and the last ``d`` of group ``i`` (``2m`` slots; entry 0 only the latter).

    Returns:
        ``(B, n, w)`` (``(B, n, w/2)`` with ``overlap``): the entries before their norm and RoPE.
    """
    B, L, w = c.shape
    m = compress_rate
    n = L // m
    c, z = c[:, : n * m].view(B, n, m, w), z[:, : n * m].view(B, n, m, w) + bias  # (B, n, m, w)
    if overlap:
        d = w // 2
        prev_c = F.pad(c[..., :d], (0, 0, 0, 0, 1, 0))[:, :n]  # group i-1's first half; zeros before group 0
        prev_z = F.pad(z[..., :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))[:, :n]  # ... weight 0 there
        c, z = torch.cat([prev_c, c[..., d:]], dim=2), torch.cat([prev_z, z[..., d:]], dim=2)  # (B, n, 2m, d)
    weights = z.softmax(dim=2, dtype=torch.float32).to(c.dtype)  # per channel, over the group's slots
    return (weights * c).sum(dim=2)


def entries_visible(positions: torch.Tensor, n_entries: int, compress_rate: int) -> torch.Tensor:
    """``(T, N)`` bool: query at ``positions[t]`` may read entry ``w`` iff its group is complete,
    ``(w + 1)·m - 1 <= positions[t]``: no entry ever holds a token after the query."""
    w = torch.arange(n_entries, device=positions.device)
    return (w[None, :] + 1) * compress_rate <= positions[:, None] + 1


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's ``I_{t,s} = Σ_h w_{t,h} · ReLU(q_{t,h} · k_s) · scale`` (V4 eq. 16).

    ``q (B, T, H_I, d_I)``, ``keys (B, N, d_I)``, ``weights (B, T, H_I)`` → ``(B, T, N)`` (float32).
    """
    dots = torch.einsum("bthc,bsc->bths", q.float(), keys.float()).relu() * scale  # (B, T, H_I, N)
    return (dots * weights.float().unsqueeze(-1)).sum(dim=2)


class Compressor(nn.Module):
    """``C, Z = x W^KV, x W^Z`` → :func:`compress` → RMSNorm → RoPE at ``w·m``: the compressed entries.

    Args:
        d_model, head_dim: input and entry widths; compress_rate: ``m``; overlap: CSA's overlapping groups.
        rope_head_dim, rope_theta: RoPE on the entries' last ``rope_head_dim`` channels; eps: the norm's.

    Attributes (``transformers``' names): ``kv_proj``, ``gate_proj`` (``d_model → (1 or 2)·head_dim``),
    ``position_bias`` ``(m, (1 or 2)·head_dim)``, ``kv_norm``.
    """

    def __init__(self, d_model: int, head_dim: int, compress_rate: int, *, overlap: bool, rope_head_dim: int,
                 rope_theta: float, eps: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        width = (2 if overlap else 1) * head_dim
        self.compress_rate, self.overlap, self.head_dim = compress_rate, overlap, head_dim
        self.kv_proj = nn.Linear(d_model, width, bias=False)
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(compress_rate, width))
        self.kv_norm = RMSNorm(head_dim, eps=eps)
        self.rope = RotaryEmbedding(rope_head_dim, rope_theta, rope_scaling)  # only its angles: no YaRN factor

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C, Z)``, each ``(B, T, (1 or 2)·head_dim)``."""
        return self.kv_proj(x), self.gate_proj(x)

    def forward(self, c: torch.Tensor, z: torch.Tensor, first_group: int = 0) -> torch.Tensor:
        """Entries ``(B, n, head_dim)`` of the whole groups of ``c, z`` ``(B, n·m, ·)``, group ``first_group`` first."""
        n = c.shape[1] // self.compress_rate
        if n == 0:
            return c.new_zeros(c.shape[0], 0, self.head_dim)
        entries = self.kv_norm(compress(c, z, self.position_bias, self.compress_rate, overlap=self.overlap))
        positions = (first_group + torch.arange(n, device=c.device)) * self.compress_rate
        return rope_interleaved(entries, self.rope.angles(positions))


class Indexer(Compressor):
    """The lightning indexer over compressed keys (V4 §2.3.1): its own :class:`Compressor` (``index_head_dim``,
    overlapping groups) makes the keys ``K^I``; queries ``q^I = RoPE(q_res W^IQ)`` per index head, weights
    ``w = x W^w / √H_I``; :func:`index_scores` with scale ``1/√index_head_dim``.

    Attributes: as :class:`Compressor`, and ``q_b_proj`` (``q_lora_rank → H_I · d_I``), ``weights_proj``
    (``d_model → H_I``).
    """

    def __init__(self, d_model: int, q_lora_rank: int, index_n_heads: int, index_head_dim: int,
                 compress_rate: int, **kwargs) -> None:
        super().__init__(d_model, index_head_dim, compress_rate, overlap=True, **kwargs)
        self.n_heads = index_n_heads
        self.q_b_proj = nn.Linear(q_lora_rank, index_n_heads * index_head_dim, bias=False)
        self.weights_proj = nn.Linear(d_model, index_n_heads, bias=False)

    def scores(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor) -> torch.Tensor:
        """``(B, T, N)`` index scores of the queries at ``positions`` over ``keys (B, N, d_I)``."""
        B, T, _ = x.shape
        q = self.q_b_proj(q_residual).view(B, T, self.n_heads, self.head_dim)
        q = rope_interleaved(q.transpose(1, 2), self.rope.angles(positions)).transpose(1, 2)  # (B, T, H_I, d_I)
        weights = self.weights_proj(x) * self.n_heads ** -0.5
        return index_scores(q, keys, weights, self.head_dim ** -0.5)


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer: a window, and (CSA / HCA) compressed entries, in one softmax with sinks.

    Args:
        d_model, n_heads, head_dim: widths (V4-Flash: 4096, 64, 512); one key/value head of ``head_dim``.
        layer_type: one of :data:`LAYER_TYPES`.
        q_lora_rank: the queries' low rank (``q_a``); rope_head_dim: RoPE'd channels, the last of each head.
        o_groups, o_lora_rank: grouped output projection: ``o_groups`` groups of heads, each to ``o_lora_rank``.
        sliding_window: the window (query included); ``None``: the local branch sees every past position
            (not in V4; full attention, for checks).
        compress_rate: ``m`` (default 4 for CSA, 128 for HCA); index_n_heads, index_head_dim, index_topk:
            CSA's indexer (``index_topk`` entries per query).
        rope_theta: RoPE base of sliding layers; compress_rope_theta: of CSA / HCA layers (and their entries);
            compress_rope_scaling: their scaling (``transformers``' dict; V4: YaRN, its cos/sin factor kept at 1).
        eps: RMSNorm's; attn_fn: an attention function with ``sinks`` (``"eager"``, ``"tiled"``, ``"flash"``).

    Attributes: ``transformers``' names (``q_a_proj``, ``q_a_norm``, ``q_b_proj``, ``kv_proj``, ``kv_norm``,
    ``o_a_proj`` (the groups' weights stacked), ``o_b_proj``, ``sinks``, ``compressor``, ``indexer``).

    Shapes: ``x (B, T, d_model)`` → ``(B, T, d_model)``; with a cache (:meth:`new_cache`) the next tokens.

    Raises:
        TypeError / ValueError: a size not an int >= 1 or not fitting (``rope_head_dim`` even and at most
            ``head_dim`` / ``index_head_dim``, ``o_groups`` dividing ``n_heads``), an unknown ``layer_type`` or
            ``attn_fn`` (or ``"sdpa"``: no sinks); in forward, ``x`` not ``(B, T, d_model)`` float, a cache that
            is not this layer's kind (named).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, layer_type: str = "compressed_sparse_attention",
                 q_lora_rank: int, rope_head_dim: int, o_groups: int, o_lora_rank: int,
                 sliding_window: int | None = 128, compress_rate: int | None = None, index_n_heads: int = 64,
                 index_head_dim: int = 128, index_topk: int = 512, rope_theta: float = 10000.0,
                 compress_rope_theta: float = 160000.0, compress_rope_scaling: dict | None = None, eps: float = 1e-6,
                 attn_fn: str = "eager") -> None:
        super().__init__()
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type={layer_type!r} is not one of {LAYER_TYPES}")
        compress_rate = _DEFAULT_RATE.get(layer_type) if compress_rate is None else compress_rate
        sizes = dict(d_model=d_model, n_heads=n_heads, head_dim=head_dim, q_lora_rank=q_lora_rank,
                     rope_head_dim=rope_head_dim, o_groups=o_groups, o_lora_rank=o_lora_rank,
                     index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=index_topk)
        if compress_rate is not None:
            sizes["compress_rate"] = compress_rate
        if sliding_window is not None or layer_type == "sliding_attention":
            sizes["sliding_window"] = sliding_window
        for name, value in sizes.items():
            positive_int(name, value)
        sparse = layer_type == "compressed_sparse_attention"
        widest = min(head_dim, index_head_dim) if sparse else head_dim
        if rope_head_dim % 2 or rope_head_dim > widest:
            raise ValueError(f"rope_head_dim={rope_head_dim} must be even and at most {widest} "
                             f"(head_dim{' and index_head_dim' if sparse else ''})")
        if n_heads % o_groups:
            raise ValueError(f"o_groups={o_groups} must divide n_heads={n_heads}")
        if attn_fn == "sdpa":
            raise ValueError("attn_fn='sdpa' cannot add sinks to its softmax; use 'eager', 'tiled' or 'flash'")
        self.attn_fn = get_attention_function(attn_fn)
        self.d_model, self.n_heads, self.head_dim, self.layer_type = d_model, n_heads, head_dim, layer_type
        self.sliding_window, self.o_groups, self.index_topk = sliding_window, o_groups, index_topk
        self.compress_rate = None if layer_type == "sliding_attention" else compress_rate
        self.overlap = sparse if self.compress_rate else None
        self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps=eps)
        self.o_a_proj = nn.Linear(n_heads * head_dim // o_groups, o_groups * o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, d_model, bias=False)
        self.sinks = nn.Parameter(torch.zeros(n_heads))
        rope = dict(rope_head_dim=rope_head_dim, rope_theta=compress_rope_theta, rope_scaling=compress_rope_scaling)
        local = (rope_theta, None) if self.compress_rate is None else (compress_rope_theta, compress_rope_scaling)
        self.rope, self.eps, rope["eps"] = RotaryEmbedding(rope_head_dim, *local), eps, eps
        self.compressor = self.indexer = None
        if self.compress_rate:
            self.compressor = Compressor(d_model, head_dim, compress_rate, overlap=sparse, **rope)
        if sparse:
            self.indexer = Indexer(d_model, q_lora_rank, index_n_heads, index_head_dim, compress_rate, **rope)

    def new_cache(self, block_size: int, windows: bool = True):
        """This layer's cache: a ring of the window (sliding layers), or a
        :class:`~attnlib.cache.CompressedLayerCache` (``windows=False``: the window's every position)."""
        window = self.sliding_window if windows else None
        if self.compress_rate is None:
            return RingLayerCache(block_size, window) if window else LayerCache(block_size)
        return CompressedLayerCache(block_size, self.compress_rate, window=window, overlap=self.overlap)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """``x (B, T, d_model)`` at positions ``cache.length, …`` (0, … without a cache) → ``(B, T, d_model)``."""
        float_input(x, self.d_model)
        if cache is not None:
            if self.compressor is not None and not callable(getattr(cache, "group", None)):
                raise ValueError(f"cache must be this layer's new_cache() (a CompressedLayerCache); "
                                 f"got {type(cache).__name__}")
            cache.check_layer(self, masked=False)
        B, T, _ = x.shape
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + T, device=x.device)
        angles = self.rope.angles(positions)  # (T, rope_head_dim / 2)
        q_residual = self.q_a_norm(self.q_a_proj(x))  # (B, T, q_lora_rank)
        q = self.q_b_proj(q_residual).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q = rope_interleaved(F.rms_norm(q, (self.head_dim,), eps=self.eps), angles)  # (B, H, T, d)
        kv = rope_interleaved(self.kv_norm(self.kv_proj(x)).unsqueeze(1), angles)  # (B, 1, T, d): key = value
        keys, key_positions = (kv, positions) if cache is None else (cache.update(kv)[0], cache.key_positions)
        key_positions = key_positions.to(x.device)
        mask = key_positions[None, :] <= positions[:, None]  # (T, T_k): causal ...
        if self.sliding_window is not None:  # ... within the window, the query included
            mask = mask & (key_positions[None, :] > positions[:, None] - self.sliding_window)
        mask = mask.expand(B, T, -1)
        if self.compressor is not None:
            entries, chosen = self.compressed(x, q_residual, positions, cache)  # (B, N, d), (B, T, N)
            keys, mask = torch.cat([keys, entries.unsqueeze(1)], dim=2), torch.cat([mask, chosen], dim=-1)
        y, _ = self.attn_fn(q, keys, keys, mask.unsqueeze(1), scale=self.head_dim ** -0.5, sinks=self.sinks)
        y = rope_interleaved(y, -angles).transpose(1, 2)  # values carried RoPE: turn back by -t; (B, T, H, d)
        y = y.reshape(B, T, self.o_groups, -1)  # (B, T, G, H·d/G)
        w = self.o_a_proj.weight.view(self.o_groups, -1, y.shape[-1])  # (G, o_lora_rank, H·d/G)
        return self.o_b_proj(torch.einsum("btgi,gri->btgr", y, w).flatten(2))

    def compressed(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                   cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed entries ``(B, N, head_dim)`` made so far and which each query reads ``(B, T, N)``
        bool: all visible ones (HCA), or the indexer's ``index_topk`` among them (CSA)."""
        projections = self.compressor.project(x) + (() if self.indexer is None else self.indexer.project(x))
        first = 0
        if cache is not None:
            projections, first = cache.group(*projections)  # whole groups only; the rest waits
        entries = [self.compressor(*projections[:2], first)]
        if self.indexer is not None:
            entries.append(self.indexer(*projections[2:], first))
        if cache is not None:
            made = max(0, cache.n_entries - first)  # overlap: the previous group's entry, already cached
            entries = list(cache.add_entries(*(e[:, made:] for e in entries)))
        visible = entries_visible(positions, entries[0].shape[1], self.compress_rate)  # (T, N)
        if self.indexer is None or entries[0].shape[1] == 0:
            return entries[0], visible.expand(x.shape[0], -1, -1)
        scores = self.indexer.scores(x, q_residual, positions, entries[1])  # (B, T, N)
        return entries[0], topk_mask(scores, self.index_topk, visible)
