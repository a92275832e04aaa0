"""MoBA and NSA (chapter 21): blocked ≡ readable (outputs and gradients), limits that are known attentions,
choices made by hand, causality, bad inputs. No transformers reference exists for either."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from attnlib.attention.block_sparse import MoBAAttention, moba_attention, moba_attention_reference
from attnlib.attention.native_sparse import (
    BlockCompressor,
    NativeSparseAttention,
    nsa_attention,
    nsa_attention_reference,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}  # blocked vs readable, outputs and gradients (max abs)
NSA = dict(compress_block=8, compress_stride=4, select_block=8, top_n=3, window=6, initial_blocks=1, local_blocks=1)


def qkv(T=37, B=2, H=4, h=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, d, generator=g, dtype=dtype).requires_grad_() for n in (H, h, h)]


def causal_sdpa(q, k, v, mask=None):
    """SDPA with a bool mask (T, T) or causal; GQA by enable_gqa."""
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool).tril() if mask is None else mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def block_mask(T, block, chosen):
    """``(T, T)`` causal mask from ``chosen(t) -> set of blocks``, written one query at a time."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for s in range(t + 1):
            mask[t, s] = s // block in chosen(t)
    return mask


def grads(out, tensors, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    found = torch.autograd.grad((out * w).sum(), tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, found)]  # unused: zero


def assert_close(a, b, tol):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol:.3g}"


# ---------------------------------------------------------------- MoBA


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,chunk,topk,h", [(37, 8, 2, 2), (32, 4, 3, 4), (20, 5, 1, 1)])
def test_moba_blocked_equals_readable_outputs_and_gradients(dtype, T, chunk, topk, h):
    q, k, v = qkv(T, h=h, dtype=dtype)
    kw = dict(moba_chunk_size=chunk, moba_topk=topk)
    fast, ref = moba_attention(q, k, v, **kw), moba_attention_reference(q, k, v, **kw)
    assert_close(fast, ref, TOL[dtype])
    for a, b in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v))):
        assert_close(a, b, TOL[dtype])


@pytest.mark.parametrize("fn", [moba_attention, moba_attention_reference])
def test_moba_topk_covering_every_block_is_full_causal_attention(fn):
    q, k, v = qkv(29)
    for topk in (4, 5, 9):  # ceil(29 / 8) = 4 blocks
        assert_close(fn(q, k, v, moba_chunk_size=8, moba_topk=topk), causal_sdpa(q, k, v), 1e-12)


