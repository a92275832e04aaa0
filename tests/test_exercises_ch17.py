"""The chapter 17 exercise checks: the solution is correct, plausible mistakes are wrong with a hint naming them."""
import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, ch17, grade  # noqa: F401  (ch17 registers 17.x)


# ---------------------------------------------------------------- 17.1
def ntk_base(base, head_dim, factor):
    return base * factor ** (head_dim / (head_dim - 2))


# ---------------------------------------------------------------- 17.3
def streaming_keys(position, window, n_sink, sinks=True, extra=0, dedup=True, sinks_in_window=False,
                   future_sinks=False):
    first = list(range(n_sink if future_sinks else min(n_sink, position + 1))) if sinks else []
    span = window - n_sink if sinks_in_window else window
    recent = list(range(max(0, position - span + 1 - extra), position + 1))
    keys = first + recent
    return sorted(set(keys)) if dedup else sorted(keys)


def streaming_renumbered(position, window, n_sink):
    return list(range(len(streaming_keys(position, window, n_sink))))


# ---------------------------------------------------------------- 17.2
def pattern_cache_bytes(windows, n_kv_heads, head_dim, context_length, dtype, batch_size, kv=2, use_min=True,
                        itemsize=None, batch=True, extra=0, ignore_windows=False):
    per = n_kv_heads * head_dim * (itemsize or dtype.itemsize) * (batch_size if batch else 1)
    total = 0
    for w in windows:
        if w is None or ignore_windows:
            total += kv * per * context_length
        else:
            total += kv * per * (min(w + extra, context_length) if use_min else w + extra)
    return total


# ---------------------------------------------------------------- 17.4
def softcap_grad(scores, cap):
    return 1 - torch.tanh(scores / cap) ** 2


def softcap_grad_in_place(scores, cap):
    return 1 - scores.div_(cap).tanh_() ** 2


CORRECT_ANSWERS = [
    ("17.1", ntk_base),
    ("17.3", streaming_keys),
    ("17.2", pattern_cache_bytes),
    ("17.4", softcap_grad),
]


@pytest.mark.parametrize("exercise_id, answer", CORRECT_ANSWERS)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("17.1", lambda b, d, s: b * s, "slowed by only"),
        ("17.1", lambda b, d, s: b * s ** ((d - 2) / d), "exponent is upside down"),
        ("17.1", lambda b, d, s: b / s, "a smaller base makes every pair turn faster"),
        ("17.1", lambda b, d, s: b * s ** (d / 2), "i = d_h/2 - 1"),
        ("17.1", lambda b, d, s: b * s ** (d / (d - 1)), "the fastest pair (i = 0) never changes"),
        ("17.1", lambda b, d, s: torch.tensor([b, s]), "return a number"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, sinks=False), "never evicted"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, extra=1), "the window counts the token itself"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, dedup=False), "list it once"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, sinks_in_window=True), "besides the sinks"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, future_sinks=True), "once its token has arrived"),
        ("17.3", streaming_renumbered, "not the positions 0, 1, ..."),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n)[::-1], "ascending order"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, kv=1), "a key AND a value"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, use_min=False), "min(context_length, window)"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, ignore_windows=True), "keeps only its window"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, itemsize=2), "dtype.itemsize"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, batch=False), "batch_size="),
        ("17.2", lambda *a: pattern_cache_bytes(*a, extra=1), "not w + 1"),
        ("17.2", lambda *a: float(pattern_cache_bytes(*a)), "return a Python int"),
        ("17.4", lambda s, c: c * (1 - torch.tanh(s / c) ** 2), "chain rule"),
        ("17.4", lambda s, c: 1 - torch.tanh(s) ** 2, "the tanh is of s / cap"),
        ("17.4", lambda s, c: 1 / torch.cosh(s / c), "(squared)"),
        ("17.4", lambda s, c: torch.where(s == 0, torch.ones_like(s), c * torch.tanh(s / c) / s), "the secant"),
        ("17.4", softcap_grad_in_place, "changed scores in place"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


@pytest.mark.parametrize("exercise_id", ["17.1", "17.2", "17.3", "17.4"])
def test_stub_is_not_solved(exercise_id):
    def stub(*args):
        raise NotImplementedError("write it")

    assert grade(exercise_id, stub).status == NOT_SOLVED
