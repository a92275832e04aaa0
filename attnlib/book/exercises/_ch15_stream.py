"""The stream of Exercise 15.1's check: score blocks handed out once, weighing what the answer keeps.

Private to :mod:`attnlib.book.exercises.ch15`, which imports :class:`_Stream`,
:class:`_LiveTensors`, :class:`_Materialized`, :func:`_stats`, :func:`_softmax_cases` and
``_MATERIALIZED_HINT`` from here.
"""
from __future__ import annotations

import tracemalloc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Materialized(Exception):
    """Raised inside the stream when the answer holds on to what it has read."""


class _LiveTensors(TorchDispatchMode):
    """Weak references to every tensor the answer's operations create, to weigh what it keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.refs.append(weakref.ref(t))
        return out

    def live_bytes(self) -> int:
        """Bytes of the distinct storages that the answer's tensors still reference."""
        self.refs = [r for r in self.refs if r() is not None]
        storages = {}
        for r in self.refs:
            t = r()
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


class _Stream:
    """Score blocks of a ``(rows, n)`` matrix, handed out once, left to right, as a stream does.

    At every request the stream weighs what the answer still holds: the blocks handed out (by weak
    reference), the tensors its operations made, views of the blocks included (through
    :class:`_LiveTensors`) and Python's own memory (``tracemalloc``), and refuses an answer that
    keeps more than a few blocks' worth. Asking again after the end is counted in ``ends``.
    """

    def __init__(self, x: torch.Tensor, widths: list[int], tracker: _LiveTensors | None,
                 check_memory: bool) -> None:
        self.x, self.widths = x, widths
        self.tracker, self.check_memory = tracker, check_memory
        self.starts = [sum(widths[:i]) for i in range(len(widths))]
        self.next_block, self.ends, self.handed = 0, 0, []
        self.python_base: int | None = None
        # what a streaming answer may hold: its statistics and a few block-sized temporaries
        self.budget = 8 * x.shape[0] * (4 * max(widths) + 16)

    def __iter__(self):
        return self

    def _weigh(self) -> None:
        alive = sum(ref() is not None for ref in self.handed)
        if alive > 2:
            raise _Materialized(f"{alive} blocks were still held when block {self.next_block} was asked for")
        if self.check_memory and self.tracker is not None:
            held = self.tracker.live_bytes()
            if held > self.budget:
                raise _Materialized(f"after {self.next_block} blocks your tensors hold {held:,} bytes, more "
                                    f"than a few blocks' worth ({self.budget:,})")
        if self.check_memory and tracemalloc.is_tracing():
            now = tracemalloc.get_traced_memory()[0]
            if self.next_block == 3:
                self.python_base = now
            elif self.python_base is not None and now - self.python_base > 64 * 1024:
                raise _Materialized(f"after {self.next_block} blocks Python holds "
                                    f"{(now - self.python_base) // 1024:,} KiB more than after 3 (lists "
                                    "of numbers, or NumPy copies, of the blocks)")

    def __next__(self) -> torch.Tensor:
        if self.tracker is not None:
            self.tracker.paused = True
        try:
            self._weigh()
            if self.next_block == len(self.widths):
                self.ends += 1
                raise StopIteration
            i, w = self.next_block, self.widths[self.next_block]
            block = self.x[:, self.starts[i] : self.starts[i] + w].clone()  # a fresh tensor
            self.next_block += 1
            self.handed.append(weakref.ref(block))
            return block
        finally:
            if self.tracker is not None:
                self.tracker.paused = False


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift[:, None]).sum(dim=-1)


def _softmax_cases(g: torch.Generator) -> list[tuple[str, torch.Tensor, list[int]]]:
    plain = torch.randn(3, 10, generator=g)
    huge = torch.randn(2, 12, generator=g) * 400  # exp(400) overflows float32
    huge[0, 11] = 1000.0  # the largest score comes last: the sum so far must be rescaled
    masked = torch.randn(4, 9, generator=g)
    masked[0, :4] = float("-inf")  # a whole first block masked (as in causal attention)
    masked[1, 3:] = float("-inf")
    masked[2] = float("-inf")  # a row with nothing to attend to
    growing = torch.arange(12.0).repeat(2, 1)  # every block holds a new maximum
    growing[1] = growing[1].flip(0)
    widths = [3 + int(w) for w in torch.randint(0, 6, (160,), generator=g)]  # 3 to 8 columns each
    long = torch.randn(64, sum(widths), generator=g) * 5
    long[:8, : sum(widths) // 2] = float("-inf")  # half of some rows masked
    return [
        ("random scores, blocks of 4, 4, 2", plain, [4, 4, 2]),
        ("random scores, blocks of 1", plain, [1] * 10),
        ("growing and shrinking rows, blocks of 5, 7", growing, [5, 7]),
        ("scores in the hundreds, blocks of 5, 5, 2", huge, [5, 5, 2]),
        ("masked scores (-inf), blocks of 4, 3, 2", masked, [4, 3, 2]),
        (f"a long stream: 64 rows, {len(widths)} blocks of 3 to 8 columns", long, widths),
    ]


_MATERIALIZED_HINT = (
    "the blocks arrive once, as from a stream (in attention, a block of scores is computed, used and "
    "dropped). Do not keep them (no list(blocks), no torch.cat, no copies): update a running max m and "
    "a running sum l with each block, then let it go"
)
