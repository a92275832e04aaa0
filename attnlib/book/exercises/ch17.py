"""Exercise checks for chapter 17 (long context).

* 17.1 ``check_ntk_base``: ``ntk_base(base, head_dim, factor)``, the base of NTK-aware RoPE
  scaling (bloc97 2023) that leaves the fastest pair alone and slows the slowest one by
  ``factor``; checked exactly (relative 1e-9) and against attnlib's dynamic NTK frequencies.
* 17.2 ``check_reach``: ``reach(windows, T)``, how many input positions can change the last output of a
  residual stack of attention layers with these windows (``None`` = global), measured with gradients
  through attnlib's ``MultiHeadAttention(sliding_window=...)``.
* 17.3 ``check_streaming_keys``: ``streaming_keys(position, window, n_sink)``, the absolute
  positions of the keys that the token at ``position`` attends to through a StreamingLLM cache
  (Xiao et al. 2023), checked against :class:`attnlib.cache.SinkLayerCache` filled token by token.
* 17.4 ``check_softcap_grad``: ``softcap_grad(scores, cap)``, the derivative of Gemma 2's soft-cap
  ``cap · tanh(s / cap)``, checked against autograd.
* 17.5 ``check_dynamic_scores``: ``dynamic_scores(q, k, base, factor, original_length)``, the scores of the
  newest query as an uncached pass with dynamic NTK computes them (every key rotated with the base of
  the current length), checked against a float64 reference of transformers' rule.
* 17.6 ``check_ring_cache``: chunked prefill through a ring-buffer KV cache for a sliding window
  (``step`` takes T >= 1 new tokens; beyond Exercise 08.1's one-token ring), written by hand
  (:mod:`._ch17_ring`).

Every learner call goes through :func:`~attnlib.book.exercises._run.run`; besides fixed edge cases, the
random cases come from :func:`~attnlib.book.exercises._core.case_rng` (fresh each run).
"""
from __future__ import annotations

import math

import torch

