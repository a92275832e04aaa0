"""The cache of a compressed-attention layer (DeepSeek-V4's CSA and HCA), and its size. Chapter 21.

A layer of :class:`~attnlib.attention.compressed.CompressedAttention` keeps three things per sequence:

* the **window**: the last ``sliding_window`` keys (= values: one shared head of ``head_dim``), a
  :class:`~attnlib.cache.RingLayerCache` (a :class:`~attnlib.cache.LayerCache` without a window);
* the **compressed entries**: one key (= value) of ``head_dim`` per ``m = compress_rate`` tokens, and
  for compressed *sparse* attention one indexer key of ``index_head_dim`` beside it, in a
  :class:`~attnlib.cache.LayerCache` indexed by entry (entry ``w`` stands for tokens ``w·m … w·m+m-1``);
* the **pending** projections ``(C, Z)`` of the tokens whose group of ``m`` is not complete yet (at most
  ``m - 1``), and with overlapping groups (CSA) those of the last complete group too: entry ``w`` reads
  group ``w - 1``. An entry is made once its ``m`` tokens are all in, never from part of a group.

So the cache grows by ``(head_dim + index_head_dim) / m`` numbers per token, against MLA's
``kv_latent_dim + rope_head_dim`` (DeepSeek-V2 Table 1): :func:`compressed_cache_bytes`,
:func:`mla_cache_bytes` (DeepSeek-V4 technical report, DeepSeek-AI 2026, §2.3).
"""
from __future__ import annotations

import torch

from attnlib._checks import batch_rows, non_negative_int, positive_int
from attnlib.cache.layer import LayerCache
from attnlib.cache.windowed import RingLayerCache

__all__ = ["CompressedLayerCache", "compressed_cache_bytes", "mla_cache_bytes"]


