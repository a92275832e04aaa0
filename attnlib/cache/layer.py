"""One attention layer's KV cache: the protocol, and the contiguous cache. Chapter 08.

A layer cache keeps what an attention layer needs from past tokens, so that decoding a new
token costs O(T), not O(T²). Every cache of the library (this module's, :mod:`attnlib.cache.windowed`,
:mod:`attnlib.cache.paged`) has one protocol, as ``transformers``' cache layers and torchtune's
``KVCache`` do:

* ``update(*new) -> tuple``: append the new positions of each cached tensor (keys and values
  ``(B, n_kv_heads, T_new, head_dim)``, or MLA's latent ``(B, T_new, d_c)``; the time axis is ``-2``)
  and return what attention sees, in position order, the new positions last;
* ``key_positions``: the positions (``(T_k,)`` int64) of the keys the last ``update`` returned;
* ``length``: positions seen so far (the next token's position);
* ``mask_mod``: ``None``, or the rule the cache itself imposes on which keys a query sees (a sink
  cache's window), as a FlexAttention ``mask_mod``;
* ``check_layer(layer, masked)``: refuse a layer whose attention the cache would change;
* ``crop(length)``, ``reorder(index)``, ``reset()``, ``nbytes()``, ``bytes_per_token()``.

The caches differ only in *where a position goes* (:meth:`LayerCache.slots`) and *which positions
they keep* (:meth:`LayerCache.held`, :meth:`LayerCache.needed`): here position ``p`` lives in slot
``p`` of a buffer pre-allocated to ``block_size`` positions on first use, and nothing is dropped.
"""
from __future__ import annotations

import torch

from attnlib._checks import batch_rows, non_negative_int, positive_int

__all__ = ["LayerCache"]


