"""The chapter 06 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlib.book.exercises import (
    CORRECT,
    WRONG,
    ch06,  # noqa: F401  (registers the 06.x graders)
    grade,
)
from attnlib.functional import causal_mask


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


def gqa_attention_repeat(q, k, v):
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


# ---------------------------------------------------------------- 06.3
def _kv_heads(config):  # GPTConfig keeps n_kv_heads as given: None when not given
    return {"mha": config.n_heads, "gqa": config.n_kv_heads or config.n_heads, "mqa": 1}[config.attention]


def kv_cache_bytes(config, n_tokens, dtype):
    return 2 * _kv_heads(config) * config.head_dim * dtype.itemsize * config.n_layers * n_tokens


def kv_cache_bytes_no_two(config, n_tokens, dtype):
    return kv_cache_bytes(config, n_tokens, dtype) // 2


def kv_cache_bytes_one_layer(config, n_tokens, dtype):
    return kv_cache_bytes(config, n_tokens, dtype) // config.n_layers


def kv_cache_bytes_config_heads(config, n_tokens, dtype):  # trusts config.n_kv_heads, None when not given
    return 2 * config.n_kv_heads * config.head_dim * dtype.itemsize * config.n_layers * n_tokens


def kv_cache_bytes_or_n_heads(config, n_tokens, dtype):  # n_kv_heads or n_heads for every variant: wrong for "mqa"
    return 2 * (config.n_kv_heads or config.n_heads) * config.head_dim * dtype.itemsize * config.n_layers * n_tokens


def kv_cache_bytes_gqa_no_default(config, n_tokens, dtype):  # a "gqa" config without n_kv_heads holds None
    n_kv_heads = {"mha": config.n_heads, "gqa": config.n_kv_heads, "mqa": 1}[config.attention]
    return 2 * n_kv_heads * config.head_dim * dtype.itemsize * config.n_layers * n_tokens


def kv_cache_bytes_float(config, n_tokens, dtype):
    return float(kv_cache_bytes(config, n_tokens, dtype))


def kv_cache_bytes_bits(config, n_tokens, dtype):
    bits = torch.finfo(dtype).bits
    return 2 * _kv_heads(config) * config.head_dim * bits * config.n_layers * n_tokens


def kv_cache_bytes_library(config, n_tokens, dtype):  # the config's own property: also right
    return 2 * config.kv_heads * config.head_dim * dtype.itemsize * config.n_layers * n_tokens


REFERENCE = [("06.1", repeat_kv), ("06.2", gqa_attention), ("06.3", kv_cache_bytes)]


@pytest.mark.parametrize(
    "exercise_id, answer", REFERENCE + [("06.2", gqa_attention_folded), ("06.3", kv_cache_bytes_library)]
)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("06.1", repeat_kv_tiled, "i % n_kv_heads"),
        ("06.1", repeat_kv_library, "without repeat_interleave"),
        ("06.1", repeat_kv_with_view, "RuntimeError"),
        ("06.2", gqa_attention_broadcast_matmul, "torch.matmul when it broadcasts"),
        ("06.2", gqa_attention_repeat, "allocated"),
        ("06.2", gqa_attention_sdpa, "write the attention yourself"),
        ("06.2", gqa_attention_wrong_groups, "i // group_size"),
        ("06.2", gqa_attention_top_left, "top-left"),
        ("06.3", kv_cache_bytes_no_two, "a factor 2"),
        ("06.3", kv_cache_bytes_one_layer, "n_layers"),
        ("06.3", kv_cache_bytes_config_heads, "n_kv_heads was not given; multi-head attention has one kv head per"),
        ("06.3", kv_cache_bytes_or_n_heads, "you used n_heads; here the layers have 1: multi-query attention"),
        ("06.3", kv_cache_bytes_gqa_no_default, 'a "gqa" config without n_kv_heads'),
        ("06.3", kv_cache_bytes_float, "Python int"),
        ("06.3", kv_cache_bytes_bits, "bits"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


