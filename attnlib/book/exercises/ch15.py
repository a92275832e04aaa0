"""Exercise checks for chapter 15 (fast attention).

* 15.1 ``check_online_softmax_stats``: ``online_softmax_stats(blocks)`` reads score blocks
  ``(rows, n_j)`` once, in order, and returns the row max ``m`` and ``l = Σ exp(x - m)``,
  each ``(rows,)``; checked against the whole row, with huge scores and masked (``-inf``) blocks.
  The blocks come from a stream that can be read once, whose blocks are valid only until the next
  request, and that refuses an answer holding more than a few blocks' worth of tensors or Python
  memory (a list of the blocks, ``torch.cat``, clones, ``tolist``, NumPy copies).
* 15.2 ``check_longest_context``: ``longest_context(budget_bytes, B, n_heads, dtype)``, the
  largest ``T`` whose ``(B, n_heads, T, T)`` scores fit in ``budget_bytes``; checked exactly.
* 15.3 ``check_causal_tile_kind``: ``causal_tile_kind(q_start, q_end, k_start, k_end, T_q, T_k)``
  says whether a tile of the bottom-right causal mask is ``"skip"`` (all masked), ``"full"``
  (all visible) or ``"partial"``; checked against :func:`attnlib.attention.masks.causal_mask`.
* 15.4 ``check_merge_partials``: ``merge_partials(out_a, lse_a, out_b, lse_b)`` combines the
  attention outputs and log-sum-exps of two parts of the keys into those of all the keys (the
  merge of split-key / flash-decoding kernels); checked against attention over all keys, with
  large scores and queries that see none of one part's keys (lse = -inf).

The graders draw their random inputs from a local ``torch.Generator``; ``grade`` runs them
inside ``torch.random.fork_rng``, so checking an answer never changes the notebook's global
random state.
"""
from __future__ import annotations

import math
import tracemalloc

import torch

from attnlib.attention.masks import causal_mask, mask_from_mod
from attnlib.book.exercises._ch15_stream import (
    _MATERIALIZED_HINT,
    _large_case,
    _LiveTensors,
    _Materialized,
    _softmax_cases,
    _stats,
    _Stream,
    reset_peak,
)
from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    case_rng,
    exercise,
    expect,
    expect_int,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import Refuse, run

__all__ = ["check_online_softmax_stats", "check_longest_context", "check_causal_tile_kind", "check_merge_partials",
           "check_flash_backward_tile", "check_flex_offset_mods"]


# ---------------------------------------------------------------- 15.1
def _read_stream(online_softmax_stats, what: str, x: torch.Tensor, widths: list[int], big: bool):
    """Run the answer on one stream; return ``(m, l)`` and the stream, or raise :class:`Wrong`."""
    tracker = _LiveTensors()
    blocks = _Stream(x, widths, tracker, check_memory=len(widths) > 20, check_rss=big)
    peak = big and reset_peak()
    try:
        got = run(online_softmax_stats, blocks, what=f"online_softmax_stats(<{what}>)", inside=(tracker,),
                  copy_args=False)
        if peak:
            blocks.weigh_process(peak=True)
    except _Materialized as e:
        raise Wrong(f"{what}: {e}: {_MATERIALIZED_HINT}") from None
    return got, blocks


@exercise("15.1")
def check_online_softmax_stats(online_softmax_stats) -> None:
    """Check ``online_softmax_stats(blocks) -> (m, l)`` on streams that can be read once, block by block."""
    g = case_rng()
    with _LiveTensors():  # the first dispatch imports torch._dynamo: before tracemalloc, which slows imports
        torch.zeros(1).add_(1)
    started_tracing = not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start()
    try:
        cases = [(*case, False) for case in _softmax_cases(g)] + [(*_large_case(g), True)]
        for what, x, widths, big in cases:
            got, blocks = _read_stream(online_softmax_stats, what, x, widths, big)
            if got is None:
                raise NotSolved("return the pair (m, l), not None")
            expect(blocks.ends <= 1,
                   f"{what}: you asked the stream for blocks again after it had ended. It can be read only "
                   "once (the textbook softmax reads a row twice, once for the max, once for the sum): keep a "
                   "running max and a running sum, and rescale the sum when the max grows")
            expect(blocks.next_block == len(widths),
                   f"{what}: you read {blocks.next_block} of the {len(widths)} blocks; read all of them")
            expect(type(got) in (tuple, list) and len(got) == 2, f"return a pair (m, l); got {type(got).__name__}")
            m, denom = got
            for name, t in (("m", m), ("l", denom)):
                expect_tensor(t, f"{what}: {name}", shape=(x.shape[0],))
            m_ref, l_ref = _stats(x)
            nan_rows = torch.isnan(m) | torch.isnan(denom)
            expect(not nan_rows.any(),
                   f"{what}: your m or l holds NaN. While a row has seen only -inf, m is -inf and "
                   "exp(-inf - (-inf)) is NaN: subtract 0 instead of m in that case (torch.where), so that l "
                   "stays 0")
            expect(torch.equal(m.to(m_ref.dtype), m_ref),
                   f"{what}: m should be each row's largest score {_short(m_ref)}; got {_short(m)}")
            expect(torch.isfinite(denom).all(),
                   f"{what}: l overflowed to inf. Sum exp(x - m) with m the running max, never exp(x) itself")
            if not torch.allclose(denom.double(), l_ref.double(), rtol=1e-5, atol=1e-6):
                hint = ("when a block raises the running max from m to m', the sum so far was taken against m: "
                        "multiply it by exp(m - m') before adding the block's exp(x - m')")
                expect(False, f"{what}: l should be {_short(l_ref)}; got {_short(denom)}: {hint}")
    finally:
        if started_tracing:
            tracemalloc.stop()


