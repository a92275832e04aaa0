"""The chapter 04 exercise checks, table-driven (tests/exercise_table.py): each ANSWERS entry lists answers the
check must accept and plausible mistakes it must refuse with a hint that names them."""
import math

import torch
import torch.nn.functional as F
from exercise_table import Answers

from attnlib import MultiHeadAttentionWrapper


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


def split_by_slicing(mha):  # another way: slice the rows of each block, no view
    d, e = mha.d_model, mha.head_dim
    wrapper = MultiHeadAttentionWrapper(d, e, mha.block_size, mha.n_heads, bias=mha.qkv.bias is not None)
    with torch.no_grad():
        for r, head in enumerate(wrapper.heads):
            for block, linear in enumerate((head.W_query, head.W_key, head.W_value)):
                rows = slice(block * d + r * e, block * d + (r + 1) * e)
                linear.weight.copy_(mha.qkv.weight[rows])
                if linear.bias is not None:
                    linear.bias.copy_(mha.qkv.bias[rows])
    return wrapper


def split_swapped_q_k(mha):  # takes the key block for the queries and the query block for the keys
    wrapper = _split(mha)
    for head in wrapper.heads:
        head.W_query, head.W_key = head.W_key, head.W_query
    return wrapper


def split_in_place(mha):  # right heads, but "normalises" mha's query weights in place afterwards
    wrapper = _split(mha)
    with torch.no_grad():
        mha.qkv.weight[: mha.d_model].div_(mha.qkv.weight[: mha.d_model].norm())
    return wrapper


def split_as_module_list(mha):
    return torch.nn.ModuleList(_split(mha).heads)


def split_three_heads_only(mha):  # learned from the first case: 3 heads of 4
    d = mha.d_model
    wrapper = MultiHeadAttentionWrapper(d, d // 3, mha.block_size, 3, bias=mha.qkv.bias is not None)
    return wrapper if mha.n_heads != 3 or d % 3 else _split(mha)


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


def mha_einsum_separate_blocks(x, w_qkv, b_qkv, w_out, b_out, n_heads):  # another way: one einsum per block
    B, T, d = x.shape
    e = d // n_heads
    q, k, v = (torch.einsum("btd,hed->bhte", x, w_qkv[i * d : (i + 1) * d].reshape(n_heads, e, d))
               for i in range(3))
    if b_qkv is not None:
        q, k, v = (t + b_qkv[i * d : (i + 1) * d].reshape(1, n_heads, 1, e) for i, t in enumerate((q, k, v)))
    scores = torch.einsum("bhqe,bhke->bhqk", q, k) * e**-0.5
    scores = scores + torch.full((T, T), float("-inf")).triu(1)
    y = torch.einsum("bhqk,bhke->bhqe", torch.softmax(scores, -1), v)
    out = torch.einsum("bhte,ohe->bto", y, w_out.reshape(d, n_heads, e))
    return out if b_out is None else out + b_out


def mha_einsum_split_activations(x, w_qkv, b_qkv, w_out, b_out, n_heads):  # splits x's projections into heads
    B, T, d = x.shape
    e = d // n_heads
    qkv = torch.einsum("btd,od->bto", x, w_qkv)
    if b_qkv is not None:
        qkv = qkv + b_qkv
    q, k, v = (t.view(B, T, n_heads, e).transpose(1, 2) for t in qkv.split(d, dim=-1))
    scores = torch.einsum("bhqe,bhke->bhqk", q, k) / math.sqrt(e)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = torch.einsum("bhqk,bhke->bhqe", scores.softmax(-1), v)
    out = torch.einsum("bhte,ohe->bto", y, w_out.view(d, n_heads, e))
    return out if b_out is None else out + b_out


def mha_einsum_sdpa_alias(x, w_qkv, b_qkv, w_out, b_out, n_heads):  # attnlib's attention under another name
    from attnlib.attention.functions import attention as attend

    B, T, d = x.shape
    e = d // n_heads
    qkv = torch.einsum("btd,shed->sbhte", x, w_qkv.view(3, n_heads, e, d))
    if b_qkv is not None:
        qkv = qkv + b_qkv.view(3, 1, n_heads, 1, e)
    y, _ = attend(*qkv, is_causal=True)
    out = torch.einsum("bhte,ohe->bto", y, w_out.view(d, n_heads, e))
    return out if b_out is None else out + b_out


def mha_einsum_aten_sdpa(x, w_qkv, b_qkv, w_out, b_out, n_heads):  # the fused kernel through torch.ops.aten
    B, T, d = x.shape
    e = d // n_heads
    qkv = torch.einsum("btd,shed->sbhte", x, w_qkv.view(3, n_heads, e, d))
    if b_qkv is not None:
        qkv = qkv + b_qkv.view(3, 1, n_heads, 1, e)
    y = torch.ops.aten.scaled_dot_product_attention(*qkv, is_causal=True)
    out = torch.einsum("bhte,ohe->bto", y, w_out.view(d, n_heads, e))
    return out if b_out is None else out + b_out


def mha_einsum_linear_out(x, w_qkv, b_qkv, w_out, b_out, n_heads):  # the output projection with F.linear
    B, T, d = x.shape
    e = d // n_heads
    w_eye = torch.eye(d).view(d, n_heads, e)
    y = _einsum(x, w_qkv, b_qkv, w_eye, None, n_heads)  # the concatenated heads, through an identity W^O
    return F.linear(y, w_out, b_out)


def mha_einsum_no_out_bias(x, w_qkv, b_qkv, w_out, b_out, n_heads):
    return _einsum(x, w_qkv, b_qkv, w_out, None, n_heads)


def mha_einsum_memorised(x, w_qkv, b_qkv, w_out, b_out, n_heads):  # right only for the 3-head cases
    return _einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads if n_heads == 3 else 1)


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


