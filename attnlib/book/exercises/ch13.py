"""Exercise checks for chapter 13 (attention variants compared): reading losses and results honestly.

* 13.1 ``bits_per_char(loss, n_tokens, n_chars)`` -> bits per character of a loss in nats per
  token (to compare models whose tokenizers differ)
* 13.2 ``first_suspicious_step(steps, val_loss, floor_bits=1.0)`` -> the first step whose validation
  loss is below a floor given in bits per character, or ``None``
* 13.3 ``seed_verdict(losses_a, losses_b, z=2.0)`` -> ``"a"``, ``"b"`` or ``None``: does one
  variant have a lower loss than the other beyond the spread over seeds?

Every check calls the answer through :func:`run`, on fixed cases (typed-in loss curves, edges) and
fresh random ones from :func:`case_rng`; a number is checked with its exact type.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._core import Wrong, case_rng, exercise, expect, expect_number, randint
from attnlib.book.exercises._run import run

__all__ = ["check_bits_per_char", "check_first_suspicious_step", "check_seed_verdict"]

LN2 = math.log(2.0)


def _uniform(g: torch.Generator, low: float, high: float) -> float:
    return float(torch.empty((), dtype=torch.float64).uniform_(low, high, generator=g))


def _close(a: float, b: float, rel: float = 1e-6, abs_: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


# ------------------------------------------------------------------------------------------ 13.1
def _cases_13_1() -> list[tuple[float, int, int]]:
    """(loss in nats per token, tokens, characters): varied, tokens of 1 to 5 characters."""
    g = case_rng()
    cases = [(1.86, 1000, 1000), (3.6, 1000, 3800)]  # a character model; a BPE model
    for _ in range(6):  # fresh each run
        n_tokens = randint(g, 50, 5000)
        cases.append((round(_uniform(g, 0.5, 6.0), 4), n_tokens, int(n_tokens * _uniform(g, 1.5, 5.0))))
    return cases


_MISTAKES_13_1 = [
    (lambda loss, nt, nc: loss * nt / nc,
     "that is nats per character; a bit is ln 2 nats, so divide by ln 2"),
    (lambda loss, nt, nc: loss * nt / nc * LN2,
     "one bit is ln 2 = 0.693 nats: divide by ln 2 (you multiplied)"),
    (lambda loss, nt, nc: loss * nc / (nt * LN2),
     "the text's total loss is loss * n_tokens nats; spread it over n_chars characters "
     "(you inverted the ratio)"),
    (lambda loss, nt, nc: loss / LN2,
     "that is bits per *token*; multiply by n_tokens for the total, then divide by n_chars"),
    (lambda loss, nt, nc: 2 ** (loss * nt / (nc * LN2)),
     "that is the perplexity per character; return the bits"),
]


@exercise("13.1")
def check_bits_per_char(fn) -> None:
    """Check ``bits_per_char(loss, n_tokens, n_chars) -> loss * n_tokens / (n_chars * ln 2)``."""
    cases = _cases_13_1()
    got = []
    for loss, nt, nc in cases:
        what = f"bits_per_char({loss}, {nt}, {nc})"
        got.append(expect_number(run(fn, loss, nt, nc, what=what), what))
    expected = [loss * nt / (nc * LN2) for loss, nt, nc in cases]
    if all(_close(g, e) for g, e in zip(got, expected)):
        return
    for mistake, hint in _MISTAKES_13_1:
        if all(_close(g, mistake(*case)) for g, case in zip(got, cases)):
            expect(False, hint)
    i = next(i for i, (g, e) in enumerate(zip(got, expected)) if not _close(g, e))
    loss, nt, nc = cases[i]
    expect(False, f"for loss={loss} nats per token, n_tokens={nt}, n_chars={nc}: expected "
                  f"{expected[i]:.4f} bits per character (loss * n_tokens / n_chars / ln 2), got {got[i]:.4f}")


# ------------------------------------------------------------------------------------------ 13.2
# Validation losses (nats per character) every 100 steps from 0 to 2000, as the source notebook
# prints them for its run labelled `causal` (it collapses) and its MQA run (it does not).
_SOURCE_CAUSAL = [4.4812, 2.6553, 2.3581, 2.2083, 2.0922, 1.9897, 1.8655, 1.6542, 1.2377, 0.9049, 0.6903,
                  0.5265, 0.4287, 0.3660, 0.3150, 0.2758, 0.2597, 0.2444, 0.2260, 0.2049, 0.1971]
_SOURCE_MQA = [4.3242, 2.6457, 2.5095, 2.4069, 2.3733, 2.3052, 2.2665, 2.2288, 2.1994, 2.1528, 2.1300,
               2.1113, 2.0981, 2.0779, 2.0471, 2.0363, 2.0137, 2.0073, 2.0025, 1.9981, 1.9879]
_STEPS_100 = list(range(0, 2001, 100))
_STEPS_250 = list(range(0, 5001, 250))
_CURVE_250 = [4.19, 2.52, 2.31, 2.20, 2.12, 2.05, 1.98, 1.95, 1.61, 1.42, 1.38, 1.36, 1.33, 1.30, 1.27,
              1.25, 1.24, 1.22, 1.21, 1.20, 1.19]

# losses exactly at 2 bits and at 1 bit (2 ln 2 and ln 2 nats), each followed by lower ones
_CURVE_TOUCH = [4.2, 2.3, 1.9, 1.5, 2 * LN2, 1.2, 0.9, LN2, 0.6]

_CASES_13_2 = [
    ("the source's `causal` run, floor 1 bit", _STEPS_100, _SOURCE_CAUSAL, 1.0),
    ("the source's `causal` run, floor 2.5 bits", _STEPS_100, _SOURCE_CAUSAL, 2.5),
    ("the source's MQA run, floor 1 bit", _STEPS_100, _SOURCE_MQA, 1.0),
    ("the source's MQA run, floor 3 bits", _STEPS_100, _SOURCE_MQA, 3.0),
    ("a run evaluated every 250 steps, floor 2 bits", _STEPS_250, _CURVE_250, 2.0),
    ("a run evaluated every 250 steps, floor 1.5 bits", _STEPS_250, _CURVE_250, 1.5),
    ("a run evaluated every 250 steps, floor 0.5 bits", _STEPS_250, _CURVE_250, 0.5),
    ("a curve that touches 2 bits, floor 2 bits", _STEPS_250[:9], _CURVE_TOUCH, 2.0),
    ("a curve that touches 1 bit, floor 1 bit", _STEPS_250[:9], _CURVE_TOUCH, 1.0),
]


def _random_curves(g: torch.Generator) -> list[tuple[str, list[int], list[float], float]]:
    """Fresh decreasing curves (noisy exponential decay), evaluated every ``every`` steps."""
    cases = []
    for _ in range(3):
        every, n = randint(g, 1, 8) * 50, randint(g, 5, 30)
        start, end = _uniform(g, 3.0, 4.5), _uniform(g, 0.2, 2.2)
        losses = [round(end + (start - end) * math.exp(-4 * i / n) + _uniform(g, -0.05, 0.05), 4) for i in range(n)]
        floor_bits = round(_uniform(g, 0.5, 3.0), 2)
        cases.append((f"a random run every {every} steps, floor {floor_bits} bits", list(range(0, every * n, every)),
                      losses, floor_bits))
    return cases


def _first_below(steps: list[int], losses: list[float], floor: float, strict: bool = True):
    for step, loss in zip(steps, losses):
        if loss < floor or (not strict and loss <= floor):
            return step
    return None


def _after(steps: list[int], step):
    """The evaluation step after ``step`` (None if ``step`` is None or the last)."""
    if step is None or steps.index(step) + 1 >= len(steps):
        return None
    return steps[steps.index(step) + 1]


def _index(steps: list[int], step):
    return None if step is None else steps.index(step)


_MISTAKES_13_2 = [  # (what a plausible wrong rule returns, the hint that names it)
    (lambda steps, losses, fb: _first_below(steps, losses, fb),
     "the losses are in nats and the floor in bits; convert the floor to nats "
     "(floor_bits * ln 2) before comparing"),
    (lambda steps, losses, fb: _first_below(steps, losses, fb / LN2),
     "to turn bits into nats multiply by ln 2 (you divided)"),
    (lambda steps, losses, fb: _first_below(steps, losses, fb * LN2, strict=False),
     "a loss equal to the floor is not below it; compare with <, not <="),
    (lambda steps, losses, fb: _index(steps, _first_below(steps, losses, fb * LN2)),
     "return the step (an entry of `steps`), not its index in the list"),
    (lambda steps, losses, fb: _after(steps, _first_below(steps, losses, fb * LN2)),
     "you returned the step after the first one below the floor"),
]


@exercise("13.2")
def check_first_suspicious_step(fn) -> None:
    """Check ``first_suspicious_step(steps, val_loss, floor_bits)`` on typed-in loss curves."""
    got_all = []
    cases = _CASES_13_2 + _random_curves(case_rng())
    for what, steps, losses, floor_bits in cases:
        expected = _first_below(steps, losses, floor_bits * LN2)
        got = run(fn, list(steps), list(losses), floor_bits, what=f"first_suspicious_step on {what}")
        if got is not None:
            expect(not (expected is None and (got is False or (type(got) is int and got == -1))),
                   f"{what}: when no loss is below the floor, return None (not {got!r})")
            expect(type(got) is int, f"{what}: return the step as a Python int from `steps`, or None; got "
                                     f"{type(got).__name__} {got!r}")
        got_all.append(got)
    expected_all = [_first_below(s, v, fb * LN2) for _, s, v, fb in cases]
    if got_all == expected_all:
        return
    for mistake, hint in _MISTAKES_13_2:
        if got_all == [mistake(s, v, fb) for _, s, v, fb in cases]:
            expect(False, hint)
    i = next(i for i, (g, e) in enumerate(zip(got_all, expected_all)) if g != e)
    what, steps, losses, floor_bits = cases[i]
    if expected_all[i] is None:
        expect(False, f"{what}: no validation loss is below {floor_bits} bits = "
                      f"{floor_bits * LN2:.4f} nats, so return None; got {got_all[i]!r}")
    expect(False, f"{what}: the first validation loss below {floor_bits * LN2:.4f} nats is at "
                  f"step {expected_all[i]}; you returned {got_all[i]!r}")


# ------------------------------------------------------------------------------------------ 13.3
# One rule, written once: Welch's difference of means in units of its standard error.
def _mean_sd(xs: list[float], ddof: int = 1) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - ddof))


def _verdict(a, b, z, *, ddof=1, se_kind="se", n_fixed=None, swap=False, z_fixed=None, spread=True):
    """The rule's verdict ("a", "b" or None), or the verdict of one of its plausible mistakes."""
    (ma, sa), (mb, sb) = _mean_sd(a, ddof), _mean_sd(b, ddof)
    na, nb = (n_fixed, n_fixed) if n_fixed else (len(a), len(b))
    if se_kind == "se":
        se = math.sqrt(sa**2 / na + sb**2 / nb)
    elif se_kind == "sd":  # the spread of one run, not of a mean
        se = math.sqrt(sa**2 + sb**2)
    else:  # "var": the square root forgotten
        se = sa**2 / na + sb**2 / nb
    zz = z if z_fixed is None else z_fixed
    differ = abs(ma - mb) > zz * se if spread else ma != mb
    if not differ:
        return None
    better = "a" if ma < mb else "b"
    return ({"a": "b", "b": "a"}[better]) if swap else better


