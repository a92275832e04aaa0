"""Exercise 22.3: the prompt positions SnapKV keeps, from the prompt's attention weights.

``snapkv_keep(weights, window, budget, kernel_size) -> (B, H, kept) int64``: the last ``window`` queries of the
prompt vote for the keys before them (their weights summed over those queries), the votes are averaged over
``kernel_size`` neighbouring keys (zeros padded at both ends, ``kernel_size // 2`` each, and counted), and the
``budget - window`` keys of the highest pooled vote are kept with the window's own positions, ascending; a prompt
of at most ``budget`` positions keeps them all (Li et al. 2024, SnapKV, §4.1-4.2; :class:`attnlib.cache.SnapKVLayerCache`,
refused). The expected choice is computed in float64; an answer whose chosen keys have the same pooled votes
(a near tie decided the other way by float32's rounding) is right too.
"""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from attnlib.book.exercises._core import NotSolved, Wrong, case_rng, exercise, expect, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.cache.eviction import H2OLayerCache, SnapKVLayerCache

__all__ = ["check_snapkv_keep", "keep", "pooled_votes"]

_BY_HAND = Refuse("choose the positions yourself, without attnlib's evicting caches", SnapKVLayerCache,
                  H2OLayerCache)


def pooled_votes(weights: torch.Tensor, window: int, kernel_size: int, *, queries: int | None = None,
                 keys: int | None = None, pool: str = "avg", count_pad: bool = True, pad: bool = True) -> torch.Tensor:
    """SnapKV's pooled votes ``(B, H, T - window)`` in float64; the keyword arguments give the slips' variants.

    ``queries``: how many of the last queries vote (``window``); ``keys``: how many keys are pooled before the
    first ``T - window`` are taken (``T - window``).
    """
    B, H, T, _ = weights.shape
    n_keys = T - window if keys is None else keys
    vote = weights.double()[..., T - (window if queries is None else queries):, :n_keys].sum(-2)  # (B, H, n_keys)
    flat = vote.reshape(B * H, 1, n_keys)
    padding = kernel_size // 2 if pad else 0
    if pool == "max":
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=padding)
    elif pool == "avg":
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=padding, count_include_pad=count_pad)
    else:
        pooled = flat
    return pooled.reshape(B, H, -1)[..., :T - window]


def keep(pooled: torch.Tensor, T: int, window: int, budget: int, with_window: bool = True) -> torch.Tensor:
    """The top ``budget - window`` keys of ``pooled`` (ascending) and the window's positions: ``(B, H, budget)``."""
    B, H, _ = pooled.shape
    top = pooled.topk(budget - window if with_window else budget, dim=-1).indices.sort(-1).values
    last = torch.arange(T - window, T).expand(B, H, window)
    return torch.cat([top, last], dim=-1) if with_window else top


