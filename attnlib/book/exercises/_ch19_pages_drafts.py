"""Exercises 19.4 (reading a batch out of a paged pool) and 19.5 (a round with a greedy draft).

* 19.4 ``gather_pages(pool, tables, lengths) -> (keys (B, T, h, d), mask (B, T) bool)``: sequence b's
  ``lengths[b]`` positions, read from the pages its block table lists (position p in page
  ``tables[b][p // page_size]`` at offset ``p % page_size``), right-aligned in a left-padded batch
  (zeros at the pads, ``True`` = a real position), ``T = max(lengths)``; attnlib's paged cache and
  allocator are refused.
* 19.5 ``greedy_draft_round(p, drafts, generator) -> (n,) int64``: one round of speculative sampling
  when the draft proposes its argmax (its ``q`` is a point mass); the emitted tokens must follow the
  target's law (measured over many rounds), end at the first rejection, carry the bonus token after
  ``k`` acceptances, and be reproducible from ``generator``.
"""
from __future__ import annotations

import torch

from attnlib.book.exercises._core import NotSolved, case_rng, exercise, expect, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.cache.paged import PageAllocator, PagedKVCache, PagedLayerCache
from attnlib.serving import left_pad

__all__ = ["check_gather_pages", "check_greedy_draft_round"]

# ---------------------------------------------------------------- 19.4
_OWN_PAGES = Refuse("read the pages yourself, not with attnlib's paged cache", PageAllocator, PagedKVCache,
                    PagedLayerCache, left_pad)


