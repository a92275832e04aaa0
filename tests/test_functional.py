"""attnlib.attention's functions and their registry: eager, SDPA, tiled and flash attention against torch's SDPA,
masks, score_mod.

The reference everywhere is ``torch.nn.functional.scaled_dot_product_attention`` on K/V heads
copied per query head (``repeat_interleave``), with masks built here by hand; rows with
nothing to attend to are expected to be zeros (SDPA would give NaN for them, so the
reference unmasks them and zeroes their output). Bad inputs are in test_bad_inputs.py.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.attention import (
    ATTENTION_FUNCTIONS,
    attention,
    causal_mask,
    flash_attention,
    get_attention_function,
    mask_from_mod,
    masked_softmax,
    padding_mask,
    sdpa_attention,
    tiled_attention,
)

ATOL = 1e-5
FUNCTIONS = {  # small tiles, so that every test crosses several of them
    "eager": attention,
    "sdpa": sdpa_attention,
    "tiled": lambda *a, **kw: tiled_attention(*a, tile_size=3, **kw),
    "flash": lambda *a, **kw: flash_attention(*a, tile_size=3, **kw),
}


def reference(q, k, v, mask=None, is_causal=False, scale=None):
    """torch SDPA with each K/V head repeated for its query heads; empty rows give zeros."""
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    T_q, T_k = q.shape[-2], k.shape[-2]
    full = None if mask is None else mask.expand(*q.shape[:-1], T_k)
    if is_causal:
        below = torch.ones(T_q, T_k, dtype=torch.bool).tril(diagonal=T_k - T_q)  # query i at position T_k - T_q + i
        full = below if full is None else full & below
    if full is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    empty = ~full.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=full | empty, scale=scale)
    return out.masked_fill(empty, 0.0)


def make_mask(kind, g, B, H, T_q, T_k):
    if kind == "none":
        return None
    if kind == "padding":  # (B, 1, 1, T_k), some sequences possibly without any key
        lengths = torch.randint(0, T_k + 1, (B,), generator=g)
        return (torch.arange(T_k)[None, :] < lengths[:, None])[:, None, None, :]
    if kind == "per_head":  # (B, H, T_q, T_k), some rows fully masked
        return torch.rand(B, H, T_q, T_k, generator=g) < 0.5
    if kind == "broadcast_query":  # (1, 1, T_q, T_k)
        return torch.rand(1, 1, T_q, T_k, generator=g) < 0.7
    raise ValueError(kind)


@settings(max_examples=80, deadline=None)
@given(
    B=st.integers(1, 3),
    n_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    T_q=st.integers(1, 9),
    extra_keys=st.integers(0, 6),
    head_dim=st.integers(1, 16),
    mask_kind=st.sampled_from(["none", "padding", "per_head", "broadcast_query"]),
    is_causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    seed=st.integers(0, 2**16),
)
def test_every_function_equals_sdpa(B, n_kv_heads, group, T_q, extra_keys, head_dim, mask_kind, is_causal, scale, seed):
    """eager == sdpa == tiled == flash == torch SDPA, for MHA and GQA, every mask kind, fully masked rows included."""
    g = torch.Generator().manual_seed(seed)
    H, T_k = n_kv_heads * group, T_q + extra_keys
    q = torch.randn(B, H, T_q, head_dim, generator=g)
    k = torch.randn(B, n_kv_heads, T_k, head_dim, generator=g)
    v = torch.randn(B, n_kv_heads, T_k, head_dim, generator=g)
    mask = make_mask(mask_kind, g, B, H, T_q, T_k)
    expected = reference(q, k, v, mask, is_causal, scale)
    for name, fn in FUNCTIONS.items():
        out, weights = fn(q, k, v, mask, is_causal=is_causal, scale=scale)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=name)
        if name == "eager":
            assert weights.shape == (B, H, T_q, T_k)
            sums = weights.sum(-1)
            assert (((sums - 1).abs() < ATOL) | (sums == 0)).all()  # 1, or 0 for a row with nothing to attend to
        else:
            assert weights is None


@pytest.mark.parametrize("mask_kind", ["none", "padding", "per_head", "broadcast_query"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_gradients_equal_sdpa(mask_kind, is_causal, n_kv_heads):
    g = torch.Generator().manual_seed(7)
    B, H, T_q, T_k, d = 2, 4, 5, 7, 8
    mask = make_mask(mask_kind, g, B, H, T_q, T_k)
    if mask is not None:
        mask[..., 0, :] = False  # at least one fully masked row wherever the mask reaches
    base = [
        torch.randn(B, H, T_q, d, generator=g, dtype=torch.float64),
        torch.randn(B, n_kv_heads, T_k, d, generator=g, dtype=torch.float64),
        torch.randn(B, n_kv_heads, T_k, d, generator=g, dtype=torch.float64),
    ]
    upstream = torch.randn(B, H, T_q, d, generator=g, dtype=torch.float64)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in base]
        out = fn(*leaves)
        (out * upstream).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    expected_out, expected = grads(lambda q, k, v: reference(q, k, v, mask, is_causal))
    for name, fn in FUNCTIONS.items():
        out, got = grads(lambda q, k, v, fn=fn: fn(q, k, v, mask, is_causal=is_causal)[0])
        torch.testing.assert_close(out, expected_out, msg=name)
        for which, mine, ref in zip("qkv", got, expected):
            assert torch.isfinite(mine).all(), (name, which)
            torch.testing.assert_close(mine, ref, msg=f"{name} d{which}")


def test_attention_without_batch_dims_and_default_scale():
    q, k, v = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, 3)
    out, weights = attention(q, k, v)
    expected = torch.softmax(q @ k.T / math.sqrt(8), dim=-1) @ v
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert weights.shape == (4, 6)
    torch.testing.assert_close(tiled_attention(q, k, v, tile_size=4)[0], expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(sdpa_attention(q, k, v)[0], expected, atol=ATOL, rtol=0)


def test_is_causal_square_equals_sdpa_is_causal():
    q, k, v = (torch.randn(2, 3, 7, 5) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name, fn in FUNCTIONS.items():
        torch.testing.assert_close(fn(q, k, v, is_causal=True)[0], expected, atol=ATOL, rtol=0, msg=name)


def test_is_causal_is_bottom_right_aligned_for_decoding():
    """The last T_q queries over all keys with is_causal equal the last rows of full causal attention."""
    q, k, v = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name, fn in FUNCTIONS.items():
        tail, _ = fn(q[..., -3:, :], k, v, is_causal=True)
        torch.testing.assert_close(tail, full[..., -3:, :], atol=ATOL, rtol=0, msg=name)


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q = torch.randn(2, 4, 8, requires_grad=True)
    k = torch.randn(2, 5, 8, requires_grad=True)
    v = torch.randn(2, 5, 8, requires_grad=True)
    mask = torch.ones(2, 4, 5, dtype=torch.bool)
    mask[0, 1] = False  # query 1 of sequence 0 may attend nothing
    mask[1] = False  # all of sequence 1
    out, weights = attention(q, k, v, mask=mask)
    assert not torch.isnan(out).any() and not torch.isnan(weights).any()
    assert torch.equal(out[0, 1], torch.zeros(8)) and torch.equal(out[1], torch.zeros(4, 8))
    assert torch.equal(weights[1], torch.zeros(4, 5))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_dropout_zeroes_weights_and_rescales():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 64, 4), torch.randn(1, 64, 4), torch.randn(1, 64, 4)
    _, plain = attention(q, k, v)
    _, dropped = attention(q, k, v, dropout_p=0.5)
    kept = dropped != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(dropped[kept], plain[kept] * 2.0)


def test_score_mod_equals_an_additive_bias_in_sdpa():
    """An ALiBi-style score_mod (Press et al. 2022) equals SDPA with the same bias as a float attn_mask."""
    B, H, T, d = 2, 4, 6, 8
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, 2, T, d), torch.randn(B, 2, T, d)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    bias = -slopes.view(1, H, 1, 1) * (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs()  # (1, H, T, T)
    bias = bias.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=bias)
    for name in ("eager", "tiled"):
        out, _ = FUNCTIONS[name](q, k, v, is_causal=True, score_mod=alibi)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=name)


def test_causal_mask_is_bottom_right_aligned():
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    m = causal_mask(2, 5)  # two new queries at positions 3 and 4 over five keys
    assert torch.equal(m, torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert causal_mask(1, 7).all()  # one decoding query sees every cached key
    assert causal_mask(0).shape == (0, 0)


def test_mask_from_mod_builds_the_causal_and_a_sliding_window_mask():
    causal = mask_from_mod(lambda b, h, q, kv: q >= kv, (1, 1, 5, 5))
    assert causal.shape == (1, 1, 5, 5) and torch.equal(causal[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    window = mask_from_mod(lambda b, h, q, kv: (q >= kv) & (q - kv < 2), (2, 3, 2, 6))  # q_idx counts from T_k - T_q
    expected = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert window.shape == (2, 3, 2, 6) and torch.equal(window[1, 2], expected)


def test_masked_softmax():
    scores = torch.randn(3, 4, 5, requires_grad=True)
    mask = torch.rand(3, 4, 5) < 0.6
    mask[0, 0] = False
    mask[1, 1] = True
    weights = masked_softmax(scores, mask)
    for b in range(3):
        for i in range(4):
            keep = mask[b, i]
            if keep.any():
                torch.testing.assert_close(weights[b, i, keep], torch.softmax(scores[b, i, keep], -1))
            assert torch.equal(weights[b, i, ~keep], torch.zeros(int((~keep).sum())))
    weights.square().sum().backward()
    assert torch.isfinite(scores.grad).all() and torch.equal(scores.grad[0, 0], torch.zeros(5))
    torch.testing.assert_close(masked_softmax(scores), torch.softmax(scores, -1))


def test_padding_mask_is_true_for_real_tokens():
    m = padding_mask(torch.tensor([2, 0, 3]), 3)
    assert m.shape == (3, 3) and m.dtype == torch.bool
    assert torch.equal(m, torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.equal(padding_mask([1, 2], 2), torch.tensor([[True, False], [True, True]]))
    assert padding_mask([], 4).shape == (0, 4)
    # as a (B, 1, 1, T_k) attention mask: padded keys get no weight
    q, k, v = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 3, 8), torch.randn(3, 2, 3, 8)
    _, weights = attention(q, k, v, m[:, None, None, :])
    assert torch.equal(weights[0, ..., 2], torch.zeros(2, 4)) and torch.equal(weights[1], torch.zeros(2, 4, 3))


def test_registry():
    assert set(ATTENTION_FUNCTIONS) == {"eager", "sdpa", "tiled", "flash"}
    assert get_attention_function("eager") is attention and get_attention_function("sdpa") is sdpa_attention
    assert get_attention_function("tiled") is tiled_attention and get_attention_function("flash") is flash_attention
    with pytest.raises(ValueError, match=r"attn_fn='xformers' is not one of \['eager', 'flash', 'sdpa', 'tiled'\]"):
        get_attention_function("xformers")


@pytest.mark.parametrize("magnitude", [30.0, 300.0])
@pytest.mark.parametrize("n_kv_heads", [1, 4], ids=["mqa", "mha"])
def test_eager_stays_finite_where_sdpa_does_in_float16(magnitude, n_kv_heads):
    """Large activations in float16 (q, k ~ 300, head_dim 64): SDPA stays finite, and so must eager, tiled and flash.

    Scores q·k / 8 reach ~1e5, past float16's 65504: SDPA's kernels accumulate in float32.
    """
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 4, 16, 64, generator=g) * magnitude).half()
    k = (torch.randn(2, n_kv_heads, 16, 64, generator=g) * magnitude).half()
    v = torch.randn(2, n_kv_heads, 16, 64, generator=g).half()
    sdpa, _ = sdpa_attention(q, k, v, is_causal=True)
    assert torch.isfinite(sdpa).all()
    expected = reference(q.double(), k.double(), v.double(), is_causal=True)
    for name, fn in FUNCTIONS.items():
        out, weights = fn(q, k, v, is_causal=True)
        assert out.dtype == torch.float16 and torch.isfinite(out).all(), name
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0, msg=name)
        if weights is not None:
            assert weights.dtype == torch.float16 and torch.isfinite(weights).all()