def _ranges_verdict(a, b, z):
    if max(a) < min(b):
        return "a"
    if max(b) < min(a):
        return "b"
    return None


_MISTAKES_13_3 = [  # (a plausible wrong rule, the hint that names it)
    (lambda a, b, z: _verdict(a, b, z, spread=False),
     "you rank by the means alone; two means always differ a little: call a difference real only "
     "when it is larger than z standard errors, else return None"),
    (lambda a, b, z: _verdict(a, b, z, swap=True),
     "the verdict names the variant with the *higher* loss; return the one whose mean loss is "
     "lower (lower is better)"),
    (lambda a, b, z: _verdict(a, b, z, ddof=0),
     "use the sample standard deviation (divide by n - 1, statistics.stdev or "
     "torch.std(unbiased)), not the population one (divide by n): with 2 to 5 seeds it matters"),
    (lambda a, b, z: _verdict(a, b, z, se_kind="sd"),
     "the uncertainty of a *mean* over n seeds is its standard error s / sqrt(n); you compared the "
     "difference with the standard deviations themselves"),
    (lambda a, b, z: _verdict(a, b, z, se_kind="var"),
     "take the square root: the standard error is sqrt(s_a^2 / n_a + s_b^2 / n_b), not the sum of "
     "the variances of the means"),
    (lambda a, b, z: _verdict(a, b, z, n_fixed=3),
     "divide by each list's own number of seeds (len(losses)), not by a fixed 3"),
    (lambda a, b, z: _verdict(a, b, z, z_fixed=2.0),
     "use the threshold z the caller passes, not a fixed 2"),
    (_ranges_verdict,
     "non-overlapping ranges are not the rule here: compare the difference of the means with z "
     "standard errors (two seeds each can fall apart by chance)"),
]