@pytest.mark.parametrize("fn", [moba_attention, moba_attention_reference])
def test_moba_top1_is_chunked_attention(fn):
    q, k, v = qkv(29)
    expected = causal_sdpa(q, k, v, block_mask(29, 8, lambda t: {t // 8}))  # Llama 4's chunks of 8
    assert_close(fn(q, k, v, moba_chunk_size=8, moba_topk=1), expected, 1e-12)


@pytest.mark.parametrize("fn", [moba_attention, moba_attention_reference])
def test_moba_gate_picks_the_block_whose_mean_key_matches_the_query(fn):
    T, d = 32, 8
    q, k, v = (x.detach() for x in qkv(T, H=1, h=1, d=d))
    u = torch.zeros(d, dtype=q.dtype)
    u[0] = 1.0
    k = 0.1 * k
    k[:, :, 8:16] += 5 * u  # block 1's mean key points along u
    q = 0.1 * q
    q[:, :, 24:] += 5 * u  # the queries of block 3 look for it
    expected = causal_sdpa(q, k, v, block_mask(T, 8, lambda t: {t // 8, 1} if t >= 24 else {t // 8, max(t // 8 - 1, 0)}))
    out = fn(q, k, v, moba_chunk_size=8, moba_topk=2)
    assert_close(out[:, :, 24:], expected[:, :, 24:], 1e-12)


def test_moba_layer_blocked_equals_readable_with_parameter_gradients():
    torch.manual_seed(0)
    fast = MoBAAttention(32, 4, 2, moba_chunk_size=4, moba_topk=2).double()
    ref = copy.deepcopy(fast)
    ref.blocked = False
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    a, b = fast(x), ref(x)
    assert_close(a, b, 1e-12)
    for ga, gb in zip(grads(a, list(fast.parameters())), grads(b, list(ref.parameters()))):
        assert_close(ga, gb, 1e-12)


# ---------------------------------------------------------------- NSA


def compressors(dtype, compress_block=8, seed=0):
    torch.manual_seed(seed)
    return BlockCompressor(compress_block, 8).to(dtype), BlockCompressor(compress_block, 8).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,sizes", [
    (37, NSA),
    (40, dict(NSA, compress_stride=8, select_block=16, top_n=2, initial_blocks=0, local_blocks=1, window=40)),
    (33, dict(NSA, compress_block=4, select_block=12, top_n=4, local_blocks=2)),
    (40, dict(NSA, compress_block=16, top_n=4)),  # compressed blocks longer than the selection blocks
    (6, NSA),  # shorter than a compressed block: the cmp branch is empty
])
def test_nsa_blocked_equals_readable_outputs_and_gradients(dtype, T, sizes):
    q, k, v = qkv(T, dtype=dtype)
    gates = torch.rand(2, 4, T, 3, dtype=dtype, generator=torch.Generator().manual_seed(2)).requires_grad_()
    ck, cv = compressors(dtype, sizes["compress_block"])
    fast = nsa_attention(q, k, v, gates, ck, cv, **sizes)
    ref = nsa_attention_reference(q, k, v, gates, ck, cv, **sizes)
    assert_close(fast, ref, TOL[dtype])
    inputs = [q, k, v, gates, *ck.parameters(), *cv.parameters()]
    for a, b in zip(grads(fast, inputs), grads(ref, inputs)):
        assert_close(a, b, TOL[dtype])


def pool(x):
    """φ = mean pooling over the block."""
    return x.mean(-2)


def one_branch(branch, T):
    gates = torch.zeros(2, 4, T, 3, dtype=torch.float64)
    gates[..., branch] = 1.0
    return gates


@pytest.mark.parametrize("fn", [nsa_attention, nsa_attention_reference])
@pytest.mark.parametrize("window", [1, 6, 50])
def test_nsa_window_branch_alone_is_sliding_window_attention(fn, window):
    q, k, v = qkv(37)
    t = torch.arange(37)
    mask = (t[:, None] >= t[None, :]) & (t[:, None] - t[None, :] < window)  # Mistral's window
    out = fn(q, k, v, one_branch(2, 37), *compressors(torch.float64), **dict(NSA, window=window))
    assert_close(out, causal_sdpa(q, k, v, mask), 1e-12)


@pytest.mark.parametrize("fn", [nsa_attention, nsa_attention_reference])
def test_nsa_selection_alone_all_blocks_is_full_and_own_block_is_chunked(fn):
    q, k, v = qkv(37)
    sizes = dict(NSA, top_n=5)  # ceil(37 / 8) = 5 blocks
    out = fn(q, k, v, one_branch(1, 37), *compressors(torch.float64), **sizes)
    assert_close(out, causal_sdpa(q, k, v), 1e-12)
    sizes = dict(NSA, top_n=1, initial_blocks=0, local_blocks=1)  # nothing left to choose: the own block
    out = fn(q, k, v, one_branch(1, 37), *compressors(torch.float64), **sizes)
    assert_close(out, causal_sdpa(q, k, v, block_mask(37, 8, lambda t: {t // 8})), 1e-12)


@pytest.mark.parametrize("fn", [nsa_attention, nsa_attention_reference])
def test_nsa_compressed_branch_by_hand_with_mean_pooling(fn):
    T, lc, stride = 30, 8, 4
    q, k, v = (x.detach() for x in qkv(T))
    out = fn(q, k, v, one_branch(0, T), pool, pool, **dict(NSA, compress_block=lc, compress_stride=stride))
    expected = torch.zeros_like(q)
    for t in range(T):
        blocks = [i for i in range((T - lc) // stride + 1) if i * stride + lc - 1 <= t]  # complete, in the past
        if not blocks:
            continue  # nothing compressed yet: the branch gives 0
        kc = torch.stack([k[:, :, i * stride:i * stride + lc].mean(2) for i in blocks], 2)  # (B, h, n, d)
        vc = torch.stack([v[:, :, i * stride:i * stride + lc].mean(2) for i in blocks], 2)
        w = (q[:, :, t:t + 1] @ kc.repeat_interleave(2, 1).transpose(-2, -1) / 8 ** 0.5).softmax(-1)
        expected[:, :, t:t + 1] = w @ vc.repeat_interleave(2, 1)
    assert_close(out, expected, 1e-12)


@pytest.mark.parametrize("fn", [nsa_attention, nsa_attention_reference])
def test_nsa_selects_the_block_the_compressed_scores_point_to(fn):
    T, d = 40, 8
    q, k, v = (x.detach() for x in qkv(T, H=2, h=1, d=d))
    u = torch.zeros(d, dtype=q.dtype)
    u[0] = 1.0
    k, q = 0.1 * k, 0.1 * q
    k[:, :, 16:24] += 5 * u  # block 2
    q[:, :, 32:, :] += 5 * u  # block 4's queries, in both heads of the group
    out = fn(q, k, v, one_branch(1, T)[:, :2], pool, pool, **NSA)  # 1 initial + 1 local + 1 chosen
    expected = causal_sdpa(q, k, v, block_mask(T, 8, lambda t: {0, t // 8, 2}))
    assert_close(out[:, :, 32:], expected[:, :, 32:], 1e-12)


def test_nsa_layer_blocked_equals_readable_with_parameter_gradients():
    torch.manual_seed(0)
    fast = NativeSparseAttention(32, 4, 2, blocked=True, **NSA).double()
    ref = copy.deepcopy(fast)
    ref.blocked = False
    x = torch.randn(2, 29, 32, dtype=torch.float64)
    a, b = fast(x), ref(x)
    assert_close(a, b, 1e-12)
    names = [n for n, _ in fast.named_parameters()]
    assert {"gate_proj.weight", "compress_k.pos", "compress_v.mlp.0.weight"} <= set(names)
    for name, ga, gb in zip(names, grads(a, list(fast.parameters())), grads(b, list(ref.parameters()))):
        assert ga.abs().max() > 0, name  # every parameter is used
        assert_close(ga, gb, 1e-12)


@pytest.mark.parametrize("make", [
    lambda blocked: NativeSparseAttention(32, 4, 2, blocked=blocked, **NSA),
    lambda blocked: MoBAAttention(32, 4, 1, moba_chunk_size=4, moba_topk=2, blocked=blocked),
])
@pytest.mark.parametrize("blocked", [True, False])
def test_future_tokens_do_not_change_past_outputs(make, blocked):
    torch.manual_seed(0)
    layer = make(blocked).double()
    x = torch.randn(2, 31, 32, dtype=torch.float64)
    y = x.clone()
    y[:, 17:] = torch.randn(2, 14, 32, dtype=torch.float64)
    a, b = layer(x), layer(y)
    assert_close(a[:, :17], b[:, :17], 1e-13)
    assert (a[:, 17:] - b[:, 17:]).abs().max() > 1e-3  # and the future ones do change


# ---------------------------------------------------------------- bad inputs


def test_bad_sizes_name_the_argument():
    q, k, v = qkv(16)
    with pytest.raises(ValueError, match="moba_topk=0 must be a positive integer"):
        moba_attention(q, k, v, moba_chunk_size=4, moba_topk=0)
    with pytest.raises(ValueError, match="moba_chunk_size=0"):
        MoBAAttention(32, 4, moba_chunk_size=0, moba_topk=2)
    gates, (ck, cv) = one_branch(2, 16), compressors(torch.float64)
    for bad, match in [(dict(top_n=0), "top_n=0"),
                       (dict(compress_stride=3), "compress_block=8 is not divisible by compress_stride=3"),
                       (dict(select_block=6), "select_block=6 is not divisible by compress_stride=4"),
                       (dict(top_n=2, local_blocks=2), "top_n=2 must be >= initial_blocks"),
                       (dict(window=0), "window=0")]:
        for fn in (nsa_attention, nsa_attention_reference):
            with pytest.raises(ValueError, match=match):
                fn(q, k, v, gates, ck, cv, **dict(NSA, **bad))
        with pytest.raises(ValueError, match=match):
            NativeSparseAttention(32, 4, **dict(NSA, **bad))
    with pytest.raises(ValueError, match="does not take"):
        NativeSparseAttention(32, 4, sliding_window=4, **NSA)


def test_bad_shapes_name_the_argument():
    q, k, v = qkv(16)
    gates, (ck, cv) = one_branch(2, 16), compressors(torch.float64)
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of k's n_kv_heads=3"):
        moba_attention(q, torch.randn(2, 3, 16, 8, dtype=q.dtype), torch.randn(2, 3, 16, 8, dtype=q.dtype),
                       moba_chunk_size=4, moba_topk=1)
    with pytest.raises(ValueError, match="T_q <= T_k"):  # queries are the last T_q of T_k positions
        nsa_attention(q, k[:, :, :5], v[:, :, :5], gates, ck, cv, **NSA)
    with pytest.raises(ValueError, match=r"gates must have shape \(B, n_heads, T_q, 3\)"):
        nsa_attention(q, k, v, gates[..., :2], ck, cv, **NSA)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., compress_block=4, head_dim=8\)"):
        nsa_attention(q, k, v, gates, BlockCompressor(4, 8).double(), cv, **NSA)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=32\)"):
        MoBAAttention(32, 4, moba_chunk_size=4, moba_topk=2)(torch.randn(2, 5, 31))
    with pytest.raises(TypeError, match="compress_k must be callable"):
        nsa_attention(q, k, v, gates, None, cv, **NSA)


@pytest.mark.parametrize("layer", [NativeSparseAttention(32, 4, **NSA), MoBAAttention(32, 4, moba_chunk_size=4, moba_topk=2)])
def test_layers_refuse_what_they_do_not_support(layer):
    x = torch.randn(1, 8, 32)
    with pytest.raises(ValueError, match=r"without masks or weights; got \['mask'\]"):
        layer(x, mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got \['context', 'return_weights'\]"):
        layer(x, x, return_weights=True)
    assert layer(x).shape == (1, 8, 32)
