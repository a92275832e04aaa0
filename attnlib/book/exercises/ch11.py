"""Exercise checks for chapter 11 (tokenizers): the two steps of BPE training, and padding.

* 11.1 ``pair_counts(ids)`` -> ``dict[(a, b), int]``: how often each pair of adjacent ids occurs
* 11.2 ``merge(ids, pair, new_id)`` -> ``list[int]``: one BPE merge, left to right, no overlap
* 11.3 ``left_pad(batch, pad_id)`` -> ``(ids (B, T) long, attention_mask (B, T) bool)``, padding on the left

The graders draw their random inputs from a local ``torch.Generator``.
"""
from __future__ import annotations

from collections import Counter

import torch

from attnlib.book.exercises._core import exercise, expect, expect_close

__all__ = ["check_pair_counts", "check_merge", "check_left_pad"]


def _random_ids(g: torch.Generator, n: int, high: int) -> list[int]:
    return torch.randint(0, high, (n,), generator=g).tolist()


def _reference_merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


@exercise("11.1")
def check_pair_counts(fn) -> None:
    """Check a function counting the pairs of adjacent ids of a list."""
    g = torch.Generator().manual_seed(11)
    cases = [[], [5], [1, 2], [97, 97, 97, 98], [1, 2, 1, 2, 1], [7, 7, 7, 7]]
    cases += [_random_ids(g, n, 4) for n in (10, 30, 100)]
    for ids in cases:
        what = f"pair_counts({ids if len(ids) <= 12 else str(ids[:12])[:-1] + ', ...]'})"
        got = fn(list(ids))
        expect(isinstance(got, dict), f"{what} should return a dict (a Counter is fine), got {type(got).__name__}")
        expected = Counter(zip(ids, ids[1:]))
        got = {k: v for k, v in got.items() if v}
        bad_keys = [k for k in got if not (isinstance(k, tuple) and len(k) == 2)]
        expect(not bad_keys, f"{what}: keys must be pairs (a, b) of ids, got {bad_keys[:1]}")
        expect(set(got) == set(expected), f"{what}: pairs {sorted(set(got) ^ set(expected))[:3]} are missing or extra; "
                                          f"pair i is (ids[i], ids[i + 1]) for i < len(ids) - 1")
        for k, v in expected.items():
            if k[0] == k[1] and got[k] < v:
                expect(False, f"{what}: pair {k} occurs {v} times, you counted {got[k]}; count every window of "
                              f"two neighbours, overlaps included")
            expect(got[k] == v, f"{what}: pair {k} occurs {v} times, you counted {got[k]}")


@exercise("11.2")
def check_merge(fn) -> None:
    """Check one BPE merge step: every occurrence of a pair, left to right, becomes the new id."""
    g = torch.Generator().manual_seed(12)
    cases = [([], (1, 2), 9), ([1], (1, 2), 9), ([97, 97, 97, 98, 100, 97, 97, 97, 98, 97, 99], (97, 97), 256),
             ([1, 1, 1], (1, 1), 5), ([1, 1, 1, 1], (1, 1), 5), ([1, 2, 1, 2, 1], (1, 2), 3), ([2, 1, 2], (1, 2), 3)]
    for n in (10, 40, 100):
        ids = _random_ids(g, n, 3)
        cases.append((ids, (ids[0], ids[1]), 10))
    for ids, pair, new_id in cases:
        what = f"merge({ids if len(ids) <= 12 else str(ids[:12])[:-1] + ', ...]'}, {pair}, {new_id})"
        original = list(ids)
        got = fn(ids, pair, new_id)
        expect(ids == original, f"{what} changed its input list; build a new list")
        expect(isinstance(got, list), f"{what} should return a list, got {type(got).__name__}")
        expected = _reference_merge(original, pair, new_id)
        if original == [1, 1, 1] and got == [1, 5]:
            expect(False, f"{what} gives [1, 5]: scan from the left, so the first two 1s merge: [5, 1]")
        if len(got) > len(expected) and got.count(new_id) < expected.count(new_id):
            expect(False, f"{what} misses occurrences: expected {expected}, got {got}")
        expect(got == expected, f"{what} should be {expected}, got {got}; after a merge, skip both merged ids")


@exercise("11.3")
def check_left_pad(fn) -> None:
    """Check padding a batch on the left, with its attention mask (True at real tokens)."""
    g = torch.Generator().manual_seed(13)
    cases = [([[5, 6, 7], [8]], 0), ([[1], [2], [3]], 0), ([[4, 5], []], 9), ([[], []], 0), ([[0, 3], [4]], 0)]
    for B in (2, 5):
        lengths = torch.randint(0, 7, (B,), generator=g).tolist()
        cases.append(([_random_ids(g, n, 50) for n in lengths], 0))
    for batch, pad_id in cases:
        what = f"left_pad({batch}, pad_id={pad_id})"
        got = fn([list(s) for s in batch], pad_id)
        expect(isinstance(got, tuple) and len(got) == 2, f"{what} should return a pair (ids, attention_mask)")
        ids, mask = got
        T = max(len(s) for s in batch)
        exp_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
        exp_mask = torch.zeros(len(batch), T, dtype=torch.bool)
        for b, s in enumerate(batch):
            if s:
                exp_ids[b, T - len(s):] = torch.tensor(s)
                exp_mask[b, T - len(s):] = True
        expect(isinstance(ids, torch.Tensor) and ids.dtype == torch.long,
               f"{what}: ids should be a torch.long tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
        expect(isinstance(mask, torch.Tensor) and mask.dtype == torch.bool,
               f"{what}: attention_mask should be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        right = torch.full_like(exp_ids, pad_id)
        for b, s in enumerate(batch):
            right[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        if ids.shape == exp_ids.shape and torch.equal(ids, right) and not torch.equal(right, exp_ids):
            expect(False, f"{what} pads on the right; put the pad ids before each sequence, so that every "
                          f"sequence ends in the last column")
        expect_close(ids, exp_ids, f"{what} ids")
        if isinstance(mask, torch.Tensor) and mask.shape == exp_mask.shape and torch.equal(mask, ids != pad_id) \
                and not torch.equal(mask, exp_mask):
            expect(False, f"{what}: the mask cannot be computed from the ids: pad_id may also be a real token; "
                          f"mark positions by the sequence lengths")
        expect_close(mask, exp_mask, f"{what} attention_mask")
