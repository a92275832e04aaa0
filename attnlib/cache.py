"""The KV cache: what each attention layer keeps from past tokens so decoding a new one costs O(T), not O(T²).

Chapter 08. A :class:`LayerCache` holds named tensors whose time axis is ``-2``
(keys and values ``(B, heads, T, head_dim)``, or MLA's latent ``(B, T, d_c)``),
pre-allocated to ``max_len`` on first use; each attention variant decides what it
stores (multi-head attention: K and V of every head; GQA/MQA: only the
``n_kv_heads`` shared heads; MLA: only the latent). :class:`KVCache` is one
``LayerCache`` per layer of a GPT.
"""
from __future__ import annotations

import torch

from attnlib._checks import non_negative_int, positive_int

__all__ = ["KVCache", "LayerCache", "RingLayerCache", "SinkLayerCache"]


class LayerCache:
    """Pre-allocated storage for one attention layer.

    Args:
        max_len: the most tokens it can hold (the model's ``block_size``).

    Raises:
        ValueError: on :meth:`update` past ``max_len`` or with tensors of another
            batch or shape than the first update's.
    """

    def __init__(self, max_len: int) -> None:
        positive_int("max_len", max_len)
        self.max_len = max_len
        self.length = 0
        self.buffers: dict[str, torch.Tensor] = {}

    def update(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append ``T_new`` positions of each named tensor; return every cached position so far.

        Args:
            **new: tensors of shape ``(..., T_new, width)``, all with the same ``T_new``.

        Returns:
            One tensor ``(..., length + T_new, width)`` per name, in the order given
            (views into the buffers: no copy of the past).
        """
        T_new = self.check_new(new)
        end = self.length + T_new
        if end > self.max_len:
            raise ValueError(
                f"the cache holds {self.length} positions and max_len={self.max_len}; cannot add {T_new} more"
            )
        out = []
        for name, t in new.items():
            buffer = self.buffer(name, t, self.max_len)
            buffer[..., self.length : end, :] = t
            out.append(buffer[..., :end, :])
        self.length = end
        return tuple(out)

    def check_new(self, new: dict[str, torch.Tensor]) -> int:
        """Raise unless ``new`` holds the names this cache holds, each ``(..., T_new, width)``; return ``T_new``."""
        if self.buffers and set(new) != set(self.buffers):
            raise ValueError(
                f"this cache holds {sorted(self.buffers)} (filled by another attention variant?); "
                f"cannot append {sorted(new)}"
            )
        for name, t in new.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                raise ValueError(f"{name} must be a tensor (..., T_new, width); got {getattr(t, 'shape', type(t).__name__)}")
        T_new = {t.shape[-2] for t in new.values()}
        if len(T_new) != 1:
            raise ValueError(f"all tensors must add the same number of positions; got {sorted(T_new)}")
        return T_new.pop()

    def buffer(self, name: str, t: torch.Tensor, positions: int) -> torch.Tensor:
        """The buffer for ``name`` (allocated for ``positions`` on first use), checked against ``t``."""
        if name not in self.buffers:
            shape = (*t.shape[:-2], positions, t.shape[-1])
            self.buffers[name] = torch.zeros(shape, dtype=t.dtype, device=t.device)  # pre-allocated once
        buffer = self.buffers[name]
        if buffer.shape[:-2] != t.shape[:-2] or buffer.shape[-1] != t.shape[-1]:
            raise ValueError(f"cached {name!r} has shape {tuple(buffer.shape)}; cannot append {tuple(t.shape)}")
        if buffer.dtype != t.dtype or buffer.device != t.device:
            raise ValueError(f"cached {name!r} is {buffer.dtype} on {buffer.device}; cannot append {t.dtype} on {t.device}")
        return buffer

    @property
    def next_position(self) -> int:
        """The position the next token takes as the model sees it: ``length`` (a sink cache renumbers)."""
        return self.length

    def visible(self, T_new: int) -> torch.Tensor | None:
        """Which of the keys the last :meth:`update` returned the ``T_new`` new queries may see, beyond
        causality: ``None`` (all of them) here; a :class:`SinkLayerCache` restricts it."""
        return None

    def reset(self) -> None:
        """Forget every position, keeping the allocated buffers for reuse."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding's rejected drafts).

        Raises:
            TypeError / ValueError: ``length`` not an int >= 0.
        """
        self.length = min(self.length, non_negative_int("length", length))

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam search: follow each surviving beam's parent).

        Raises:
            TypeError: ``index`` not an integer tensor. ValueError: not 1-D, or a row outside the cached batch.
        """
        if not isinstance(index, torch.Tensor) or index.dtype == torch.bool or index.is_floating_point() \
                or index.is_complex():
            raise TypeError(f"index must be a 1-D integer tensor of batch rows; got {getattr(index, 'dtype', type(index).__name__)}")
        B = next(iter(self.buffers.values())).shape[0] if self.buffers else None
        if index.dim() != 1 or (B is not None and index.numel() and index.device.type != "meta"
                                and not bool(((index >= 0) & (index < B)).all())):
            raise ValueError(f"index must be a 1-D tensor of rows of the cached batch of {B}; got {index.tolist()}")
        for name, buffer in self.buffers.items():
            self.buffers[name] = buffer.index_select(0, index.to(buffer.device))

    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes, measured from the allocated buffers (0 if empty)."""
        return sum(b[:1, ..., :1, :].numel() * b.element_size() for b in self.buffers.values())

    def nbytes(self) -> int:
        """Bytes allocated (the whole ``max_len``, as pre-allocated)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class RingLayerCache(LayerCache):
    """A layer cache that keeps only the last ``window`` positions, in a ring buffer. Chapter 17.

    For a layer with a sliding window (Mistral; Gemma's local layers) no query ever looks further
    back than ``window - 1`` positions, so older keys and values can go: the buffer holds
    ``window`` positions whatever the length generated, and position ``p`` is written to slot
    ``p mod window``. :meth:`update` returns the kept past plus the new positions, in position
    order (at most ``window - 1 + T_new`` of them), which the window mask then trims per query.
    ``length`` counts every position seen (RoPE rotates by it); ``max_len`` bounds it.

    Args:
        max_len: the most positions a sequence may reach (the model's ``block_size``).
        window: positions kept (the layer's ``sliding_window``), an int >= 1.

    Raises:
        ValueError: as :class:`LayerCache`; a window that is not an int >= 1.
    """

    def __init__(self, max_len: int, window: int) -> None:
        super().__init__(max_len)
        positive_int("window", window)
        self.window = window

    def truncate(self, length: int) -> None:
        """Refused: positions the ring has overwritten cannot come back.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"{type(self).__name__} keeps only the last window={self.window} positions; "
                         "it cannot be truncated")

    def kept(self) -> int:
        """Positions of the past held now: ``min(length, window)``."""
        return min(self.length, self.window)

    def update(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T_new = self.check_new(new)
        if self.length + T_new > self.max_len:
            raise ValueError(f"the cache has seen {self.length} positions and max_len={self.max_len}; "
                             f"cannot add {T_new} more")
        past = torch.arange(self.length - self.kept(), self.length) % self.window  # slots of the kept past, in order
        out = []
        for name, t in new.items():
            buffer = self.buffer(name, t, self.window)
            out.append(torch.cat([buffer.index_select(-2, past.to(t.device)), t], dim=-2))  # (..., kept + T_new, w)
            tail = t[..., -self.window:, :]  # only the last `window` new positions can be needed again
            first = self.length + T_new - tail.shape[-2]
            slots = torch.arange(first, first + tail.shape[-2], device=t.device) % self.window
            buffer.index_copy_(buffer.dim() - 2, slots, tail)
        self.length += T_new
        return tuple(out)


class SinkLayerCache(LayerCache):
    """Attention sinks + a window: StreamingLLM's cache (Xiao et al. 2023, §3.2). Chapter 17.

    Keeps the first ``n_sink`` positions for ever and the last ``window`` in a ring buffer, so
    ``n_sink + window`` positions at most, however long the stream. The first tokens stay
    because a trained model parks attention it does not need on them ("attention sinks");
    dropping them, as a plain window does, breaks the model once the stream passes the window.

    Positions are those *within the cache* (the paper's §3.2): keys are stored before RoPE and
    rotated when read, at ``0, 1, …`` in cache order, so no position exceeds what the model saw
    in training (:class:`~attnlib.attention.RotaryAttention` does this for a cache with
    ``renumbers = True``). Query ``p`` sees the sinks and keys ``p - window < j <= p``.

    Args:
        max_len: bound on the total stream length (the stream may be far longer than ``block_size``).
        window: recent positions kept (the query itself included), an int >= 1.
        n_sink: first positions kept, an int >= 0 (StreamingLLM: 4).

    Raises:
        ValueError: a window < 1, ``n_sink`` < 0 or larger than the window (named); as :class:`LayerCache`.
    """

    renumbers = True
    truncate = RingLayerCache.truncate  # the evicted positions cannot come back either

    def __init__(self, max_len: int, window: int, n_sink: int = 4) -> None:
        super().__init__(max_len)
        positive_int("window", window)
        if isinstance(n_sink, bool) or not isinstance(n_sink, int):
            raise TypeError(f"n_sink must be an int >= 0, got {n_sink!r}")
        if n_sink < 0:
            raise ValueError(f"n_sink must be an int >= 0, got {n_sink!r}")
        if n_sink > window:
            raise ValueError(f"n_sink={n_sink} is larger than window={window}: the sinks would outnumber the window")
        self.window, self.n_sink = window, n_sink
        self.key_positions = torch.empty(0, dtype=torch.long)  # absolute positions of the keys last returned

    def _kept(self) -> torch.Tensor:
        """Absolute positions kept for the next query, in order: the sinks, then the last ``window - 1``."""
        sinks = torch.arange(min(self.length, self.n_sink))
        recent = torch.arange(min(self.length, max(self.n_sink, self.length - self.window + 1)), self.length)
        return torch.cat([sinks, recent])

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.where(positions < self.n_sink, positions, self.n_sink + (positions - self.n_sink) % self.window)

    @property
    def next_position(self) -> int:
        return len(self._kept())

    def update(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T_new = self.check_new(new)
        if self.length + T_new > self.max_len:
            raise ValueError(f"the cache has seen {self.length} positions and max_len={self.max_len}; "
                             f"cannot add {T_new} more")
        kept = self._kept()
        fresh = torch.arange(self.length, self.length + T_new)
        stored = fresh[(fresh < self.n_sink) | (fresh >= self.length + T_new - self.window)]  # what can be needed again
        out = []
        for name, t in new.items():
            buffer = self.buffer(name, t, self.n_sink + self.window)
            out.append(torch.cat([buffer.index_select(-2, self._slots(kept).to(t.device)), t], dim=-2))
            buffer.index_copy_(buffer.dim() - 2, self._slots(stored).to(t.device), t[..., stored - self.length, :])
        self.key_positions = torch.cat([kept, fresh])
        self.length += T_new
        return tuple(out)

    def visible(self, T_new: int) -> torch.Tensor:
        """``(T_new, n_keys)`` bool: the sinks, and the keys within the window of each new query."""
        q = self.key_positions[-T_new:, None]  # (T_new, 1) absolute positions of the new queries
        k = self.key_positions[None, :]  # (1, n_keys)
        return (k < self.n_sink) | (q - k < self.window)  # causality is the layer's (keys are in order)


class KVCache:
    """One :class:`LayerCache` per layer of a GPT. Chapter 08.

    Args:
        n_layers: number of attention layers.
        max_len: positions each layer can hold (the model's ``block_size``).
        windows: per layer, ``None`` (a :class:`LayerCache`) or a sliding window (a :class:`RingLayerCache`).
        n_sink: with a window for every layer, keep also the first ``n_sink`` positions: each layer a
            :class:`SinkLayerCache` (StreamingLLM).

    Example::

        cache = KVCache.for_model(model)
        logits, _ = model(prompt, cache=cache)          # prefill: the whole prompt at once
        logits, _ = model(next_token, cache=cache)      # decode: one new token against the cache
    """

    def __init__(self, n_layers: int, max_len: int, windows: list[int | None] | None = None,
                 n_sink: int | None = None) -> None:
        positive_int("n_layers", n_layers)
        if windows is not None and (isinstance(windows, (str, bytes, torch.Tensor)) or not hasattr(windows, "__iter__")):
            raise TypeError(f"windows must be a list of one window (int) or None per layer; got {windows!r}")
        windows = [None] * n_layers if windows is None else list(windows)
        if len(windows) != n_layers:
            raise ValueError(f"windows must give one window (or None) per layer, {n_layers}; got {len(windows)}")
        if n_sink is not None and None in windows:
            raise ValueError("n_sink needs a window for every layer (StreamingLLM: sinks + a window)")
        if n_sink is not None:
            self.layers = [SinkLayerCache(max_len, w, n_sink) for w in windows]
        else:
            self.layers = [LayerCache(max_len) if w is None else RingLayerCache(max_len, w) for w in windows]
        self.max_len = max_len

    @classmethod
    def for_model(cls, model) -> KVCache:
        """An empty cache sized for ``model`` (an :class:`attnlib.GPT`): a ring buffer for each windowed layer."""
        windows = [getattr(block.attn, "sliding_window", None) for block in model.blocks]
        return cls(model.config.n_layers, model.config.block_size, windows)

    @property
    def next_position(self) -> int:
        """The position the next token takes as the model sees it (see :attr:`LayerCache.next_position`)."""
        _ = self.length
        return self.layers[0].next_position

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

    def reset(self) -> None:
        """Forget every position in every layer, keeping the buffers."""
        for layer in self.layers:
            layer.reset()

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on in every layer (see :meth:`LayerCache.truncate`).

        Raises:
            TypeError / ValueError: ``length`` not an int >= 0; a window or sink layer (checked before any
                layer changes, so the cache stays in step).
        """
        non_negative_int("length", length)
        for layer in self.layers:
            if isinstance(layer, (RingLayerCache, SinkLayerCache)):
                layer.truncate(length)  # raises
        for layer in self.layers:
            layer.truncate(length)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` in every layer."""
        for layer in self.layers:
            layer.reorder(index)

    def bytes_per_token(self) -> int:
        """Bytes per cached position of one sequence, all layers, measured from the tensors."""
        return sum(layer.bytes_per_token() for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes allocated by all layers."""
        return sum(layer.nbytes() for layer in self.layers)
