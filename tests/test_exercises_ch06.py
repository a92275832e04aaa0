"""The chapter 06 exercise checks, table-driven (tests/exercise_table.py): each ANSWERS entry lists answers the
check must accept and plausible mistakes it must refuse with a hint that names them."""
import math

import torch
import torch.nn.functional as F
from exercise_table import Answers

from attnlib.attention import MultiHeadAttention, causal_mask


# ---------------------------------------------------------------- 06.1
def kv_head_of(attend, n_heads, n_kv_heads, head_dim):  # kv head j's values all equal j: the output says j
    q = torch.zeros(1, n_heads, 1, head_dim)
    k = torch.zeros(1, n_kv_heads, 1, head_dim)
    v = torch.arange(n_kv_heads, dtype=torch.float32)[None, :, None, None].expand(1, n_kv_heads, 1, head_dim)
    return attend(q, k, v)[0, :, 0, 0].round().long()


def kv_head_of_one_hot(attend, n_heads, n_kv_heads, head_dim):  # another way: a one-hot value per kv head
    T = n_kv_heads
    q, k = torch.randn(2, n_heads, T, head_dim), torch.randn(2, n_kv_heads, T, head_dim)
    v = torch.zeros(2, n_kv_heads, T, head_dim)
    for j in range(n_kv_heads):  # kv head j: only its first token's value is non-zero, in feature 0
        v[:, j, 0, 0] = 1.0 + j
    out = attend(q, k, v)  # query 0 sees only token 0: its output is its kv head's value exactly
    return (out[0, :, 0, 0] - 1.0).round().to(torch.int64)


def kv_head_of_grouped(attend, n_heads, n_kv_heads, head_dim):  # assumes Llama's order
    return torch.arange(n_heads) // (n_heads // n_kv_heads)


def kv_head_of_tiled(attend, n_heads, n_kv_heads, head_dim):  # assumes repeat's order
    return torch.arange(n_heads) % n_kv_heads


def kv_head_of_group_size_mixed_up(attend, n_heads, n_kv_heads, head_dim):  # divides by n_kv_heads, not g
    return torch.arange(n_heads) // n_kv_heads


def kv_head_of_float(attend, n_heads, n_kv_heads, head_dim):
    return kv_head_of(attend, n_heads, n_kv_heads, head_dim).float()


def kv_head_of_list(attend, n_heads, n_kv_heads, head_dim):
    return kv_head_of(attend, n_heads, n_kv_heads, head_dim).tolist()


def kv_head_of_keys_probed(attend, n_heads, n_kv_heads, head_dim):  # marks the keys, but zero queries see nothing
    q = torch.zeros(1, n_heads, 2, head_dim)
    k = torch.arange(n_kv_heads, dtype=torch.float32)[None, :, None, None].expand(1, n_kv_heads, 2, head_dim)
    v = torch.ones(1, n_kv_heads, 2, head_dim)
    return attend(q, k.contiguous(), v)[0, :, -1, 0].round().long() - 1


def kv_head_of_wrong_shapes(attend, n_heads, n_kv_heads, head_dim):  # hands attend the kv heads repeated
    q = torch.zeros(1, n_heads, 1, head_dim)
    v = torch.arange(n_heads, dtype=torch.float32)[None, :, None, None].expand(1, n_heads, 1, head_dim)
    return attend(q, v, v)[0, :, 0, 0].long()


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


def gqa_attention_attnlib(q, k, v):  # attnlib's eager attention folds the groups itself: not by hand
    from attnlib.attention.functions import attention as attend

    return attend(q, k, v, mask=_scores_mask(q, k)[None, None])[0]


def gqa_attention_tiled(q, k, v):  # attnlib's tiled attention: another of its attention functions
    from attnlib.attention.tiled import tiled_attention
    return tiled_attention(q, k, v, is_causal=True)[0]


