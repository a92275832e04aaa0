"""Chapter 03 exercise graders: reference answers pass, plausible mistakes fail, stubs are 'not solved yet'."""
import pytest
import torch

from attnlib.book.exercises import CORRECT, WRONG, grade
from attnlib.functional import causal_mask

# 03.1 bottom-right causal mask ---------------------------------------------------------------

def bottom_right(T_q, T_k):
    return torch.ones(T_q, T_k, dtype=torch.bool).tril(diagonal=T_k - T_q)


def top_left(T_q, T_k):
    return torch.ones(T_q, T_k, dtype=torch.bool).tril()


def bottom_right_float(T_q, T_k):
    return bottom_right(T_q, T_k).float()


def bottom_right_off_by_one(T_q, T_k):
    return torch.ones(T_q, T_k, dtype=torch.bool).tril(diagonal=T_k - T_q + 1)


def test_03_1_reference_is_correct():
    assert grade("03.1", bottom_right).status == CORRECT


@pytest.mark.parametrize("answer", [top_left, bottom_right_float, bottom_right_off_by_one])
def test_03_1_mistakes_are_wrong(answer):
    assert grade("03.1", answer).status == WRONG


def test_03_1_top_left_hint():
    assert "top-left" in grade("03.1", top_left).detail


# 03.2 causal & padding for a batch -----------------------------------------------------------

# Written from torch.arange, independently of attnlib's causal_mask / padding_mask that the check uses.
def _causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)


def _real(lengths, T):
    return torch.arange(T)[None, :] < lengths[:, None]  # (1, T) < (B, 1) -> (B, T), True = real token


def batch_mask(lengths, T):
    return _causal(T) & _real(lengths, T)[:, None, :]  # (T, T) & (B, 1, T) -> (B, T, T)


def batch_mask_queries_padded(lengths, T):
    return _causal(T) & _real(lengths, T)[:, :, None]  # pad rows (queries) instead of pad columns (keys)


def batch_mask_not_causal(lengths, T):
    return _real(lengths, T)[:, None, :].expand(len(lengths), T, T)


def batch_mask_no_padding(lengths, T):
    return _causal(T).expand(len(lengths), T, T)


def batch_mask_unbroadcast(lengths, T):
    return _real(lengths, T)[:, None, :]  # (B, 1, T), not (B, T, T)


def test_03_2_reference_is_correct():
    assert grade("03.2", batch_mask).status == CORRECT


@pytest.mark.parametrize(
    "answer", [batch_mask_queries_padded, batch_mask_not_causal, batch_mask_no_padding, batch_mask_unbroadcast]
)
def test_03_2_mistakes_are_wrong(answer):
    assert grade("03.2", answer).status == WRONG


def test_03_2_rows_instead_of_columns_hint():
    assert "instead of pad keys" in grade("03.2", batch_mask_queries_padded).detail


# 03.3 sliding window -------------------------------------------------------------------------

def window_mask(T, window):
    ones = torch.ones(T, T, dtype=torch.bool)
    return ones.tril() & ~ones.tril(diagonal=-window)


def window_off_by_one(T, window):
    ones = torch.ones(T, T, dtype=torch.bool)
    return ones.tril() & ~ones.tril(diagonal=-window - 1)


def window_not_causal(T, window):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (i - j).abs() < window


def test_03_3_reference_is_correct():
    assert grade("03.3", window_mask).status == CORRECT


@pytest.mark.parametrize("answer", [window_off_by_one, window_not_causal, lambda T, w: causal_mask(T)])
def test_03_3_mistakes_are_wrong(answer):
    assert grade("03.3", answer).status == WRONG


# 03.4 leak detector --------------------------------------------------------------------------

def detector(module, T, d_model, atol=1e-6, every_t=True, use_eval=True):
    if use_eval:
        module.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, T, d_model, generator=g)
    with torch.no_grad():
        base = module(x)
        for t in range(T - 1) if every_t else [0]:
            changed = x.clone()
            changed[:, t + 1 :] = torch.randn(changed[:, t + 1 :].shape, generator=g)
            if (module(changed)[:, : t + 1] - base[:, : t + 1]).abs().max() > atol:
                return True
    return False


def test_03_4_reference_is_correct():
    assert grade("03.4", detector).status == CORRECT


@pytest.mark.parametrize(
    "answer",
    [
        lambda m, T, d: detector(m, T, d, atol=1e-3),  # too loose: misses a 1e-4 leak
        lambda m, T, d: detector(m, T, d, every_t=False),  # only t = 0: misses a one-position leak
        lambda m, T, d: detector(m, T, d, use_eval=False),  # dropout looks like a leak
        lambda m, T, d: True,
        lambda m, T, d: False,
    ],
    ids=["loose", "only-t0", "no-eval", "always-true", "always-false"],
)
def test_03_4_mistakes_are_wrong(answer):
    assert grade("03.4", answer).status == WRONG


# stubs ---------------------------------------------------------------------------------------

