"""Exercise check 17.6 (a ring-buffer KV cache for a sliding window), registered by :mod:`ch17`.

The learner's ``RingCache(window, batch_size, n_heads, head_dim)`` keeps keys and values in tensors
``k`` and ``v`` of ``window`` slots and answers ``step(q, k, v, position)`` with the attention output of
the new token. The check drives it token by token over texts longer than the window and compares every
output with an uncached sliding-window attention written here (a mask, a softmax), inspects the slot
each position went to (``position % window``), and measures the numbers the object holds.
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


def _window_attention(q, k, v, window: int, keep=None, scale: bool = True) -> torch.Tensor:
    """Uncached sliding-window attention ``(B, h, T, d_h)``: query ``i`` sees keys ``i - window < j <= i``."""
    T = q.shape[-2]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & (i - j < window) if keep is None else keep
    scores = q.double() @ k.double().transpose(-2, -1)  # (B, h, T, T)
    scores = scores / math.sqrt(q.shape[-1]) if scale else scores
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v.double()).float()


def _zeros_seen(q, k, v, window: int, p: int) -> torch.Tensor:
    """Query ``p`` over all ``window`` slots while the ring is not full: the empty slots hold zeros."""
    slots_k = torch.zeros(*k.shape[:2], window, k.shape[-1], dtype=torch.float64)
    slots_v = torch.zeros_like(slots_k)
    slots_k[:, :, : p + 1], slots_v[:, :, : p + 1] = k[:, :, : p + 1].double(), v[:, :, : p + 1].double()
    scores = q[:, :, p : p + 1].double() @ slots_k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return (scores.softmax(-1) @ slots_v).float()  # (B, h, 1, d_h)


def _cases(g: torch.Generator) -> list[tuple[int, int, int, int, int]]:
    """(window, T, B, n_heads, head_dim): a window of 1, texts shorter than the window, fresh random ones."""
    cases = [(1, 5, 1, 1, 4), (3, 11, 2, 2, 8), (6, 4, 1, 2, 4), (4, 9, 1, 1, 2)]
    for _ in range(2):
        window = randint(g, 2, 7)
        cases.append((window, randint(g, window + 1, 3 * window + 5), randint(g, 1, 2), randint(g, 1, 3),
                      2 * randint(g, 1, 8)))
    return cases


def check_ring_cache(RingCache) -> None:
    """Check ``RingCache(window, batch_size, n_heads, head_dim)`` and its ``step(q, k, v, position)``."""
    g = case_rng()
    for window, T, B, h, d in _cases(g):
        case = f"window={window}, batch_size={B}, n_heads={h}, head_dim={d}"
        cache = run(RingCache, window, B, h, d, what=f"RingCache({case})", refuse=OWN_RING)
        q, k, v = (torch.randn(B, h, T, d, generator=g) for _ in range(3))  # (B, h, T, d_h) each
        expected = _window_attention(q, k, v, window)
        budget = 2 * B * h * window * d + 4 * window + 64  # the two rings, and a few numbers of bookkeeping
        for p in range(T):
            what = f"{case}: step(q, k, v, position={p})"
            new = (q[:, :, p : p + 1], k[:, :, p : p + 1], v[:, :, p : p + 1])  # (B, h, 1, d_h) each
            out = run(cache.step, *new, p, what=what, refuse=OWN_RING)
            expect_tensor(out, what, shape=(B, h, 1, d))
            for name, full in (("k", k), ("v", v)):
                ring = getattr(cache, name, None)
                expect_tensor(ring, f"{case}: the cache's attribute {name} (its ring of {window} slots)",
                              shape=(B, h, window, d))
                expect(torch.equal(ring[:, :, p % window].detach(), full[:, :, p].to(ring.dtype)),
                       f"{what}: position {p} must be written to slot {p} % {window} = {p % window} of "
                       f"cache.{name}, and stay there until position {p + window} overwrites it")
            held = sum(t.numel() for t in tensors_in(list(vars(cache).values())))
            expect(held <= budget, f"{what}: your cache holds {held:,} numbers in tensors, more than its two "
                                   f"rings of {window} positions ({2 * B * h * window * d:,}): a ring keeps only "
                                   "the last window positions, overwriting the oldest")
            if (out.double() - expected[:, :, p : p + 1].double()).abs().max().item() <= 1e-5:
                continue
            got = out.double()

            def close(candidate: torch.Tensor, got: torch.Tensor = got) -> bool:
                return (got - candidate.double()).abs().max().item() <= 1e-5

            if p < window - 1 and close(_zeros_seen(q, k, v, window, p)):
                raise Wrong(f"{what}: the slots not written yet hold zeros, and a zero key still gets weight "
                            "(score 0, not -inf): mask the empty slots until the ring is full")
            if p > 0:
                i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
                before = _window_attention(q, k, v, window, keep=(j < i) & (i - j <= window))
                expect(not close(before[:, :, p : p + 1]),
                       f"{what}: the token attends to the positions before it but not to itself: write its key "
                       "and value into the ring first, then attend")
            expect(not close(_window_attention(q, k, v, window, scale=False)[:, :, p : p + 1]),
                   f"{what}: scale the scores by 1/sqrt(head_dim)")
            diff = (got - expected[:, :, p : p + 1].double()).abs().max().item()
            raise Wrong(f"{what}: the output differs from sliding-window attention over positions "
                        f"{max(0, p - window + 1)} ... {p} by up to {diff:.3g}")