def _slips(weights: torch.Tensor, window: int, budget: int, K: int) -> dict[str, tuple[str, torch.Tensor]]:
    """What the usual slips keep: name -> (the hint naming it, the positions it keeps); a slip that cannot be
    computed for these sizes is left out."""
    B, H, T, _ = weights.shape
    the_window = f"the observation window is the last window = {window} queries"
    always = ("the last window positions are always kept: choose budget - window keys among those before the "
              "window, then add the window's")

    def kept(**variant) -> torch.Tensor:
        return keep(pooled_votes(weights, window, K, **variant), T, window, budget)

    slips = {
        "no pooling": ("pool the votes along the keys before choosing (average over kernel_size neighbours): a key "
                       "next to keys the window reads is kept with them", kept(pool="none")),
        "every query": ("only the observation window votes: sum the weights of its last window queries, not of "
                        "every query", kept(queries=T)),
        "window + 1": (f"{the_window}, not window + 1", kept(queries=window + 1)),
        "max": ("SnapKV's default pooling (and this exercise's) is an average, not a max", kept(pool="max")),
        "pads not counted": ("pad with kernel_size // 2 zeros at each end and count them (avg_pool1d's "
                             "count_include_pad): every pooled vote is a sum divided by kernel_size",
                             kept(count_pad=False)),
        "window's keys pooled": ("pool the votes of the keys before the window only: the zeros padded at their end "
                                 "stand where the window's keys are", kept(keys=T)),
    }
    if window > 1:
        slips["window - 1"] = (f"{the_window}, not window - 1", kept(queries=window - 1))
    if T - window >= K:  # without padding: T - window - K + 1 pooled votes, vote j centred on key j + K // 2
        unpadded = pooled_votes(weights, window, K, pad=False)
        if unpadded.shape[-1] >= budget - window:
            slips["no padding"] = ("pad kernel_size // 2 zeros at each end, so that pooled vote j is centred on key "
                                   "j (without padding the pooled votes are shifted by kernel_size // 2, and fewer)",
                                   keep(unpadded, T, window, budget))
    if budget <= T - window:
        slips["no window"] = (always, keep(pooled_votes(weights, window, K), T, window, budget, with_window=False))
    every = F.avg_pool1d(weights.double()[..., T - window:, :].sum(-2).reshape(B * H, 1, T), K, stride=1,
                         padding=K // 2).reshape(B, H, T)  # every key a candidate, the window's too
    slips["window competes"] = (always, every.topk(budget, dim=-1).indices.sort(-1).values)
    return slips


def _cases(g: torch.Generator) -> list[tuple[tuple[int, int, int, int], int, int, int, float, str]]:
    """((B, H, T, T), window, budget, kernel_size, the scores' scale, a pattern of :func:`_weights`): a prompt
    within the budget, a window that is the whole budget, pooling of 1, votes that the pool's edges decide, and
    fresh random ones."""
    cases = [((1, 1, 12, 12), 3, 6, 3, 3.0), ((1, 2, 6, 6), 2, 8, 3, 2.0), ((1, 1, 8, 8), 2, 8, 5, 2.0),
             ((2, 2, 16, 16), 4, 4, 3, 2.0), ((1, 2, 20, 20), 4, 10, 1, 3.0), ((2, 3, 32, 32), 4, 12, 5, 3.0),
             ((1, 2, 40, 40), 8, 16, 7, 4.0), ((1, 1, 14, 14), 1, 13, 3, 3.0)]
    cases = [(*case, "") for case in cases]
    cases += [((1, 2, 24, 24), 4, 8, 5, 2.0, "recency"), ((2, 1, 12, 12), 2, 4, 3, 1.0, "first keys")]
    for _ in range(3):
        T = randint(g, 8, 40)
        window = randint(g, 1, T // 3)
        cases.append(((randint(g, 1, 2), randint(g, 1, 3), T, T), window, randint(g, window, T - 1),
                      2 * randint(g, 0, 3) + 1, 1.0 + randint(g, 0, 3), ""))
    return cases


#: the window's votes (up to a factor) on the 10 keys before it in the "first keys" case: with a pool of 3 that
#: counts the padded zeros, key 6 (0.8) and key 1 (0.733) lead; without counting them, key 0 (1.05) does
_FIRST_KEYS = (1.0, 1.1, 0.1, 1e-3, 1e-3, 0.8, 0.8, 0.8, 1e-3, 1e-3)


def _weights(g: torch.Generator, size: tuple[int, int, int, int], scale: float, pattern: str = "",
             window: int = 0, kernel_size: int = 1) -> torch.Tensor:
    """Causal softmax weights ``(B, H, T, T)`` float32 of random scores. ``"recency"``: the window's keys draw the
    most weight and the ``kernel_size // 2`` keys just before the window the least (pooling across the window's
    edge then changes the choice); ``"first keys"``: the window's weights on the earlier keys are
    :data:`_FIRST_KEYS` (pooling at the first keys decides)."""
    T = size[-1]
    scores = torch.randn(*size, generator=g) * scale
    if pattern == "recency":
        scores[..., T - window:] += 6.0
        scores[..., T - window - kernel_size // 2:T - window] -= 6.0
    elif pattern == "first keys":
        scores[..., T - window:, :T - window] = torch.tensor(_FIRST_KEYS).log()
        scores[..., T - window:, T - window:] = 0.0
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf).softmax(-1)


@exercise("22.3")
def check_snapkv_keep(answer) -> None:
    """Check ``answer(weights (B, H, T, T), window, budget, kernel_size) -> (B, H, min(T, budget)) int64``.

    Every case runs first; a wrong choice is then explained by the slips that keep the answer's positions in
    every case (one case alone often fits several slips).
    """
    g = case_rng()
    chosen = []  # (what, weights, window, budget, K, the answer's positions, the expected ones, right)
    for size, window, budget, K, scale, pattern in _cases(g):
        weights = _weights(g, size, scale, pattern, window, K)
        B, H, T, _ = size
        what = f"snapkv_keep(weights {tuple(weights.shape)}, window={window}, budget={budget}, kernel_size={K})"
        try:
            got = run(answer, weights, window, budget, K, what=what, refuse=_BY_HAND)
        except Wrong as e:
            if any(not case[-1] for case in chosen):
                break  # an earlier case's wrong choice says more than this one's error (a slip that fails here)
            if T <= budget and "your code raised" in str(e):
                raise Wrong(f"{e}; a prompt of T = {T} <= budget = {budget} positions keeps them all, 0 … T - 1: "
                            "nothing to choose") from None
            raise
        if got is None:
            raise NotSolved("return the kept positions (B, H, budget) as a LongTensor, not None")
        expect_tensor(got, what)
        kept = min(T, budget)
        if T <= budget:
            expect(tuple(got.shape) == (B, H, T), f"{what} has shape {tuple(got.shape)}: a prompt of T = {T} <= "
                                                  f"budget positions keeps them all, ({B}, {H}, {T})")
        expect(not (T > budget and tuple(got.shape) == (B, H, budget - window)), f"{what} has shape "
               f"{tuple(got.shape)}: the last window positions are kept too, with the budget - window chosen ones")
        expect(tuple(got.shape) == (B, H, kept), f"{what} has shape {tuple(got.shape)}, expected {(B, H, kept)}: "
                                                 "per row and head, the positions kept")
        expect(got.dtype == torch.int64, f"{what} has dtype {got.dtype}: return positions as int64 (a LongTensor)")
        if T <= budget:
            expect(torch.equal(got, torch.arange(T).expand(B, H, T)), f"{what}: a prompt of T = {T} <= budget "
                                                                      "positions keeps them all, 0 … T - 1")
            continue
        # the expected choice, after the answer ran, in float64
        pooled = pooled_votes(weights, window, K)
        want = keep(pooled, T, window, budget)
        right = torch.equal(got, want) or _as_good(got, want, pooled, T, window)
        expect(right or not torch.equal(got.sort(-1).values, want), f"{what}: the right positions, not in order: "
                                                                    "sort them ascending (the cache keeps them in order)")
        chosen.append((what, weights, window, budget, K, got, want, right))
    wrong = [case for case in chosen if not case[-1]]
    if not wrong:
        return
    slips = [_slips(*case[1:5]) for case in chosen]
    names = set.intersection(*({name for name, (_, kept) in table.items()
                                if torch.equal(kept, got) or (right and torch.equal(kept, want))}
                               | {name for name in _NAMES if name not in table}
                               for table, (*_, got, want, right) in zip(slips, chosen)))
    what, weights, window, budget, K, got, want, _ = wrong[0]
    here = _slips(weights, window, budget, K)
    hints = list(dict.fromkeys(here[name][0] for name in _NAMES if name in names and name in here
                               and not torch.equal(here[name][1], want)))
    if not hints:  # no slip fits every case: the first that fits this one
        hints = [hint for hint, kept in here.values() if not torch.equal(kept, want) and torch.equal(got, kept)][:1]
    expect(not hints, f"{what}: " + "; or ".join(hints))
    T = weights.shape[-1]
    expect(torch.equal(got[..., -window:], want[..., -window:]), f"{what}: the last window positions, "
           f"{T - window} … {T - 1}, are always kept, last")
    b, h = (int(i) for i in (got != want).any(-1).nonzero()[0])
    expect(False, f"{what}: row {b}, head {h} keeps {got[b, h].tolist()}, expected {want[b, h].tolist()} (the "
                  "window's summed weights, average-pooled along the keys, top budget - window, then the window)")


#: the slips' names, in the order their hints are given
_NAMES = ("no pooling", "every query", "window + 1", "window - 1", "max", "pads not counted", "window's keys pooled",
          "no padding", "no window", "window competes")


def _as_good(got: torch.Tensor, want: torch.Tensor, pooled: torch.Tensor, T: int, window: int) -> bool:
    """Whether ``got`` keeps the window and distinct earlier keys whose pooled votes are ``want``'s (a near tie)."""
    chosen, n = got[..., :-window], want.shape[-1] - window
    if not torch.equal(got[..., -window:], want[..., -window:]) or n == 0:
        return False
    if bool((chosen < 0).any() or (chosen >= T - window).any() or (chosen.diff(dim=-1) <= 0).any()):
        return False
    a, b = pooled.gather(-1, chosen).sort(-1).values, pooled.gather(-1, want[..., :-window]).sort(-1).values
    return torch.allclose(a, b, atol=1e-6 * pooled.abs().max().item(), rtol=0)
