"""Exercise checks for chapter 01, *Attention from averages*.

* 01.1 ``check_decay_average``: a causal average whose weights fall off as
  ``exp(-lam * (t - s))``, built with a masked softmax (ALiBi's bias, Press et al. 2022).
* 01.2 ``check_attend_to_earlier``: parameter-free dot-product attention over the
  strictly earlier tokens (not the token itself); the first token gets zeros.
* 01.3 ``check_window_average``: the mean of the last ``w`` tokens, from a band mask.

Every check runs the answer through :func:`~attnlib.book.exercises._run.run` on fixed edge cases
(an overflow only a long sequence or a steep decay reaches, a single token, a window wider than
the sequence) and on fresh random cases from :func:`~attnlib.book.exercises._core.case_rng`. The
expected values are computed after the answer ran, in float64, from ``torch.arange`` comparisons.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, expect_tensor, randint
from attnlib.book.exercises._run import run

__all__ = ["check_decay_average", "check_attend_to_earlier", "check_window_average"]


def _random_shapes(g: torch.Generator, n: int, max_T: int = 12) -> list[tuple[int, int, int]]:
    return [(randint(g, 1, 3), randint(g, 2, max_T), randint(g, 2, 5)) for _ in range(n)]


def _distance(T: int) -> torch.Tensor:
    t = torch.arange(T, dtype=torch.float64)
    return t[:, None] - t[None, :]  # (T, 1) - (1, T) -> (T, T): entry [t, s] = t - s


def _weighted(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return weights @ x.double()  # (T, T) @ (B, T, d) -> (B, T, d), in float64


def _masked_softmax(logits: torch.Tensor, keep: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of ``logits`` where ``keep``; rows (along ``dim``) with nothing kept are zeros."""
    weights = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=dim)
    return torch.nan_to_num(weights, nan=0.0)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.detach().double(), b.double(), atol=1e-5, rtol=1e-4))


def _expect_same_tensor_as_x(y: object, x: torch.Tensor, what: str) -> torch.Tensor:
    return expect_tensor(y, what, shape=tuple(x.shape), dtype=x.dtype)


def _expect_causal(fn, x: torch.Tensor, y: torch.Tensor, args: tuple, what: str, g: torch.Generator) -> None:
    """Redrawing the tokens from the middle on must not move any output before the middle."""
    T = x.shape[1]
    if T < 2:
        return
    cut = randint(g, 1, T - 1)
    changed = x.clone()
    changed[:, cut:] = 3.0 * torch.randn(changed[:, cut:].shape, generator=g)
    moved = run(fn, changed, *args, what=what)
    moved = moved[0] if isinstance(moved, tuple) else moved
    y = y[0] if isinstance(y, tuple) else y
    expect(
        isinstance(moved, torch.Tensor) and _close(moved[:, :cut], y[:, :cut]),
        f"{what} is not causal: redrawing only the tokens from position {cut} on moved the outputs at "
        f"positions < {cut}; mask every key s > t (the future) before the softmax",
    )


# --------------------------------------------------------------------------- 01.1


@exercise("01.1")
def check_decay_average(decay_average) -> None:
    """Check ``decay_average(x, lam)``: causal average with weights proportional to exp(-lam (t - s))."""
    g = case_rng()
    # fixed edges: lam = 0 (the running mean), one token, and exp(lam * (T - 1)) beyond float32's
    # range, by a steep decay (lam = 40) or only by a long sequence (T = 100, lam = 1)
    cases = [((2, 6, 3), 0.7), ((1, 9, 4), 0.0), ((2, 1, 3), 1.5), ((1, 7, 2), 40.0), ((1, 100, 2), 1.0)]
    cases += [(shape, round(3.0 * torch.rand((), generator=g).item(), 3)) for shape in _random_shapes(g, 3)]
    for shape, lam in cases:
        x = torch.randn(*shape, generator=g)
        what = f"decay_average(x, lam={lam}) for x of shape {shape}"
        y = _expect_same_tensor_as_x(run(decay_average, x, lam, what=what), x, what)
        T = shape[1]
        expect(
            bool(torch.isfinite(y).all()),
            f"{what}: NaN or inf in the output. Above the diagonal -lam * (t - s) is positive and exp() of it "
            "overflows (exp(89) is already inf in float32), and inf * 0 is NaN: mask those logits with -inf "
            "before the softmax (exp(-inf) = 0), or zero them before exp",
        )
        keep = _distance(T) >= 0  # (T, T): key s <= query t
        expected = _weighted(_masked_softmax(-lam * _distance(T), keep), x)
        if _close(y, expected):
            _expect_causal(decay_average, x, y, (lam,), what, g)
            continue
        _expect_causal(decay_average, x, y, (lam,), what, g)
        if lam > 0:
            expect(not _close(y, _weighted(_masked_softmax(0 * _distance(T), keep), x)),
                   f"{what}: you returned the plain running mean; the weights must depend on lam through "
                   "exp(-lam * (t - s))")
            expect(not _close(y, _weighted(_masked_softmax(lam * _distance(T), keep), x)),
                   f"{what}: the sign is flipped; older tokens (larger t - s) must get smaller weights, so the "
                   "logits are -lam * (t - s)")
        expect(not _close(y, _weighted(torch.exp(-lam * _distance(T)) * keep, x)),
               f"{what}: each row of weights must sum to 1; a softmax over the masked logits normalises them")
        if T > 1:
            expect(not _close(y, _weighted(_masked_softmax(-lam * _distance(T), keep, dim=-2), x)),
                   f"{what}: the softmax ran over the queries (dim=-2); each query's weights over its keys "
                   "must sum to 1, so take it over the keys (dim=-1)")
        expect_close(y, expected, what)


