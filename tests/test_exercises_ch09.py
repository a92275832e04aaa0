"""Chapter 09 exercise graders: reference answers pass, plausible mistakes fail, stubs are 'not solved yet'."""
import math

import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, grade

# 09.1 cross-attention weights with an attention mask (True = real key) ----------------------------

def cross_weights(q, k, attention_mask=None, *, scale=True, tril=False, mask_axis="keys", fill=float("-inf"),
                  zero_empty=True, invert=False):
    scores = q @ k.transpose(-2, -1)  # (B, T_q, d) @ (B, d, T_k) -> (B, T_q, T_k)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    allowed = torch.ones_like(scores, dtype=torch.bool)
    if tril:
        allowed = allowed & torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if attention_mask is not None:
        m = ~attention_mask if invert else attention_mask
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


# 09.2 additive (Bahdanau) cross-attention ----------------------------------------------------------

def additive(s, m, W_s, W_m, w, mask=None, *, tanh=True, softmax_dim=-1, mask_after=False, scale=False,
             project_values=False):
    features = (s @ W_s.T).unsqueeze(2) + (m @ W_m.T).unsqueeze(1)  # (B, T_q, T_k, d_a)
    scores = (torch.tanh(features) if tanh else features) @ w  # (B, T_q, T_k)
    if scale:
        scores = scores / math.sqrt(W_s.shape[0])
    if mask is not None and not mask_after:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=softmax_dim)
    if mask is not None and mask_after:
        weights = weights * mask[:, None, :]
    values = m @ W_m.T if project_values else m
    return weights @ values, weights


def test_09_2_reference_is_correct():
    assert grade("09.2", additive).status == CORRECT


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        (dict(tanh=False), "tanh"),
        (dict(softmax_dim=-2), "over the keys"),
        (dict(mask_after=True), "-inf before the softmax"),
        (dict(scale=True), "no 1/sqrt(d) scale"),
        (dict(project_values=True), "weighted sum of the encoder states m"),
    ],
    ids=["no-tanh", "softmax-over-queries", "mask-after-softmax", "scaled", "projected-values"],
)
def test_09_2_mistakes_are_wrong(kwargs, hint):
    verdict = grade("09.2", lambda *args: additive(*args, **kwargs))
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


def test_09_2_ignoring_the_mask_is_wrong():
    verdict = grade("09.2", lambda s, m, W_s, W_m, w, mask=None: additive(s, m, W_s, W_m, w))
    assert verdict.status == WRONG and "padded key" in verdict.detail, str(verdict)


def test_09_2_stub_is_not_solved():
    def stub(*args):
        raise NotImplementedError("scores, softmax, context")

    assert grade("09.2", stub).status == NOT_SOLVED


# 09.3 AUC from ranks ------------------------------------------------------------------------------

def rank_auc(scores, labels, *, ties=True, descending=False, from_zero=False):
    s = -scores if descending else scores
    if ties:
        values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
        ends = counts.cumsum(0).double()  # last rank of each group of equal scores
        ranks = (ends - (counts.double() - 1) / 2)[inverse]  # average rank within the group
    else:
        ranks = torch.empty(len(s), dtype=torch.float64)
        ranks[s.argsort()] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    if from_zero:
        ranks = ranks - 1
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return ((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


def test_09_3_reference_is_correct():
    assert grade("09.3", rank_auc).status == CORRECT


@pytest.mark.parametrize(
    "kwargs, hint",
    [(dict(ties=False), "average of their ranks"), (dict(descending=True), "wrong direction"),
     (dict(from_zero=True), "start at 1")],
    ids=["ties-ignored", "descending", "ranks-from-zero"],
)
def test_09_3_mistakes_are_wrong(kwargs, hint):
    verdict = grade("09.3", lambda s, y: rank_auc(s, y, **kwargs))
    assert verdict.status == WRONG
    assert hint in verdict.detail


def test_09_3_accuracy_is_not_auc():
    verdict = grade("09.3", lambda s, y: ((s > 0).long() == y.long()).double().mean().item())
    assert verdict.status == WRONG
