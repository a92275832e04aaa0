"""Native Sparse Attention: compressed, selected and sliding-window branches, gated. Chapter 21.

Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention"
(ACL 2025), §3. Query ``q_t`` attends three times and mixes the results by gates from the input:

    o_t = Σ_{c ∈ {cmp, slc, win}} g_t^c · Attn(q_t, K̃_t^c, Ṽ_t^c),   g_t^c ∈ (0, 1)            (eq. 5)

* **cmp** (§3.3.1): blocks of ``l = compress_block`` keys with stride ``d = compress_stride``, each
  mapped to one key by a learnable MLP φ with intra-block positions (:class:`BlockCompressor`):
  ``K̃_t^cmp = {φ(k_{id+1 : id+l}) | 0 ≤ i ≤ ⌊(t - l)/d⌋}`` (eq. 7): a block is used only once complete,
  in the past. Its attention weights are the scores ``p_t^cmp`` (eq. 8).
* **slc** (§3.3.2): keys in blocks of ``l' = select_block``. Block ``j``'s score sums the compressed
  scores of the compressed blocks overlapping it, each once per stride-``d`` piece it shares with it
  (eq. 9; ``d`` divides ``l`` and ``l'``), then over the query heads of a GQA group (eq. 10). The
  ``top_n`` best blocks, counting ``initial_blocks`` first blocks and ``local_blocks`` latest ones that are
  always taken (the paper: 16 = 1 + 2 + 13), give ``K̃_t^slc``: full causal attention over their tokens.
* **win** (§3.3.3): the ``window`` latest keys ``k_{t-w+1 : t}``.

:func:`nsa_attention_reference` builds every branch as an explicit mask over all ``T`` keys (the
definition); :func:`nsa_attention` unfolds the compressed blocks, gathers the selected blocks and the
window (``T · (top_n · l' + w)`` scores, no ``T × T`` mask). They must agree: no ``transformers`` reference
exists for NSA, so each checks the other, the mask form being the independent reference. The paper gives
each branch its own keys and values (§3.3.3); :class:`NativeSparseAttention` shares one projection.

Both take queries that are the last ``T_q`` of ``T_k`` positions (query ``i`` at ``t = T_k - T_q + i``,
as when decoding with a cache): compressed blocks complete by ``t``, selection blocks up to ``t``'s and the
window ending at ``t``, so a query's output does not depend on how its past arrived. The layer caches the
raw keys and values only and recomputes the compressed ones from them at every step (simple, O(T_k) work
for φ a step; caching them as DeepSeek-V4's :class:`~attnlib.cache.CompressedLayerCache` does would save it).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, non_negative_int, positive_int
from attnlib.attention.block_sparse import (
    attend_gathered,
    check_self_attention,
    checked_projection,
    choose_blocks_readable,
    gather_blocks,
    query_positions,
    select_blocks,
)
from attnlib.attention.functions import attention
from attnlib.attention.masks import causal_mask
from attnlib.attention.multi_head import MultiHeadAttention, refuse_options

__all__ = ["BlockCompressor", "NativeSparseAttention", "check_nsa_sizes", "nsa_attention", "nsa_attention_reference"]

Compressor = Callable[[torch.Tensor], torch.Tensor]


class BlockCompressor(nn.Module):
    """φ of NSA's eq. (7): a block of ``compress_block`` keys (or values) → one, ``MLP(flatten(x + P))``.

    ``P`` ``(compress_block, head_dim)``: learned intra-block positions; the MLP ``l·head_dim → hidden →
    head_dim`` with a GELU (the paper does not give its depth; chapter 21). Shapes: ``(..., l, head_dim)``
    → ``(..., head_dim)``. Raises ValueError for another input shape, TypeError / ValueError for sizes.
    """

    def __init__(self, compress_block: int, head_dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = head_dim if hidden is None else hidden
        for name, value in (("compress_block", compress_block), ("head_dim", head_dim), ("hidden", hidden)):
            positive_int(name, value)
        self.compress_block, self.head_dim = compress_block, head_dim
        self.pos = nn.Parameter(torch.randn(compress_block, head_dim) * 0.02)
        self.mlp = nn.Sequential(nn.Linear(compress_block * head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.compress_block, self.head_dim):
            raise ValueError(f"x must have shape (..., compress_block={self.compress_block}, "
                             f"head_dim={self.head_dim}); got {tuple(x.shape)}")
        return self.mlp((x + self.pos).flatten(-2))  # (..., l, hd) -> (..., l·hd) -> (..., hd)


def check_nsa_sizes(compress_block, compress_stride, select_block, top_n, window, initial_blocks,
                    local_blocks) -> None:
    """Raise TypeError / ValueError, naming the argument, unless NSA's sizes fit: positive ints (the forced
    block counts >= 0), ``compress_stride`` dividing ``compress_block`` and ``select_block``, and ``top_n >=
    initial_blocks + local_blocks``."""
    for name, value in (("compress_block", compress_block), ("compress_stride", compress_stride),
                        ("select_block", select_block), ("top_n", top_n), ("window", window)):
        positive_int(name, value)
    non_negative_int("initial_blocks", initial_blocks)
    non_negative_int("local_blocks", local_blocks)
    divisible("compress_block", compress_block, "compress_stride", compress_stride)
    divisible("select_block", select_block, "compress_stride", compress_stride)
    if top_n < initial_blocks + local_blocks:
        raise ValueError(f"top_n={top_n} must be >= initial_blocks + local_blocks = {initial_blocks + local_blocks} "
                         "(the blocks always selected count among the top_n)")


def _checks(q, k, v, gates, compress_k, compress_v, sizes, scale) -> float:
    check_nsa_sizes(*sizes)
    check_self_attention(q, k, v, scale)
    B, H, T, _ = q.shape  # T = T_q
    if not isinstance(gates, torch.Tensor) or not gates.is_floating_point() or gates.dtype != q.dtype:
        raise TypeError(f"gates must be a float tensor of q's dtype {q.dtype}; got {getattr(gates, 'dtype', gates)}")
    if tuple(gates.shape) != (B, H, T, 3) or gates.device != q.device:
        raise ValueError(f"gates must have shape (B, n_heads, T_q, 3) = {(B, H, T, 3)} on {q.device}; "
                         f"got {tuple(gates.shape)} on {gates.device}")
    for name, fn in (("compress_k", compress_k), ("compress_v", compress_v)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable (..., compress_block, d) -> (..., d); got {fn!r}")
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _rules(t, T_k, select_block, initial_blocks, local_blocks):
    """``allowed, forced (T_q, n_blocks)`` for queries at positions ``t (T_q,)``: selection blocks at or before
    the query's, and those always taken."""
    own = t[:, None] // select_block  # (T_q, 1)
    j = torch.arange(-(-T_k // select_block), device=t.device)[None, :]  # (1, n_blocks)
    allowed = j <= own
    return allowed, allowed & ((j < initial_blocks) | (own - j < local_blocks))


def _compressed(q, k_cmp, v_cmp, t, lc, d, scale):
    """``Attn(q, K̃^cmp, Ṽ^cmp)`` over the blocks complete by each query's position ``t (T_q,)`` and its
    weights ``p^cmp (B, H, T_q, n_cmp)``."""
    B, H, T, _ = q.shape
    if k_cmp is None:  # T_k < l: no block is complete yet
        return q.new_zeros(B, H, T, q.shape[-1]), q.new_zeros(B, H, T, 0)
    ends = torch.arange(k_cmp.shape[2], device=q.device) * d + lc - 1  # last position of each block
    complete = ends[None, :] <= t[:, None]  # (T_q, n_cmp)
    return attention(q, k_cmp, v_cmp, complete[None, None], scale=scale)


def nsa_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor, compress_k: Compressor,
    compress_v: Compressor, *, compress_block: int = 32, compress_stride: int = 16, select_block: int = 64,
    top_n: int = 16, window: int = 512, initial_blocks: int = 1, local_blocks: int = 2, scale: float | None = None,
) -> torch.Tensor:
    """NSA written out (Yuan et al. 2025, §3, eqs. 5-10; chapter 21): each branch an explicit ``(T, T)`` mask.

    No ``transformers`` reference exists; :func:`nsa_attention` must equal this.

    Args:
        q: ``(B, n_heads, T_q, head_dim)``: the last ``T_q`` of ``T_k`` positions (``T_q = T_k`` for a whole
            sequence); k, v: ``(B, n_kv_heads, T_k, head_dim)``, shared by the branches.
        gates: ``(B, n_heads, T_q, 3)``: ``g^cmp, g^slc, g^win`` per query and head (in (0, 1) from a
            sigmoid in the layer; any numbers here).
        compress_k, compress_v: φ for keys and values, ``(..., compress_block, head_dim) → (..., head_dim)``.
        compress_block, compress_stride: ``l`` and ``d`` (``d`` divides ``l``); select_block: ``l'``
            (``d`` divides it); top_n: ``n`` selected blocks per query, counting ``initial_blocks`` and
            ``local_blocks`` (always selected); window: ``w``. Defaults: the paper's (its experiments, §4).
        scale: on ``q · k`` in every branch; default ``1 / √head_dim``.

    Returns:
        ``(B, n_heads, T_q, head_dim)``.

    Raises:
        TypeError / ValueError: see :func:`check_nsa_sizes` and
            :func:`~attnlib.attention.block_sparse.check_self_attention`; ``gates`` not ``(B, n_heads, T_q, 3)``
            of q's dtype; a compressor not callable.
    """
    lc, d, lsel = compress_block, compress_stride, select_block  # the paper's l, d, l'
    scale = _checks(q, k, v, gates, compress_k, compress_v,
                    (lc, d, lsel, top_n, window, initial_blocks, local_blocks), scale)
    B, H, T, _ = q.shape  # T = T_q
    T_k, t = k.shape[2], query_positions(T, k.shape[2], q.device)  # t: each query's position
    h, n_cmp = k.shape[1], (T_k - lc) // d + 1 if T_k >= lc else 0
    # cmp (eq. 7): block i covers positions i·d … i·d + l - 1
    k_cmp = torch.stack([compress_k(k[:, :, i * d:i * d + lc]) for i in range(n_cmp)], 2) if n_cmp else None
    v_cmp = torch.stack([compress_v(v[:, :, i * d:i * d + lc]) for i in range(n_cmp)], 2) if n_cmp else None
    o_cmp, p_cmp = _compressed(q, k_cmp, v_cmp, t, lc, d, scale)  # p^cmp (eq. 8): (B, H, T, n_cmp)
    # slc (eqs. 9, 10): p^slc[j] = Σ_m Σ_n p^cmp[(l'/d)·j + m - n], summed over the group's heads
    p_group = p_cmp.reshape(B, h, H // h, T, n_cmp).sum(2)  # (B, h, T, n_cmp)
    n_sel = -(-T_k // lsel)
    p_slc = q.new_zeros(B, h, T, n_sel)
    for j in range(n_sel):
        for m in range(lsel // d):
            for n in range(lc // d):
                c = (lsel // d) * j + m - n  # a compressed block sharing a stride-d piece with block j
                if 0 <= c < n_cmp:
                    p_slc[..., j] += p_group[..., c]
    allowed, forced = _rules(t, T_k, lsel, initial_blocks, local_blocks)
    chosen = choose_blocks_readable(p_slc, allowed, forced, top_n)  # (B, h, T, n_sel)
    causal, s = causal_mask(T, T_k, q.device), torch.arange(T_k, device=q.device)  # s: each key's position
    mask_slc = chosen[..., s // lsel] & causal  # (B, h, T, T_k)
    o_slc = attention(q, k, v, mask_slc.repeat_interleave(H // h, dim=1), scale=scale)[0]
    # win: keys t - w + 1 … t
    o_win = attention(q, k, v, (causal & (t[:, None] - s[None, :] < window))[None, None], scale=scale)[0]
    g = gates.unsqueeze(-1)  # (B, H, T, 3, 1)
    return g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win  # eq. 5


def nsa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor, compress_k: Compressor,
    compress_v: Compressor, *, compress_block: int = 32, compress_stride: int = 16, select_block: int = 64,
    top_n: int = 16, window: int = 512, initial_blocks: int = 1, local_blocks: int = 2, scale: float | None = None,
) -> torch.Tensor:
    """NSA, blocked (Yuan et al. 2025, §3; chapter 21): compressed blocks by ``unfold``, the selected blocks
    and the window gathered per query, no ``(T, T)`` mask.

    Same arguments, results and errors as :func:`nsa_attention_reference` (no ``transformers`` reference
    exists). Eq. (9) is one matrix product: ``p^slc = p^cmp W`` with ``W[c, j]`` the overlap of compressed
    block ``c`` and selection block ``j`` in strides of ``d``.
    """
    lc, d, lsel = compress_block, compress_stride, select_block
    scale = _checks(q, k, v, gates, compress_k, compress_v,
                    (lc, d, lsel, top_n, window, initial_blocks, local_blocks), scale)
    B, H, T, hd = q.shape  # T = T_q
    h, dev, T_k = k.shape[1], q.device, k.shape[2]
    t = query_positions(T, T_k, dev)  # each query's position
    k_cmp = compress_k(k.unfold(2, lc, d).transpose(-1, -2)) if T_k >= lc else None  # (B, h, n_cmp, l, hd) -> (B, h, n_cmp, hd)
    v_cmp = compress_v(v.unfold(2, lc, d).transpose(-1, -2)) if T_k >= lc else None
    o_cmp, p_cmp = _compressed(q, k_cmp, v_cmp, t, lc, d, scale)
    n_cmp, n_sel = p_cmp.shape[-1], -(-T_k // lsel)
    c_start = torch.arange(n_cmp, device=dev)[:, None] * d  # (n_cmp, 1)
    j_start = torch.arange(n_sel, device=dev)[None, :] * lsel  # (1, n_sel)
    overlap = (torch.minimum(c_start + lc, j_start + lsel) - torch.maximum(c_start, j_start)).clamp(min=0)
    p_slc = p_cmp.reshape(B, h, H // h, T, n_cmp).sum(2) @ (overlap // d).to(q.dtype)  # (B, h, T, n_sel)
    allowed, forced = _rules(t, T_k, lsel, initial_blocks, local_blocks)
    index, valid = select_blocks(p_slc, allowed, forced, top_n)  # (B, h, T, n)
    pos = index[..., None] * lsel + torch.arange(lsel, device=dev)  # (B, h, T, n, l')
    keep = (valid[..., None] & (pos <= t.view(T, 1, 1))).flatten(-2)  # (B, h, T, n·l')
    o_slc = attend_gathered(q, gather_blocks(k, lsel, index).flatten(3, 4), gather_blocks(v, lsel, index).flatten(3, 4),
                            keep, scale)
    w = min(window, T_k)  # a window past the start holds nothing more
    k_win, v_win = (F.pad(x, (0, 0, w - 1, 0))[:, :, T_k - T:].unfold(2, w, 1).transpose(-1, -2)
                    for x in (k, v))  # padded: position p at p + w - 1; (B, h, T, w, hd): keys t - w + 1 … t
    in_seq = (t[:, None] - w + 1 + torch.arange(w, device=dev)) >= 0  # (T, w): left padding is not a key
    o_win = attend_gathered(q, k_win, v_win, in_seq[None, None], scale)
    g = gates.unsqueeze(-1)  # (B, H, T, 3, 1)
    return g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win  # eq. 5


class NativeSparseAttention(MultiHeadAttention):
    """Causal multi-head attention through NSA (Yuan et al. 2025, §3; chapter 21), with GQA.

    Projections, GQA (the selection shared by a group's heads, eq. 10), RoPE and QK-norm as
    :class:`MultiHeadAttention`; φ for keys and values (:class:`BlockCompressor`); the gates
    ``g = σ(x W_g + b_g)`` ``(B, n_heads, T, 3)`` (the paper's "MLP and sigmoid", here one linear layer).
    One key/value projection serves the three branches (the paper gives each its own). No
    ``transformers`` reference exists. No mask or padding yet.

    Cache: :meth:`new_cache` is a :class:`~attnlib.cache.LayerCache` of every position's raw keys and values
    (:attr:`cache_width` = ``2 · n_kv_heads · head_dim`` numbers a token); the compressed keys and values
    are *recomputed* from the cached raw ones at every step (not cached), so token by token, in chunks or
    in one pass give the same output.

    Args:
        d_model, n_heads, n_kv_heads, **kwargs: as :class:`MultiHeadAttention` (causal self-attention; no
            sliding window, chunk, dropout, score_mod or sinks).
        compress_block, compress_stride, select_block, top_n, window, initial_blocks, local_blocks: as
            :func:`nsa_attention`; compress_hidden: φ's hidden width (default ``head_dim``).
        blocked: :func:`nsa_attention` (True) or :func:`nsa_attention_reference`.

    Shapes: ``x (B, T, d_model)`` → ``(B, T, d_model)``.

    Raises:
        TypeError / ValueError: see :func:`check_nsa_sizes`; an option NSA does not take (named); in
            ``forward``, a cache that does not keep every position
            (:func:`~attnlib.attention.block_sparse.check_full_cache`).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, compress_block: int = 32,
                 compress_stride: int = 16, select_block: int = 64, top_n: int = 16, window: int = 512,
                 initial_blocks: int = 1, local_blocks: int = 2, compress_hidden: int | None = None,
                 blocked: bool = True, **kwargs) -> None:
        check_nsa_sizes(compress_block, compress_stride, select_block, top_n, window, initial_blocks, local_blocks)
        refuse_options("NativeSparseAttention", kwargs, {"sliding_window": None, "chunk_size": None, "causal": True,
                                                         "dropout": 0.0, "score_mod": None, "sinks": False})
        super().__init__(d_model, n_heads, n_kv_heads, **kwargs)
        self.sizes = dict(compress_block=compress_block, compress_stride=compress_stride, select_block=select_block,
                          top_n=top_n, window=window, initial_blocks=initial_blocks, local_blocks=local_blocks)
        self.compress_k = BlockCompressor(compress_block, self.head_dim, compress_hidden)
        self.compress_v = BlockCompressor(compress_block, self.head_dim, compress_hidden)
        self.gate_proj = nn.Linear(d_model, 3 * n_heads)
        self.blocked = bool(blocked)

    def forward(self, x: torch.Tensor, context=None, *, mask=None, attention_mask=None, cache=None,
                positions: torch.Tensor | None = None, return_weights: bool = False) -> torch.Tensor:
        """``(B, T, d_model)`` → ``(B, T, d_model)``; ``cache``: a :class:`~attnlib.cache.LayerCache` (the new
        positions follow its ``cache.length``); ``positions`` ``(B, T)`` for RoPE (default ``cache.length, …``).
        :meth:`MultiHeadAttention.forward`'s signature; ValueError for the other arguments (not supported)."""
        q, k, v = checked_projection(self, x, context, mask, attention_mask, cache, positions, return_weights)
        B, T, _ = x.shape
        gates = torch.sigmoid(self.gate_proj(x)).view(B, T, self.n_heads, 3).transpose(1, 2)  # (B, H, T, 3)
        fn = nsa_attention if self.blocked else nsa_attention_reference
        y = fn(q, k, v, gates, self.compress_k, self.compress_v, **self.sizes, scale=self.scale)
        return self.merge(y)
