"""Chapter 01's exercise checks: the answers they must accept and the mistakes they must refuse.

``ANSWERS`` is graded by ``tests/test_exercise_tables.py`` (under two seeds, with the generic cheats).
The answers here are written from ``torch.tril`` / ``torch.arange`` and loops, independently of the
checks' own helpers.
"""
import math

import torch
from exercise_table import Answers

from attnlib.book.exercises import NOT_SOLVED, grade

# ---------------------------------------------------------------- 01.1 an average that forgets


def decay_average(x, lam):  # the solution's way: a masked softmax of -lam * (t - s)
    T = x.shape[1]
    t = torch.arange(T, dtype=x.dtype)
    logits = -lam * (t[:, None] - t[None, :])  # entry [t, s] = -lam (t - s)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool))
    weights = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return weights @ x


def decay_average_loops(x, lam):  # another way: one query at a time, weights normalised by hand
    y = torch.empty_like(x)
    for t in range(x.shape[1]):
        w = torch.tensor([math.exp(-lam * (t - s)) for s in range(t + 1)], dtype=x.dtype)
        y[:, t] = (w / w.sum()) @ x[:, : t + 1]
    return y


def decay_sign_flipped(x, lam):
    return decay_average(x, -lam)


def decay_ignores_lam(x, lam):
    return decay_average(x, 0.0)


def decay_not_normalised(x, lam):
    t = torch.arange(x.shape[1], dtype=x.dtype)
    return torch.exp(-lam * (t[:, None] - t[None, :])).tril() @ x


def decay_exp_then_mask(x, lam):  # exp of the future logits overflows: inf * 0 = NaN
    T = x.shape[1]
    t = torch.arange(T, dtype=x.dtype)
    weights = torch.exp(-lam * (t[:, None] - t[None, :])) * torch.tril(torch.ones(T, T))
    return (weights / weights.sum(dim=-1, keepdim=True)) @ x


def decay_no_mask(x, lam):
    t = torch.arange(x.shape[1], dtype=x.dtype)
    return torch.softmax(-lam * (t[:, None] - t[None, :]).abs(), dim=-1) @ x


def decay_softmax_over_queries(x, lam):
    T = x.shape[1]
    t = torch.arange(T, dtype=x.dtype)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool))
    logits = (-lam * (t[:, None] - t[None, :])).masked_fill(~keep, float("-inf"))
    return torch.softmax(logits, dim=0) @ x


def decay_in_float64(x, lam):
    T = x.shape[1]
    t = torch.arange(T, dtype=torch.float64)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool))
    logits = (-lam * (t[:, None] - t[None, :])).masked_fill(~keep, float("-inf"))
    return torch.softmax(logits, dim=-1) @ x.double()


def decay_in_place(x, lam):
    x.mul_(1.0).add_(0.5)
    return decay_average(x - 0.5, lam)


# ---------------------------------------------------------------- 01.2 look only at the others


def attend_to_earlier(x):  # the solution's way: -inf, softmax, then zeros on the masked entries
    T, d_model = x.shape[1], x.shape[2]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1)
    scores = (x @ x.transpose(-2, -1) / math.sqrt(d_model)).masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1).masked_fill(~keep, 0.0)
    return weights @ x, weights


def attend_to_earlier_library(x):  # allowed by the statement: attnlib's attention, strict mask
    from attnlib.attention import attention

    T = x.shape[1]
    strict = torch.ones(T, T, dtype=torch.bool).tril(diagonal=-1)
    return attention(x, x, x, mask=strict[None])


def attend_to_earlier_nan_to_num(x):
    T, d_model = x.shape[1], x.shape[2]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1)
    scores = (x @ x.transpose(-2, -1) / math.sqrt(d_model)).masked_fill(~keep, float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return weights @ x, weights


def _earlier(x, diagonal=-1, scale=None, fill=float("-inf"), zero_empty=True):
    T, d_model = x.shape[1], x.shape[2]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=diagonal)
    scale = 1 / math.sqrt(d_model) if scale is None else scale
    weights = torch.softmax((x @ x.transpose(-2, -1) * scale).masked_fill(~keep, fill), dim=-1)
    if zero_empty:
        weights = torch.nan_to_num(weights, nan=0.0)
    return weights @ x, weights


def earlier_includes_self(x):
    return _earlier(x, diagonal=0)


