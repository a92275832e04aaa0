"""The free list and the block tables of a paged KV cache (Kwon et al. 2023, "Efficient Memory Management
for Large Language Model Serving with PagedAttention", §4.2). Chapter 19.

:class:`PageAllocator` hands out pages of ``page_size`` positions from one free list and keeps, per
sequence, its *block table* (the pages it holds, in order); :class:`attnlib.cache.PagedKVCache` stores the
keys and values in those pages. :class:`attnlib.cache.prefix.PrefixPageAllocator` adds sharing between
sequences (prefix caching).
"""
from __future__ import annotations

import math

import torch

from attnlib._checks import non_negative_int, positive_int

__all__ = ["OutOfPages", "PageAllocator"]


class OutOfPages(RuntimeError):
    """The free list is empty: no page left for a sequence that needs one (a scheduler admits less)."""


class PageAllocator:
    """The free list and one block table per sequence: which pages each sequence holds.

    Args:
        n_pages: pages in the pool (shared by every sequence and every layer).
        page_size: positions per page, an int >= 1.

    Raises:
        TypeError / ValueError: ``n_pages`` or ``page_size`` not an int >= 1 (named).
    """

    def __init__(self, n_pages: int, page_size: int) -> None:
        positive_int("n_pages", n_pages)
        positive_int("page_size", page_size)
        self.n_pages, self.page_size = n_pages, page_size
        self.free = list(range(n_pages - 1, -1, -1))  # a stack: pop() hands out page 0 first
        self.tables: dict[int, list[int]] = {}  # sequence id -> block table (its pages, in order)
        self._next_id = 0

    def new_sequence(self) -> int:
        """Register an empty sequence (no page yet); return its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq] = []
        return seq

    def table(self, seq: int) -> list[int]:
        """The block table of ``seq``. Raises ValueError for an unknown (or released) sequence."""
        if seq not in self.tables:
            raise ValueError(f"sequence {seq!r} is not in the cache (released, or never added)")
        return self.tables[seq]

    def pages_for(self, n_positions: int) -> int:
        """Pages that ``n_positions`` positions occupy: ``ceil(n_positions / page_size)``."""
        return math.ceil(n_positions / self.page_size)

    def ensure(self, seq: int, n_positions: int) -> None:
        """Give ``seq`` pages from the free list until it can hold ``n_positions`` positions.

        Raises:
            TypeError / ValueError: ``n_positions`` not an int >= 0; an unknown ``seq``.
            OutOfPages: the free list ran out (the pages taken so far stay with ``seq``;
                :meth:`PagedLayerCache.update` checks the whole batch first, so a forward pass takes none).
        """
        table = self.table(seq)
        non_negative_int("n_positions", n_positions)
        while len(table) < self.pages_for(n_positions):
            table.append(self.take(seq))

    def take(self, seq: int) -> int:
        """A page off the free list, for ``seq``. Raises OutOfPages when the free list is empty."""
        if not self.free:
            raise OutOfPages(f"no free page for sequence {seq} ({self.n_pages} pages of {self.page_size} "
                             f"positions, all in use)")
        return self.free.pop()

    @property
    def available(self) -> int:
        """Pages :meth:`take` can still hand out: the free list (a prefix cache adds its unreferenced cached pages)."""
        return len(self.free)

    def must_copy(self, page: int) -> bool:
        """Whether ``page`` must be copied before a sequence writes into it: never here (no page is shared;
        :class:`~attnlib.cache.prefix.PrefixPageAllocator` shares them)."""
        return False

    def release(self, seq: int) -> None:
        """Return the pages of ``seq`` to the free list and forget it."""
        self.free.extend(reversed(self.table(seq)))
        del self.tables[seq]

    def locate(self, seq: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Page and offset of each of ``positions`` (1-D int64) of ``seq``: ``(page ids, offsets)``.

        Raises:
            TypeError: ``positions`` not an integer tensor. ValueError: a position outside the pages ``seq``
                holds (``[0, len(table) * page_size)``): negative indices would wrap around to another page.
        """
        table = torch.tensor(self.table(seq), dtype=torch.long)
        if not isinstance(positions, torch.Tensor) or positions.dtype == torch.bool \
                or positions.is_floating_point() or positions.is_complex():
            raise TypeError(f"positions must be an integer tensor; got {getattr(positions, 'dtype', type(positions).__name__)}")
        held = len(table) * self.page_size
        if positions.numel() and not bool(((positions >= 0) & (positions < held)).all()):
            raise ValueError(f"positions must lie in [0, {held}) (sequence {seq} holds {len(table)} pages of "
                             f"{self.page_size}); got {positions.min().item()}..{positions.max().item()}")
        return table[positions // self.page_size], positions % self.page_size

    def slots(self, seqs: list[int], lengths: list[int], width: int,
              device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where positions ``0 … lengths[b] - 1`` of each of ``seqs`` live, right-aligned in rows of ``width``.

        Returns ``(slots, held)``, both ``(len(seqs), width)``: ``slots`` the flat index
        ``page * page_size + offset`` into the pool viewed as ``(n_pages * page_size, …)`` (int64),
        ``held`` bool, False in each row's left padding (whose slot is 0). One gather for the whole
        batch, as :meth:`locate` gives one sequence's pages and offsets. The sequences must hold
        their pages (:meth:`ensure`) and ``lengths[b] <= width``. The last answer is kept: every layer
        of a forward pass asks the same (a sequence's first pages change only by copy-on-write, which
        forgets it, and ids are never reused).
        """
        key = (tuple(seqs), tuple(lengths), width, device)
        if getattr(self, "_slots", (None,))[0] == key:
            return self._slots[1]
        tables = [self.table(seq) for seq in seqs]
        most = max(len(table) for table in tables)
        table = torch.tensor([t + [0] * (most - len(t)) for t in tables], dtype=torch.long, device=device)
        n = torch.tensor(lengths, dtype=torch.long, device=device)
        position = torch.arange(width, device=device)[None, :] - (width - n)[:, None]  # < 0: left padding
        held = position >= 0
        position = position.clamp(min=0)
        slots = table.gather(1, position // self.page_size) * self.page_size + position % self.page_size
        self._slots = (key, (slots.masked_fill(~held, 0), held))
        return self._slots[1]

    @property
    def pages_used(self) -> int:
        return self.n_pages - len(self.free)
