"""Block-sparse attention: each query attends to a few blocks of keys it chooses. Chapter 21.

Two ways of choosing, each in a readable form (an explicit ``(T, T)`` mask over every key, the
definition, attended with :func:`~attnlib.attention.functions.attention`) and a blocked form (the
chosen blocks gathered, ``T · k · block`` scores, no ``T × T`` mask), equal to each other:

* **MoBA** (Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs", §2.2): keys
  split into blocks ``I_i`` of ``moba_chunk_size`` positions; query ``q`` scores each block by its
  gate ``s_i = ⟨q, mean_pool(K[I_i])⟩``, future blocks ``-∞``, its own block ``+∞`` (always chosen,
  causal within it); the ``moba_topk`` blocks of highest ``s_i`` form ``I = ∪ I_i`` and
  ``MoBA(q, K, V) = Softmax(q K[I]ᵀ) V[I]``: one softmax over the union. Here: :func:`moba_attention_reference`,
  :func:`moba_attention`, :class:`MoBAAttention`.
* **NSA**'s selected branch (Yuan et al. 2025, §3.3.2) chooses blocks the same way from other scores:
  :mod:`attnlib.attention.native_sparse`, which uses the helpers here (:func:`select_blocks`,
  :func:`gather_blocks`, :func:`attend_gathered`).

No ``transformers`` reference exists for MoBA or NSA (no model there uses them): the two forms check
each other, and the readable form's explicit mask is the independent reference. Ties between equal gate
scores go to the earlier block in both forms (a stable sort).

Both forms take queries that are the *last* ``T_q`` of ``T_k`` positions (``T_q <= T_k``): query ``i``
sits at position ``T_k - T_q + i`` (:func:`query_positions`), as when decoding with a KV cache. Its gate
sees the complete blocks before its own (their means need no key it has not seen) and its own block, which
it always takes, causal within it; so a query's output is the same whether its past came in the same call
or from a cache. The layers take a :class:`~attnlib.cache.LayerCache` of every position
(:func:`check_full_cache`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlib._checks import positive_int
from attnlib.attention.functions import attention, check_attention_inputs
from attnlib.attention.inputs import check_layer_inputs
from attnlib.attention.masks import causal_mask, masked_softmax
from attnlib.attention.multi_head import MultiHeadAttention, refuse_options

__all__ = [
    "MoBAAttention",
    "attend_gathered",
    "check_full_cache",
    "check_self_attention",
    "checked_projection",
    "refuse_forward_options",
    "choose_blocks_readable",
    "gather_blocks",
    "moba_attention",
    "moba_attention_reference",
    "query_positions",
    "select_blocks",
]


def check_self_attention(q, k, v, scale) -> None:
    """Raise unless ``q (B, n_heads, T_q, d)``, ``k (B, n_kv_heads, T_k, d)``, ``v (B, n_kv_heads, T_k, d_v)``
    fit causal self-attention of the last ``T_q`` of ``T_k`` positions (:func:`check_attention_inputs`, 4-D,
    ``T_q <= T_k``)."""
    check_attention_inputs(q, k, v, None, True, scale)  # is_causal: T_q <= T_k, named
    if q.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, n_heads, T, head_dim); got q {tuple(q.shape)}")


def query_positions(T_q: int, T_k: int, device) -> torch.Tensor:
    """``(T_q,)`` int64: the positions ``T_k - T_q, …, T_k - 1`` of the last ``T_q`` of ``T_k`` positions."""
    return torch.arange(T_k - T_q, T_k, device=device)


def refuse_forward_options(layer: str, context, mask, attention_mask, return_weights) -> None:
    """Raise ValueError naming what a block-sparse layer's ``forward`` does not take yet (same signature as
    :meth:`MultiHeadAttention.forward`): a context, mask, padding mask or returned weights."""
    given = [name for name, value in (("context", context), ("mask", mask), ("attention_mask", attention_mask))
             if value is not None] + (["return_weights"] if return_weights else [])
    if given:
        raise ValueError(f"{layer} is causal self-attention without masks or weights; got {given}")


def check_full_cache(layer: str, cache, T_new: int) -> None:
    """Raise ValueError unless ``cache`` returns every past position, in order, at this step.

    MoBA's gate and NSA's compressed blocks read keys anywhere in the past, so a cache that drops positions
    (a window, a chunk, an evicting cache), renumbers them (a sink cache) or holds something else (a
    recurrent state, compressed entries) would change the output. Asked through the protocol: the positions
    a query at the last new position needs (``cache.needed``) must be all of them.
    """
    name = type(cache).__name__
    if getattr(cache, "renumbers", False) or getattr(cache, "mask_mod", None) is not None:
        raise ValueError(f"{layer} needs a cache of every position at its own position (a LayerCache); "
                         f"{name} renumbers positions or masks keys")
    if getattr(cache, "needs_weights", False) or not callable(getattr(cache, "needed", None)):
        raise ValueError(f"{layer} needs a cache of every position's keys and values (a LayerCache, "
                         f"layer.new_cache()); got {name}")
    last = cache.length + T_new - 1
    if cache.needed(last).tolist() != list(range(last)):
        raise ValueError(f"{layer} needs a cache of every position (a LayerCache, layer.new_cache()); {name} "
                         f"drops some of the {last} past positions")


def checked_projection(layer, x, context, mask, attention_mask, cache, positions, return_weights):
    """A block-sparse layer's forward up to its attention: refuse what it does not take (see
    :func:`refuse_forward_options`, :func:`check_full_cache`), check ``x`` and ``positions``, and return
    ``layer.project``'s ``q (B, H, T, hd)`` and ``k, v (B, n_kv, T_k, hd)``: with a cache, its past
    positions and the new (``T_k = cache.length + T`` before the call)."""
    refuse_forward_options(type(layer).__name__, context, mask, attention_mask, return_weights)
    check_layer_inputs(layer, x, None, None, None, cache, positions)
    if cache is not None:
        check_full_cache(type(layer).__name__, cache, x.shape[1])
    return layer.project(x, None, cache, positions)


def choose_blocks_readable(scores: torch.Tensor, allowed: torch.Tensor, forced: torch.Tensor, n: int) -> torch.Tensor:
    """The blocks each query chooses, query by query: its forced blocks, then the best others.

    Args:
        scores: ``(B, h, T, n_blocks)`` float gate scores.
        allowed, forced: ``(T, n_blocks)`` bool: the blocks a query may choose (causal), those it must.
        n: blocks per query, counting the forced ones (``n >= forced.sum(-1)`` for every query).

    Returns:
        ``(B, h, T, n_blocks)`` bool, ``True`` = chosen. Ties go to the earlier block.
    """
    chosen = torch.zeros(scores.shape, dtype=torch.bool)
    s = scores.detach().cpu().tolist()
    for t in range(scores.shape[2]):
        must = [j for j in range(scores.shape[3]) if forced[t, j]]
        may = [j for j in range(scores.shape[3]) if allowed[t, j] and not forced[t, j]]
        for b in range(scores.shape[0]):
            for h in range(scores.shape[1]):
                rest = sorted(may, key=lambda j: (-s[b][h][t][j], j))  # highest score, then earliest
                chosen[b, h, t, must + rest[: max(n - len(must), 0)]] = True
    return chosen.to(scores.device)


def select_blocks(scores: torch.Tensor, allowed: torch.Tensor, forced: torch.Tensor, n: int):
    """The same choice batched: ``(index (B, h, T, n'), valid (B, h, T, n'))`` with ``n' = min(n, n_blocks)``.

    Forced blocks score ``+∞``, blocks not allowed ``-∞``; a stable descending sort keeps the first ``n'``
    (ties to the earlier block, as :func:`choose_blocks_readable`); ``valid`` is False where a query has fewer
    than ``n'`` allowed blocks (the indices there point at blocks it must not read).
    """
    s = scores.masked_fill(forced, float("inf")).masked_fill(~allowed, float("-inf"))
    values, index = s.sort(dim=-1, descending=True, stable=True)  # (B, h, T, n_blocks)
    n = min(n, s.shape[-1])
    return index[..., :n], values[..., :n] > float("-inf")


def gather_blocks(x: torch.Tensor, block: int, index: torch.Tensor) -> torch.Tensor:
    """The blocks ``index (B, h, T_q, n)`` of ``x (B, h, T_k, d)`` cut into blocks of ``block`` positions
    (the last one zero-padded) → ``(B, h, T_q, n, block, d)``: each query's chosen keys, gathered."""
    B, h, T_k, d = x.shape
    n_blocks = -(-T_k // block)
    x = F.pad(x, (0, 0, 0, n_blocks * block - T_k)).reshape(B, h, n_blocks, block * d)  # (B, h, n_blocks, block·d)
    T, n = index.shape[-2:]
    flat = index.reshape(B, h, T * n, 1).expand(-1, -1, -1, block * d)
    return x.gather(2, flat).view(B, h, T, n, block, d)  # (B, h, T·n, block·d) -> (B, h, T, n, block, d)


def attend_gathered(q: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, valid: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Each query against its own gathered keys: one softmax over its ``M`` keys.

    Args:
        q: ``(B, n_heads, T, d)``; k_sel, v_sel: ``(B, h, T, M, d)`` and ``(B, h, T, M, d_v)``, ``h``
            dividing ``n_heads`` (query heads ``g·i … g·i + g - 1`` read key head ``i``, as GQA).
        valid: bool broadcastable to ``(B, h, T, M)``, ``True`` = may attend.

    Returns:
        ``(B, n_heads, T, d_v)``; a query with no valid key gets zeros.
    """
    B, H, T, d = q.shape
    h = k_sel.shape[1]
    qg = q.reshape(B, h, H // h, T, d) * scale  # (B, H, T, d) -> (B, h, group, T, d)
    scores = torch.einsum("bkgtd,bktmd->bkgtm", qg, k_sel)  # (B, h, group, T, M)
    weights = masked_softmax(scores, valid.unsqueeze(2))
    out = torch.einsum("bkgtm,bktmd->bkgtd", weights, v_sel)  # (B, h, group, T, d_v)
    return out.reshape(B, H, T, v_sel.shape[-1])


def _moba_checks(q, k, v, moba_chunk_size, moba_topk, scale) -> float:
    positive_int("moba_chunk_size", moba_chunk_size)
    positive_int("moba_topk", moba_topk)
    check_self_attention(q, k, v, scale)
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _moba_rules(T_q: int, T_k: int, chunk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``allowed, forced (T_q, n_blocks)``: blocks at or before the query's, and the query's own."""
    own = query_positions(T_q, T_k, device)[:, None] // chunk  # (T_q, 1): the query's block
    j = torch.arange(-(-T_k // chunk), device=device)[None, :]  # (1, n_blocks)
    return j <= own, j == own


def moba_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, moba_chunk_size: int,
                             moba_topk: int, scale: float | None = None) -> torch.Tensor:
    """MoBA written out (Lu et al. 2025, §2.2; chapter 21): gate, choice, one ``(T, T)`` mask, attention.

    No ``transformers`` reference exists; :func:`moba_attention` must equal this.

    Args:
        q: ``(B, n_heads, T_q, head_dim)``: the last ``T_q`` of the ``T_k`` positions (query ``i`` at
            ``T_k - T_q + i``; ``T_q = T_k`` for a whole sequence); k, v: ``(B, n_kv_heads, T_k, head_dim)``
            (GQA: each query head gates with its group's keys).
        moba_chunk_size: positions per block of keys, >= 1 (the last block may be shorter).
        moba_topk: blocks per query, >= 1, counting its own block; ``>= ceil(T_k / moba_chunk_size)`` gives
            full causal attention.
        scale: on ``q · k`` in the attention (not in the gate); default ``1 / √head_dim``.

    Returns:
        ``(B, n_heads, T_q, head_dim)``.

    Raises:
        TypeError / ValueError: a size that is not a positive int (named); inputs that do not fit
            (:func:`check_self_attention`).
    """
    scale = _moba_checks(q, k, v, moba_chunk_size, moba_topk, scale)
    B, H, T_q, _ = q.shape
    T_k = k.shape[2]
    n_blocks = -(-T_k // moba_chunk_size)
    k_h = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, n_kv, T_k, d) -> (B, H, T_k, d): each head's keys
    means = torch.stack([k_h[:, :, i * moba_chunk_size:(i + 1) * moba_chunk_size].mean(2) for i in range(n_blocks)],
                        dim=2)  # mean_pool(K[I_i]): (B, H, n_blocks, d); a query's own block is forced, never scored
    gate = q @ means.transpose(-2, -1)  # s_i = <q, mean_pool(K[I_i])>: (B, H, T_q, n_blocks)
    allowed, forced = _moba_rules(T_q, T_k, moba_chunk_size, q.device)
    chosen = choose_blocks_readable(gate, allowed, forced, moba_topk)  # (B, H, T_q, n_blocks)
    key_block = torch.arange(T_k, device=q.device) // moba_chunk_size  # the block of every key
    mask = chosen[..., key_block] & causal_mask(T_q, T_k, q.device)  # (B, H, T_q, T_k): the union I, causal
    return attention(q, k, v, mask, scale=scale)[0]


def moba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, moba_chunk_size: int, moba_topk: int,
                   scale: float | None = None) -> torch.Tensor:
    """MoBA, blocked (Lu et al. 2025, §2.2-2.3; chapter 21): the chosen blocks are gathered, no ``(T, T)`` mask.

    Block means by one ``view``; the gate ``(B, n_heads, T, n_blocks)``; :func:`select_blocks`; each query's
    ``moba_topk`` blocks gathered, ``T · moba_topk · moba_chunk_size`` scores. Same arguments, results and
    errors as :func:`moba_attention_reference` (no ``transformers`` reference exists).
    """
    scale = _moba_checks(q, k, v, moba_chunk_size, moba_topk, scale)
    B, H, T_q, d = q.shape
    T_k = k.shape[2]
    n_blocks = -(-T_k // moba_chunk_size)
    k_h, v_h = (x.repeat_interleave(H // k.shape[1], dim=1) for x in (k, v))  # per query head: its own choice
    padded = F.pad(k_h, (0, 0, 0, n_blocks * moba_chunk_size - T_k))
    means = padded.view(B, H, n_blocks, moba_chunk_size, d).mean(3)  # (B, H, n_blocks, d); last block: never scored
    allowed, forced = _moba_rules(T_q, T_k, moba_chunk_size, q.device)
    index, valid = select_blocks(q @ means.transpose(-2, -1), allowed, forced, moba_topk)  # (B, H, T_q, n)
    k_sel = gather_blocks(k_h, moba_chunk_size, index)  # (B, H, T_q, n, chunk, d)
    v_sel = gather_blocks(v_h, moba_chunk_size, index)
    pos = index[..., None] * moba_chunk_size + torch.arange(moba_chunk_size, device=q.device)  # (B, H, T_q, n, chunk)
    t = query_positions(T_q, T_k, q.device).view(T_q, 1, 1)
    keep = (valid[..., None] & (pos <= t)).flatten(-2)  # causal within the own block: (B, H, T_q, n·chunk)
    return attend_gathered(q, k_sel.flatten(3, 4), v_sel.flatten(3, 4), keep, scale)


class MoBAAttention(MultiHeadAttention):
    """Causal multi-head attention through MoBA (Lu et al. 2025, §2; chapter 21).

    Projections, GQA, RoPE and QK-norm as :class:`MultiHeadAttention`; the attention is
    :func:`moba_attention` (``blocked=True``) or :func:`moba_attention_reference`. No ``transformers``
    reference exists. No mask or padding yet.

    Cache: :meth:`new_cache` is a :class:`~attnlib.cache.LayerCache` of every position's keys and values
    (:attr:`cache_width` = ``2 · n_kv_heads · head_dim`` numbers a token): the gate's block means are
    recomputed from the cached keys at each step (one ``view`` and a mean), so token by token, in chunks or
    in one pass give the same output.

    Args:
        d_model, n_heads, n_kv_heads, **kwargs: as :class:`MultiHeadAttention` (causal self-attention; no
            sliding window, chunk, dropout, score_mod or sinks).
        moba_chunk_size: positions per block of keys; moba_topk: blocks per query (its own counted).
        blocked: which form runs.

    Shapes: ``x (B, T, d_model)`` → ``(B, T, d_model)``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, an option MoBA does not take (named); in
            ``forward``, a cache that does not keep every position (:func:`check_full_cache`).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, moba_chunk_size: int,
                 moba_topk: int, blocked: bool = True, **kwargs) -> None:
        positive_int("moba_chunk_size", moba_chunk_size)
        positive_int("moba_topk", moba_topk)
        refuse_options("MoBAAttention", kwargs, {"sliding_window": None, "chunk_size": None, "causal": True,
                                                 "dropout": 0.0, "score_mod": None, "sinks": False})
        super().__init__(d_model, n_heads, n_kv_heads, **kwargs)
        self.moba_chunk_size, self.moba_topk, self.blocked = moba_chunk_size, moba_topk, bool(blocked)

    def forward(self, x: torch.Tensor, context=None, *, mask=None, attention_mask=None, cache=None,
                positions: torch.Tensor | None = None, return_weights: bool = False) -> torch.Tensor:
        """``(B, T, d_model)`` → ``(B, T, d_model)``; ``cache``: a :class:`~attnlib.cache.LayerCache` (the new
        positions follow its ``cache.length``); ``positions`` ``(B, T)`` for RoPE (default ``cache.length, …``).
        :meth:`MultiHeadAttention.forward`'s signature; ValueError for the other arguments (not supported)."""
        q, k, v = checked_projection(self, x, context, mask, attention_mask, cache, positions, return_weights)
        fn = moba_attention if self.blocked else moba_attention_reference
        y = fn(q, k, v, moba_chunk_size=self.moba_chunk_size, moba_topk=self.moba_topk, scale=self.scale)
        return self.merge(y)
