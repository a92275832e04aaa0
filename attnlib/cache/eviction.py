"""Caches that evict keys by their attention: H2O's heavy hitters and SnapKV's observation window. Chapter 17.

A window (:class:`~attnlib.cache.RingLayerCache`) or StreamingLLM's sinks (:class:`~attnlib.cache.SinkLayerCache`)
keep positions chosen by *where* they are. The caches here keep those the model *attends to*, chosen per
batch row and key/value head from the attention weights of the step just computed:

* :class:`H2OLayerCache`: H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
  of Large Language Models", NeurIPS 2023, §3-4): every key's attention, summed over every query that has
  seen it, is its score; after each step the cache keeps the ``recent`` latest positions and the
  ``budget - recent`` other keys of the highest accumulated score (the "heavy hitters"), never more than
  ``budget`` positions;
* :class:`SnapKVLayerCache`: SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
  Generation", §4): once, after the prompt, the last ``window`` prompt queries (the observation window) vote
  for the earlier prompt keys: their weights summed over the window's queries, pooled along keys (a 1-D
  max or average pool of ``kernel_size``, padding ``kernel_size // 2``, stride 1), the top ``budget -
  window`` kept with the window itself; decoding then appends every new position.

**The hook.** Eviction needs this step's attention weights, which only the layer has. A cache whose
``needs_weights`` is true gets them: the layer (:class:`~attnlib.attention.multi_head.MultiHeadAttention`)
attends with the eager function, which returns them, and calls :meth:`observe` with them right after
attending. The new positions wait (``update`` returns past + new, as every cache does) until
:meth:`observe` has chosen what stays; only then are they written into the ``budget`` slots.

**Heads.** Each ``(row, key/value head)`` keeps its own positions: keys and values are stored gathered,
``(B, n_kv_heads, held, head_dim)``, each head's in position order, and :attr:`key_positions` is
``(B, n_kv_heads, T_k)`` (not the ``(T_k,)`` of the other caches). Every head keeps as many, so the tensors
stay rectangular. With GQA a group's query heads share their key/value head's choice: their weights are
summed over the group (H2O: before accumulating; SnapKV: after pooling, as SnapKV's own GQA code sums
and kvpress averages, which ranks the same).

**Positions.** Keys are cached after RoPE, at their original positions, and a new query is rotated at its
own (``length``): the offsets between query and kept keys are the true ones, nothing is renumbered
(:attr:`renumbers` is false, unlike :class:`~attnlib.cache.SinkLayerCache`, which stores keys unrotated and
renumbers them within the cache), and a sequence stays within ``block_size``. Causality needs no mask: every
kept past key precedes every new query, and the new keys come last, in order (the layer's bottom-right
causal mask).

**Measured** (``tests/test_kv_eviction.py::test_logit_error_at_half_budget``; a random 2-layer Llama-style
decoder, d_model 32, 4 query / 2 key-value heads, logits up to 0.37; a 40-token prompt then 8 decoded tokens,
T = 48; budget T/2 = 24 positions per layer; |Δlogit| against the full cache over the decoded steps, max / mean):
a window of 24 (``KVCache.streaming(window=24, n_sink=0)``): 2.9e-2 / 7.1e-3; 4 sinks + 20 recent: 3.0e-2 /
7.9e-3; H2O (12 recent + 12 heavy): 2.3e-2 / 4.9e-3; SnapKV (window 8, kernel 5, avgpool): 1.9e-2 / 4.8e-3.
An untrained model attends diffusely, so this ranks nothing; it shows the scale of the change.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from attnlib._checks import non_negative_int, positive_int
from attnlib.cache.layer import LayerCache
from attnlib.cache.per_head import EvictingLayerCache
from attnlib.cache.shared import kv_sources

__all__ = ["METHODS", "POOLINGS", "H2OLayerCache", "SnapKVLayerCache", "eviction_layers"]

#: The methods of :func:`eviction_layers`.
METHODS = ("h2o", "snapkv")
#: SnapKV's poolings of the vote along keys (its code's names).
POOLINGS = ("avgpool", "maxpool")


class H2OLayerCache(EvictingLayerCache):
    """H2O: the ``recent`` latest positions and the heavy hitters, ``budget`` at most per row and head. Chapter 17.

    Zhang et al. 2023 (H2O, NeurIPS 2023, §3.2 Alg. 1, §4). Each held key's score is the attention it has
    received, summed over every query since it entered (the prompt's queries included) and over the query
    heads that share its key/value head. After each step, if more than ``budget`` positions are held, the
    cache keeps the last ``recent`` and, among the others, the ``budget - recent`` of the highest score
    (H2O's code keeps one score per head for the whole batch; here each row has its own). ``budget`` slots
    are allocated; the step's new positions are held only until :meth:`observe`.

    Args:
        block_size: the most positions a sequence may reach (the model's ``block_size``).
        budget: positions kept per row and head, an int >= 1.
        recent: of which the latest, an int in ``[0, budget]`` (H2O: half the budget).

    Raises:
        TypeError / ValueError: a bad size, ``budget < recent`` (named); on :meth:`update`, anything but keys and
            values ``(B, n_kv_heads, T_new, head_dim)``, a second update before :meth:`observe`, or what
            :class:`~attnlib.cache.LayerCache` refuses; in :meth:`check_layer`, see there; :meth:`crop` back
            into the sequence (the scores of what was evicted are lost), except to 0.
    """

    def __init__(self, block_size: int, budget: int, recent: int) -> None:
        super().__init__(block_size, budget)
        non_negative_int("recent", recent)
        if budget < recent:
            raise ValueError(f"budget={budget} is below the recent window recent={recent}: it must hold it")
        self.recent = recent
        self.scores: torch.Tensor | None = None  # (B, n_kv_heads, budget) float32: accumulated attention per slot

    def allocate(self, k: torch.Tensor, T_new: int) -> None:
        super().allocate(k, T_new)
        self.scores = torch.zeros(*k.shape[:2], self.budget, dtype=torch.float32, device=k.device)

    def choose(self, grouped: torch.Tensor) -> torch.Tensor:
        B, H, _, _, T_k = grouped.shape
        received = grouped.sum(dim=(2, 3))  # (B, H, T_k): over the group's query heads and this step's queries
        received[..., :self._held] += self.scores[..., :self._held]
        if T_k <= self.budget:
            index = torch.arange(T_k, device=received.device).expand(B, H, T_k)
        else:  # positions ascend along the keys, so the last `recent` are the recent window
            heavy = received[..., :T_k - self.recent].topk(self.budget - self.recent, dim=-1).indices.sort(-1).values
            recent = torch.arange(T_k - self.recent, T_k, device=received.device).expand(B, H, self.recent)
            index = torch.cat([heavy, recent], dim=-1)
        self.scores[..., :index.shape[-1]] = received.gather(2, index)
        return index

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        if self.scores is not None:
            self.scores = self.scores.index_select(0, index.to(self.scores.device))

    def nbytes(self) -> int:
        """Bytes allocated: keys, values, positions and scores (float32) of every slot."""
        return super().nbytes() + (0 if self.scores is None else self.scores.numel() * self.scores.element_size())

    def bytes_per_token(self) -> int:
        return super().bytes_per_token() + (0 if self.scores is None else self.scores[:1, :, :1].numel() * 4)


class SnapKVLayerCache(EvictingLayerCache):
    """SnapKV: after the prompt, an observation window's vote keeps ``budget`` prompt positions. Chapter 17.

    Li et al. 2024 (SnapKV, §4.1-4.2, Listing 1). The first :meth:`update` is the prompt, ``T_p`` positions.
    If ``T_p > budget``, each row and key/value head keeps the last ``window`` prompt positions and the
    ``budget - window`` earlier ones of the highest vote: the weights of the window's queries on them, summed
    over those queries, pooled along keys (``pooling``: ``"avgpool"``, zeros padding counted, or ``"maxpool"``)
    per query head, then summed over the group's query heads. Later updates append every position (SnapKV
    compresses the prompt only), so the cache holds ``min(T_p, budget) + (positions decoded)``: its buffers
    are allocated at the prompt for ``min(T_p, budget) + block_size - T_p`` positions, all a sequence can
    still reach (a :meth:`reset` frees them for the next prompt).

    Args:
        block_size: the most positions a sequence may reach (the model's ``block_size``).
        budget: prompt positions kept, an int >= ``window``.
        window: the observation window, an int >= 1 (default 32).
        kernel_size: the pooling's width, an odd int >= 1 (default 5, as kvpress after SnapKV's code).
        pooling: one of :data:`POOLINGS`.

    Raises:
        TypeError / ValueError: a bad size, ``budget < window``, an even ``kernel_size``, an unknown ``pooling``
            (named); as :class:`H2OLayerCache` on :meth:`update` and :meth:`check_layer`; :meth:`crop` into
            the prompt (except to 0).
    """

    def __init__(self, block_size: int, budget: int, window: int = 32, kernel_size: int = 5,
                 pooling: str = "avgpool") -> None:
        super().__init__(block_size, budget)
        positive_int("window", window)
        positive_int("kernel_size", kernel_size)
        if budget < window:
            raise ValueError(f"budget={budget} is below the observation window window={window}: it must hold it")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={kernel_size} must be odd (the pooled vote keeps the keys' length)")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}; got {pooling!r}")
        self.window, self.kernel_size, self.pooling = window, kernel_size, pooling
        self.needs_weights = True  # until the prompt is compressed
        self.prompt_length = 0
        self._capacity = budget

    @property
    def capacity(self) -> int:
        return self._capacity

    def allocate(self, k: torch.Tensor, T_new: int) -> None:
        self._capacity = min(T_new, self.budget) + self.block_size - T_new
        super().allocate(k, T_new)

    def choose(self, grouped: torch.Tensor) -> torch.Tensor:
        B, H, G, T_p, _ = grouped.shape
        self.needs_weights, self.prompt_length = False, T_p
        if T_p <= self.budget:
            return torch.arange(T_p, device=grouped.device).expand(B, H, T_p)
        vote = grouped[..., -self.window:, :T_p - self.window].sum(dim=-2)  # (B, H, G, T_p - window)
        pool = F.avg_pool1d if self.pooling == "avgpool" else F.max_pool1d
        pooled = pool(vote.reshape(B * H, G, -1), self.kernel_size, stride=1, padding=self.kernel_size // 2)
        pooled = pooled.view(B, H, G, -1).sum(dim=2)  # per query head, then over the group
        top = pooled.topk(self.budget - self.window, dim=-1).indices.sort(-1).values
        window = torch.arange(T_p - self.window, T_p, device=grouped.device).expand(B, H, self.window)
        return torch.cat([top, window], dim=-1)

    def croppable(self) -> int:
        return self.prompt_length

    def reset(self) -> None:
        super().reset()
        self.buffers, self.positions, self._capacity = [], None, self.budget
        self.needs_weights, self.prompt_length = True, 0


def eviction_layers(model, method: str, *, budget: int, recent: int | None = None, window: int = 32,
                    kernel_size: int = 5, pooling: str = "avgpool", block_size: int | None = None) -> list:
    """One evicting cache per full-attention layer of ``model`` (:meth:`attnlib.cache.KVCache.eviction`).

    A layer with a sliding window or chunk gets its own window cache (``layer.new_cache``: already bounded).

    Args:
        model: a decoder (``model.blocks``, ``model.config.block_size``).
        method: ``"h2o"`` (:class:`H2OLayerCache`, ``recent`` default ``budget // 2``) or ``"snapkv"``
            (:class:`SnapKVLayerCache`: ``window``, ``kernel_size``, ``pooling``).
        budget: positions kept per row and key/value head. block_size: the most positions (default: the model's).

    Raises:
        ValueError: an unknown ``method``; layers that share other layers' keys and values (Gemma 4); an MLA
            layer; a linear-attention layer; a bad size (as the caches).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    block_size = model.config.block_size if block_size is None else block_size
    positive_int("block_size", block_size)

    def new():
        if method == "h2o":
            return H2OLayerCache(block_size, budget, budget // 2 if recent is None else recent)
        return SnapKVLayerCache(block_size, budget, window, kernel_size, pooling)

    new()  # checks the sizes once, before any layer
    shared = [i for i, source in enumerate(kv_sources(model)) if source is not None]
    if shared:
        raise ValueError(f"layers {shared} share other layers' keys and values: an evicting cache ({method!r}), "
                         "which keeps other keys per head, cannot serve them")
    caches = []
    for i, block in enumerate(model.blocks):
        if getattr(block.attn, "kv_latent_dim", None) is not None:
            raise ValueError(f"layer {i} is multi-head latent attention (kv_latent_dim={block.attn.kv_latent_dim}): "
                             f"its cache holds a latent, not per-head keys to evict with method={method!r}")
        own = block.attn.new_cache(block_size)
        if not isinstance(own, LayerCache):
            kind = getattr(model.config, "layer_types", None)
            raise ValueError(f"layer {i} ({kind[i] if kind else type(block.attn).__name__!r}) keeps a recurrent "
                             f"state, not keys per token: method={method!r} cannot evict from it")
        windowed = getattr(block.attn, "mask_mod", None) is not None
        caches.append(own if windowed else new())
    return caches
