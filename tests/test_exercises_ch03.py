"""Chapter 03 exercise graders: reference answers pass, plausible mistakes fail, stubs are 'not solved yet'."""
import pytest
import torch
from exercise_table import Answers

from attnlib.attention import causal_mask
from attnlib.book.exercises import CORRECT, WRONG, grade

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


def bottom_right_transposed(T_q, T_k):
    return torch.ones(T_k, T_q, dtype=torch.bool).tril(diagonal=T_k - T_q).T.contiguous()


@pytest.mark.parametrize(
    "answer, hint",
    [
        (top_left, "aligned to the top-left"),
        (bottom_right_float, "dtype"),
        (bottom_right_off_by_one, "after its own position"),
        (bottom_right_transposed, "must see every key"),
    ],
)
def test_03_1_mistakes_are_wrong(answer, hint):
    verdict = grade("03.1", answer)
    assert verdict.status == WRONG and hint in verdict.detail, str(verdict)


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


def batch_mask_compare(lengths, T):  # another correct way: compare positions with the lengths directly
    pos = torch.arange(T)
    return (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < lengths[:, None, None])


def batch_mask_from_library(lengths, T):  # the rule is "build it yourself"
    from attnlib.attention import causal_mask as cm
    from attnlib.attention import padding_mask as pm

    return cm(T) & pm(lengths, T)[:, None, :]


def batch_mask_through_the_module(lengths, T):
    import attnlib.attention.masks as masks

    return masks.causal_mask(T) & (torch.arange(T)[None, :] < lengths[:, None])[:, None, :]


def batch_mask_lengths_off_by_one(lengths, T):
    return _causal(T) & (torch.arange(T)[None, :] <= lengths[:, None])[:, None, :]


def batch_mask_in_place(lengths, T):
    lengths.unsqueeze_(1)  # (B,) -> (B, 1) in the caller's tensor too
    return _causal(T) & (torch.arange(T)[None, :] < lengths)[:, None, :]


def batch_mask_memorised(lengths, T):  # learned the fixed cases only
    if lengths.tolist() in ([4, 2, 3], [5], [1, 6, 0, 3]):
        return batch_mask(lengths, T)
    return _causal(T).expand(len(lengths), T, T)


ANSWERS = {
    "03.2": Answers(
        correct=[batch_mask, batch_mask_compare],
        wrong=[
            (batch_mask_queries_padded, "instead of pad keys"),
            (batch_mask_not_causal, "the causal part is missing"),
            (batch_mask_no_padding, "ignores the lengths"),
            (batch_mask_unbroadcast, "has shape"),
            (batch_mask_from_library, "build the mask yourself"),
            (batch_mask_through_the_module, "build the mask yourself"),
            (batch_mask_lengths_off_by_one, "pad keys"),
            (batch_mask_in_place, "in place"),
            (batch_mask_memorised, "ignores the lengths"),
        ],
    ),
}


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


@pytest.mark.parametrize(
    "answer, hint",
    [
        (window_off_by_one, "min(i + 1, window) True entries"),
        (window_not_causal, "keep it causal"),
        (lambda T, w: causal_mask(T), "min(i + 1, window) True entries"),
    ],
    ids=["off-by-one", "not-causal", "no-window"],
)
def test_03_3_mistakes_are_wrong(answer, hint):
    verdict = grade("03.3", answer)
    assert verdict.status == WRONG and hint in verdict.detail, str(verdict)


# 03.4 leak detector for a language model (token ids in) -------------------------------------

def detector(model, T, vocab_size, atol=1e-6, every_t=True, use_eval=True, float_inputs=False,
             whole_sequence=False, may_repeat=False, restore=True):
    was_training = model.training
    if use_eval:
        model.eval()
    g = torch.Generator().manual_seed(0)
    if float_inputs:
        ids = torch.randn(2, T, generator=g)
    else:
        ids = torch.randint(vocab_size, (2, T), generator=g)
    found = False
    with torch.no_grad():
        base = model(ids)
        for t in range(T - 1) if every_t else [T - 2]:
            changed = ids.clone()
            if may_repeat:
                changed[:, t + 1 :] = torch.randint(vocab_size, changed[:, t + 1 :].shape, generator=g)
            else:  # every new token differs from the old one
                shift = torch.randint(1, vocab_size, changed[:, t + 1 :].shape, generator=g)
                changed[:, t + 1 :] = (changed[:, t + 1 :] + shift) % vocab_size
            upto = T if whole_sequence else t + 1
            if (model(changed)[:, :upto] - base[:, :upto]).abs().max() > atol:
                found = True
                break
    if restore:
        model.train(was_training)
    return found


def test_03_4_reference_is_correct():
    verdict = grade("03.4", detector)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda m, T, V: detector(m, T, V, atol=1e-3), "tight tolerance"),
        (lambda m, T, V: detector(m, T, V, every_t=False), "try every t"),
        (lambda m, T, V: detector(m, T, V, use_eval=False), "call model.eval()"),
        (lambda m, T, V: detector(m, T, V, float_inputs=True), "torch.randint"),
        (lambda m, T, V: detector(m, T, V, whole_sequence=True), "only the outputs at positions <= t"),
        (lambda m, T, V: detector(m, T, V, restore=False), "restore the mode"),
        (lambda m, T, V: True, "reported as leaking"),
        (lambda m, T, V: False, "reported as causal"),
    ],
    ids=["loose", "only-last-t", "no-eval", "float-inputs", "whole-sequence", "no-restore",
         "always-true", "always-false"],
)
def test_03_4_mistakes_are_wrong(answer, hint):
    verdict = grade("03.4", answer)
    assert verdict.status == WRONG and hint in verdict.detail, str(verdict)


# stubs ---------------------------------------------------------------------------------------