def without_heads_subtract(mha, x, keep):  # another way: mha(x) minus what the dropped heads add through W^O
    heads = _heads(mha, x)  # (B, n_heads, T, head_dim)
    w = mha.out_proj.weight.view(mha.d_model, mha.n_heads, mha.head_dim)  # (out, head, feature)
    dropped = torch.einsum("bhte,ohe->btho", heads, w)[:, :, ~keep].sum(2)  # (B, T, d_model)
    return mha(x) - dropped


def without_heads_memorised(mha, x, keep):  # learned that the first head is the one to drop
    keep = torch.ones_like(keep)
    keep[0] = False
    return mha_without_heads(mha, x, keep)


ANSWERS = {
    "04.1": Answers(
        correct=[split_into_heads, split_by_slicing],
        wrong=[
            (split_interleaved, "wrong output"),
            (split_without_biases, "bias"),
            (split_reversed, "keep the heads in order"),
            (split_swapped_q_k, "wrong output"),
            (split_in_place, "in place"),
            (split_as_module_list, "MultiHeadAttentionWrapper"),
            (split_three_heads_only, "heads, expected n_heads"),
        ],
    ),
    "04.2": Answers(
        correct=[mha_einsum, mha_einsum_separate_blocks],
        wrong=[
            (mha_einsum_d_model_scale, "1/sqrt(head_dim)"),
            (mha_einsum_no_mask, "mask the scores"),
            (mha_matmul_only, "attnlib.attention.multi_head.MultiHeadAttention"),
            (mha_einsum_scores_by_matmul, "einsum only"),
            (mha_einsum_w_out_transposed, "nn.Linear's layout"),
            (mha_einsum_split_activations, "reshape the weights, not the activations"),
            (mha_einsum_sdpa_alias, "attnlib.attention.functions.attention"),
            (mha_einsum_aten_sdpa, "scaled_dot_product"),
            (mha_einsum_linear_out, "called linear"),
            (mha_einsum_no_out_bias, "b_out is missing"),
            (mha_einsum_memorised, "your output"),
        ],
    ),
    "04.3": Answers(
        correct=[mha_without_heads, without_heads_subtract],
        wrong=[
            (without_heads_inverted, "True means keep"),
            (without_heads_output_features, "zeroed features of the output"),
            (without_heads_zero_queries, "zero queries still attends"),
            (without_heads_no_bias, "bias belongs to no head"),
            (without_heads_rescaled, "do not rescale"),
            (without_heads_in_place, "in place"),
            (without_heads_all_on, "every head on"),
            (without_heads_memorised, "your output"),
        ],
    ),
}
