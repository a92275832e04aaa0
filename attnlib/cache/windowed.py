"""Layer caches that keep only some positions: a window, sinks and a window, the current chunk. Chapter 17.

Each is a :class:`~attnlib.cache.layer.LayerCache` that differs only in where a position goes
(:meth:`slots`: a ring of fixed size) and which positions it keeps (:meth:`held`) and returns
(:meth:`needed`): its memory stays fixed however long the sequence grows. What a query may see
among the returned keys is the layer's rule (its window or chunk) and, for the sink cache, the
cache's own (:attr:`~attnlib.cache.layer.LayerCache.mask_mod`).
"""
from __future__ import annotations

import torch

from attnlib._checks import positive_int
from attnlib.cache.layer import LayerCache

__all__ = ["ChunkedLayerCache", "RingLayerCache", "SinkLayerCache"]


class _KeptCache(LayerCache):
    """The update of a cache with fewer slots than positions: read the needed past, then overwrite."""

    def __init__(self, block_size: int, capacity: int) -> None:
        super().__init__(block_size)
        self._capacity = capacity
        self._key_positions = torch.empty(0, dtype=torch.long)  # of the keys the last update returned
        self._slot_positions = torch.full((capacity,), -1, dtype=torch.long)  # the position each slot holds

    @property
    def capacity(self) -> int:
        return self._capacity

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.capacity

    def held(self, length: int) -> torch.Tensor:
        """The positions below ``length`` that the slots hold now, in order: what was written last into each
        slot (after a crop, a slot may still hold a position past the new length, which counts for nothing)."""
        stored = self._slot_positions
        return stored[(stored >= 0) & (stored < length)].sort().values

    @property
    def key_positions(self) -> torch.Tensor:
        return self._key_positions

    def reset(self) -> None:
        super().reset()
        self._key_positions = torch.empty(0, dtype=torch.long)
        self._slot_positions.fill_(-1)

    def still_held(self, fresh: torch.Tensor, end: int) -> torch.Tensor:
        """Which of the new positions ``fresh`` the slots still hold once ``end`` positions are written (bool)."""
        return fresh >= end - self.capacity

    def store(self, new: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
        end, device = start + new[0].shape[-2], new[0].device
        needed, fresh = self.needed(start), torch.arange(start, end)
        self._key_positions = torch.cat([needed, fresh])
        past = self.slots(needed).to(device)
        keep = fresh[self.still_held(fresh, end)]  # only these can be needed again: the rest would be overwritten
        slots, rows = self.slots(keep).to(device), (keep - start).to(device)
        out = []
        for i, t in enumerate(new):
            buffer = self.buffer(i, t)
            out.append(torch.cat([buffer.index_select(-2, past), t], dim=-2))  # (..., n_past + T_new, w)
            buffer.index_copy_(buffer.dim() - 2, slots, t.index_select(-2, rows))
        self._slot_positions[self.slots(keep)] = keep
        return tuple(out)

    def check_room(self, end: int) -> None:
        if end > self.block_size:
            raise ValueError(f"the cache has seen {self.length} positions and block_size={self.block_size}; "
                             f"cannot add {end - self.length} more")


class RingLayerCache(_KeptCache):
    """The last ``window`` positions, in a ring buffer: a sliding-window layer's cache. Chapter 17.

    No query of a layer with a sliding window (Mistral; Gemma's local layers) looks further back
    than ``window - 1`` positions, so older keys and values can go: position ``p`` is written to slot
    ``p mod window``. :meth:`update` returns the last ``window - 1`` positions and the new ones
    (``window - 1 + T_new``), which the layer's window mask trims per query.

    Args:
        block_size: the most positions a sequence may reach (the model's ``block_size``).
        window: positions kept (the layer's ``sliding_window``), an int >= 1.

    Raises:
        ValueError: as :class:`~attnlib.cache.layer.LayerCache`; a window that is not an int >= 1;
            in :meth:`crop`, a length further back than the ring keeps; in :meth:`check_layer`, a layer
            whose window is larger (or that has none).
    """

    def __init__(self, block_size: int, window: int) -> None:
        positive_int("window", window)
        super().__init__(block_size, window)
        self.window = window

    def needed(self, length: int) -> torch.Tensor:
        return torch.arange(max(0, length - self.window + 1), length)

    def check_layer(self, layer, masked: bool) -> None:
        if getattr(layer, "sliding_window", None) is None or layer.sliding_window > self.window:
            raise ValueError(f"a ring cache of window={self.window} drops keys this layer "
                             f"(sliding_window={getattr(layer, 'sliding_window', None)}) still attends to")


class SinkLayerCache(_KeptCache):
    """Attention sinks + a window: StreamingLLM's cache (Xiao et al. 2023, §3.2). Chapter 17.

    Keeps the first ``n_sink`` positions for ever and the last ``window`` in a ring, so
    ``n_sink + window`` positions at most, however long the stream. The first tokens stay
    because a trained model parks attention it does not need on them ("attention sinks");
    dropping them, as a plain window does, breaks the model once the stream passes the window.
    Query ``p`` sees the sinks and keys ``p - window < j <= p`` (:attr:`mask_mod`).

    Positions are those *within the cache* (the paper's §3.2): keys are stored before RoPE and
    rotated when read, at ``0, 1, …`` in cache order (:attr:`renumbers`), so no position exceeds
    what the model saw in training.

    Args:
        block_size: bound on the stream's length (it may exceed the model's ``block_size``).
        window: recent positions kept (the query itself included), an int >= 1.
        n_sink: first positions kept, an int >= 0 (StreamingLLM: 4), at most ``window``.

    Raises:
        ValueError: a window < 1, ``n_sink`` < 0 or larger than the window (named); as
            :class:`~attnlib.cache.layer.LayerCache`; in :meth:`check_layer`, a padding mask, a layer
            without RoPE, or one whose own window is smaller than the cache's.
    """

    renumbers = True

    def __init__(self, block_size: int, window: int, n_sink: int = 4) -> None:
        positive_int("window", window)
        if isinstance(n_sink, bool) or not isinstance(n_sink, int):
            raise TypeError(f"n_sink must be an int >= 0, got {n_sink!r}")
        if n_sink < 0:
            raise ValueError(f"n_sink must be an int >= 0, got {n_sink!r}")
        if n_sink > window:
            raise ValueError(f"n_sink={n_sink} is larger than window={window}: the sinks would outnumber the window")
        super().__init__(block_size, n_sink + window)
        self.window, self.n_sink = window, n_sink

        def mask_mod(b, h, q_idx, kv_idx):  # the sinks, and the keys within the window (causality is the layer's)
            return (kv_idx < n_sink) | (q_idx - kv_idx < window)

        self.mask_mod = mask_mod

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.where(positions < self.n_sink, positions, self.n_sink + (positions - self.n_sink) % self.window)

    def still_held(self, fresh: torch.Tensor, end: int) -> torch.Tensor:
        return (fresh < self.n_sink) | (fresh >= end - self.window)

    def needed(self, length: int) -> torch.Tensor:
        sinks = torch.arange(min(length, self.n_sink))
        return torch.cat([sinks, torch.arange(min(length, max(self.n_sink, length - self.window + 1)), length)])

    def check_layer(self, layer, masked: bool) -> None:
        if masked:
            raise ValueError("masks are not supported with a sink cache (it renumbers positions within the cache)")
        if getattr(layer, "rope", None) is None:
            raise ValueError(f"a sink cache renumbers positions; {type(layer).__name__} has no RoPE to rotate keys with")
        own = getattr(layer, "sliding_window", None)
        if own is not None and own < self.window:
            raise ValueError(f"a sink cache of window={self.window} shows keys this layer "
                             f"(sliding_window={own}) must not see")


class ChunkedLayerCache(_KeptCache):
    """The current chunk only: a chunked-attention layer's cache (Llama 4's ``attention_chunk_size``).

    A query of a chunked layer sees only the keys of its own chunk of ``chunk_size`` positions
    (:func:`attnlib.attention.mods.chunked`), so the cache keeps at most ``chunk_size`` positions, in
    a ring; :meth:`update` returns the current chunk's past and the new positions.

    Args:
        block_size: the most positions a sequence may reach (the model's ``block_size``).
        chunk_size: positions per chunk, an int >= 1.

    Raises:
        ValueError: as :class:`~attnlib.cache.layer.LayerCache`; a chunk size that is not an int >= 1;
            in :meth:`check_layer`, a layer with another chunk size (or none), or a padding mask (each
            left-padded row's chunks would start at another column).
    """

    def __init__(self, block_size: int, chunk_size: int) -> None:
        positive_int("chunk_size", chunk_size)
        super().__init__(block_size, chunk_size)
        self.chunk_size = chunk_size

    def needed(self, length: int) -> torch.Tensor:
        return torch.arange(length - length % self.chunk_size, length)

    def check_layer(self, layer, masked: bool) -> None:
        if getattr(layer, "chunk_size", None) != self.chunk_size:
            raise ValueError(f"a chunked cache of chunk_size={self.chunk_size} does not fit a layer with "
                             f"chunk_size={getattr(layer, 'chunk_size', None)}")
        if masked:
            raise ValueError("masks are not supported with a chunked cache: with left padding each row's chunks "
                             "start at another column (use a full cache, model.new_cache(windows=False))")