def earlier_nan_first_row(x):
    return _earlier(x, zero_empty=False)


def earlier_unscaled(x):
    return _earlier(x, scale=1.0)


def earlier_divided_by_d_model(x):
    return _earlier(x, scale=1 / x.shape[-1])


def earlier_fill_minus_1e9(x):  # row 0 becomes uniform over all T keys, the future included
    return _earlier(x, fill=-1e9)


def earlier_returns_y_only(x):
    return _earlier(x)[0]


def earlier_swapped(x):
    y, weights = _earlier(x)
    return weights, y


def earlier_in_place(x):
    out = _earlier(x.clone())
    x.zero_()
    return out


# ---------------------------------------------------------------- 01.3 a sliding window


def window_average(x, w):  # the solution's way: a band mask and a softmax over zeros
    T = x.shape[1]
    t = torch.arange(T)
    keep = ((t[:, None] - t[None, :]) >= 0) & ((t[:, None] - t[None, :]) < w)
    weights = torch.softmax(torch.zeros(T, T).masked_fill(~keep, float("-inf")), dim=-1)
    return weights @ x


def window_average_loops(x, w):
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        y[:, t] = x[:, max(0, t - w + 1) : t + 1].mean(dim=1)
    return y


def window_average_cumsum(x, w):  # running sums: S_t - S_{t-w}, divided by the count
    T = x.shape[1]
    padded = torch.cat([torch.zeros_like(x[:, :1]), x.double().cumsum(dim=1)], dim=1)
    t = torch.arange(T)
    start = (t - w + 1).clamp(min=0)
    return ((padded[:, t + 1] - padded[:, start]) / (t - start + 1)[None, :, None]).to(x.dtype)


def window_too_wide(x, w):
    return window_average(x, w + 1)


def window_too_narrow(x, w):
    return window_average(x, max(w - 1, 1)) if w > 1 else window_average(x, w)


def window_divides_by_w(x, w):
    T = x.shape[1]
    t = torch.arange(T)
    keep = ((t[:, None] - t[None, :]) >= 0) & ((t[:, None] - t[None, :]) < w)
    return (keep.float() / w) @ x


def window_symmetric(x, w):
    T = x.shape[1]
    t = torch.arange(T)
    keep = (t[:, None] - t[None, :]).abs() < w
    return torch.softmax(torch.zeros(T, T).masked_fill(~keep, float("-inf")), dim=-1) @ x


def window_in_place(x, w):
    x[:, 0] += 1.0
    return window_average(x, w)


ANSWERS = {
    "01.1": Answers(
        correct=[decay_average, decay_average_loops],
        wrong=[
            (decay_sign_flipped, "sign is flipped"),
            (decay_ignores_lam, "plain running mean"),
            (decay_not_normalised, "sum to 1"),
            (decay_no_mask, "not causal"),
            (decay_exp_then_mask, "overflows"),
            (decay_softmax_over_queries, "over the keys (dim=-1)"),
            (decay_in_float64, "dtype"),
            (decay_in_place, "in place"),
        ],
    ),
    "01.2": Answers(
        correct=[attend_to_earlier, attend_to_earlier_library, attend_to_earlier_nan_to_num],
        wrong=[
            (earlier_includes_self, "mask the diagonal"),
            (earlier_nan_first_row, "NaN"),
            (earlier_unscaled, "sqrt(d_model) before the softmax"),
            (earlier_divided_by_d_model, "divided by d_model"),
            (earlier_fill_minus_1e9, "-1e9"),
            (earlier_returns_y_only, "pair (y, weights)"),
            (earlier_swapped, "wrong order"),
            (earlier_in_place, "in place"),
        ],
    ),
    "01.3": Answers(
        correct=[window_average, window_average_loops, window_average_cumsum],
        wrong=[
            (window_too_wide, "w + 1 tokens"),
            (window_too_narrow, "w - 1 tokens"),
            (window_divides_by_w, "fewer than w tokens"),
            (window_symmetric, "not causal"),
            (window_in_place, "in place"),
        ],
    ),
}


def test_the_stubs_are_not_solved():
    def stub(*args):
        raise NotImplementedError("write it")

    for exercise_id in ANSWERS:
        assert grade(exercise_id, stub).status == NOT_SOLVED
        assert grade(exercise_id, None).status == NOT_SOLVED
