"""The per-head cache under H2O and SnapKV: keys gathered per head, chosen from the attention weights. Chapter 17.

:class:`EvictingLayerCache` is a :class:`~attnlib.cache.LayerCache` whose rows and key/value heads each keep
their own positions; a subclass says which (:meth:`EvictingLayerCache.choose`) from the weights the layer hands
to :meth:`EvictingLayerCache.observe`. The methods and the hook are described in :mod:`attnlib.cache.eviction`.
"""
from __future__ import annotations

import torch

from attnlib._checks import non_negative_int, positive_int
from attnlib.cache.layer import LayerCache

__all__ = ["EvictingLayerCache"]


class EvictingLayerCache(LayerCache):
    """A cache that keeps, per batch row and key/value head, the positions :meth:`choose` picks from the weights.

    What :class:`~attnlib.cache.H2OLayerCache` and :class:`~attnlib.cache.SnapKVLayerCache` share (see
    :mod:`attnlib.cache.eviction`): keys and values gathered per head ``(B, n_kv_heads, held, head_dim)``, their
    positions ``(B, n_kv_heads, held)``, and the cycle :meth:`update` (past + new returned, the new held back)
    then :meth:`observe` (this step's weights; what :meth:`choose` picks is written into the slots).

    Args:
        block_size: the most positions a sequence may reach. budget: slots per row and head, an int >= 1.

    Raises:
        TypeError / ValueError: a bad size (named); on :meth:`update`, anything but keys and values
            ``(B, n_kv_heads, T_new, head_dim)`` of one shape, or a second update before :meth:`observe`; on
            :meth:`observe`, no update waiting or weights of another shape; in :meth:`check_layer` and
            :meth:`crop`, see there.
    """

    #: The layer hands this step's attention weights to :meth:`observe` (the eager path) while this is true.
    needs_weights = True

    def __init__(self, block_size: int, budget: int) -> None:
        super().__init__(block_size)
        positive_int("budget", budget)
        self.budget = budget
        self._held = 0  # positions each (row, head) holds in its slots
        self.positions: torch.Tensor | None = None  # (B, n_kv_heads, capacity) int64: the position in each slot
        self._key_positions = torch.empty(0, dtype=torch.long)
        self._pending: tuple[torch.Tensor, ...] | None = None  # keys, values, positions awaiting observe()

    @property
    def capacity(self) -> int:
        return self.budget

    @property
    def n_held(self) -> int:
        """Positions each row and head holds now (``positions[..., :n_held]``, ascending)."""
        return self._held

    @property
    def key_positions(self) -> torch.Tensor:
        """``(B, n_kv_heads, T_k)`` int64: each row's and head's positions of the keys the last update returned."""
        return self._key_positions

    def check_new(self, new: tuple[torch.Tensor, ...]) -> int:
        if len(new) != 2 or any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in new):
            raise ValueError(f"{type(self).__name__} caches keys and values (B, n_kv_heads, T_new, head_dim); got "
                             f"{len(new)} tensors of shapes {[tuple(getattr(t, 'shape', ())) for t in new]}")
        if new[0].shape != new[1].shape:
            raise ValueError(f"keys {tuple(new[0].shape)} and values {tuple(new[1].shape)} must have one shape")
        if self._pending is not None:
            raise ValueError(f"{type(self).__name__}.update called again before observe(weights): the layer must "
                             "hand each step's attention weights to the cache (MultiHeadAttention does)")
        return new[0].shape[-2]

    def store(self, new: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
        k, v = new
        B, H, T_new, _ = k.shape
        if not self.buffers:
            self.allocate(k, T_new)
        buffers = [self.buffer(i, t) for i, t in enumerate(new)]  # checks batch, heads, width, dtype, device
        fresh = torch.arange(start, start + T_new, device=k.device).expand(B, H, T_new)
        out = tuple(torch.cat([b[..., :self._held, :], t], dim=-2) for b, t in zip(buffers, new))
        positions = torch.cat([self.positions[..., :self._held], fresh], dim=-1)  # (B, H, held + T_new)
        self._key_positions = positions
        if self.needs_weights:
            self._pending = (*out, positions)
        else:  # nothing to choose: append (SnapKV after the prompt)
            for buffer, t in zip(buffers, new):
                buffer[..., self._held:self._held + T_new, :] = t
            self.positions[..., self._held:self._held + T_new] = fresh
            self._held += T_new
        return out

    def allocate(self, k: torch.Tensor, T_new: int) -> None:
        """The position buffer beside the key and value buffers (allocated by :meth:`buffer`)."""
        B, H = k.shape[:2]
        self.positions = torch.full((B, H, self.capacity), -1, dtype=torch.long, device=k.device)

    def observe(self, weights: torch.Tensor) -> None:
        """Choose the positions to keep from this step's attention weights, and store them.

        Args:
            weights: ``(B, n_heads, T_new, T_k)`` float, the weights of the queries of the last :meth:`update`
                over the keys it returned (the eager function's), ``n_heads`` a multiple of ``n_kv_heads``.

        Raises:
            ValueError: no update waits for its weights; weights of another shape (named).
        """
        if self._pending is None:
            raise ValueError(f"{type(self).__name__}.observe needs an update first: no keys await their weights")
        keys, values, positions = self._pending
        B, H, T_k, _ = keys.shape
        T_new = self._last[1] - self._last[0]
        if not isinstance(weights, torch.Tensor) or weights.dim() != 4 or weights.shape[0] != B \
                or weights.shape[1] % H or tuple(weights.shape[2:]) != (T_new, T_k):
            raise ValueError(f"weights must be (B, n_heads, T_new, T_k) = ({B}, a multiple of {H}, {T_new}, {T_k}); "
                             f"got {tuple(getattr(weights, 'shape', ())) or type(weights).__name__}")
        grouped = weights.detach().float().view(B, H, weights.shape[1] // H, T_new, T_k)  # (B, H, group, T_new, T_k)
        index = self.choose(grouped)  # (B, H, kept), ascending: positions stay in order
        self._pending = None
        self.write(index, keys, values, positions)

    def choose(self, grouped: torch.Tensor) -> torch.Tensor:
        """The indices (among the keys returned, ``(B, H, kept)``, ascending) to keep, from ``grouped`` weights."""
        raise NotImplementedError

    def write(self, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Store the returned keys, values and positions at ``index`` ``(B, H, kept)`` in the first slots."""
        kept = index.shape[-1]
        if kept > self.capacity:
            raise ValueError(f"{type(self).__name__} would hold {kept} positions in {self.capacity} slots")
        rows = index[..., None].expand(-1, -1, -1, keys.shape[-1])
        self.buffers[0][..., :kept, :] = keys.gather(2, rows)
        self.buffers[1][..., :kept, :] = values.gather(2, rows)
        self.positions[..., :kept] = positions.gather(2, index)
        self._held = kept

    def check_layer(self, layer, masked: bool) -> None:
        """Refuse a layer whose attention this cache cannot serve: a padding or explicit mask, a window or chunk,
        a ``score_mod``, MLA, or an ``attend``/``forward`` other than MultiHeadAttention's (heads mixed or split,
        or no weights handed to :meth:`observe`)."""
        name = type(self).__name__
        if masked:
            raise ValueError(f"masks are not supported with {name}: its rows and heads keep different positions")
        if getattr(layer, "kv_latent_dim", None) is not None:
            raise ValueError(f"{name} keeps per-head keys and values; this layer is MLA (kv_latent_dim="
                             f"{layer.kv_latent_dim}) and caches a latent")
        if getattr(layer, "mask_mod", None) is not None:
            raise ValueError(f"{name} cannot serve a layer with sliding_window={getattr(layer, 'sliding_window', None)}"
                             f" / chunk_size={getattr(layer, 'chunk_size', None)}: give it its own window cache "
                             "(KVCache.eviction does)")
        if getattr(layer, "score_mod", None) is not None:
            raise ValueError(f"{name} cannot serve a layer with a score_mod: it reads key indices, which after "
                             "eviction are not positions")
        for method in ("attend", "forward"):
            qualname = getattr(getattr(type(layer), method, None), "__qualname__", "")
            if qualname != f"MultiHeadAttention.{method}":
                raise ValueError(f"{name} needs MultiHeadAttention's {method}, which keeps heads apart and hands "
                                 f"the weights to the cache; {type(layer).__name__} has {qualname or None}")

    def check_crop(self, length: int) -> None:
        non_negative_int("length", length)
        if 0 < length < self.length and length < self.croppable():
            raise ValueError(f"{type(self).__name__} cannot crop to length={length}: positions before it were "
                             f"evicted by attention that a shorter sequence would not have paid them (it can crop "
                             f"to 0 or to {self.croppable()} … {self.length})")

    def croppable(self) -> int:
        """The shortest length (other than 0) :meth:`crop` can go back to."""
        return self.length

    def crop(self, length: int) -> None:
        self.check_crop(length)
        if length == 0:
            self.reset()
        elif length < self.length:
            self._held -= self.length - length  # the latest positions, appended last
            self._length = length

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, index.to(self.positions.device))

    def reset(self) -> None:
        super().reset()
        self._held, self._pending = 0, None
        self._key_positions = torch.empty(0, dtype=torch.long)

    def bytes_per_token(self) -> int:
        """Bytes one held position of one sequence takes: keys, values and its position (int64), every head."""
        extra = 0 if self.positions is None else self.positions[:1, :, :1].numel() * self.positions.element_size()
        return super().bytes_per_token() + extra

    def nbytes(self) -> int:
        """Bytes allocated: keys, values and positions of every slot."""
        extra = 0 if self.positions is None else self.positions.numel() * self.positions.element_size()
        return super().nbytes() + extra