class LayerCache:
    """The contiguous cache: every position of the sequence, in a buffer of ``block_size`` positions.

    Args:
        block_size: the most positions it can hold (the model's ``block_size``).

    Raises:
        TypeError / ValueError: ``block_size`` not an int >= 1; on :meth:`update`, tensors of another
            batch, shape, dtype or device than the first update's, or past ``block_size`` (named).
    """

    #: Whether keys are stored before RoPE and rotated at their places in the cache (StreamingLLM).
    renumbers = False
    #: The cache's own rule on which keys a query sees, beyond causality and the layer's (None: none).
    mask_mod = None
    #: Keep what the last update returned in ``returned`` (set by a :class:`~attnlib.cache.SharedLayerCache`
    #: over this one: another layer attends with these keys and values).
    keep_returned = False

    def __init__(self, block_size: int) -> None:
        positive_int("block_size", block_size)
        self.block_size = block_size
        self._length = 0
        self.buffers: list[torch.Tensor] = []  # one per cached tensor, allocated on the first update
        self._last = (0, 0)  # (start, end) of the last update
        self.returned: tuple[torch.Tensor, ...] = ()  # what the last update returned (read by a SharedLayerCache)

    # ------------------------------------------------------------ where positions go (subclasses)

    @property
    def capacity(self) -> int:
        """Slots per sequence the buffers have."""
        return self.block_size

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``positions`` (1-D int64): here the position itself."""
        return positions

    def held(self, length: int) -> torch.Tensor:
        """The positions below ``length`` the slots hold now, in order: here all of them."""
        return torch.arange(length)

    def needed(self, length: int) -> torch.Tensor:
        """The past positions a query at position ``length`` may see: here all of them."""
        return torch.arange(length)

    def check_room(self, end: int) -> None:
        """Raise unless the sequence may grow to ``end`` positions."""
        if end > self.block_size:
            raise ValueError(f"the cache holds {self.length} positions and block_size={self.block_size}; "
                             f"cannot add {end - self.length} more")

    def check_layer(self, layer, masked: bool) -> None:
        """Raise ``ValueError`` if attending through this cache would change ``layer``'s output.

        ``masked``: the forward pass has a padding mask. The contiguous cache changes nothing.
        """

    # ------------------------------------------------------------ the protocol

    @property
    def length(self) -> int:
        """Positions seen so far: the position the next token takes."""
        return self._length

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append ``T_new`` positions of each cached tensor; return what attention sees.

        Args:
            *new: tensors ``(B, ..., T_new, width)``, all with the same ``T_new``, in the same order at
                every call (e.g. ``k, v``).

        Returns:
            One tensor ``(B, ..., T_k, width)`` per argument: the past positions a new query may need
            (:meth:`needed`) and the new ones, in position order (:attr:`key_positions`). Here every
            position, as views into the buffers (no copy of the past).
        """
        T_new = self.check_new(new)
        start, end = self.length, self.length + T_new
        self.check_room(end)
        out = self.store(new, start)
        self._last, self._length = (start, end), end
        if self.keep_returned:
            self.returned = out
        return out

    def store(self, new: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
        """Write the new positions (from ``start``) where they go; return the past a new query needs + the new.

        Here past and new are contiguous: written in place at slots ``start, …``, returned as views.
        """
        end = start + new[0].shape[-2]
        out = []
        for i, t in enumerate(new):
            buffer = self.buffer(i, t)
            buffer[..., start:end, :] = t
            out.append(buffer[..., :end, :])
        return tuple(out)

    @property
    def key_positions(self) -> torch.Tensor:
        """``(T_k,)`` int64: the positions of the keys the last :meth:`update` returned, in order."""
        start, end = self._last
        return torch.cat([self.needed(start), torch.arange(start, end)])

    @property
    def returned_span(self) -> tuple[int, int]:
        """``(start, end)``: the positions the last :meth:`update` added (``returned`` holds what it returned)."""
        return self._last

    def check_new(self, new: tuple[torch.Tensor, ...]) -> int:
        """Raise unless ``new`` holds as many tensors as the cache holds, each ``(B, ..., T_new, width)``; return ``T_new``."""
        if not new:
            raise ValueError("update needs at least one tensor (B, ..., T_new, width)")
        if self.buffers and len(new) != len(self.buffers):
            raise ValueError(f"this cache holds {len(self.buffers)} tensors (filled by another attention "
                             f"variant?); cannot append {len(new)}")
        for i, t in enumerate(new):
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                raise ValueError(f"tensor {i} must be a tensor (B, ..., T_new, width); got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
        T_new = {t.shape[-2] for t in new}
        if len(T_new) != 1:
            raise ValueError(f"all tensors must add the same number of positions; got {sorted(T_new)}")
        return T_new.pop()

    def buffer(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """The buffer of tensor ``i`` (``capacity`` slots, allocated on first use), checked against ``t``."""
        if i == len(self.buffers):
            shape = (*t.shape[:-2], self.capacity, t.shape[-1])
            self.buffers.append(torch.zeros(shape, dtype=t.dtype, device=t.device))  # pre-allocated once
        buffer = self.buffers[i]
        if buffer.shape[:-2] != t.shape[:-2] or buffer.shape[-1] != t.shape[-1]:
            raise ValueError(f"cached tensor {i} has shape {tuple(buffer.shape)}; cannot append {tuple(t.shape)}")
        if buffer.dtype != t.dtype or buffer.device != t.device:
            raise ValueError(f"cached tensor {i} is {buffer.dtype} on {buffer.device}; cannot append "
                             f"{t.dtype} on {t.device}")
        return buffer

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding's rejected drafts); a larger
        ``length`` changes nothing.

        Raises:
            TypeError / ValueError: ``length`` not an int >= 0; a position the next token needs was
                overwritten (a window or sink cache cropped further back than it keeps), checked
                before anything changes.
        """
        self.check_crop(length)
        self._length = min(self._length, length)

    def check_crop(self, length: int) -> None:
        """Raise as :meth:`crop` would, changing nothing."""
        non_negative_int("length", length)
        if length < self.length:
            lost = set(self.needed(length).tolist()) - set(self.held(self.length).tolist())
            if lost:
                raise ValueError(f"{type(self).__name__} cannot crop to length={length}: it no longer holds "
                                 f"positions {sorted(lost)[:4]}... that the next token needs (it keeps "
                                 f"{self.capacity} slots)")

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam search: follow each surviving beam's parent).

        Raises:
            TypeError: ``index`` not an integer tensor. ValueError: not 1-D, or a row outside the cached batch.
        """
        batch_rows(index, self.buffers[0].shape[0] if self.buffers else None)
        self.buffers = [b.index_select(0, index.to(b.device)) for b in self.buffers]

    def reset(self) -> None:
        """Forget every position, keeping the allocated buffers for reuse."""
        self._length = 0
        self._last = (0, 0)

    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes, measured from the allocated buffers (0 if empty)."""
        return sum(b[:1, ..., :1, :].numel() * b.element_size() for b in self.buffers)

    def nbytes(self) -> int:
        """Bytes allocated (every slot, as pre-allocated)."""
        return sum(b.numel() * b.element_size() for b in self.buffers)