def _cases_13_3() -> list[tuple[list[float], list[float], float]]:
    """Varied cases: 2 to 6 seeds per side, several z, differences placed around the threshold (fresh noise)."""
    g = case_rng()
    cases = []
    plan = [  # (n_a, n_b, z, difference of the means in units of z standard errors, sign)
        (3, 3, 2.0, 0.45, 1), (3, 3, 2.0, 1.5, -1), (2, 2, 2.0, 0.9, -1), (5, 5, 2.0, 1.15, 1),
        (2, 5, 1.0, 1.3, 1), (6, 3, 3.0, 1.2, -1), (3, 4, 3.0, 0.8, 1), (3, 3, 2.0, 0.15, -1),
        (5, 4, 2.0, 3.0, 1), (2, 3, 2.5, 0.88, -1), (3, 5, 2.0, 0.9, 1), (4, 4, 1.0, 1.9, -1),
        (4, 2, 2.0, 1.3, -1),
    ]
    for n_a, n_b, z, t, sign in plan:
        a = [round(1.8 + 0.03 * float(torch.randn((), generator=g)), 4) for _ in range(n_a)]
        b = [round(1.8 + 0.03 * float(torch.randn((), generator=g)), 4) for _ in range(n_b)]
        (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
        se = math.sqrt(sa**2 / n_a + sb**2 / n_b)
        shift = ma + sign * t * z * se - mb  # b's mean lands t * z standard errors from a's
        cases.append((a, [round(x + shift, 6) for x in b], z))
    # two seeds each, ranges apart, yet the means are less than z standard errors apart
    cases.append(([1.80, 1.90], [1.91, 2.01], 2.0))
    # numbers on a larger scale (perplexities, say): 3.3 standard errors apart, variances > 1
    cases.append(([5.0, 9.2426], [15.0, 19.2426], 2.0))
    return cases


def _is_verdict(x: object) -> bool:
    return x is None or (type(x) is str and x in ("a", "b"))


@exercise("13.3")
def check_seed_verdict(fn) -> None:
    """Check ``seed_verdict(losses_a, losses_b, z)`` -> "a", "b" or None on varied per-seed losses."""
    for a, b in (([1.85], [1.90, 1.92]), ([1.85, 1.86], [1.90])):
        try:
            got = run(fn, list(a), list(b), 2.0, what=f"seed_verdict({a}, {b}, 2.0)")
        except Wrong as e:
            if "your code raised ValueError" in str(e):
                continue  # the answer's own ValueError, as asked
            raise
        expect(False, f"seed_verdict({a}, {b}) returned {got!r}: one seed has no spread to compare "
                      f"with; raise ValueError when either list has fewer than 2 losses")
    cases = _cases_13_3()
    got_all = []
    for a, b, z in cases:
        a_in, b_in = list(a), list(b)
        got = run(fn, a_in, b_in, z, what=f"seed_verdict({a}, {b}, {z})", copy_args=False)
        expect(a_in == a and b_in == b, "seed_verdict changed the lists it was given (sorted them in "
                                        "place?); leave the caller's losses as they are")
        expect(_is_verdict(got), f"return 'a', 'b' or None; got {got!r} for a={a}, b={b}, z={z}")
        got_all.append(got)
    expected = [_verdict(a, b, z) for a, b, z in cases]
    if got_all == expected:
        return
    for mistake, hint in _MISTAKES_13_3:
        if got_all == [mistake(a, b, z) for a, b, z in cases]:
            expect(False, hint)
    i = next(i for i, (g, e) in enumerate(zip(got_all, expected)) if g != e)
    a, b, z = cases[i]
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    se = math.sqrt(sa**2 / len(a) + sb**2 / len(b))
    expect(False, f"for a={a}, b={b}, z={z}: the means differ by {abs(ma - mb):.4f}, "
                  f"{abs(ma - mb) / se:.2f} standard errors (se = {se:.4f}), so the verdict is "
                  f"{expected[i]!r}; you returned {got_all[i]!r}")
