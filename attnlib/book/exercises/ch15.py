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

from attnlib.attention.masks import causal_mask
from attnlib.book.exercises._ch15_stream import (
    _MATERIALIZED_HINT,
    _LiveTensors,
    _Materialized,
    _softmax_cases,
    _stats,
    _Stream,
)
from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect

__all__ = ["check_online_softmax_stats", "check_longest_context", "check_causal_tile_kind", "check_merge_partials"]


# ---------------------------------------------------------------- 15.1
@exercise("15.1")
def check_online_softmax_stats(online_softmax_stats) -> None:
    """Check ``online_softmax_stats(blocks) -> (m, l)`` on streams that can be read once, block by block."""
    g = torch.Generator().manual_seed(1501)
    with _LiveTensors():  # the first dispatch imports torch._dynamo: before tracemalloc, which slows imports
        torch.zeros(1).add_(1)
    started_tracing = not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start()
    try:
        for what, x, widths in _softmax_cases(g):
            check_memory = len(widths) > 20
            tracker = _LiveTensors()
            blocks = _Stream(x, widths, tracker, check_memory)
            try:
                with tracker:
                    got = online_softmax_stats(blocks)
            except _Materialized as e:
                raise Wrong(f"{what}: {e}: {_MATERIALIZED_HINT}") from None
            if got is None:
                raise NotSolved("return the pair (m, l), not None")
            expect(blocks.ends <= 1,
                   f"{what}: you asked the stream for blocks again after it had ended. It can be read only "
                   "once (the textbook softmax reads a row twice, once for the max, once for the sum): keep a "
                   "running max and a running sum, and rescale the sum when the max grows")
            expect(blocks.next_block == len(widths),
                   f"{what}: you read {blocks.next_block} of the {len(widths)} blocks; read all of them")
            expect(isinstance(got, (tuple, list)) and len(got) == 2, f"return a pair (m, l); got {type(got).__name__}")
            m, denom = got
            for name, t in (("m", m), ("l", denom)):
                expect(isinstance(t, torch.Tensor), f"{what}: {name} should be a torch.Tensor, got {type(t).__name__}")
                expect(tuple(t.shape) == (x.shape[0],),
                       f"{what}: {name} has shape {tuple(t.shape)}, expected ({x.shape[0]},)")
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


@exercise("15.2")
def check_longest_context(longest_context) -> None:
    """Check ``longest_context(budget_bytes, B, n_heads, dtype) -> int`` exactly, boundaries included."""
    for budget, B, n_heads, dtype in _BUDGET_CASES:
        got = longest_context(budget, B, n_heads, dtype)
        if got is None:
            raise NotSolved("return the longest T as an int, not None")
        expect(
            isinstance(got, int) and not isinstance(got, bool),
            f"return a Python int; got {type(got).__name__} (use int(...) or math.isqrt)",
        )
        expected = _longest(budget, B, n_heads, dtype)
        case = f"longest_context(budget_bytes={budget:,}, B={B}, n_heads={n_heads}, {dtype}) = {got:,}"
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


@exercise("15.3")
def check_causal_tile_kind(causal_tile_kind) -> None:
    """Check ``causal_tile_kind(q_start, q_end, k_start, k_end, T_q, T_k)`` on every tile of several masks."""
    for T_q, T_k, bq, bk in _TILE_CASES:
        mask = causal_mask(T_q, T_k)
        top_left = torch.ones(T_q, T_k, dtype=torch.bool).tril()
        for q_start in range(0, T_q, bq):
            q_end = min(q_start + bq, T_q)
            for k_start in range(0, T_k, bk):
                k_end = min(k_start + bk, T_k)
                got = causal_tile_kind(q_start, q_end, k_start, k_end, T_q, T_k)
                if got is None:
                    raise NotSolved('return "skip", "full" or "partial", not None')
                expect(got in ("skip", "full", "partial"), f'return "skip", "full" or "partial"; got {got!r}')
                expected = _kind(mask[q_start:q_end, k_start:k_end])
                if got == expected:
                    continue
                case = (f"causal_tile_kind(q_start={q_start}, q_end={q_end}, k_start={k_start}, k_end={k_end}, "
                        f"T_q={T_q}, T_k={T_k}) = {got!r}, expected {expected!r}")
                expect(
                    T_q == T_k or got != _kind(top_left[q_start:q_end, k_start:k_end]),
                    f"{case}: you aligned the mask top-left. The queries are the last T_q positions: query i sits "
                    "at position T_k - T_q + i",
                )
                expect(
                    expected != "skip" or got != "partial",
                    f"{case}: every key of this tile comes after the last query of the tile (position "
                    f"T_k - T_q + q_end - 1 = {T_k - T_q + q_end - 1}): nothing is visible",
                )
                expect(
                    expected != "partial",
                    f"{case}: the tile crosses the diagonal: some of its keys are visible to some queries, not all. "
                    "q_end and k_end are exclusive: the last query is q_end - 1, the last key k_end - 1",
                )
                expect(False, f"{case}. Key j is visible to query i when j <= T_k - T_q + i; q_end and k_end are "
                              "exclusive")


