"""Chapter 09 exercise graders: reference answers pass, plausible mistakes fail, stubs are 'not solved yet'."""
import math

import pytest
import torch

from attnlib.book.exercises import CORRECT, WRONG, grade

# 09.1 cross-attention weights with a key padding mask ------------------------------------------

def cross_weights(q, k, key_padding_mask=None, *, scale=True, tril=False, mask_axis="keys", fill=float("-inf"),
                  zero_empty=True, invert=False):
    scores = q @ k.transpose(-2, -1)  # (B, T_q, d) @ (B, d, T_k) -> (B, T_q, T_k)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    allowed = torch.ones_like(scores, dtype=torch.bool)
    if tril:
        allowed = allowed & torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if key_padding_mask is not None:
        m = ~key_padding_mask if invert else key_padding_mask
        if mask_axis == "keys":
            allowed = allowed & m[:, None, :]
        else:
            allowed = allowed & m[:, : scores.shape[1], None] if m.shape[1] >= scores.shape[1] else allowed
    weights = torch.softmax(scores.masked_fill(~allowed, fill), dim=-1)
    if zero_empty:
        weights = weights.masked_fill(~allowed, 0.0)
    return weights


def test_09_1_reference_is_correct():
    assert grade("09.1", cross_weights).status == CORRECT


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        (dict(tril=True), "no causal mask"),
        (dict(scale=False), "1/sqrt(d)"),
        (dict(zero_empty=False), "NaN"),
        (dict(invert=True), "padded key"),
        (dict(mask_axis="queries"), "padded key"),
        (dict(fill=-1e9, zero_empty=False), ""),
    ],
    ids=["causal-tril", "no-scale", "nan-rows", "inverted-mask", "masked-queries", "finite-fill"],
)
def test_09_1_mistakes_are_wrong(kwargs, hint):
    verdict = grade("09.1", lambda *args: cross_weights(*args, **kwargs))
    assert verdict.status == WRONG
    assert hint in verdict.detail


# 09.2 DIN activation-unit inputs ----------------------------------------------------------------

def din_inputs(e, v, *, order=("e", "v", "ev", "e-v"), expand=True):
    e_ = e.unsqueeze(1).expand_as(v) if expand else e.unsqueeze(1)
    parts = {"e": e_, "v": v, "ev": e_ * v, "e-v": e_ - v, "v-e": v - e_}
    return torch.cat([parts[p] for p in order], dim=-1)


def test_09_2_reference_is_correct():
    assert grade("09.2", din_inputs).status == CORRECT


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        (dict(order=("e", "v", "ev", "v-e")), "you have v - e"),
        (dict(order=("v", "e", "ev", "e-v")), "block 0"),
        (dict(order=("e", "v", "e-v", "ev")), "block 2"),
        (dict(expand=False), ""),
    ],
    ids=["v-minus-e", "swapped", "product-last", "no-expand"],
)
def test_09_2_mistakes_are_wrong(kwargs, hint):
    verdict = grade("09.2", lambda e, v: din_inputs(e, v, **kwargs))
    assert verdict.status == WRONG
    assert hint in verdict.detail


# 09.3 AUC from ranks ------------------------------------------------------------------------------

def rank_auc(scores, labels, *, ties=True, descending=False):
    s = -scores if descending else scores
    if ties:
        values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
        ends = counts.cumsum(0).double()  # last rank of each group of equal scores
        ranks = (ends - (counts.double() - 1) / 2)[inverse]  # average rank within the group
    else:
        ranks = torch.empty(len(s), dtype=torch.float64)
        ranks[s.argsort()] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return ((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


def test_09_3_reference_is_correct():
    assert grade("09.3", rank_auc).status == CORRECT


@pytest.mark.parametrize(
    "kwargs, hint", [(dict(ties=False), "average of their ranks"), (dict(descending=True), "wrong direction")],
    ids=["ties-ignored", "descending"],
)
def test_09_3_mistakes_are_wrong(kwargs, hint):
    verdict = grade("09.3", lambda s, y: rank_auc(s, y, **kwargs))
    assert verdict.status == WRONG
    assert hint in verdict.detail


def test_09_3_accuracy_is_not_auc():
    verdict = grade("09.3", lambda s, y: ((s > 0).long() == y.long()).double().mean().item())
    assert verdict.status == WRONG