def _short(t: torch.Tensor, n: int = 4) -> str:
    """The first ``n`` values of a vector, rounded, for a hint that fits a line."""
    values = [round(v, 4) for v in t.detach().double().tolist()[:n]]
    return str(values)[:-1] + (", ...]" if t.numel() > n else "]")


# ---------------------------------------------------------------- 15.2
_BUDGET_CASES = [  # (budget_bytes, B, n_heads, dtype)
    (80 * 2**30, 1, 32, torch.bfloat16),  # an 80 GiB accelerator, one sequence, 32 heads
    (24 * 2**30, 8, 12, torch.float32),
    (2**20, 1, 1, torch.float32),  # exactly 512 x 512 float32 scores
    (2**20 - 1, 1, 1, torch.float32),  # one byte short of that
    (12 * 1024 * 1024 * 4, 1, 12, torch.float32),  # exactly T = 1024
    (3, 1, 1, torch.float32),  # not even one score
    (10**9, 3, 5, torch.float16),
    (7 * 2**30 + 12345, 2, 16, torch.float64),
]


def _longest(budget: int, B: int, n_heads: int, dtype: torch.dtype) -> int:
    per_score = B * n_heads * torch.empty((), dtype=dtype).element_size()
    return math.isqrt(budget // per_score)  # T^2 * per_score <= budget  <=>  T^2 <= budget // per_score


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _budget_cases(g: torch.Generator) -> list[tuple[int, int, int, torch.dtype]]:
    """The fixed boundaries, one beyond 2**53 (where a float square root rounds up), and fresh ones."""
    cases = list(_BUDGET_CASES)
    T = 2**31  # T^2 = 2**62 > 2**53: budget / c is no longer exact in a float
    cases.append((2 * T * T - 1, 1, 1, torch.float16))  # one byte short: T - 1, a float square root says T
    for _ in range(4):
        B, n_heads, dtype = randint(g, 1, 16), randint(g, 1, 64), _DTYPES[randint(g, 0, 3)]
        T = randint(g, 1, 200_000)
        exact = B * n_heads * T * T * dtype.itemsize
        cases.append((exact + randint(g, -1, 1) * randint(g, 1, B * n_heads * dtype.itemsize), B, n_heads, dtype))
    return cases


@exercise("15.2")
def check_longest_context(longest_context) -> None:
    """Check ``longest_context(budget_bytes, B, n_heads, dtype) -> int`` exactly, boundaries included."""
    for budget, B, n_heads, dtype in _budget_cases(case_rng()):
        case = f"longest_context(budget_bytes={budget:,}, B={B}, n_heads={n_heads}, {dtype})"
        got = expect_int(run(longest_context, budget, B, n_heads, dtype, what=case), case)
        expected = _longest(budget, B, n_heads, dtype)
        case = f"{case} = {got:,}"
        if got == expected:
            continue
        size = torch.empty((), dtype=dtype).element_size()
        expect(got != _longest(budget // 8, B, n_heads, dtype),
               f"{case}, expected {expected:,}: you counted bits; a {dtype} number takes {size} bytes")
        expect(got != math.isqrt(budget // (B * size)),
               f"{case}, expected {expected:,}: every one of the n_heads={n_heads} heads has its own T x T scores")
        expect(got != math.isqrt(budget // (n_heads * size)),
               f"{case}, expected {expected:,}: every one of the B={B} sequences has its own scores")
        expect(size == 4 or got != _longest(budget * size // 4, B, n_heads, dtype),
               f"{case}, expected {expected:,}: you counted 4 bytes per score; a {dtype} number takes "
               f"{size} bytes (dtype.itemsize)")
        used = B * n_heads * got * got * size
        if used > budget and got == expected + 1 and budget > 2**53:
            expect(False, f"{case}, expected {expected:,}: {got} x {got} scores take {used:,} bytes, one score "
                          "more than the budget. Past 2**53 a float square root rounds: math.sqrt of a number "
                          "just below T^2 gives T. Stay in integers: math.isqrt")
        expect(used <= budget, f"{case}: {got} x {got} scores take {used:,} bytes, more than the budget: round down")
        expect(False, f"{case}, expected {expected:,}: the largest T with B x n_heads x T x T x bytes <= budget_bytes "
                      "(one more would not fit)")


# ---------------------------------------------------------------- 15.3
_TILE_CASES = [  # (T_q, T_k, queries per tile, keys per tile)
    (8, 8, 4, 4),
    (10, 10, 3, 4),
    (7, 12, 4, 3),  # fewer queries than keys: the last queries of a sequence, after a cache
    (1, 9, 1, 2),  # one decoding step
    (12, 12, 5, 2),
    (5, 20, 2, 6),
]


def _kind(visible: torch.Tensor) -> str:
    if not visible.any():
        return "skip"
    return "full" if visible.all() else "partial"


#: 15.3 asks for the corners only: the mask helpers are refused, and the largest case has no mask at all
_CORNERS = Refuse("decide from the tile's corners; never build the mask", causal_mask, mask_from_mod, torch.tril,
                  torch.triu, aten=("aten.tril", "aten.triu"))


def _huge_tiles(T_q: int, T_k: int, tile: int) -> list[tuple[int, int, int, int, str]]:
    """Three tiles of a mask far too large to build, with their kinds: on, above and below the diagonal."""
    offset, q0 = T_k - T_q, T_q // 2
    diagonal = offset + q0  # the first query's position
    return [(q0, q0 + tile, diagonal - tile // 2, diagonal + tile // 2, "partial"),
            (q0, q0 + tile, diagonal + 2 * tile, diagonal + 3 * tile, "skip"),
            (q0, q0 + tile, diagonal - 3 * tile, diagonal - 2 * tile + 1, "full")]


def _tile_hint(case: str, got: str, expected: str, top_left: str, q_end: int, T_q: int, T_k: int) -> str:
    if T_q != T_k and got == top_left:
        return (f"{case}: you aligned the mask top-left. The queries are the last T_q positions: query i sits "
                "at position T_k - T_q + i")
    if expected == "skip" and got == "partial":
        return (f"{case}: every key of this tile comes after the last query of the tile (position "
                f"T_k - T_q + q_end - 1 = {T_k - T_q + q_end - 1}): nothing is visible")
    if expected == "partial":
        return (f"{case}: the tile crosses the diagonal: some of its keys are visible to some queries, not all. "
                "q_end and k_end are exclusive: the last query is q_end - 1, the last key k_end - 1")
    return f"{case}. Key j is visible to query i when j <= T_k - T_q + i; q_end and k_end are exclusive"


@exercise("15.3")
def check_causal_tile_kind(causal_tile_kind) -> None:
    """Check ``causal_tile_kind(q_start, q_end, k_start, k_end, T_q, T_k)`` on every tile of several masks."""
    g = case_rng()
    cases = list(_TILE_CASES)
    for _ in range(3):  # fresh masks and tiles each run
        T_k = randint(g, 2, 40)
        cases.append((randint(g, 1, T_k), T_k, randint(g, 1, 8), randint(g, 1, 8)))
    for T_q, T_k, bq, bk in cases:
        mask = causal_mask(T_q, T_k)
        top_left = torch.ones(T_q, T_k, dtype=torch.bool).tril()
        for q_start in range(0, T_q, bq):
            q_end = min(q_start + bq, T_q)
            for k_start in range(0, T_k, bk):
                k_end = min(k_start + bk, T_k)
                args = (q_start, q_end, k_start, k_end, T_q, T_k)
                case = "causal_tile_kind(q_start={}, q_end={}, k_start={}, k_end={}, T_q={}, T_k={})".format(*args)
                got = run(causal_tile_kind, *args, what=case, refuse=_CORNERS)
                if got is None:
                    raise NotSolved('return "skip", "full" or "partial", not None')
                expect(type(got) is str and got in ("skip", "full", "partial"),
                       f'return "skip", "full" or "partial"; got {got!r}')
                expected = _kind(mask[q_start:q_end, k_start:k_end])
                if got != expected:
                    raise Wrong(_tile_hint(f"{case} = {got!r}, expected {expected!r}", got, expected,
                                           _kind(top_left[q_start:q_end, k_start:k_end]), q_end, T_q, T_k))
    T_q, T_k = 2**40 + randint(g, 0, 2**20), 2**41  # a million-million queries: no mask of them fits anywhere
    for args in _huge_tiles(T_q, T_k, 2**20):
        *args, expected = args
        case = "causal_tile_kind(q_start={:,}, q_end={:,}, k_start={:,}, k_end={:,}, T_q={:,}, T_k={:,})".format(
            *args, T_q, T_k)
        try:
            got = run(causal_tile_kind, *args, T_q, T_k, what=case, refuse=_CORNERS)
        except Wrong as e:
            raise Wrong(f"{e}. No mask of T_q x T_k (or of one tile of 2**20 x 2**20) fits in memory here: "
                        "decide from the tile's corners, four integers") from None
        expect(got == expected, f"{case} = {got!r}, expected {expected!r}: key j is visible to query i when "
                                "j <= T_k - T_q + i; q_end and k_end are exclusive")


# ---------------------------------------------------------------- 15.4, 15.5, 15.6
# In modules of their own (no module over 350 lines); importing them registers the checks.
from attnlib.book.exercises._ch15_flash import check_flash_backward_tile, check_flex_offset_mods  # noqa: E402
from attnlib.book.exercises._ch15_merge import check_merge_partials  # noqa: E402
