"""The stream of Exercise 15.1's check: score blocks handed out once, weighing what the answer keeps.

Private to :mod:`attnlib.book.exercises.ch15`, which imports :class:`_Stream`,
:class:`_LiveTensors`, :class:`_Materialized`, :func:`_stats`, :func:`_softmax_cases` and
``_MATERIALIZED_HINT`` from here.

What the answer holds is weighed three ways: the tensors its operations made (a dispatch mode),
Python's own allocations (``tracemalloc``), and, for the largest stream, what the process really
holds in memory, its resident set (``VmRSS`` of ``/proc/self/status``, sampled at every request,
and its peak ``VmHWM`` after a reset through ``/proc/self/clear_refs``): memory hidden from torch
and Python, an anonymous ``mmap`` or a C buffer, is resident all the same.
"""
from __future__ import annotations

import tracemalloc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: how much more than at block 3 the process may hold while it reads the 48 MiB stream: a third of
#: it, far above what a streaming answer's temporaries take (under 1 MiB), so that the allocator's and
#: other threads' noise on a busy machine does not count as keeping the blocks
RSS_MARGIN = 16 * 2**20


def _status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux), or None where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset the process's peak resident memory (``VmHWM``) to its current one; False where Linux refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
                 check_memory: bool, check_rss: bool = False) -> None:
        self.x, self.widths = x, widths
        self.tracker, self.check_memory, self.check_rss = tracker, check_memory, check_rss
        self.rss_base: int | None = None
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
        if self.check_rss:
            self.weigh_process()

    def weigh_process(self, peak: bool = False) -> None:
        """Refuse a process that holds more than :data:`RSS_MARGIN` beyond what it held after 3 blocks."""
        now = _status_bytes("VmHWM" if peak else "VmRSS")
        if now is None:
            return
        if self.next_block == 3 and not peak:
            self.rss_base = now
        elif self.rss_base is not None and now - self.rss_base > RSS_MARGIN:
            when = "at its peak" if peak else f"after {self.next_block} blocks"
            raise _Materialized(
                f"{when} the process holds {(now - self.rss_base) / 2**20:,.0f} MiB more than after 3 "
                f"blocks, of a {self.x.nbytes / 2**20:,.0f} MiB stream: memory outside torch and Python "
                "(an mmap, a file, a C buffer) is resident memory all the same")

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
    cases = [
        ("random scores, blocks of 4, 4, 2", plain, [4, 4, 2]),
        ("random scores, blocks of 1", plain, [1] * 10),
        ("growing and shrinking rows, blocks of 5, 7", growing, [5, 7]),
        ("scores in the hundreds, blocks of 5, 5, 2", huge, [5, 5, 2]),
        ("masked scores (-inf), blocks of 4, 3, 2", masked, [4, 3, 2]),
        (f"a long stream: 64 rows, {len(widths)} blocks of 3 to 8 columns", long, widths),
    ]
    n = 3 + int(torch.randint(0, 4, (), generator=g))  # fresh sizes: 4 to 7 blocks
    fresh = torch.randn(int(torch.randint(1, 6, (), generator=g)), 3 * n, generator=g) * 50
    fresh[0, int(torch.randint(0, 3 * n, (), generator=g))] = float("-inf")
    cases.insert(5, ("fresh random scores", fresh, [3] * n))
    return cases


def _large_case(g: torch.Generator) -> tuple[str, torch.Tensor, list[int]]:
    """48 MiB of scores in blocks of 128 to 384 columns: what the process holds is weighed."""
    widths, total = [], 48 * 2**20 // (512 * 4)
    while sum(widths) < total:
        widths.append(128 + int(torch.randint(0, 257, (), generator=g)))
    return (f"a 48 MiB stream: 512 rows, {len(widths)} blocks of 128 to 384 columns",
            torch.randn(512, sum(widths), generator=g) * 5, widths)


_MATERIALIZED_HINT = (
    "the blocks arrive once, as from a stream (in attention, a block of scores is computed, used and "
    "dropped). Do not keep them (no list(blocks), no torch.cat, no copies): update a running max m and "
    "a running sum l with each block, then let it go"
)
