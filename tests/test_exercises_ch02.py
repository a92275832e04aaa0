"""The chapter 02 graders accept the reference answers, reject plausible wrong ones and spot unsolved stubs."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, grade

# --------------------------------------------------------------------------- 02.1 attention by hand


def attention_reference(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def attention_unscaled(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def attention_scaled_by_head_dim(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def attention_softmax_over_queries(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def attention_softmax_after_values(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) @ v, dim=-2)


def attention_returns_weights_too(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def attention_with_k_T(q, k, v):
    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v


def attention_delegates_to_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def attention_delegates_to_attnlib(q, k, v):
    import attnlib.attention

    return attnlib.attention.attention(q, k, v)[0]


def attention_delegates_to_attnlib_functions(q, k, v):
    from attnlib.attention import functions

    return functions.attention(q, k, v)[0]


def attention_stub(q, k, v):
    raise NotImplementedError("compute softmax(q k^T / sqrt(head_dim)) v")


def test_attention_reference_is_correct():
    assert grade("02.1", attention_reference).status == CORRECT


@pytest.mark.parametrize(
    "answer, hint",
    [
        (attention_unscaled, "sqrt(head_dim)"),
        (attention_scaled_by_head_dim, "divided by head_dim"),
        (attention_softmax_over_queries, "dim=-1"),
        (attention_softmax_after_values, "softmax the scores first"),
        (attention_returns_weights_too, "not a tuple"),
        (attention_delegates_to_sdpa, "by hand"),
        (attention_delegates_to_attnlib, "by hand"),
        (attention_delegates_to_attnlib_functions, "by hand"),
        (attention_with_k_T, "k.transpose(-2, -1)"),
    ],
)
@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")  # the k.T answer warns before it fails
def test_attention_wrong_answers(answer, hint):
    verdict = grade("02.1", answer)
    assert verdict.status == WRONG
    assert hint in verdict.detail


def test_attention_grader_restores_sdpa():
    import attnlib.attention
    from attnlib.attention import functions

    originals = F.scaled_dot_product_attention, attnlib.attention.attention, functions.attention
    grade("02.1", attention_delegates_to_sdpa)
    assert (F.scaled_dot_product_attention, attnlib.attention.attention, functions.attention) == originals


def test_attention_stub_is_not_solved():
    assert grade("02.1", attention_stub).status == NOT_SOLVED


# --------------------------------------------------------------------------- 02.2 fused QKV


def fuse_reference(sa_v2):
    parts = (sa_v2.W_query, sa_v2.W_key, sa_v2.W_value)
    has_bias = sa_v2.W_query.bias is not None
    fused = nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias=has_bias)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def fuse_wrong_order(sa_v2):
    parts = (sa_v2.W_key, sa_v2.W_query, sa_v2.W_value)
    fused = nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias=sa_v2.W_query.bias is not None)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def fuse_without_bias(sa_v2):
    parts = (sa_v2.W_query, sa_v2.W_key, sa_v2.W_value)
    fused = nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias=False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
    return fused


def fuse_fresh_weights(sa_v2):
    return nn.Linear(sa_v2.d_model, 3 * sa_v2.head_dim, bias=sa_v2.W_query.bias is not None)


def fuse_stub(sa_v2):
    raise NotImplementedError("stack the three weights")


def test_fuse_reference_is_correct():
    assert grade("02.2", fuse_reference).status == CORRECT


@pytest.mark.parametrize(
    "answer, hint",
    [
        (fuse_wrong_order, "[W_query; W_key; W_value]"),
        (fuse_without_bias, "needs one too"),
        (fuse_fresh_weights, "differs from the expected values"),
    ],
)
def test_fuse_wrong_answers(answer, hint):
    verdict = grade("02.2", answer)
    assert verdict.status == WRONG
    assert hint in verdict.detail


def test_fuse_stub_is_not_solved():
    assert grade("02.2", fuse_stub).status == NOT_SOLVED


# --------------------------------------------------------------------------- 02.3 variance of q.k


def variance_reference(head_dim, n, std=1.0, generator=None):
    q = std * torch.randn(n, head_dim, generator=generator)
    k = std * torch.randn(n, head_dim, generator=generator)
    dots = (q * k).sum(dim=-1)
    return dots.var().item(), (dots / math.sqrt(head_dim)).var().item()


def variance_divided_by_head_dim(head_dim, n, std=1.0, generator=None):
    q = std * torch.randn(n, head_dim, generator=generator)
    k = std * torch.randn(n, head_dim, generator=generator)
    dots = (q * k).sum(dim=-1)
    return dots.var().item(), (dots / head_dim).var().item()


def variance_uniform_entries(head_dim, n, std=1.0, generator=None):
    q = std * torch.rand(n, head_dim, generator=generator)
    k = std * torch.rand(n, head_dim, generator=generator)
    dots = (q * k).sum(dim=-1)
    return dots.var().item(), (dots / math.sqrt(head_dim)).var().item()


def variance_ignores_std(head_dim, n, std=1.0, generator=None):
    return variance_reference(head_dim, n, 1.0, generator)


def variance_formula(head_dim, n, std=1.0, generator=None):
    return head_dim * std**4, std**4


def variance_stub(head_dim, n, std=1.0, generator=None):
    raise NotImplementedError("estimate the variances")


def test_variance_reference_is_correct():
    assert grade("02.3", variance_reference).status == CORRECT


@pytest.mark.parametrize(
    "answer, hint",
    [
        (variance_divided_by_head_dim, "divided the dot products by head_dim"),
        (variance_uniform_entries, "mean 0"),
        (variance_ignores_std, "multiply them by std"),
        (variance_formula, "random samples"),
    ],
)
def test_variance_wrong_answers(answer, hint):
    verdict = grade("02.3", answer)
    assert verdict.status == WRONG
    assert hint in verdict.detail


def test_variance_stub_is_not_solved():
    assert grade("02.3", variance_stub).status == NOT_SOLVED


# --------------------------------------------------------------------------- all graders


def test_none_is_not_solved():
    for exercise_id in ("02.1", "02.2", "02.3"):
        assert grade(exercise_id, None).status == NOT_SOLVED