# ---------------------------------------------------------------- 15.4
def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """Attention of ``q`` over one part of the keys, in float64: (out, lse); a row that sees nothing
    gets out 0 and lse -inf."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with nothing visible
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return p @ v, lse


def _merge_cases(g: torch.Generator):
    cases = []
    for what, T_q, T_k, split, scale, causal in [
        ("random scores, keys split 5 | 7", 4, 12, 5, 1.0, False),
        ("random scores, keys split 1 | 9", 3, 10, 1, 1.0, False),
        ("scores in the hundreds", 4, 10, 6, 60.0, False),
        ("causal, 6 queries over 6 keys split 3 | 3 (early queries see no key of the second part)",
         6, 6, 3, 1.0, True),
        ("causal, the first part masked for some rows, one query sees no key", 5, 9, 4, 1.0, True),
    ]:
        q = torch.randn(2, 3, T_q, 8, generator=g, dtype=torch.float64) * scale
        k = torch.randn(2, 3, T_k, 8, generator=g, dtype=torch.float64) * scale
        v = torch.randn(2, 3, T_k, 8, generator=g, dtype=torch.float64)
        visible = causal_mask(T_q, T_k) if causal else torch.ones(T_q, T_k, dtype=torch.bool)
        if what.startswith("causal, the first part"):
            visible = visible.clone()
            visible[:2, :split] = False  # these rows see only the second part
            visible[2] = False  # a padded query: it sees no key at all
        cases.append((what, q, k, v, visible, split))
    return cases


@exercise("15.4")
def check_merge_partials(merge_partials) -> None:
    """Check ``merge_partials(out_a, lse_a, out_b, lse_b) -> (out, lse)`` against attention over all keys."""
    g = torch.Generator().manual_seed(1504)
    for what, q, k, v, visible, split in _merge_cases(g):
        out_a, lse_a = _partial(q, k[..., :split, :], v[..., :split, :], visible[:, :split])
        out_b, lse_b = _partial(q, k[..., split:, :], v[..., split:, :], visible[:, split:])
        want_out, want_lse = _partial(q, k, v, visible)
        args = [t.clone() for t in (out_a, lse_a, out_b, lse_b)]
        got = merge_partials(*args)
        if got is None:
            raise NotSolved("return the pair (out, lse), not None")
        expect(all(torch.equal(a, b) for a, b in zip(args, (out_a, lse_a, out_b, lse_b))),
               f"{what}: your function changed its inputs in place; leave them as they are")
        expect(isinstance(got, (tuple, list)) and len(got) == 2,
               f"return a pair (out, lse); got {type(got).__name__}")
        out, lse = got
        expect(isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor),
               f"{what}: out and lse should be tensors")
        expect(tuple(out.shape) == tuple(want_out.shape) and tuple(lse.shape) == tuple(want_lse.shape),
               f"{what}: out has shape {tuple(out.shape)} and lse {tuple(lse.shape)}; expected "
               f"{tuple(want_out.shape)} and {tuple(want_lse.shape)}")
        if torch.isnan(out).any() or torch.isnan(lse).any():
            bad = torch.isnan(out).any(dim=-1) | torch.isnan(lse)  # (B, h, T_q)
            both = torch.isinf(lse_a) & torch.isinf(lse_b)
            if (bad & both).any():
                raise Wrong(f"{what}: NaN for a query that sees no key in either part (a padded "
                            "query): both lse are -inf, and exp(-inf - (-inf)) is NaN. Shift by 0 "
                            "when both are -inf, and return out 0 and lse -inf for that query")
            if (bad & (torch.isinf(lse_a) | torch.isinf(lse_b))).any():
                raise Wrong(f"{what}: NaN where one part has lse = -inf (the query sees none of its "
                            "keys): its weight exp(-inf - m) should be 0")
            raise Wrong(f"{what}: your out or lse holds NaN. With lse in the hundreds, exp(lse) "
                        "overflows: weigh each part by exp(lse_part - max(lse_a, lse_b))")
        if not torch.allclose(out.double(), want_out, rtol=1e-5, atol=1e-6):
            mean = (out_a + out_b) / 2
            if torch.allclose(out.double(), mean, rtol=1e-5, atol=1e-6):
                raise Wrong(f"{what}: out is the plain mean of the two parts. Each part's output is "
                            "normalised over its own keys: weigh it by its share of the whole "
                            "denominator, exp(lse_part - lse)")
            raise Wrong(f"{what}: out differs from attention over all keys by up to "
                        f"{(out.double() - want_out).abs().max().item():.2e}. out = "
                        "(exp(lse_a - lse) out_a + exp(lse_b - lse) out_b)")
        finite = torch.isfinite(want_lse)
        expect(torch.equal(torch.isinf(lse), ~finite),
               f"{what}: lse must be -inf exactly where a query sees no key at all, finite elsewhere")
        if not torch.allclose(lse.double()[finite], want_lse[finite], rtol=1e-6, atol=1e-6):
            if torch.allclose(lse.double()[finite], torch.maximum(lse_a, lse_b)[finite]):
                raise Wrong(f"{what}: lse is max(lse_a, lse_b); the log-sum-exp of the union is "
                            "log(exp(lse_a) + exp(lse_b)), computed as m + log(exp(lse_a - m) + "
                            "exp(lse_b - m))")
            raise Wrong(f"{what}: lse should be the log-sum-exp over all keys, log(exp(lse_a) + "
                        "exp(lse_b))")