from attnlib.attention import MultiHeadAttention
from attnlib.book.exercises._ch17_dynamic import dynamic_scores
from attnlib.book.exercises._ch17_ring import check_ring_cache as _check_ring_cache
from attnlib.book.exercises._core import (
    Wrong,
    case_rng,
    exercise,
    expect,
    expect_int,
    expect_number,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import Refuse, run
from attnlib.cache import SinkLayerCache
from attnlib.positional import RotaryEmbedding, rope_frequencies

__all__ = ["check_dynamic_scores", "check_ntk_base", "check_reach", "check_ring_cache", "check_softcap_grad",
           "check_streaming_keys"]


# ---------------------------------------------------------------- 17.1
@exercise("17.1")
def check_ntk_base(ntk_base) -> None:
    """Check ``ntk_base(base, head_dim, factor) -> float`` = ``base · factor^(d / (d - 2))``."""
    g = case_rng()
    cases = [(10000.0, 128, 4.0), (10000.0, 16, 8.0), (500000.0, 64, 2.5), (1e6, 128, 16.0), (10000.0, 4, 2.0),
             (10000.0, 64, 1.0)]
    for _ in range(3):
        cases.append(((1e4, 5e5, 1e6)[randint(g, 0, 2)] * (1 + torch.rand((), generator=g).item()),
                      2 * randint(g, 2, 128), 1 + 31 * torch.rand((), generator=g).item()))
    for base, d, s in cases:
        what = f"ntk_base(base={base:.10g}, head_dim={d}, factor={s:.10g})"
        got = expect_number(run(ntk_base, base, d, s, what=what), what)
        expected = base * s ** (d / (d - 2))
        case = f"{what} = {got:.6g}, expected {expected:.6g}"
        if math.isclose(got, expected, rel_tol=1e-9):
            continue

        def close(x, got=got):
            return math.isclose(got, x, rel_tol=1e-9)

        expect(not close(base * s),
               f"{case}: with base * factor the slowest pair (exponent (d_h - 2)/d_h) is slowed by only "
               "factor**((d_h - 2)/d_h); raise factor to the power that makes it exactly factor")
        expect(not close(base * s ** ((d - 2) / d)),
               f"{case}: the exponent is upside down: theta_last = base**(-(d_h - 2)/d_h), so the base "
               "must grow by factor**(d_h/(d_h - 2)) for theta_last to shrink by factor")
        expect(not close(base / s ** (d / (d - 2))) and not close(base / s),
               f"{case}: a smaller base makes every pair turn faster; to slow the slow pairs down the base grows")
        expect(not close(base * s ** (d / 2)),
               f"{case}: base**(-2i/d_h) for the slowest pair has i = d_h/2 - 1, not d_h/2 (its exponent is "
               "(d_h - 2)/d_h, not 1)")
        plain = base ** (-(d - 2) / d)
        slowed = plain / got ** (-(d - 2) / d) if got > 0 else float("nan")
        expect(False, f"{case}: with your base the slowest pair turns {slowed:.4g} times slower, not factor={s:g} "
                      "times; the fastest pair (i = 0) never changes")
    # the same base as transformers' / attnlib's dynamic NTK at seq_len = factor * L (factor field 1.0)
    ours, _ = rope_frequencies(64, 10000.0, {"rope_type": "dynamic", "factor": 1.0}, 100, seq_len=400)
    mine = 1.0 / run(ntk_base, 10000.0, 64, 4.0, what="ntk_base(10000.0, 64, 4.0)") ** (
        torch.arange(0, 64, 2).double() / 64)
    expect(torch.allclose(mine.float(), ours, rtol=1e-5), "your base does not give dynamic NTK's frequencies at 4 x L")


# ---------------------------------------------------------------- 17.2
def _measured_reach(windows: list, T: int) -> int:
    """Inputs the last output depends on, through a residual stack of windowed attention layers (gradients)."""
    torch.manual_seed(17)  # grade() forks the RNG: the notebook's state is untouched
    layers = [MultiHeadAttention(8, 2, sliding_window=w) for w in windows]
    x = torch.randn(1, T, 8, requires_grad=True)
    h = x
    for layer in layers:
        h = h + layer(h)  # (1, T, 8)
    (grad,) = torch.autograd.grad(h[0, -1].sum(), x)
    return int((grad[0].abs().sum(-1) > 0).sum())


@exercise("17.2")
def check_reach(reach) -> None:
    """Check ``reach(windows, T) -> int`` against gradients through a stack of windowed layers."""
    g = case_rng()
    cases = [([4, 4, 4], 16), ([3, 8], 40), ([2, 5, 3, 9], 30), ([16, 16, 16], 20), ([1, 1], 5), ([4, None, 4], 16),
             ([None], 1)]
    for _ in range(3):
        windows = [None if randint(g, 0, 5) == 0 else randint(g, 1, 10) for _ in range(randint(g, 1, 5))]
        cases.append((windows, randint(g, 1, 50)))
    for windows, T in cases:
        what = f"reach(windows={windows}, T={T})"
        got = expect_int(run(reach, list(windows), T, what=what), what)
        expected = _measured_reach(windows, T)
        if got == expected:
            continue
        case = f"{what} = {got}, but the last output depends on {expected} inputs"
        local = [w for w in windows if w is not None]
        expect(not (None in windows and got == min(T, 1 + sum(w - 1 for w in local))),
               f"{case}: a global layer lets the last position see every position before it, so after it the "
               "last output can depend on all T inputs")
        expect(not (len(set(local)) > 1 and got == min(T, 1 + len(windows) * (windows[0] - 1))),
               f"{case}: the windows differ between layers; each layer adds its own w - 1 positions")
        expect(got != min(T, sum(local)),
               f"{case}: a window of w reaches w - 1 positions back (it counts the query itself), so each layer "
               "adds w - 1, not w")
        short = sum(w - 1 for w in local)
        expect(got not in (short, min(T, short)), f"{case}: count the last position itself (+1)")
        expect(got <= T, f"{case}: there are only T = {T} inputs")
        expect(False, f"{case}")


# ---------------------------------------------------------------- 17.3
def _streaming_reference(position: int, window: int, n_sink: int) -> list[int]:
    """Fill a SinkLayerCache token by token (key = its position) and read what the last token sees."""
    cache = SinkLayerCache(block_size=position + 1, window=window, n_sink=n_sink)
    for p in range(position + 1):
        (keys,) = cache.update(torch.full((1, 1, 1), float(p)))  # (B, T_new, width) = (1, 1, 1)
    at = cache.key_positions  # (n_keys,) the positions of the returned keys; the query is the last
    visible = cache.mask_mod(None, None, at[-1:, None], at[None, :])[0]  # the cache's own rule: (n_keys,)
    return sorted(int(k) for k in keys.flatten()[visible].tolist())


@exercise("17.3")
def check_streaming_keys(streaming_keys) -> None:
    """Check ``streaming_keys(position, window, n_sink) -> list[int]`` against a SinkLayerCache."""
    g = case_rng()
    cases = [(0, 4, 2), (3, 4, 2), (5, 4, 2), (10, 4, 2), (100, 8, 4), (9, 5, 0), (6, 3, 3), (2, 8, 4), (37, 6, 1)]
    for _ in range(3):  # SinkLayerCache takes n_sink <= window
        window = randint(g, 1, 12)
        cases.append((randint(g, 0, 120), window, randint(g, 0, min(5, window))))
    for position, window, n_sink in cases:
        what = f"streaming_keys(position={position}, window={window}, n_sink={n_sink})"
        got = run(streaming_keys, position, window, n_sink, what=what)
        expect(type(got) is list, f"{what}: return a list of ints, got {type(got).__name__}"
               + (" (use .tolist())" if isinstance(got, torch.Tensor) else ""))
        expect(all(type(p) is int for p in got), f"{what}: return plain Python ints (absolute positions); "
               f"got {sorted({type(p).__name__ for p in got})}")
        expected = _streaming_reference(position, window, n_sink)
        case = f"{what} = {got}, expected {expected}"
        if got == expected:
            continue
        expect(len(got) == len(set(got)),
               f"{case}: a position that is both a sink and in the window is one key: list it once")
        expect(got == sorted(got), f"{case}: list the positions in ascending order")
        expect(not (got == list(range(len(got))) and len(expected) == len(got) and expected != got),
               f"{case}: absolute positions in the stream, not the positions 0, 1, ... that the cache renumbers "
               "them to for RoPE")
        expect(position in got, f"{case}: the token attends to itself (its own key is in the window)")
        expect(all(p <= position for p in got), f"{case}: a sink exists only once its token has arrived "
                                                 "(positions after the current one are not keys)")
        recent = [p for p in got if p >= n_sink]
        expect(not (n_sink and not any(p < n_sink for p in got) and position >= n_sink),
               f"{case}: the first n_sink={n_sink} tokens are never evicted: they are the attention sinks")
        expect(not (recent and min(recent) == position - window and position - window >= n_sink),
               f"{case}: the window counts the token itself: positions position - window + 1 ... position "
               f"({window} keys), not {window + 1}")
        expect(not (recent and min(recent) == position - window + n_sink + 1 and n_sink),
               f"{case}: the window is the recent positions besides the sinks: a cache of n_sink + window "
               "positions, not window in all")
        expect(not (recent and min(recent) == position - window + 2 and position - window + 2 > n_sink),
               f"{case}: the window holds window={window} keys, the token itself and the {window - 1} before "
               f"it (position - window + 1 ... position), not {window - 1}")
        expect(False, f"{case}: the sinks 0 ... n_sink - 1, then position - window + 1 ... position")


# ---------------------------------------------------------------- 17.4
@exercise("17.4")
def check_softcap_grad(softcap_grad) -> None:
    """Check ``softcap_grad(scores, cap) -> d/ds [cap · tanh(s / cap)]`` against autograd (float64)."""
    g = case_rng()
    cases = [(50.0, 80.0), (5.0, 10.0), (1.0, 3.0), (0.3, 1.0), (30.0, 100.0)]
    cases += [(0.5 + 60 * torch.rand((), generator=g).item(), 1 + 100 * torch.rand((), generator=g).item())]
    for cap, spread in cases:
        scores = torch.randn(2, 3, 7, 7, generator=g, dtype=torch.float64) * spread
        what = f"softcap_grad(scores of shape (2, 3, 7, 7) in float64, cap={cap:.4g})"
        got = run(softcap_grad, scores, cap, what=what)
        expect_tensor(got, what, shape=tuple(scores.shape))
        expect(got.dtype == scores.dtype, f"{what}: the result is {got.dtype}; keep scores' dtype ({scores.dtype})")
        s = scores.clone().requires_grad_(True)
        (cap * torch.tanh(s / cap)).sum().backward()
        expected, got = s.grad, got.detach()
        if torch.allclose(got, expected, rtol=1e-6, atol=1e-9):
            continue
        t = torch.tanh(scores / cap)

        def close(x, got=got):
            return torch.allclose(got, x, rtol=1e-6, atol=1e-9)

        expect(not close(cap * (1 - t**2)),
               f"{what}: chain rule: d/ds tanh(s/cap) = (1 - tanh^2(s/cap)) / cap, and the 1/cap cancels the "
               "cap in front")
        expect(not close(1 - torch.tanh(scores) ** 2), f"{what}: the tanh is of s / cap, not of s")
        expect(not close(1 / torch.cosh(scores / cap)),
               f"{what}: the derivative of tanh is sech^2 = 1 / cosh^2 = 1 - tanh^2 (squared)")
        expect(not close(torch.where(scores == 0, torch.ones_like(t), cap * t / scores)),
               f"{what}: cap * tanh(s/cap) / s is the slope from the origin (the secant), not the derivative")
        expect(False, f"{what}: differs from autograd's derivative by {(got - expected).abs().max().item():.3g}")


# ---------------------------------------------------------------- 17.5
def _dynamic_refusal() -> Refuse:
    """attnlib's scaled RoPE, and transformers' dynamic rule when transformers is installed."""
    targets: list = [rope_frequencies, RotaryEmbedding]
    try:
        from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters

        targets.append(_compute_dynamic_ntk_parameters)
    except ImportError:  # transformers is optional: nothing of it to refuse
        pass
    return Refuse("compute the dynamic base and the rotation yourself", *targets)


def _dynamic_cases(g: torch.Generator) -> list[tuple[int, int, int, float, float, int]]:
    """(n_heads, head_dim, T, base, factor, original_length): short texts, the edge T = L, long ones, random."""
    cases = [(2, 8, 5, 10000.0, 1.0, 8), (1, 8, 8, 10000.0, 2.0, 8), (2, 16, 40, 10000.0, 1.0, 32),
             (3, 16, 96, 500000.0, 2.0, 24), (1, 4, 40, 10000.0, 4.0, 10), (2, 32, 130, 10000.0, 1.5, 32)]
    for _ in range(3):
        L = randint(g, 4, 40)
        cases.append((randint(g, 1, 3), 2 * randint(g, 2, 16), randint(g, 1, 4 * L), (1e4, 5e5)[randint(g, 0, 1)],
                      (1.0, 1.5, 2.0, 4.0)[randint(g, 0, 3)], L))
    return cases


@exercise("17.5")
def check_dynamic_scores(dynamic_scores_answer) -> None:
    """Check ``dynamic_scores(q, k, base, factor, original_length) -> (n_heads, T)`` scores."""
    g, refuse = case_rng(), _dynamic_refusal()
    for h, d, T, base, factor, L in _dynamic_cases(g):
        q = torch.randn(h, d, generator=g, dtype=torch.float64)  # the newest token's query, unrotated
        k = torch.randn(h, T, d, generator=g, dtype=torch.float64)  # keys of positions 0 ... T - 1, unrotated
        what = (f"dynamic_scores(q of shape {(h, d)}, k of shape {(h, T, d)}, base={base:g}, factor={factor:g}, "
                f"original_length={L})")
        got = run(dynamic_scores_answer, q, k, base, factor, L, what=what, refuse=refuse)
        expect_tensor(got, what, shape=(h, T))
        expected = dynamic_scores(q, k, base, factor, L)
        tol = 1e-4 * max(1.0, expected.abs().max().item())
        got = got.detach().double()
        if (got - expected).abs().max().item() <= tol:
            continue

        def close(tol=tol, got=got, args=(q, k, base, factor, L), **slip):
            return (got - dynamic_scores(*args, **slip)).abs().max().item() <= tol

        expect(T <= L or not close(length=L),
               f"{what}: these are plain RoPE's scores; past original_length={L} dynamic NTK grows the base, "
               f"for a text of T = {T} tokens")
        expect(T >= L or not close(clamp=False),
               f"{what}: the text is shorter than original_length={L}: up to it dynamic NTK leaves the base as it "
               "is (transformers takes max(T, original_length)), it never shrinks it")
        expect(not close(own_length=True),
               f"{what}: each key rotated with the base of the length when it arrived (j + 1 tokens) is what a "
               f"cache of keys rotated on arrival holds; the uncached pass rotates every key with the base of T = {T}")
        expect(not close(length=T - 1), f"{what}: the text has T = {T} tokens (the newest is at position T - 1): "
                                        "compute the base for T, not T - 1")
        expect(not close(length=T + 1), f"{what}: the text has T = {T} tokens: compute the base for T, not T + 1")
        expect(factor == 1 or not close(plain_ratio=True),
               f"{what}: transformers' dynamic type stretches by s = factor * T / L - (factor - 1), not T / L")
        expect(not close(exponent=1.0), f"{what}: the base grows by s ** (d_h / (d_h - 2)) (Exercise 17.1), not s")
        expect(not close(query_at=T), f"{what}: the query is the newest token, at position T - 1 = {T - 1}")
        expect(not close(query_at=0), f"{what}: the query sits at position T - 1 = {T - 1}, not 0")
        expect(not close(scale=False), f"{what}: scale the scores by 1/sqrt(head_dim)")
        expect(not close(interleaved=True),
               f"{what}: rotate half-split pairs (x[i], x[i + d_h/2]), as the chapter's RoPE, not (x[2i], x[2i+1])")
        diff = (got - expected).abs().max().item()
        raise Wrong(f"{what}: your scores differ from an uncached pass's by up to {diff:.3g}")


# ---------------------------------------------------------------- 17.6
check_ring_cache = exercise("17.6")(_check_ring_cache)