def _pool_case(g: torch.Generator, lengths: list[int], page_size: int, spare: int, h: int, d: int):
    """A pool whose pages are handed out in a shuffled order, ``spare`` unused pages and one reserved ahead."""
    need = [-(-n // page_size) + (1 if b == 0 else 0) for b, n in enumerate(lengths)]  # row 0: a page reserved ahead
    n_pages = sum(need) + spare
    order = torch.randperm(n_pages, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    pool = torch.randn(n_pages, page_size, h, d, generator=g)
    return pool, tables


@exercise("19.4")
def check_gather_pages(gather_pages) -> None:
    """Check ``gather_pages(pool (n_pages, page_size, h, d), tables, lengths) -> (keys (B, T, h, d), mask (B, T))``."""
    g = case_rng()
    cases = [([7, 3, 10], 4), ([8, 8], 4), ([5], 16), ([1, 9, 0, 4], 3)]  # full pages, one page, an empty sequence
    cases += [(torch.randint(0, 30, (randint(g, 1, 5),), generator=g).tolist(), randint(g, 2, 8)) for _ in range(3)]
    for lengths, page_size in cases:
        if max(lengths) == 0:
            lengths = lengths[:-1] + [1]
        h, d = randint(g, 1, 3), randint(g, 1, 4)
        pool, tables = _pool_case(g, lengths, page_size, randint(g, 0, 3), h, d)
        what = f"gather_pages(pool, tables={tables}, lengths={lengths}) with pages of {page_size}"
        got = run(gather_pages, pool, [list(t) for t in tables], list(lengths), what=what, refuse=_OWN_PAGES)
        if got is None:
            raise NotSolved("return the pair (keys, mask), not None")
        expect(type(got) in (tuple, list) and len(got) == 2,
               f"{what}: return a pair (keys (B, T, h, d), mask (B, T)); got {type(got).__name__}")
        B, T = len(lengths), max(lengths)
        keys, mask = got
        if isinstance(keys, torch.Tensor) and isinstance(mask, torch.Tensor):
            expect(not (keys.dim() == 2 and mask.dim() == 4), f"{what}: return (keys, mask) in this order")
        want_mask = torch.arange(T)[None, :] >= T - torch.tensor(lengths)[:, None]  # right-aligned
        want = torch.zeros(B, T, h, d)
        for b, n in enumerate(lengths):
            rows = [pool[tables[b][p // page_size], p % page_size] for p in range(n)]
            if rows:
                want[b, T - n:] = torch.stack(rows)
        expect_tensor(keys, f"{what}: keys", shape=(B, T, h, d), dtype=pool.dtype)
        expect_tensor(mask, f"{what}: mask", shape=(B, T))
        expect(mask.dtype == torch.bool, f"{what}: the mask has dtype {mask.dtype}; return a bool mask, True = a "
                                         "real position")
        if torch.equal(mask, ~want_mask):
            expect(False, f"{what}: your mask is True at the pads; True marks a real position")
        left = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
        expect(not (torch.equal(mask, left) and not torch.equal(left, want_mask)),
               f"{what}: right-align each sequence: the pads come first, as in the left-padded batch (the "
               "newest position in the last column)")
        expect(torch.equal(mask, want_mask), f"{what}: the mask should be True at the last lengths[b] columns of "
                                             "row b")
        expect(torch.equal(keys[~want_mask], want[~want_mask]), f"{what}: the pads should be zeros")
        if torch.equal(keys, want):
            continue
        by_number = torch.zeros(B, T, h, d)
        for b, n in enumerate(lengths):
            rows = [pool[sorted(tables[b])[p // page_size], p % page_size] for p in range(n)]
            if rows:
                by_number[b, T - n:] = torch.stack(rows)
        expect(not torch.equal(keys, by_number), f"{what}: read the pages in the order of the block table, not "
                                                 "sorted by page number: a sequence's pages need not be adjacent")
        expect(False, f"{what}: position p of sequence b is in page tables[b][p // page_size] at offset "
                      "p % page_size")


# ---------------------------------------------------------------- 19.5
def _rounds(fn, p: torch.Tensor, drafts: torch.Tensor, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    k, out = drafts.numel(), []
    what = f"greedy_draft_round(p {tuple(p.shape)}, drafts={drafts.tolist()}, generator)"
    # one run for the n rounds: the generator must advance from round to round
    for got in run(fn, p.clone(), drafts.clone(), g, what=what, copy_args=False, repeat=n):
        if got is None:
            raise NotSolved("return the emitted tokens (a 1-D tensor), not None")
        expect_tensor(got, what)
        expect(got.dim() == 1 and got.dtype in (torch.int64, torch.int32),
               f"{what}: return a 1-D integer tensor of the emitted tokens; got shape {tuple(got.shape)}, "
               f"dtype {got.dtype}")
        toks = got.tolist()
        expect(1 <= len(toks) <= k + 1, f"{what}: a round with k = {k} drafts emits 1 to k + 1 tokens; got {len(toks)}")
        expect(toks[:-1] == drafts[: len(toks) - 1].tolist(),
               f"{what}: emitted {toks}: all but the last token must be accepted drafts, in order; the round ends "
               "at the first rejection (with its replacement)")
        out.append(toks)
    return out


def _tv(tokens: list[int], law: torch.Tensor) -> tuple[float, list[float]]:
    freq = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=law.numel()).double() / len(tokens)
    return 0.5 * float((freq - law).abs().sum()), [round(x, 2) for x in freq.tolist()]


@exercise("19.5")
def check_greedy_draft_round(greedy_draft_round) -> None:
    """Check ``greedy_draft_round(p (k + 1, V), drafts (k,), generator) -> (n,) int64`` by its law."""
    base = randint(case_rng(), 0, 2**40)
    V, drafts = 5, torch.tensor([0, 1])
    sure = torch.zeros(3, V, dtype=torch.float64)
    sure[0, 0] = sure[1, 1] = 1.0  # the target is certain of both drafts
    sure[2] = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3], dtype=torch.float64)
    for toks in _rounds(greedy_draft_round, sure, drafts, 30, base):
        expect(len(toks) == 3, f"the target gives each draft probability 1, so both are accepted; you emitted "
                               f"{toks}: after k acceptances add the bonus token, drawn from p[k]")
    never = sure.clone()
    never[0] = torch.tensor([0.0, 0.4, 0.3, 0.2, 0.1], dtype=torch.float64)  # the target never says 0 first
    for toks in _rounds(greedy_draft_round, never, drafts, 30, base + 1):
        expect(toks[0] != 0, "p[0] gives the draft's token 0 probability 0, yet you emitted it: accept d with "
                             "probability min(1, p(d) / q(d)) = p(d), since q is a point mass on d (not q / p)")
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.2, 0.6]],
                     dtype=torch.float64)
    once, twice = (_rounds(greedy_draft_round, p, drafts, 20, base + 2) for _ in range(2))
    expect(once == twice, "two runs with generators of the same seed emitted different tokens: draw every random "
                          "number from the generator argument (torch.rand(..., generator=generator), "
                          "torch.multinomial(..., generator=generator))")
    runs = _rounds(greedy_draft_round, p, drafts, 2000, base + 3)
    tv, freq = _tv([r[0] for r in runs], p[0])
    if tv > 0.06:
        f0, p0 = freq[0], float(p[0, 0])
        expect(f0 < 0.95, f"the draft's token 0 came first in {f0:.0%} of the rounds, p[0] gives it {p0:.0%}: "
                          "you accept it always; accept with probability min(1, p(d) / q(d)) = p(d) (q is a "
                          "point mass on d), not min(1, q / p)")
        expect(abs(f0 - (p0 + (1 - p0) * p0)) > 0.04,
               f"token 0 came first in {f0:.0%} of the rounds, p[0] gives it {p0:.0%}: after a rejection you "
               "drew from p, which can say d again; draw from max(0, p - q) normalised, that is p without d")
        expect(False, f"the first emitted token must follow p[0] = {p[0].tolist()}; yours came out with "
                      f"frequencies {freq}")
    tv, freq = _tv([r[1] for r in runs if len(r) >= 2], p[1])
    expect(tv < 0.08, f"after the first draft is accepted, the next token must follow p[1] = {p[1].tolist()}; "
                      f"yours came out with frequencies {freq}")
    tv, freq = _tv([r[2] for r in runs if len(r) == 3], p[2])
    expect(tv < 0.08, f"after k acceptances the bonus token must follow p[k] = {p[2].tolist()} (the target's "
                      f"distribution after the last draft); yours came out with frequencies {freq}")
