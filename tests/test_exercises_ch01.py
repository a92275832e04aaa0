"""The chapter 01 graders accept the reference answers and reject plausible mistakes with the right hint."""
import math

import pytest
import torch

from attnlib.book.exercises import CORRECT, WRONG, grade

# ---------------------------------------------------------------- reference answers (as in the solutions)


def decay_average(x, lam):
    T = x.shape[1]
    t = torch.arange(T, dtype=x.dtype)
    logits = -lam * (t[:, None] - t[None, :])  # entry [t, s] = -lam (t - s)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool))
    weights = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return weights @ x


def attend_to_earlier(x):
    T, d_model = x.shape[1], x.shape[2]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1)
    scores = x @ x.transpose(-2, -1) / math.sqrt(d_model)
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # the first row has no earlier token
    return weights @ x, weights


def window_average(x, w):
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


# ---------------------------------------------------------------- plausible mistakes


def decay_sign_flipped(x, lam):
    return decay_average(x, -lam)


def decay_ignores_lam(x, lam):
    return decay_average(x, 0.0)


def decay_not_normalised(x, lam):
    T = x.shape[1]
    t = torch.arange(T, dtype=x.dtype)
    weights = torch.exp(-lam * (t[:, None] - t[None, :])).tril()
    return weights @ x


def decay_exp_then_mask(x, lam):
    T = x.shape[1]
    t = torch.arange(T, dtype=x.dtype)
    weights = torch.exp(-lam * (t[:, None] - t[None, :])) * torch.tril(torch.ones(T, T))  # inf * 0 = NaN for large lam
    return (weights / weights.sum(dim=-1, keepdim=True)) @ x


def decay_no_mask(x, lam):
    T = x.shape[1]
    t = torch.arange(T, dtype=x.dtype)
    weights = torch.softmax(-lam * (t[:, None] - t[None, :]).abs(), dim=-1)
    return weights @ x


def earlier_includes_self(x):
    T, d_model = x.shape[1], x.shape[2]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool))
    weights = torch.softmax((x @ x.transpose(-2, -1) / math.sqrt(d_model)).masked_fill(~keep, float("-inf")), -1)
    return weights @ x, weights


def earlier_nan_first_row(x):
    T, d_model = x.shape[1], x.shape[2]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1)
    weights = torch.softmax((x @ x.transpose(-2, -1) / math.sqrt(d_model)).masked_fill(~keep, float("-inf")), -1)
    return weights @ x, weights


def earlier_unscaled(x):
    T = x.shape[1]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1)
    weights = torch.softmax((x @ x.transpose(-2, -1)).masked_fill(~keep, float("-inf")), dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)
    return weights @ x, weights


def earlier_returns_y_only(x):
    return attend_to_earlier(x)[0]


def window_too_wide(x, w):
    return window_average(x, w + 1)


def window_divides_by_w(x, w):
    T = x.shape[1]
    t = torch.arange(T)
    keep = ((t[:, None] - t[None, :]) >= 0) & ((t[:, None] - t[None, :]) < w)
    return (keep.float() / w) @ x


def window_symmetric(x, w):
    T = x.shape[1]
    t = torch.arange(T)
    keep = (t[:, None] - t[None, :]).abs() < w
    weights = torch.softmax(torch.zeros(T, T).masked_fill(~keep, float("-inf")), dim=-1)
    return weights @ x


def window_in_place(x, w):
    x.mul_(1.0)
    x[:, 0] += 1.0
    return window_average(x, w)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "exercise_id, answer",
    [("01.1", decay_average), ("01.2", attend_to_earlier), ("01.3", window_average), ("01.3", window_average_loops)],
)
def test_reference_answers_are_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("01.1", decay_sign_flipped, "sign is flipped"),
        ("01.1", decay_ignores_lam, "plain running mean"),
        ("01.1", decay_not_normalised, "sum to 1"),
        ("01.1", decay_no_mask, "not causal"),
        ("01.1", decay_exp_then_mask, "overflows"),
        ("01.2", earlier_includes_self, "mask the diagonal"),
        ("01.2", earlier_nan_first_row, "NaN"),
        ("01.2", earlier_unscaled, "sqrt(d_model)"),
        ("01.2", earlier_returns_y_only, "pair (y, weights)"),
        ("01.3", window_too_wide, "w + 1 tokens"),
        ("01.3", window_divides_by_w, "fewer than w tokens"),
        ("01.3", window_symmetric, "not causal"),
        ("01.3", window_in_place, "in place"),
    ],
)
def test_plausible_mistakes_are_wrong_with_a_hint(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


def test_a_crashing_answer_is_wrong_not_an_error():
    verdict = grade("01.1", lambda x, lam: x.view(-1, 7, 7))
    assert verdict.status == WRONG and "raised" in verdict.detail