class CompressedLayerCache:
    """Window + compressed entries + pending group: one compressed-attention layer's cache. Chapter 21.

    Args:
        block_size: the most positions a sequence may reach.
        compress_rate: ``m``, tokens per compressed entry (V4: 4 for CSA, 128 for HCA), an int >= 1.
        window: positions of the window kept (the layer's ``sliding_window``), or ``None``: every position.
        overlap: groups overlap (CSA: entry ``w`` pools groups ``w - 1`` and ``w``): keep the last complete
            group's projections too.

    Protocol (:mod:`attnlib.cache.layer`): ``update(kv)`` appends to the window and returns its keys,
    ``key_positions``, ``length``, ``check_layer``, ``crop`` (only to 0 or beyond), ``reorder``, ``reset``,
    ``nbytes``, ``bytes_per_token``; and for the compressed branch :meth:`group` and :meth:`add_entries`.

    Raises:
        TypeError / ValueError: a size not an int >= 1, ``overlap`` not a bool (named).
    """

    renumbers = False
    mask_mod = None

    def __init__(self, block_size: int, compress_rate: int, *, window: int | None = None,
                 overlap: bool = False) -> None:
        positive_int("block_size", block_size)
        positive_int("compress_rate", compress_rate)
        if window is not None:
            positive_int("window", window)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool; got {overlap!r}")
        self.block_size, self.compress_rate, self.overlap = block_size, compress_rate, overlap
        self.window = None if window is None else window
        self.keys = LayerCache(block_size) if window is None else RingLayerCache(block_size, window)
        self.entries = LayerCache(max(1, block_size // compress_rate))  # indexed by entry, not by token
        self.pending: tuple[torch.Tensor, ...] = ()  # (B, T_p, width) projections not yet folded away
        self.first_group = 0  # the group of pending's first token

    # ------------------------------------------------------------ the window (the protocol's update)

    @property
    def length(self) -> int:
        """Positions seen so far: the next token's position."""
        return self.keys.length

    def update(self, kv: torch.Tensor) -> tuple[torch.Tensor]:
        """Append ``kv (B, 1, T_new, head_dim)`` to the window; return ``(keys,)`` ``(B, 1, T_k, head_dim)``."""
        return self.keys.update(kv)

    @property
    def key_positions(self) -> torch.Tensor:
        """``(T_k,)`` int64: positions of the window keys the last :meth:`update` returned."""
        return self.keys.key_positions

    # ------------------------------------------------------------ the compressed branch

    @property
    def n_entries(self) -> int:
        """Compressed entries made so far (``length // m`` once the pending group is folded)."""
        return self.entries.length

    def group(self, *new: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], int]:
        """Add the new tokens' projections; return those of every complete group held, and the first's index.

        Args:
            *new: ``(B, T_new, width)`` each (``C`` and ``Z`` of the compressor, and of the indexer), in the
                same order at every call.

        Returns:
            ``(whole, g0)``: the projections of the complete groups from group ``g0`` on (``(B, n·m, width)``
            each); with ``overlap`` the first of them may be a group whose entry was already made (read
            only as the next entry's previous group). The rest stays pending.
        """
        if self.pending and len(new) != len(self.pending):
            raise ValueError(f"this cache holds {len(self.pending)} pending tensors; got {len(new)}")
        held = new if not self.pending else tuple(torch.cat([p, t], dim=-2) for p, t in zip(self.pending, new))
        m = self.compress_rate
        whole = held[0].shape[-2] // m  # complete groups held
        drop = max(0, whole - 1) if self.overlap else whole  # groups no later entry reads
        g0 = self.first_group
        self.pending = tuple(t[..., drop * m:, :] for t in held)
        self.first_group += drop
        return tuple(t[..., : whole * m, :] for t in held), g0

    def add_entries(self, *entries: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append new entries ``(B, n_new, width)`` each; return all of them ``(B, N, width)``."""
        return self.entries.update(*entries)

    # ------------------------------------------------------------ the rest of the protocol

    def check_layer(self, layer, masked: bool) -> None:
        """Raise ``ValueError`` unless ``layer`` compresses as this cache does; a padding mask is refused."""
        if masked:
            raise ValueError("a compressed cache takes no padding mask (a group of m tokens would mix rows' pads)")
        rate, overlap = getattr(layer, "compress_rate", None), getattr(layer, "overlap", None)
        if rate != self.compress_rate or overlap != self.overlap:
            raise ValueError(f"this cache compresses m={self.compress_rate} tokens (overlap={self.overlap}); "
                             f"the layer has compress_rate={rate}, overlap={overlap}")
        own = getattr(layer, "sliding_window", None)
        if self.window is not None and (own is None or own > self.window):
            raise ValueError(f"a window of {self.window} drops keys this layer (sliding_window={own}) attends to")

    def check_crop(self, length: int) -> None:
        """Raise as :meth:`crop` would: a compressed group cannot be unfolded, so only 0 or >= ``length``."""
        non_negative_int("length", length)
        if 0 < length < self.length:
            raise ValueError(f"a compressed cache cannot crop to length={length}: tokens are folded into "
                             "compressed entries (crop to 0, or keep them)")

    def crop(self, length: int) -> None:
        """Forget everything (``length=0``); a length >= :attr:`length` changes nothing."""
        self.check_crop(length)
        if length == 0:
            self.reset()

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam search) of the window, the entries and the pending group."""
        rows = self.keys.buffers[0].shape[0] if self.keys.buffers else None
        batch_rows(index, rows)
        self.keys.reorder(index)
        self.entries.reorder(index)
        self.pending = tuple(t.index_select(0, index.to(t.device)) for t in self.pending)

    def reset(self) -> None:
        """Forget every position."""
        self.keys.reset()
        self.entries.reset()
        self.pending, self.first_group = (), 0

    def held_bytes(self) -> int:
        """Bytes of what one sequence's cache holds now: window keys held, entries made, pending projections."""
        window = min(self.length, self.keys.capacity) * self.keys.bytes_per_token()
        entries = self.n_entries * self.entries.bytes_per_token()
        pending = sum(t[:1].numel() * t.element_size() for t in self.pending)
        return window + entries + pending

    def nbytes(self) -> int:
        """Bytes allocated (the window's and the entries' pre-allocated buffers, the pending projections)."""
        return self.keys.nbytes() + self.entries.nbytes() + sum(t.numel() * t.element_size() for t in self.pending)

    def bytes_per_token(self) -> float:
        """Average growth per position: one entry's bytes over ``m`` (the window and pending are fixed)."""
        return self.entries.bytes_per_token() / self.compress_rate


def _itemsize(dtype: object) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype; got {dtype!r}")
    return dtype.itemsize


def compressed_cache_bytes(seq_len: int, *, head_dim: int = 512, compress_rate: int = 4,
                           sliding_window: int | None = 128, index_head_dim: int = 0, overlap: bool = False,
                           dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one compressed-attention layer caches for one sequence of ``seq_len`` tokens (V4-Flash's sizes).

    ``(min(T, W) · d + ⌊T/m⌋ · (d + d_I) + p(T) · 2 · w) · bytes``: the window, the entries (key = value,
    and the indexer's key for CSA: ``index_head_dim``), and the pending projections ``C, Z`` of width
    ``w = (2 if overlap else 1) · (d + d_I)`` for ``p(T)`` tokens (``T mod m``, plus ``m`` once a group is
    complete with ``overlap``). Equals :meth:`CompressedLayerCache.held_bytes` (tested). Divide by
    ``seq_len`` for bytes per token (chapter 21's plot against :func:`mla_cache_bytes`).

    Raises:
        TypeError / ValueError: a size not an int >= 1 (``index_head_dim`` >= 0), ``dtype`` not a torch dtype.
    """
    for name, value in (("seq_len", seq_len), ("head_dim", head_dim), ("compress_rate", compress_rate)):
        positive_int(name, value)
    non_negative_int("index_head_dim", index_head_dim)
    if sliding_window is not None:
        positive_int("sliding_window", sliding_window)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool; got {overlap!r}")
    size, m = _itemsize(dtype), compress_rate
    window = seq_len if sliding_window is None else min(seq_len, sliding_window)
    pending = seq_len % m + (m if overlap and seq_len >= m else 0)
    width = (2 if overlap else 1) * (head_dim + index_head_dim)
    return (window * head_dim + (seq_len // m) * (head_dim + index_head_dim) + pending * 2 * width) * size


def mla_cache_bytes(seq_len: int, *, kv_latent_dim: int = 512, rope_head_dim: int = 64,
                    dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one MLA layer caches for one sequence: ``T · (d_c + d_h^R) · bytes`` (DeepSeek-V2 §2.1, Table 1;
    V3's sizes: ``d_c = 512``, ``d_h^R = 64``). Chapter 07's :class:`~attnlib.attention.MultiHeadLatentAttention`
    caches ``d_c`` (no decoupled RoPE key: ``rope_head_dim=0``).

    Raises:
        TypeError / ValueError: a size not an int >= 1 (``rope_head_dim`` >= 0), ``dtype`` not a torch dtype.
    """
    positive_int("seq_len", seq_len)
    positive_int("kv_latent_dim", kv_latent_dim)
    non_negative_int("rope_head_dim", rope_head_dim)
    return seq_len * (kv_latent_dim + rope_head_dim) * _itemsize(dtype)
