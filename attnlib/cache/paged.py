"""A paged KV cache: PagedAttention's allocation scheme (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", §4.1-4.3). Chapter 19.

A contiguous cache (:class:`attnlib.cache.LayerCache`) reserves ``block_size`` positions for every sequence
up front, because it cannot know how long the sequence will grow; most of it stays empty. vLLM cuts
the cache into fixed-size *pages* (the paper's "KV blocks") of ``page_size`` positions, shared by all
sequences through one *free list*. Each sequence has a *block table*: the pages it holds, in order.
Position ``p`` of a sequence lives in page ``table[p // page_size]`` at offset ``p % page_size``. A
sequence takes a page only when it needs one, so it wastes less than one page; a finished sequence
gives its pages back to the free list for the next request.

Here the pages are gathered into one contiguous tensor per row at every step (vLLM's kernel reads the
pages in place instead): the allocation scheme is the point, and attention through the gathered tensor
is the same attention, so the logits equal the contiguous cache's (tests/test_paged_cache.py). A batch
of sequences of different lengths comes back right-aligned (left-padded), the same layout as batched
generation with padding, with :meth:`PagedKVCache.attention_mask` to go with it.

``PagedKVCache(..., prefix_cache=True)`` shares the full pages of equal prefixes between sequences
(:mod:`attnlib.cache.prefix`: :meth:`PagedKVCache.take_prefix`, :meth:`PagedKVCache.cache_prefix`); a write
into a page that another sequence holds, or that is indexed, goes to a private copy first
(:meth:`PagedKVCache.copy_page`, done by :meth:`PagedLayerCache.update`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from attnlib._checks import non_negative_int, positive_int
from attnlib.cache.allocator import OutOfPages, PageAllocator
from attnlib.cache.layer import LayerCache
from attnlib.cache.model import KVCache
from attnlib.cache.prefix import PrefixPageAllocator

__all__ = ["OutOfPages", "PageAllocator", "PagedKVCache", "PagedLayerCache"]


class PagedLayerCache(LayerCache):
    """One layer's pool of pages, read and written through the shared :class:`PageAllocator`.

    Each cached tensor (keys ``(B, heads, T, head_dim)``, values, or MLA's latent ``(B, T, d_c)``) is
    stored as ``(n_pages, page_size, *per-row shape without T)``, allocated on first use. :meth:`update`
    writes row ``b``'s new positions into the pages of the ``b``-th sequence of the batch
    (:meth:`PagedKVCache.select`) and returns every cached position, gathered, each row right-aligned
    to the longest: ``(B, …, width, w)`` with ``width = length + T_new``, the left zeros to be masked
    (:meth:`PagedKVCache.attention_mask`); :attr:`key_positions` are the columns ``0 … width - 1``.
    """

    def __init__(self, block_size: int, owner: PagedKVCache) -> None:
        super().__init__(block_size)
        self.owner = owner
        self.lengths: dict[int, int] = {}  # sequence id -> positions this layer holds

    @property
    def length(self) -> int:
        """Positions of the longest sequence of the batch (the time axis :meth:`update` returns, before the new)."""
        return max((self.lengths.get(s, 0) for s in self.owner.batch), default=0)

    @property
    def key_positions(self) -> torch.Tensor:
        return torch.arange(self._last[1])

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T_new = self.check_new(new)
        batch, alloc = self.owner.batch, self.owner.allocator
        if new[0].shape[0] != len(batch):
            raise ValueError(f"the batch has {len(batch)} sequences (PagedKVCache.select); got tensors of batch "
                             f"{new[0].shape[0]}")
        width = self.length + T_new
        self.check_room(width)
        starts = [self.lengths.get(seq, 0) for seq in batch]
        shared = [(seq, i) for seq, start in zip(batch, starts)  # pages written into that others hold: copied first
                  for i in range(start // alloc.page_size, min(alloc.pages_for(start + T_new), len(alloc.table(seq))))
                  if alloc.must_copy(alloc.table(seq)[i])]
        missing = len(shared) + sum(max(0, alloc.pages_for(start + T_new) - len(alloc.table(s)))
                                    for s, start in zip(batch, starts))
        if missing > alloc.available:  # refused before any row is written: the cache stays consistent
            raise OutOfPages(f"the batch needs {missing} more pages, {alloc.available} free "
                             f"({alloc.n_pages} pages of {alloc.page_size} positions)")
        for seq, i in shared:
            self.owner.copy_page(seq, i)
        for seq, start in zip(batch, starts):
            alloc.ensure(seq, start + T_new)  # the first layer takes the pages; the others find them
        slots, held = alloc.slots(batch, [start + T_new for start in starts], width, new[0].device)  # (B, width)
        new_slots = slots[:, width - T_new:].flatten()  # right-aligned: each row's last T_new are its new positions
        out = []
        for i, t in enumerate(new):
            pool = self.pool(i, t).flatten(0, 1)  # (n_pages * page_size, ..., w): a view of the pages
            pool[new_slots] = t.movedim(-2, 1).flatten(0, 1)  # write: (B, ..., T_new, w) -> (B * T_new, ..., w)
            past = pool[slots.flatten()].unflatten(0, slots.shape)  # gather: (B, width, ..., w)
            past = past.masked_fill(~held.view(*held.shape, *[1] * (past.dim() - 2)), 0)  # left padding: zeros
            out.append(past.movedim(1, -2).contiguous())  # (B, ..., width, w)
        for seq, start in zip(batch, starts):
            self.lengths[seq] = start + T_new
        self._last = (width - T_new, width)
        return tuple(out)

    def pool(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """The pages of tensor ``i``, ``(n_pages, page_size, *t.shape[1:-2], width)``, allocated on first use."""
        if i == len(self.buffers):
            alloc = self.owner.allocator
            shape = (alloc.n_pages, alloc.page_size, *t.shape[1:-2], t.shape[-1])
            self.buffers.append(torch.zeros(shape, dtype=t.dtype, device=t.device))
        pool = self.buffers[i]
        if pool.shape[2:] != (*t.shape[1:-2], t.shape[-1]) or pool.dtype != t.dtype or pool.device != t.device:
            raise ValueError(f"the pages of tensor {i} are {tuple(pool.shape)} {pool.dtype} on {pool.device}; "
                             f"cannot append {tuple(t.shape)} {t.dtype} on {t.device}")
        return pool

    def forget(self, seq: int) -> None:
        self.lengths.pop(seq, None)

    def check_crop(self, length: int) -> None:
        non_negative_int("length", length)

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on in each sequence of the batch (its pages stay its own)."""
        self.check_crop(length)
        for seq in self.owner.batch:
            if seq in self.lengths:
                self.lengths[seq] = min(self.lengths[seq], length)

    def reset(self) -> None:
        self.owner.reset()

    def reorder(self, index: torch.Tensor) -> None:
        """Refused.

        Raises:
            ValueError: always: forking a sequence needs copy-on-write pages (vLLM §4.4), left out here.
        """
        raise ValueError("a paged cache cannot reorder rows for beam search: forking a sequence needs "
                         "copy-on-write pages (vLLM §4.4) for every beam, which this teaching version leaves out "
                         "(it copies on write only the pages of shared prefixes)")

    def bytes_per_token(self) -> int:
        return sum(p[0, 0].numel() * p.element_size() for p in self.buffers)


class PagedKVCache(KVCache):
    """A KV cache for many sequences in one shared pool of pages. Chapter 19.

    Use it where a :class:`attnlib.cache.KVCache` goes (``model(idx, cache=cache)``): the rows of
    ``idx`` are the sequences chosen with :meth:`select`. Sequences of different lengths in one batch
    need ``attention_mask=cache.attention_mask(T_new)``. Every layer keeps every position (a window or
    a chunk applies as a mask).

    Args:
        n_layers: attention layers of the model.
        block_size: positions a sequence may reach (the model's ``block_size``).
        n_pages: pages in the pool.
        page_size: positions per page, an int >= 1 (vLLM's default block size is 16).
        prefix_cache: share the full pages of equal prefixes between sequences (a
            :class:`~attnlib.cache.prefix.PrefixPageAllocator`; :meth:`take_prefix`, :meth:`cache_prefix`).

    Raises:
        TypeError / ValueError: a size that is not an int >= 1 (``page_size=0`` is named); ``prefix_cache``
            not a bool.
    """

    def __init__(self, n_layers: int, block_size: int, n_pages: int, page_size: int, *,
                 prefix_cache: bool = False) -> None:
        positive_int("n_layers", n_layers)
        if not isinstance(prefix_cache, bool):
            raise TypeError(f"prefix_cache must be a bool; got {prefix_cache!r} ({type(prefix_cache).__name__})")
        self.allocator = (PrefixPageAllocator if prefix_cache else PageAllocator)(n_pages, page_size)
        self.batch: list[int] = []  # the sequence ids of the current rows, in order
        super().__init__([PagedLayerCache(block_size, self) for _ in range(n_layers)])

    @classmethod
    def for_model(cls, model, n_pages: int, page_size: int = 16, *, prefix_cache: bool = False) -> PagedKVCache:
        """An empty paged cache for ``model``; windowed layers keep every position (the window is a mask).

        Raises:
            ValueError: a layer that keeps a recurrent state (a linear layer), which pages do not hold, or that
                attends with another layer's keys and values (KV sharing, chapter 20).
        """
        for i, block in enumerate(model.blocks):
            if getattr(block.attn, "kv_source", None) is not None:
                raise ValueError(f"layer {i} attends with layer {block.attn.kv_source}'s keys and values (KV sharing): "
                                 "a paged cache cannot serve it")
            if block.attn.cache_width == 0:
                raise ValueError(f"layer {i} ({type(block.attn).__name__}) keeps a recurrent state, not keys and "
                                 "values: a paged cache cannot serve it")
        return cls(model.config.n_layers, model.config.block_size, n_pages, page_size, prefix_cache=prefix_cache)

    def add_sequence(self) -> int:
        """A new, empty sequence (no page taken yet); returns its id."""
        return self.allocator.new_sequence()

    def take_prefix(self, seq: int, tokens: Sequence[int]) -> int:
        """Prefix caching: the new, empty sequence ``seq``, whose prompt is ``tokens`` (ids: a list or 1-D tensor), takes
        the cached pages of its longest prefix of full pages; returns the positions now cached for it, at most
        ``len(tokens) - 1`` (the last token must go through the model for the logits: when the whole prompt is
        cached, its last page is copied before that write). Feed ``tokens[returned:]`` next.

        Raises:
            ValueError: the cache was made without ``prefix_cache=True``; ``seq`` not empty; ``tokens`` empty.
        """
        if not isinstance(self.allocator, PrefixPageAllocator):
            raise ValueError("take_prefix needs a cache made with prefix_cache=True")
        if self.sequence_length(seq) or not len(tokens):
            raise ValueError(f"take_prefix needs an empty sequence and a non-empty prompt; sequence {seq} holds "
                             f"{self.sequence_length(seq)} positions, the prompt {len(tokens)} tokens")
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        pages = self.allocator.lookup(tokens)
        self.allocator.share(seq, pages)
        cached = min(len(pages) * self.allocator.page_size, len(tokens) - 1)
        for layer in self.layers:
            layer.lengths[seq] = cached
        return cached

    def cache_prefix(self, seq: int, tokens: Sequence[int]) -> int:
        """Prefix caching: index the full pages of ``seq``, whose cached positions hold ``tokens``; returns the
        pages newly indexed (:meth:`attnlib.cache.prefix.PrefixPageAllocator.register`).

        Raises:
            ValueError: not a prefix cache; ``len(tokens)`` is not the sequence's cached length.
        """
        if not isinstance(self.allocator, PrefixPageAllocator):
            raise ValueError("cache_prefix needs a cache made with prefix_cache=True")
        if len(tokens) != self.sequence_length(seq):
            raise ValueError(f"tokens must be the ids of the {self.sequence_length(seq)} positions cached for "
                             f"sequence {seq}; got {len(tokens)}")
        return self.allocator.register(seq, tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens))

    def copy_page(self, seq: int, i: int) -> None:
        """Copy-on-write: page ``i`` of ``seq``'s block table becomes a private copy, in every layer."""
        old, new = self.allocator.replace(seq, i)
        for layer in self.layers:
            for pool in layer.buffers:
                pool[new] = pool[old]

    def select(self, seqs: list[int]) -> PagedKVCache:
        """Make ``seqs`` the rows of the next forward passes, in this order; returns the cache.

        Raises:
            TypeError: ``seqs`` not a list of sequence ids. ValueError: an unknown id, or one twice.
        """
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, (list, tuple)):
            raise TypeError(f"seqs must be a list of sequence ids (from add_sequence); got {type(seqs).__name__}")
        for s in seqs:
            self.allocator.table(s)  # raises for an unknown sequence
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence can be only one row of a batch; got {seqs}")
        self.batch = list(seqs)
        return self

    def release(self, seq: int) -> None:
        """A finished sequence: its pages go back to the free list, it leaves the batch."""
        self.allocator.release(seq)
        for layer in self.layers:
            layer.forget(seq)
        self.batch = [s for s in self.batch if s != seq]

    def sequence_length(self, seq: int) -> int:
        """Positions cached for ``seq``."""
        self.allocator.table(seq)
        return self.layers[0].lengths.get(seq, 0)

    def attention_mask(self, n_new: int) -> torch.Tensor:
        """``(B, length + n_new)`` bool for the batch: each row's cached and new positions, right-aligned.

        On the device of the cached tensors. Raises TypeError / ValueError: ``n_new`` not an int >= 0.
        """
        width = self.length + non_negative_int("n_new", n_new)
        pools = self.layers[0].buffers
        device = pools[0].device if pools else None
        lengths = torch.tensor([self.sequence_length(s) + n_new for s in self.batch], device=device)
        return torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]

    def reset(self) -> None:
        """Release every sequence of the batch (their pages go back to the free list)."""
        for seq in list(self.batch):
            self.release(seq)