# --------------------------------------------------------------------------- 01.2


@exercise("01.2")
def check_attend_to_earlier(attend_to_earlier) -> None:
    """Check ``attend_to_earlier(x) -> (y, weights)``: dot-product attention over the tokens strictly before t."""
    g = case_rng()
    shapes = [(2, 5, 4), (1, 7, 8), (3, 6, 2), (2, 1, 3), (1, 2, 9)] + _random_shapes(g, 3, max_T=10)
    for shape in shapes:
        B, T, d_model = shape
        x = torch.randn(*shape, generator=g)
        what = f"attend_to_earlier(x) for x of shape {shape}"
        result = run(attend_to_earlier, x, what=what)
        expect(type(result) in (tuple, list) and len(result) == 2,
               f"{what} should return a pair (y, weights), got {type(result).__name__}")
        y, weights = result
        if isinstance(y, torch.Tensor) and isinstance(weights, torch.Tensor) and T != d_model:
            expect(not (tuple(y.shape) == (B, T, T) and tuple(weights.shape) == (B, T, d_model)),
                   f"{what}: the pair is in the wrong order; return (y, weights), the output first")
        expect_tensor(weights, f"the weights of {what}", shape=(B, T, T), dtype=x.dtype)
        expect_tensor(y, f"y of {what}", shape=(B, T, d_model), dtype=x.dtype)
        expect(not (torch.isnan(weights).any() or torch.isnan(y).any()),
               f"{what}: NaN in the result. The first token has no earlier token: a softmax over a row of -inf "
               "is 0/0 = NaN; give that row zero weights and a zero output")
        if T > 1:
            expect(not bool(((weights[:, 0] - 1 / T).abs() < 1e-6).all()),
                   f"{what}: the first token attends uniformly to all {T} keys, the later ones included. That "
                   "is what a large finite fill such as -1e9 does to a row with no allowed key; fill with -inf "
                   "and then set that row's weights to zero")
        expect(bool((weights.diagonal(dim1=-2, dim2=-1).abs() < 1e-6).all()),
               f"{what}: a token gives weight to itself; mask the diagonal too (keys s < t only, "
               "e.g. torch.tril(..., diagonal=-1))")
        expect(bool((weights.triu(diagonal=1).abs() < 1e-6).all()),
               f"{what}: a token gives weight to later tokens; mask every key s > t")
        earlier = _distance(T) > 0  # (T, T): key s < query t
        scores = x.double() @ x.double().transpose(-2, -1)  # (B, T, d) @ (B, d, T) -> (B, T, T)
        expected = _masked_softmax(scores / math.sqrt(d_model), earlier)
        if not _close(weights, expected):
            expect(not _close(weights, _masked_softmax(scores, earlier)),
                   f"{what}: divide the scores x_t . x_s by sqrt(d_model) before the softmax")
            expect(not _close(weights, _masked_softmax(scores / d_model, earlier)),
                   f"{what}: the scores were divided by d_model; divide them by sqrt(d_model)")
        expect_close(weights, expected, f"the weights of {what}")
        expect_close(y, expected @ x.double(), f"y of {what} (it should be weights @ x)")


# --------------------------------------------------------------------------- 01.3


def _window_mean(x: torch.Tensor, w: int, divide_by_w: bool = False) -> torch.Tensor:
    """The mean of the last ``w`` tokens (fewer at the start), from counts, in float64."""
    d = _distance(x.shape[1])
    band = ((d >= 0) & (d < w)).double()  # (T, T)
    return _weighted(band / (w if divide_by_w else band.sum(-1, keepdim=True)), x)


@exercise("01.3")
def check_window_average(window_average) -> None:
    """Check ``window_average(x, w)``: each token the mean of itself and the w - 1 tokens before it."""
    g = case_rng()
    # fixed edges: w = 1 (x itself), w > T (the running mean), a single token, a long sequence
    cases = [((2, 7, 3), 3), ((1, 6, 2), 1), ((2, 5, 4), 8), ((1, 1, 3), 2), ((1, 40, 2), 17)]
    for shape in _random_shapes(g, 3, max_T=14):
        cases.append((shape, randint(g, 2, shape[1] + 2)))
    for shape, w in cases:
        T = shape[1]
        x = torch.randn(*shape, generator=g)
        what = f"window_average(x, w={w}) for x of shape {shape}"
        y = _expect_same_tensor_as_x(run(window_average, x, w, what=what), x, what)
        expect(bool(torch.isfinite(y).all()),
               f"{what}: NaN or inf in the output; every row of the band mask keeps at least the token itself, "
               "so no row should be empty")
        expected = _window_mean(x, w)
        if _close(y, expected):
            _expect_causal(window_average, x, y, (w,), what, g)
            continue
        _expect_causal(window_average, x, y, (w,), what, g)
        if w < T:
            expect(not _close(y, _window_mean(x, w + 1)),
                   f"{what}: off by one, your window holds w + 1 tokens; keep keys with 0 <= t - s < w")
        if 1 < w <= T:
            expect(not _close(y, _window_mean(x, w - 1)),
                   f"{what}: off by one, your window holds w - 1 tokens; keep keys with 0 <= t - s < w")
        if w > 1:
            expect(not _close(y, _window_mean(x, w, divide_by_w=True)),
                   f"{what}: the first w - 1 positions have fewer than w tokens to average; divide by how many "
                   "there are (a softmax over the band mask does this for you)")
        expect_close(y, expected, what)