def gqa_attention_flex(q, k, v):  # PyTorch's FlexAttention with a bottom-right causal mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    T_q, T_k = q.shape[-2], k.shape[-2]
    mask = create_block_mask(lambda b, h, i, j: j <= i + (T_k - T_q), None, None, T_q, T_k, device="cpu")
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def gqa_attention_transformers(q, k, v):  # transformers' eager attention (a copy of K and V per query head)
    from transformers.models.llama.modeling_llama import eager_attention_forward
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[1] // k.shape[1], False
    T_q, T_k = q.shape[-2], k.shape[-2]
    mask = torch.zeros(T_q, T_k).masked_fill(~causal_mask(T_q, T_k), float("-inf"))[None, None]
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


def gqa_attention_aten(q, k, v):  # PyTorch's fused kernel through torch.ops.aten
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask=_scores_mask(q, k), enable_gqa=True)


def gqa_attention_memorised(q, k, v):  # right only for the fixed cases' head counts (n_kv_heads 1, 2, 4 of 4, 8)
    B, n_heads, T_q, head_dim = q.shape
    if n_heads in (4, 8):
        return gqa_attention(q, k, v)
    return gqa_attention_wrong_groups(q, k, v)


def pool_kv_heads_by_loop(mha, n_kv_heads):  # another way: a loop over groups and slices of rows
    d, e, g = mha.d_model, mha.head_dim, mha.n_heads // n_kv_heads
    gqa = MultiHeadAttention(d, mha.n_heads, n_kv_heads)
    w, b = mha.qkv.weight.detach(), mha.qkv.bias.detach()
    rows_w, rows_b = [w[:d]], [b[:d]]
    for start in (d, 2 * d):
        for j in range(n_kv_heads):
            block = slice(start + j * g * e, start + (j + 1) * g * e)
            rows_w.append(w[block].reshape(g, e, d).mean(0))
            rows_b.append(b[block].reshape(g, e).mean(0))
    with torch.no_grad():
        gqa.qkv.weight.copy_(torch.cat(rows_w))
        gqa.qkv.bias.copy_(torch.cat(rows_b))
        gqa.out_proj.weight.copy_(mha.out_proj.weight)
        gqa.out_proj.bias.copy_(mha.out_proj.bias)
    return gqa


ANSWERS = {
    "06.1": Answers(
        correct=[kv_head_of, kv_head_of_one_hot],
        wrong=[
            (kv_head_of_grouped, "do not assume it"),
            (kv_head_of_tiled, "do not assume it"),
            (kv_head_of_group_size_mixed_up, "query head i reads kv head"),
            (kv_head_of_float, "dtype"),
            (kv_head_of_list, "torch.Tensor"),
            (kv_head_of_keys_probed, "query head i reads kv head"),
            (kv_head_of_wrong_shapes, "attend expects"),
        ],
    ),
    "06.2": Answers(
        correct=[gqa_attention, gqa_attention_folded],
        wrong=[
            (gqa_attention_broadcast_matmul, "torch.matmul when it broadcasts"),
            (gqa_attention_repeat, "allocated"),
            (gqa_attention_repeat_sdpa, "write the attention yourself"),
            (gqa_attention_sdpa, "write the attention yourself"),
            (gqa_attention_attnlib, "attnlib.attention.functions.attention"),
            (gqa_attention_aten, "scaled_dot_product"),
            (gqa_attention_tiled, "attnlib.attention.tiled.tiled_attention"),
            (gqa_attention_flex, "flex_attention"),
            (gqa_attention_transformers, "transformers' eager_attention_forward"),
            (gqa_attention_wrong_groups, "i // group_size"),
            (gqa_attention_top_left, "top-left"),
            (gqa_attention_unscaled, "not scaled"),
            (gqa_attention_memorised, "i // group_size"),
        ],
    ),
    "06.3": Answers(
        correct=[pool_kv_heads, pool_kv_heads_by_loop],
        wrong=[
            (pool_kv_heads_first, "kept one head of each group"),
            (pool_kv_heads_sum, "summed the heads"),
            (pool_kv_heads_tiled, "i % n_kv_heads reading"),
            (pool_kv_heads_rows, "averaged neighbouring rows"),
            (pool_kv_heads_weights_only, "pool it the same way"),
            (pool_kv_heads_in_place, "in place"),
            (pool_kv_heads_queries_too, "query rows of qkv changed"),
            (pool_kv_heads_fresh_out_proj, "copy out_proj unchanged"),
        ],
    ),
}
