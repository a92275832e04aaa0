"""The chapter 04 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch

from attnlib import MultiHeadAttentionWrapper
from attnlib.book.exercises import CORRECT, WRONG, grade


# ---------------------------------------------------------------- 04.1
def _split(mha, interleaved=False, keep_bias=True):
    d_model, n_heads, head_dim = mha.d_model, mha.n_heads, mha.head_dim
    bias = mha.qkv.bias is not None and keep_bias
    wrapper = MultiHeadAttentionWrapper(d_model, head_dim, mha.block_size, n_heads, bias=bias)
    if interleaved:  # the per-head [q_h; k_h; v_h] layout some codebases use: not attnlib's
        w = mha.qkv.weight.detach().view(n_heads, 3, head_dim, d_model).transpose(0, 1)
        b = None if mha.qkv.bias is None else mha.qkv.bias.detach().view(n_heads, 3, head_dim).transpose(0, 1)
    else:
        w = mha.qkv.weight.detach().view(3, n_heads, head_dim, d_model)  # rows [W_q; W_k; W_v], each n_heads blocks
        b = None if mha.qkv.bias is None else mha.qkv.bias.detach().view(3, n_heads, head_dim)
    with torch.no_grad():
        for i, head in enumerate(wrapper.heads):
            for j, linear in enumerate((head.W_query, head.W_key, head.W_value)):
                linear.weight.copy_(w[j, i])
                if bias:
                    linear.bias.copy_(b[j, i])
    return wrapper


def split_into_heads(mha):
    return _split(mha)


def split_interleaved(mha):
    return _split(mha, interleaved=True)


def split_without_biases(mha):
    return _split(mha, keep_bias=False)


def split_reversed(mha):
    wrapper = _split(mha)
    wrapper.heads = torch.nn.ModuleList(reversed(list(wrapper.heads)))
    return wrapper


# ---------------------------------------------------------------- 04.2
def _einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads, scale_by_d_model=False, causal=True):
    B, T, d_model = x.shape
    head_dim = d_model // n_heads
    w = w_qkv.view(3, n_heads, head_dim, d_model)
    qkv = torch.einsum("btd,shed->sbhte", x, w)  # (3, B, n_heads, T, head_dim)
    if b_qkv is not None:
        qkv = qkv + b_qkv.view(3, 1, n_heads, 1, head_dim)
    q, k, v = qkv
    scores = torch.einsum("bhqe,bhke->bhqk", q, k) / math.sqrt(d_model if scale_by_d_model else head_dim)
    if causal:
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = torch.einsum("bhqk,bhke->bhqe", scores.softmax(dim=-1), v)
    out = torch.einsum("bhte,dhe->btd", y, w_out.view(d_model, n_heads, head_dim))
    return out if b_out is None else out + b_out


def mha_einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads):
    return _einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads)


def mha_einsum_d_model_scale(x, w_qkv, b_qkv, w_out, b_out, n_heads):
    return _einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads, scale_by_d_model=True)


def mha_einsum_no_mask(x, w_qkv, b_qkv, w_out, b_out, n_heads):
    return _einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads, causal=False)


def mha_matmul_only(x, w_qkv, b_qkv, w_out, b_out, n_heads):
    import attnlib

    B, T, d_model = x.shape
    mha = attnlib.MultiHeadAttention(d_model, n_heads, bias=b_qkv is not None)
    with torch.no_grad():
        mha.qkv.weight.copy_(w_qkv)
        mha.out_proj.weight.copy_(w_out)
        if b_qkv is not None:
            mha.qkv.bias.copy_(b_qkv)
            mha.out_proj.bias.copy_(b_out)
    return mha(x)


def mha_einsum_scores_by_matmul(x, w_qkv, b_qkv, w_out, b_out, n_heads):
    B, T, d_model = x.shape
    head_dim = d_model // n_heads
    qkv = torch.einsum("btd,shed->sbhte", x, w_qkv.view(3, n_heads, head_dim, d_model))
    if b_qkv is not None:
        qkv = qkv + b_qkv.view(3, 1, n_heads, 1, head_dim)
    q, k, v = qkv
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)  # a matmul, not einsum
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = torch.einsum("bhqk,bhke->bhqe", scores.softmax(dim=-1), v)
    out = torch.einsum("bhte,dhe->btd", y, w_out.view(d_model, n_heads, head_dim))
    return out if b_out is None else out + b_out


def mha_einsum_w_out_transposed(x, w_qkv, b_qkv, w_out, b_out, n_heads):
    return _einsum(x, w_qkv, b_qkv, w_out.T.contiguous(), b_out, n_heads)


# ---------------------------------------------------------------- 04.3
def _heads(mha, x):
    q, k, v = (mha.split_heads(t, mha.n_heads) for t in mha.qkv(x).split(mha.d_model, dim=-1))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _merge(mha, heads):
    B, n_heads, T, head_dim = heads.shape
    return heads.transpose(1, 2).reshape(B, T, n_heads * head_dim)


def mha_without_heads(mha, x, keep):
    heads = _heads(mha, x) * keep[None, :, None, None]  # silence the dropped heads
    return mha.out_proj(_merge(mha, heads))


def without_heads_inverted(mha, x, keep):
    return mha_without_heads(mha, x, ~keep)


def without_heads_output_features(mha, x, keep):
    return mha(x) * keep.repeat_interleave(mha.head_dim)


def without_heads_zero_queries(mha, x, keep):
    q, k, v = (mha.split_heads(t, mha.n_heads) for t in mha.qkv(x).split(mha.d_model, dim=-1))
    q = q * keep[None, :, None, None]
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return mha.out_proj(_merge(mha, y))


def without_heads_no_bias(mha, x, keep):
    heads = _heads(mha, x) * keep[None, :, None, None]
    return _merge(mha, heads) @ mha.out_proj.weight.T


def without_heads_rescaled(mha, x, keep):
    scale = mha.n_heads / max(int(keep.sum()), 1)
    heads = _heads(mha, x) * keep[None, :, None, None] * scale
    return mha.out_proj(_merge(mha, heads))


def without_heads_in_place(mha, x, keep):
    with torch.no_grad():  # zero W^O's columns that read the dropped heads, in mha itself
        mha.out_proj.weight.mul_(keep.repeat_interleave(mha.head_dim))
    return mha(x)


def without_heads_all_on(mha, x, keep):
    return mha(x)


@pytest.mark.parametrize(
    "exercise_id, answer",
    [("04.1", split_into_heads), ("04.2", mha_einsum), ("04.3", mha_without_heads)],
)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("04.1", split_interleaved, "wrong output"),
        ("04.1", split_without_biases, "bias"),
        ("04.1", split_reversed, "keep the heads in order"),
        ("04.2", mha_einsum_d_model_scale, "1/sqrt(head_dim)"),
        ("04.2", mha_einsum_no_mask, "mask"),
        ("04.2", mha_matmul_only, "einsum"),
        ("04.2", mha_matmul_only, "attnlib.MultiHeadAttention"),
        ("04.2", mha_einsum_scores_by_matmul, "not with @"),
        ("04.2", mha_einsum_w_out_transposed, "your output"),
        ("04.3", without_heads_inverted, "True means keep"),
        ("04.3", without_heads_output_features, "zeroed features of the output"),
        ("04.3", without_heads_zero_queries, "zero queries still attends"),
        ("04.3", without_heads_no_bias, "bias belongs to no head"),
        ("04.3", without_heads_rescaled, "do not rescale"),
        ("04.3", without_heads_in_place, "changed mha's weights"),
        ("04.3", without_heads_all_on, "every head on"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


