"""Exercise check 17.6 (chunked prefill through a ring-buffer KV cache), registered by :mod:`ch17`.

The learner's ``RingCache(window, batch_size, n_heads, head_dim)`` keeps keys and values in tensors
``k`` and ``v`` of ``window`` slots and answers ``step(q, k, v, start)`` for a CHUNK of ``T >= 1`` new
tokens at positions ``start ... start + T - 1`` with their attention outputs (query ``i`` sees positions
``start + i - window < j <= start + i``). The check feeds chunks of random sizes (1, shorter than the
window, equal to it, longer, wrapping the ring several times), compares every output with an uncached
sliding-window attention over the whole text written here (a mask, a softmax, float64), reads the slot
layout after every step (position ``p`` in slot ``p % window``, the last ``window`` positions) and
measures the numbers the object holds. The diagnoses replay the usual mistakes on the same numbers.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._core import Wrong, case_rng, expect, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run, tensors_in
from attnlib.cache import KVCache, LayerCache, RingLayerCache, SinkLayerCache

#: "write the ring yourself": attnlib's caches are refused wherever they are reached from.
OWN_RING = Refuse("write the ring buffer yourself, not with attnlib's caches", RingLayerCache, SinkLayerCache,
                  LayerCache, KVCache)
EMPTY = -(10**9)  # the position of a slot never written: no query sees it


def _attend(q, k, v, start: int, T: int, window: int, *, empty_seen=False, wrap_order=False,
            write_first=False, causal=True, scale=True) -> torch.Tensor:
    """The chunk's outputs ``(B, h, T, d_h)`` in float64 over (the old ring + the chunk); flags replay mistakes.

    ``q, k, v`` are the whole text ``(B, h, L, d_h)``; the old ring is rebuilt from it: slot ``s`` holds the
    latest position before ``start`` that is ``s`` mod ``window`` (a negative one: the slot is empty, zeros).
    """
    slots = torch.arange(window)
    held = start - 1 - (start - 1 - slots) % window  # (window,)
    ring_k = torch.zeros(*k.shape[:2], window, k.shape[-1], dtype=torch.float64)
    ring_v = torch.zeros_like(ring_k)
    filled = held >= 0
    ring_k[:, :, filled], ring_v[:, :, filled] = k[:, :, held[filled]].double(), v[:, :, held[filled]].double()
    assumed = start - window + slots if wrap_order else held  # wrap_order: "slot s holds start - window + s"
    ring_pos = assumed if empty_seen else torch.where(assumed >= 0, assumed, EMPTY)
    new = start + torch.arange(T)
    pos = torch.cat([ring_pos, new])  # (window + T,)
    keys = torch.cat([ring_k, k[:, :, start : start + T].double()], dim=2)
    values = torch.cat([ring_v, v[:, :, start : start + T].double()], dim=2)
    age = new[:, None] - pos[None, :]  # (T, window + T)
    visible = (age < window) & ((age >= 0) | (not causal))
    if write_first:  # the keys the chunk's write overwrote are gone: only the last window positions remain
        visible &= pos[None, :] >= start + T - window
    scores = q[:, :, start : start + T].double() @ keys.transpose(-2, -1)
    scores = scores / math.sqrt(q.shape[-1]) if scale else scores
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values


def _cases(g: torch.Generator) -> list[tuple[int, list[int], int, int, int]]:
    """(window, chunk sizes, B, n_heads, head_dim): one token first, then wrapping and long chunks, random ones."""
    cases = [(4, [1, 1, 2, 3, 4, 1, 6, 2, 9, 5], 2, 2, 8), (1, [1, 3, 1, 2], 1, 1, 4), (5, [3, 4, 12, 5, 7], 1, 2, 4),
             (3, [7, 2, 3, 1, 4], 1, 1, 2)]
    for _ in range(2):
        window = randint(g, 2, 7)
        sizes = [randint(g, 1, 2 * window + 3) for _ in range(randint(g, 4, 7))]
        cases.append((window, sizes, randint(g, 1, 2), randint(g, 1, 3), 2 * randint(g, 1, 8)))
    return cases


def _diagnose(got, q, k, v, start: int, T: int, window: int, what: str) -> None:
    """Name the mistake whose replay gives ``got``, else say by how much the output is off."""

    def close(candidate: torch.Tensor) -> bool:
        return (got - candidate).abs().max().item() <= 1e-5

    chunk = f"a chunk of T = {T} at positions {start} ... {start + T - 1}"
    if close(_attend(q, k, v, start, T, window, write_first=True)):
        raise Wrong(f"{what}: writing the chunk into the ring before attending overwrote keys that the chunk's "
                    f"first queries still need ({chunk}, window {window}): attend over the old ring plus the "
                    "chunk, each query with its own mask, then write")
    if close(_attend(q, k, v, start, T, window, wrap_order=True)):
        raise Wrong(f"{what}: your mask reads the old ring as if slot s held position start - window + s; the ring "
                    f"wraps: slot s holds the latest position before start that is s mod {window}")
    if close(_attend(q, k, v, start, T, window, empty_seen=True)):
        raise Wrong(f"{what}: the slots not written yet hold zeros, and a zero key still gets weight "
                    "(score 0, not -inf): mask the empty slots")
    if close(_attend(q, k, v, start, T, window, causal=False)):
        raise Wrong(f"{what}: a query of the chunk sees the chunk's later keys: query i sees positions up to "
                    "start + i only")
    if close(_attend(q, k, v, start, T, window, scale=False)):
        raise Wrong(f"{what}: scale the scores by 1/sqrt(head_dim)")
    right = _attend(q, k, v, start, T, window)
    wrong_rows = ((got - right).abs().amax(dim=(0, 1, 3)) > 1e-5).nonzero().flatten().tolist()
    if T > 1 and wrong_rows and wrong_rows[0] > 0:
        raise Wrong(f"{what}: the chunk's first query is right but query {wrong_rows[0]} (position "
                    f"{start + wrong_rows[0]}) is not: each query of the chunk sees its own last {window} "
                    "positions, the chunk's keys up to itself included (an answer for T = 1 is not enough)")
    raise Wrong(f"{what}: the output differs from sliding-window attention over the whole text by up to "
                f"{(got - right).abs().max().item():.3g} ({chunk}, window {window})")


def check_ring_cache(RingCache) -> None:
    """Check ``RingCache(window, batch_size, n_heads, head_dim)`` and its ``step(q, k, v, start)`` for chunks."""
    g = case_rng()
    for window, sizes, B, h, d in _cases(g):
        case = f"window={window}, batch_size={B}, n_heads={h}, head_dim={d}"
        cache = run(RingCache, window, B, h, d, what=f"RingCache({case})", refuse=OWN_RING)
        L = sum(sizes)
        q, k, v = (torch.randn(B, h, L, d, generator=g) for _ in range(3))  # the whole text, (B, h, L, d_h)
        budget = 2 * B * h * window * d + 4 * window + 64  # the two rings, and a few numbers of bookkeeping
        start = 0
        for T in sizes:
            what = f"{case}: step(q, k, v, start={start}) with a chunk of T={T} tokens"
            new = (t[:, :, start : start + T] for t in (q, k, v))  # (B, h, T, d_h) each
            out = run(cache.step, *new, start, what=what, refuse=OWN_RING)
            expect_tensor(out, what, shape=(B, h, T, d))
            got = out.detach().double()
            if (got - _attend(q, k, v, start, T, window)).abs().max().item() > 1e-5:
                _diagnose(got, q, k, v, start, T, window, what)
            end = start + T - 1
            for name, full in (("k", k), ("v", v)):
                ring = getattr(cache, name, None)
                expect_tensor(ring, f"{case}: the cache's attribute {name} (its ring of {window} slots)",
                              shape=(B, h, window, d))
                for s in range(window):
                    p = end - (end - s) % window  # the position slot s must hold now
                    if p >= 0 and not torch.equal(ring[:, :, s].detach(), full[:, :, p].to(ring.dtype)):
                        longer = (f"; of a chunk longer than the window only its last {window} positions stay, "
                                  "each in slot p % window") if T > window else ""
                        raise Wrong(f"{what}: after the step slot {s} of cache.{name} must hold position {p} "
                                    f"(the last {window} positions, position p in slot p % {window}){longer}")
            held = sum(t.numel() for t in tensors_in(list(vars(cache).values())))
            expect(held <= budget, f"{what}: your cache holds {held:,} numbers in tensors, more than its two "
                                   f"rings of {window} positions ({2 * B * h * window * d:,}): a ring keeps only "
                                   "the last window positions, overwriting the oldest")
            start += T
