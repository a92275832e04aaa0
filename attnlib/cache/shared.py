"""Caches for cross-layer KV sharing (Brandon et al. 2024; Gemma 4): a layer that attends with another's keys
and values keeps none of its own. Chapter 20.

A shared layer's cache is a :class:`SharedLayerCache` over its source layer's cache: it allocates nothing,
and its ``update()`` (no tensors) returns what the source's cache returned in its last update, in the same
forward pass: the source's past keys it still keeps and the new ones, with their positions
(``key_positions``). Without a model cache, the sources get a :class:`ForwardLayerCache` for the one forward
pass (it keeps nothing, and hands its keys and values on): :func:`forward_caches`. So a shared layer reads its
source's keys and values the same way cached or not, and ``KVCache.nbytes()`` counts the source layers only.
"""
from __future__ import annotations

import torch

from attnlib._checks import non_negative_int
from attnlib.cache.layer import LayerCache

__all__ = ["ForwardLayerCache", "SharedLayerCache", "forward_caches", "kv_sources", "link_shared"]


class ForwardLayerCache(LayerCache):
    """The keys and values of one forward pass, kept for the layers that share them and never stored:
    :meth:`update` returns the new tensors as given (gradients flow through them). Chapter 20."""

    def store(self, new: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
        return tuple(new)


class SharedLayerCache:
    """A shared layer's cache: what its source layer's cache returned last, and nothing of its own. Chapter 20.

    Args:
        source: the source layer's cache (a :class:`~attnlib.cache.LayerCache` or one of its subclasses).

    Raises:
        TypeError: ``source`` is not a layer cache that keeps what it returned. ValueError on :meth:`update`:
            tensors given, or a source that has not just updated the positions this layer is at (the layers
            ran out of order).
    """

    renumbers = False

    def __init__(self, source) -> None:
        if not hasattr(source, "returned") or not callable(getattr(source, "update", None)) or source.renumbers:
            raise TypeError(f"source must be a layer cache that keeps its last update (LayerCache, a ring, a chunk; "
                            f"not a sink cache); got {type(source).__name__}")
        self.source = source
        source.keep_returned = True  # the source now keeps what its last update returned
        self._length = 0
        self._start = 0

    @property
    def mask_mod(self):
        """The source cache's own rule on which keys a query sees."""
        return self.source.mask_mod

    @property
    def length(self) -> int:
        """Positions this layer has seen."""
        return self._length

    @property
    def key_positions(self) -> torch.Tensor:
        """The positions of the keys the last :meth:`update` returned: the source's."""
        return self.source.key_positions

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The source's last returned keys and values; ``new`` must be empty (a shared layer computes none)."""
        if new:
            raise ValueError(f"a shared layer computes no keys or values; update() takes none, got {len(new)}")
        start, end = self.source.returned_span
        if start != self._length or end <= start:
            raise ValueError(f"the source cache last added positions {start}..{end - 1} but this shared layer is at "
                             f"position {self._length}: the source layer must run first in the same forward pass")
        self._start, self._length = start, end
        return self.source.returned

    def check_layer(self, layer, masked: bool) -> None:
        """Nothing to refuse: the source's cache checked its own layer."""

    def check_crop(self, length: int) -> None:
        non_negative_int("length", length)

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on (the source crops its own tensors)."""
        self.check_crop(length)
        self._length = min(self._length, length)

    def reorder(self, index: torch.Tensor) -> None:
        """Nothing to reorder: the source reorders its tensors."""

    def reset(self) -> None:
        self._length = 0

    @property
    def capacity(self) -> int:
        """Slots it keeps: none (its source keeps the keys and values)."""
        return 0

    def bytes_per_token(self) -> int:
        return 0

    def nbytes(self) -> int:
        return 0


def kv_sources(model) -> list[int | None]:
    """Each layer's source of keys and values (``block.attn.kv_source``), None for a layer with its own."""
    return [getattr(block.attn, "kv_source", None) for block in model.blocks]


def link_shared(caches: list, sources: list[int | None]) -> list:
    """``caches`` with every shared layer's entry a :class:`SharedLayerCache` over its source's.

    Raises:
        ValueError: a source that comes after its layer, or that has no cache.
    """
    caches = list(caches)
    for layer, source in enumerate(sources):
        if source is None:
            continue
        if not 0 <= source < layer or caches[source] is None:
            raise ValueError(f"layer {layer} shares the keys and values of layer {source}, which must be an earlier "
                             "layer with a cache")
        caches[layer] = SharedLayerCache(caches[source])
    return caches


def forward_caches(model) -> list:
    """The per-layer caches of one uncached forward pass: None for each layer, except that the layers whose keys
    and values are shared get a :class:`ForwardLayerCache` and the layers sharing them a :class:`SharedLayerCache`."""
    sources = kv_sources(model)
    used = {s for s in sources if s is not None}
    block_size = model.config.block_size
    return link_shared([ForwardLayerCache(block_size) if i in used else None for i in range(len(sources))], sources)
