"""The chapter 06 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlib.attention import MultiHeadAttention, causal_mask
from attnlib.book.exercises import (
    CORRECT,
    WRONG,
    ch06,  # noqa: F401  (registers the 06.x graders)
    grade,
)


# ---------------------------------------------------------------- 06.1
def repeat_kv(k, n_rep):
    B, n_kv_heads, T, head_dim = k.shape
    return k[:, :, None].expand(B, n_kv_heads, n_rep, T, head_dim).reshape(B, n_kv_heads * n_rep, T, head_dim)


def repeat_kv_tiled(k, n_rep):
    return k.repeat(1, n_rep, 1, 1)


def repeat_kv_library(k, n_rep):
    return k.repeat_interleave(n_rep, dim=1)


def repeat_kv_with_view(k, n_rep):  # .view cannot merge an expanded dimension: it raises
    B, n_kv_heads, T, head_dim = k.shape
    return k[:, :, None].expand(B, n_kv_heads, n_rep, T, head_dim).view(B, n_kv_heads * n_rep, T, head_dim)


# ---------------------------------------------------------------- 06.2
def _scores_mask(q, k):
    T_q, T_k = q.shape[-2], k.shape[-2]
    return causal_mask(T_q, T_k, device=q.device)


def gqa_attention(q, k, v):  # einsum with a letter for the group: nothing is broadcast by a matmul
    B, n_heads, T_q, head_dim = q.shape
    n_kv_heads = k.shape[1]
    q = q.reshape(B, n_kv_heads, n_heads // n_kv_heads, T_q, head_dim)
    scores = torch.einsum("bkgqd,bksd->bkgqs", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~_scores_mask(q, k), float("-inf"))
    y = torch.einsum("bkgqs,bksd->bkgqd", scores.softmax(dim=-1), v)
    return y.reshape(B, n_heads, T_q, head_dim)


def gqa_attention_folded(q, k, v):  # the group folded into the query rows: one plain batched matmul
    B, n_heads, T_q, head_dim = q.shape
    n_kv_heads, T_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    q = q.reshape(B, n_kv_heads, group * T_q, head_dim)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    scores = scores.view(B, n_kv_heads, group, T_q, T_k).masked_fill(~causal_mask(T_q, T_k), float("-inf"))
    y = scores.softmax(dim=-1).view(B, n_kv_heads, group * T_q, T_k) @ v
    return y.view(B, n_heads, T_q, head_dim)


def gqa_attention_broadcast_matmul(q, k, v):  # right values, but torch.matmul copies the broadcast k and v
    B, n_heads, T_q, head_dim = q.shape
    n_kv_heads = k.shape[1]
    q = q.reshape(B, n_kv_heads, n_heads // n_kv_heads, T_q, head_dim)
    scores = q @ k.unsqueeze(2).transpose(-2, -1) / math.sqrt(head_dim)
    scores = scores.masked_fill(~_scores_mask(q, k), float("-inf"))
    return (scores.softmax(dim=-1) @ v.unsqueeze(2)).reshape(B, n_heads, T_q, head_dim)


def gqa_attention_repeat(q, k, v):  # right values, but the shared heads are copied
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~_scores_mask(q, k), float("-inf")).softmax(-1) @ v


def gqa_attention_repeat_sdpa(q, k, v):  # copies, and calls PyTorch's fused attention
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_scores_mask(q, k))


def gqa_attention_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_scores_mask(q, k), enable_gqa=True)


def gqa_attention_wrong_groups(q, k, v):  # (B, group, n_kv_heads, ...): head i reads kv head i % n_kv_heads
    B, n_heads, T_q, head_dim = q.shape
    n_kv_heads = k.shape[1]
    q = q.reshape(B, n_heads // n_kv_heads, n_kv_heads, T_q, head_dim)
    scores = torch.einsum("bgkqd,bksd->bgkqs", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~_scores_mask(q, k), float("-inf"))
    return torch.einsum("bgkqs,bksd->bgkqd", scores.softmax(dim=-1), v).reshape(B, n_heads, T_q, head_dim)


def gqa_attention_top_left(q, k, v):
    B, n_heads, T_q, head_dim = q.shape
    n_kv_heads, T_k = k.shape[1], k.shape[2]
    q = q.reshape(B, n_kv_heads, n_heads // n_kv_heads, T_q, head_dim)
    scores = torch.einsum("bkgqd,bksd->bkgqs", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~torch.ones(T_q, T_k, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bkgqs,bksd->bkgqd", scores.softmax(dim=-1), v).reshape(B, n_heads, T_q, head_dim)


def gqa_attention_unscaled(q, k, v):
    B, n_heads, T_q, head_dim = q.shape
    n_kv_heads, T_k = k.shape[1], k.shape[2]
    q = q.reshape(B, n_kv_heads, n_heads // n_kv_heads, T_q, head_dim)
    scores = torch.einsum("bkgqd,bksd->bkgqs", q, k)  # no 1/sqrt(head_dim)
    scores = scores.masked_fill(~causal_mask(T_q, T_k), float("-inf"))
    return torch.einsum("bkgqs,bksd->bkgqd", scores.softmax(dim=-1), v).reshape(B, n_heads, T_q, head_dim)


# ---------------------------------------------------------------- 06.3
def _pool_with(mha, n_kv_heads, pool):
    """A MultiHeadAttention with n_kv_heads whose key/value rows are pool(rows of one projection)."""
    d = mha.d_model
    gqa = MultiHeadAttention(d, mha.n_heads, n_kv_heads)
    w, b = mha.qkv.weight.detach(), mha.qkv.bias.detach()
    with torch.no_grad():
        gqa.qkv.weight.copy_(torch.cat([w[:d], pool(w[d : 2 * d]), pool(w[2 * d :])]))
        gqa.qkv.bias.copy_(torch.cat([b[:d], pool(b[d : 2 * d]), pool(b[2 * d :])]))
        gqa.out_proj.load_state_dict(mha.out_proj.state_dict())
    return gqa


def _heads_of(mha, n_kv_heads):  # rows -> (n_kv_heads, group, head_dim, ...)
    group = mha.n_heads // n_kv_heads
    return lambda t: t.reshape(n_kv_heads, group, mha.head_dim, *t.shape[1:])


def pool_kv_heads(mha, n_kv_heads):
    heads = _heads_of(mha, n_kv_heads)
    return _pool_with(mha, n_kv_heads, lambda t: heads(t).mean(1).reshape(-1, *t.shape[1:]))


def pool_kv_heads_first(mha, n_kv_heads):  # keeps head j*g of each group
    heads = _heads_of(mha, n_kv_heads)
    return _pool_with(mha, n_kv_heads, lambda t: heads(t)[:, 0].reshape(-1, *t.shape[1:]))


def pool_kv_heads_sum(mha, n_kv_heads):
    heads = _heads_of(mha, n_kv_heads)
    return _pool_with(mha, n_kv_heads, lambda t: heads(t).sum(1).reshape(-1, *t.shape[1:]))


def pool_kv_heads_tiled(mha, n_kv_heads):  # groups j, j + n_kv, ...: the i % n_kv reading
    group = mha.n_heads // n_kv_heads

    def pool(t):
        tiled = t.reshape(group, n_kv_heads, mha.head_dim, *t.shape[1:])
        return tiled.mean(0).reshape(-1, *t.shape[1:])

    return _pool_with(mha, n_kv_heads, pool)


def pool_kv_heads_rows(mha, n_kv_heads):  # neighbouring rows averaged, not whole heads
    group = mha.n_heads // n_kv_heads
    return _pool_with(
        mha, n_kv_heads, lambda t: t.reshape(-1, group, *t.shape[1:]).mean(1)
    )


def pool_kv_heads_weights_only(mha, n_kv_heads):  # pools the weights, keeps the first biases
    gqa = pool_kv_heads(mha, n_kv_heads)
    d, kv = mha.d_model, n_kv_heads * mha.head_dim
    b = mha.qkv.bias.detach()
    with torch.no_grad():
        gqa.qkv.bias[d:].copy_(torch.cat([b[d : d + kv], b[2 * d : 2 * d + kv]]))
    return gqa


def pool_kv_heads_in_place(mha, n_kv_heads):  # right layer, but scribbles on the input
    gqa = pool_kv_heads(mha, n_kv_heads)
    with torch.no_grad():
        mha.qkv.weight.zero_()
    return gqa


def pool_kv_heads_queries_too(mha, n_kv_heads):  # also averages the query heads of a group
    gqa = pool_kv_heads(mha, n_kv_heads)
    d, group = mha.d_model, mha.n_heads // n_kv_heads
    w = mha.qkv.weight.detach()[:d].reshape(n_kv_heads, group, mha.head_dim, d)
    with torch.no_grad():
        gqa.qkv.weight[:d].copy_(w.mean(1, keepdim=True).expand_as(w).reshape(d, d))
    return gqa


def pool_kv_heads_fresh_out_proj(mha, n_kv_heads):  # forgets to copy the output projection
    gqa = pool_kv_heads(mha, n_kv_heads)
    gqa.out_proj.reset_parameters()
    return gqa


REFERENCE = [("06.1", repeat_kv), ("06.2", gqa_attention), ("06.3", pool_kv_heads)]


@pytest.mark.parametrize(
    "exercise_id, answer", REFERENCE + [("06.2", gqa_attention_folded)]
)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("06.1", repeat_kv_tiled, "i % n_kv_heads"),
        ("06.1", repeat_kv_library, "calls repeat_interleave"),
        ("06.1", repeat_kv_with_view, "RuntimeError"),
        ("06.2", gqa_attention_broadcast_matmul, "torch.matmul when it broadcasts"),
        ("06.2", gqa_attention_repeat, "allocated"),
        ("06.2", gqa_attention_repeat_sdpa, "calls F.scaled_dot_product_attention"),
        ("06.2", gqa_attention_sdpa, "calls F.scaled_dot_product_attention"),
        ("06.2", gqa_attention_wrong_groups, "i // group_size"),
        ("06.2", gqa_attention_top_left, "top-left"),
        ("06.2", gqa_attention_unscaled, "not scaled"),
        ("06.3", pool_kv_heads_first, "kept one head of each group"),
        ("06.3", pool_kv_heads_sum, "summed the heads"),
        ("06.3", pool_kv_heads_tiled, "i % n_kv_heads reading"),
        ("06.3", pool_kv_heads_rows, "averaged neighbouring rows"),
        ("06.3", pool_kv_heads_weights_only, "pool it the same way"),
        ("06.3", pool_kv_heads_in_place, "changed the multi-head layer"),
        ("06.3", pool_kv_heads_queries_too, "query rows of qkv changed"),
        ("06.3", pool_kv_heads_fresh_out_proj, "copy out_proj unchanged"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)




@pytest.mark.parametrize("exercise_id", ["06.1", "06.2", "06.3"])
def test_stub_is_not_solved(exercise_id):
    def stub(*args):
        raise NotImplementedError("not yet")

    assert grade(exercise_id, stub).status == "not solved yet"
