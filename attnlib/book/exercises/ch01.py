"""Exercise checks for chapter 01, *Attention from averages*.

* 01.1 ``check_decay_average``: a causal average whose weights fall off as
  ``exp(-lam * (t - s))``, built with a masked softmax (ALiBi's bias, Press et al. 2022).
* 01.2 ``check_attend_to_earlier``: parameter-free dot-product attention over the
  strictly earlier tokens (not the token itself); the first token gets zeros.
* 01.3 ``check_window_average``: the mean of the last ``w`` tokens, from a band mask.

Each grader draws its inputs from a local :class:`torch.Generator`, so checking an
answer never moves the notebook's global random state.
"""
from __future__ import annotations

import torch

from attnlib.attention import attention, causal_mask
from attnlib.book.exercises._core import exercise, expect, expect_close

__all__ = ["check_decay_average", "check_attend_to_earlier", "check_window_average"]


def _inputs(shapes: list[tuple[int, int, int]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in shapes]


def _masked_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``logits`` where ``mask`` is True; rows with nothing allowed are zeros."""
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return weights.masked_fill(~mask, 0.0)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and bool(torch.allclose(a.detach().double(), b.detach().double(), atol=1e-5, rtol=1e-4))
    )


def _call_pure(fn, x: torch.Tensor, *args):
    """Call ``fn(x, *args)`` and fail if it changed ``x`` in place."""
    before = x.clone()
    out = fn(x, *args)
    expect(torch.equal(x, before), "your function changed its input x in place; work on a copy")
    return out


def _expect_causal(fn, x: torch.Tensor, *args) -> None:
    """Changing the tokens from position ``cut`` on must not move any output before ``cut``."""
    T = x.shape[1]
    if T < 2:
        return
    cut = T // 2
    g = torch.Generator().manual_seed(1234)
    x_changed = x.clone()
    x_changed[:, cut:] += 3.0 * torch.randn(x_changed[:, cut:].shape, generator=g)
    y, y_changed = fn(x.clone(), *args), fn(x_changed, *args)
    expect(
        _close(y[:, :cut], y_changed[:, :cut]),
        f"not causal: changing only the tokens from position {cut} on moved the outputs at positions < {cut}; "
        "mask every key s > t (the future) before the softmax",
    )


# --------------------------------------------------------------------------- 01.1


def _decay_logits(T: int, lam: float, sign: float = -1.0) -> torch.Tensor:
    t = torch.arange(T, dtype=torch.float32)
    return sign * lam * (t[:, None] - t[None, :])  # (T, 1) - (1, T) -> (T, T): entry [t, s] = t - s


def _decay_reference(x: torch.Tensor, lam: float) -> torch.Tensor:
    T = x.shape[1]
    weights = _masked_softmax(_decay_logits(T, lam), causal_mask(T))  # (T, T)
    return weights @ x  # (T, T) @ (B, T, d_model) -> (B, T, d_model)


@exercise("01.1")
def check_decay_average(decay_average) -> None:
    """Check ``decay_average(x, lam)``: causal average with weights proportional to exp(-lam (t - s))."""
    cases = [((2, 6, 3), 0.7), ((1, 9, 4), 0.0), ((3, 5, 2), 3.0), ((2, 1, 3), 1.5), ((1, 7, 2), 40.0)]
    xs = _inputs([shape for shape, _ in cases], seed=101)
    for x, (_, lam) in zip(xs, cases):
        B, T, d_model = x.shape
        y = _call_pure(decay_average, x, lam)
        expected = _decay_reference(x, lam)
        expect(isinstance(y, torch.Tensor), f"decay_average should return a tensor, got {type(y).__name__}")
        expect(
            tuple(y.shape) == (B, T, d_model),
            f"for x of shape {(B, T, d_model)} the output should have the same shape, got {tuple(y.shape)}",
        )
        expect(
            bool(torch.isfinite(y).all()),
            f"for lam={lam}, x of shape {(B, T, d_model)}: NaN or inf in the output. Above the diagonal -lam * (t - s) "
            "is positive and exp() of it overflows; mask those logits with -inf before the softmax (exp(-inf) = 0)",
        )
        _expect_causal(decay_average, x, lam)
        if _close(y, expected):
            continue
        where = f"for lam={lam}, x of shape {(B, T, d_model)}"
        mask = causal_mask(T)
        unnormalised = (_decay_logits(T, lam).exp() * mask) @ x
        expect(
            not _close(y, _decay_reference(x, 0.0)),
            f"{where}: you returned the plain running mean; the weights must depend on lam through exp(-lam * (t - s))",
        )
        expect(
            not _close(y, _masked_softmax(_decay_logits(T, lam, sign=+1.0), mask) @ x),
            f"{where}: the sign is flipped; older tokens (larger t - s) must get smaller weights, "
            "so the logits are -lam * (t - s)",
        )
        expect(
            not _close(y, unnormalised),
            f"{where}: each row of weights must sum to 1; a softmax over the masked logits normalises them",
        )
        expect_close(y, expected, f"decay_average(x, lam) {where}")


# --------------------------------------------------------------------------- 01.2


def _strict_mask(T: int) -> torch.Tensor:
    return causal_mask(T) & ~torch.eye(T, dtype=torch.bool)  # s < t only


@exercise("01.2")
def check_attend_to_earlier(attend_to_earlier) -> None:
    """Check ``attend_to_earlier(x) -> (y, weights)``: dot-product attention over the tokens strictly before t."""
    shapes = [(2, 5, 4), (1, 7, 8), (3, 6, 2), (2, 1, 3)]
    for x in _inputs(shapes, seed=202):
        B, T, d_model = x.shape
        where = f"for x of shape {(B, T, d_model)}"
        result = _call_pure(attend_to_earlier, x)
        expect(
            isinstance(result, tuple) and len(result) == 2,
            f"attend_to_earlier should return a pair (y, weights), got {type(result).__name__}",
        )
        y, weights = result
        expect(isinstance(weights, torch.Tensor), f"weights should be a tensor, got {type(weights).__name__}")
        expect(
            tuple(weights.shape) == (B, T, T),
            f"{where}: weights should have shape (B, T, T) = {(B, T, T)}, got {tuple(weights.shape)}",
        )
        expect(isinstance(y, torch.Tensor), f"y should be a tensor, got {type(y).__name__}")
        expect(
            tuple(y.shape) == (B, T, d_model),
            f"{where}: y should have shape (B, T, d_model) = {(B, T, d_model)}, got {tuple(y.shape)}",
        )
        expect(
            not (torch.isnan(weights).any() or torch.isnan(y).any()),
            f"{where}: NaN in the result. The first token has no earlier token: softmax over a row of -inf "
            "is NaN; give that row zero weights and a zero output",
        )
        expect(
            bool((weights.diagonal(dim1=-2, dim2=-1).abs() < 1e-6).all()),
            f"{where}: a token gives weight to itself; mask the diagonal too (keys s < t only, "
            "e.g. torch.tril(..., diagonal=-1))",
        )
        expect(
            bool((weights.triu(diagonal=1).abs() < 1e-6).all()),
            f"{where}: a token gives weight to later tokens; mask every key s > t",
        )
        sums = weights.sum(dim=-1)  # (B, T)
        expected_sums = torch.ones(B, T)
        expected_sums[:, 0] = 0.0
        expect(
            _close(sums, expected_sums),
            f"{where}: each row of weights should sum to 1 (the first row, which has nothing to attend to, to 0); "
            f"got row sums {[round(v, 3) for v in sums[0].tolist()]}",
        )
        expected_y, expected_weights = attention(x, x, x, mask=_strict_mask(T)[None])  # mask (1, T, T); 1/sqrt(d_model)
        if T > 1:
            unscaled = _masked_softmax(x @ x.transpose(-2, -1), _strict_mask(T))  # (B, T, d) @ (B, d, T) -> (B, T, T)
            expect(
                d_model == 1 or not _close(weights, unscaled),
                f"{where}: divide the scores x_t . x_s by sqrt(d_model) before the softmax",
            )
        expect_close(weights, expected_weights, f"weights {where}")
        expect_close(y, expected_y, f"y {where} (it should be weights @ x)")


# --------------------------------------------------------------------------- 01.3


def _window_loops(x: torch.Tensor, w: int, divide_by_w: bool = False) -> torch.Tensor:
    """The mean of the last ``w`` tokens (fewer at the start), one position at a time."""
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        window = x[:, max(0, t - w + 1) : t + 1]  # (B, <= w, d_model)
        y[:, t] = window.sum(dim=1) / (w if divide_by_w else window.shape[1])
    return y


@exercise("01.3")
def check_window_average(window_average) -> None:
    """Check ``window_average(x, w)``: each token the mean of itself and the w - 1 tokens before it."""
    cases = [((2, 7, 3), 3), ((1, 6, 2), 1), ((2, 5, 4), 8), ((3, 9, 2), 4), ((1, 8, 3), 2)]
    xs = _inputs([shape for shape, _ in cases], seed=303)
    for x, (_, w) in zip(xs, cases):
        B, T, d_model = x.shape
        where = f"for w={w}, x of shape {(B, T, d_model)}"
        y = _call_pure(window_average, x, w)
        expect(isinstance(y, torch.Tensor), f"window_average should return a tensor, got {type(y).__name__}")
        expect(
            tuple(y.shape) == (B, T, d_model),
            f"for x of shape {(B, T, d_model)} the output should have the same shape, got {tuple(y.shape)}",
        )
        expect(
            bool(torch.isfinite(y).all()),
            f"for w={w}, x of shape {(B, T, d_model)}: NaN or inf in the output; every row of the band mask keeps at "
            "least the token itself, so no row should be empty",
        )
        _expect_causal(window_average, x, w)
        expected = _window_loops(x, w)
        if _close(y, expected):
            continue
        if w < T:
            expect(
                not _close(y, _window_loops(x, w + 1)),
                f"{where}: off by one, your window holds w + 1 tokens; keep keys with 0 <= t - s < w",
            )
        if 1 < w < T + 1:
            expect(
                not _close(y, _window_loops(x, w - 1)),
                f"{where}: off by one, your window holds w - 1 tokens; keep keys with 0 <= t - s < w",
            )
        if w > 1:
            expect(
                not _close(y, _window_loops(x, w, divide_by_w=True)),
                f"{where}: the first w - 1 positions have fewer than w tokens to average; divide by how many "
                "there are (a softmax over the band mask does this for you)",
            )
        expect_close(y, expected, f"window_average(x, w) {where}")

