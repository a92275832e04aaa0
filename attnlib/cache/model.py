"""A decoder's cache: one layer cache (or recurrent state) per layer, kept in step. Chapter 08."""
from __future__ import annotations

import torch

from attnlib._checks import non_negative_int, positive_int
from attnlib.cache.eviction import eviction_layers
from attnlib.cache.quantized import quantized_layers
from attnlib.cache.shared import kv_sources, link_shared
from attnlib.cache.windowed import SinkLayerCache

__all__ = ["KVCache"]

#: What every per-layer cache offers (:mod:`attnlib.cache.layer`, :class:`attnlib.cache.RecurrentState`).
PROTOCOL = ("length", "check_layer", "check_crop", "crop", "reorder", "reset", "nbytes", "bytes_per_token")


class KVCache:
    """The caches of a decoder's layers, one per layer. Chapter 08.

    Each layer's attention decides what its cache keeps (``layer.new_cache(block_size)``): a
    :class:`~attnlib.cache.LayerCache` for full attention, a ring for a sliding window, the current
    chunk for chunked attention, a :class:`~attnlib.cache.RecurrentState` for a linear-attention
    layer. :meth:`for_model` asks every layer of a model.

    Args:
        layers: one per-layer cache per layer of the model, in order.

    Raises:
        TypeError: ``layers`` not a non-empty list of per-layer caches (objects with the protocol's methods).

    Example::

        cache = model.new_cache()                       # = KVCache.for_model(model)
        logits, _ = model(prompt, cache=cache)          # prefill: the whole prompt at once
        logits, _ = model(next_token, cache=cache)      # decode: one new token against the cache
    """

    def __init__(self, layers: list) -> None:
        if isinstance(layers, (str, bytes, torch.Tensor)) or not hasattr(layers, "__iter__"):
            raise TypeError(f"layers must be a list of per-layer caches; got {type(layers).__name__}")
        layers = list(layers)
        if not layers:
            raise TypeError("layers must hold one per-layer cache per layer; got an empty list")
        for i, layer in enumerate(layers):
            missing = [name for name in PROTOCOL if not hasattr(layer, name)]
            if missing:
                raise TypeError(f"layers[{i}] ({type(layer).__name__}) is not a layer cache: it lacks {missing}")
        self.layers = layers

    @classmethod
    def for_model(cls, model, windows: bool = True) -> KVCache:
        """An empty cache for ``model``: what each of its layers asks for (``block.attn.new_cache``).

        ``windows=False``: a windowed or chunked layer gets a full cache too (its rule then applies as a
        mask): the same tokens, without the memory saving. A layer that shares another's keys and values
        (``block.attn.kv_source``, Gemma 4) gets a :class:`~attnlib.cache.SharedLayerCache` over its source's.
        """
        block_size, sources = model.config.block_size, kv_sources(model)
        return cls(link_shared([None if source is not None else block.attn.new_cache(block_size, windows=windows)
                                for block, source in zip(model.blocks, sources)], sources))

    @classmethod
    def streaming(cls, model, window: int, n_sink: int = 4, block_size: int | None = None) -> KVCache:
        """StreamingLLM (Xiao et al. 2023): every layer a :class:`~attnlib.cache.SinkLayerCache` of ``n_sink``
        sinks and ``window`` recent positions, for a stream of up to ``block_size`` tokens (default: the
        model's; a stream may be longer). Chapter 17.
        """
        positive_int("window", window)
        shared = [i for i, source in enumerate(kv_sources(model)) if source is not None]
        if shared:
            raise ValueError(f"layers {shared} share other layers' keys and values: a sink cache, which renumbers "
                             "positions, cannot serve them")
        block_size = model.config.block_size if block_size is None else block_size
        return cls([SinkLayerCache(block_size, window, n_sink) for _ in model.blocks])

    @classmethod
    def quantized(cls, model, scheme: str = "int8", *, group_size: int = 32, residual_length: int = 128,
                  block_size: int | None = None) -> KVCache:
        """Keys and values in fewer bits (chapter 19): ``scheme="int8"`` (:class:`~attnlib.cache.Int8LayerCache`,
        a scale per token and head) or ``"kivi4"``/``"kivi2"`` (:class:`~attnlib.cache.KIVILayerCache`: KIVI,
        Liu et al. 2024, keys per channel over ``group_size`` tokens, values per token, the last
        ``residual_length`` or more tokens in full precision). Every position is kept; see
        :func:`attnlib.cache.quantized.quantized_layers` for what is refused (MLA, linear-attention layers).
        """
        return cls(quantized_layers(model, scheme, group_size=group_size, residual_length=residual_length,
                                    block_size=block_size))

    @classmethod
    def eviction(cls, model, method: str = "h2o", *, budget: int, recent: int | None = None, window: int = 32,
                 kernel_size: int = 5, pooling: str = "avgpool", block_size: int | None = None) -> KVCache:
        """Keys kept by their attention, ``budget`` per row and key/value head (chapter 17): ``method="h2o"``
        (:class:`~attnlib.cache.H2OLayerCache`: Zhang et al. 2023, the ``recent`` latest and the heavy hitters) or
        ``"snapkv"`` (:class:`~attnlib.cache.SnapKVLayerCache`: Li et al. 2024, the prompt's keys voted for by its
        last ``window`` queries). Windowed and chunked layers keep their own window; see
        :func:`attnlib.cache.eviction.eviction_layers` for what is refused (MLA, linear and KV-shared layers).
        """
        return cls(eviction_layers(model, method, budget=budget, recent=recent, window=window,
                                   kernel_size=kernel_size, pooling=pooling, block_size=block_size))

    @property
    def length(self) -> int:
        """Positions cached so far.

        Raises:
            ValueError: the layers hold different numbers of positions (a cache that fell out of step).
        """
        lengths = {layer.length for layer in self.layers}
        if len(lengths) != 1:
            raise ValueError(f"the cache's layers hold different numbers of positions {sorted(lengths)}; reset it")
        return lengths.pop()

    @property
    def renumbers(self) -> bool:
        """Whether every layer numbers positions within itself (a stream may then outlast ``block_size``)."""
        return all(layer.renumbers for layer in self.layers)

    def reset(self) -> None:
        """Forget every position in every layer, keeping the buffers."""
        for layer in self.layers:
            layer.reset()

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on in every layer (see :meth:`attnlib.cache.LayerCache.crop`).

        Raises:
            TypeError / ValueError: ``length`` not an int >= 0; a layer that cannot crop there (checked in
                every layer before any changes, so the cache stays in step).
        """
        non_negative_int("length", length)
        for layer in self.layers:
            layer.check_crop(length)
        for layer in self.layers:
            layer.crop(length)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` in every layer (beam search)."""
        for layer in self.layers:
            layer.reorder(index)

    def bytes_per_token(self) -> int:
        """Bytes per cached position of one sequence, all layers, measured from the tensors."""
        return sum(layer.bytes_per_token() for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes allocated by all layers."""
        return sum(layer.nbytes() for layer in self.layers)
