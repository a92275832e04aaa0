"""attnlib.attention.tiled: the tiled (flash-style) attention and the online softmax, pinned to PyTorch."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.attention.tiled import online_softmax, online_softmax_update, tiled_attention
from attnlib.functional import causal_mask

ATOL = 1e-5


def _qkv(g, batch, T_q, T_k, head_dim, head_dim_v=None, dtype=torch.float32):
    q = torch.randn(*batch, T_q, head_dim, generator=g, dtype=dtype)
    k = torch.randn(*batch, T_k, head_dim, generator=g, dtype=dtype)
    v = torch.randn(*batch, T_k, head_dim_v or head_dim, generator=g, dtype=dtype)
    return q, k, v


@settings(max_examples=80, deadline=None)
@given(
    B=st.integers(1, 2),
    n_heads=st.integers(1, 3),
    T_q=st.integers(1, 40),
    extra_keys=st.integers(0, 30),
    head_dim=st.integers(1, 24),
    block_size_q=st.integers(1, 17),
    block_size_k=st.integers(1, 17),
    causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    seed=st.integers(0, 2**16),
)
def test_tiled_equals_sdpa(B, n_heads, T_q, extra_keys, head_dim, block_size_q, block_size_k, causal, scale, seed):
    g = torch.Generator().manual_seed(seed)
    T_k = T_q + extra_keys
    q, k, v = _qkv(g, (B, n_heads), T_q, T_k, head_dim)
    out = tiled_attention(q, k, v, causal=causal, block_size_q=block_size_q, block_size_k=block_size_k, scale=scale)
    mask = causal_mask(T_q, T_k) if causal else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T_q, T_k", [(100, 100), (129, 129), (1, 77), (30, 257), (255, 256)])
def test_lengths_that_are_not_multiples_of_the_blocks(causal, T_q, T_k):
    g = torch.Generator().manual_seed(T_q * 1000 + T_k)
    q, k, v = _qkv(g, (2, 3), T_q, T_k, 16)
    mask = causal_mask(T_q, T_k) if causal else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for block_size_q, block_size_k in [(128, 128), (64, 32), (7, 13), (1000, 1000)]:
        out = tiled_attention(q, k, v, causal=causal, block_size_q=block_size_q, block_size_k=block_size_k)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_square_causal_equals_sdpa_is_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(g, (2, 4), 200, 200, 32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(tiled_attention(q, k, v, causal=True, block_size_q=48, block_size_k=80), ref, atol=ATOL, rtol=0)


def test_other_value_width_no_batch_dims_and_broadcast_batch():
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g, (), 9, 14, 8, head_dim_v=5)
    torch.testing.assert_close(tiled_attention(q, k, v, block_size_q=4, block_size_k=3), F.scaled_dot_product_attention(q, k, v), atol=ATOL, rtol=0)
    q = torch.randn(2, 3, 9, 8, generator=g)  # k, v shared by the batch and heads
    out = tiled_attention(q, k, v, causal=True, block_size_q=4, block_size_k=3)
    assert out.shape == (2, 3, 9, 5)
    ref = F.scaled_dot_product_attention(q, k.expand(2, 3, 14, 8), v.expand(2, 3, 14, 5), attn_mask=causal_mask(9, 14))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_large_scores_do_not_overflow():
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(g, (1, 2), 20, 20, 8)
    q = q * 300  # scores in the thousands: exp() without the running max overflows
    out = tiled_attention(q, k, v, causal=True, block_size_q=8, block_size_k=6)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-4, rtol=0)


def test_gradients_equal_sdpa():
    g = torch.Generator().manual_seed(3)
    q, k, v = (t.requires_grad_() for t in _qkv(g, (2, 2), 19, 23, 8, dtype=torch.float64))
    tiled_attention(q, k, v, causal=True, block_size_q=5, block_size_k=7).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(19, 23)).square().sum().backward()
    for mine, ref in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_is_kept(dtype):
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(g, (1, 2), 10, 10, 8, dtype=dtype)
    out = tiled_attention(q, k, v, causal=True, block_size_q=4, block_size_k=4)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-2 if dtype == torch.bfloat16 else 1e-10, rtol=0)


def test_bad_inputs_raise():
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        tiled_attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="floating point"):
        tiled_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        tiled_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="at least 2 dims"):
        tiled_attention(torch.randn(4), k, v)
    with pytest.raises(ValueError, match="head_dim"):
        tiled_attention(torch.randn(1, 2, 8, 5), k, v)
    with pytest.raises(ValueError, match="same length T_k"):
        tiled_attention(q, k, torch.randn(1, 2, 7, 4))
    with pytest.raises(ValueError, match="do not broadcast"):
        tiled_attention(torch.randn(1, 3, 8, 4), k, v)
    with pytest.raises(ValueError, match="T_q=9 > T_k=8"):
        tiled_attention(torch.randn(1, 2, 9, 4), k, v, causal=True)
    with pytest.raises(ValueError, match="empty"):
        tiled_attention(torch.randn(1, 2, 0, 4), k, v)
    with pytest.raises(ValueError, match="block_size_q=0"):
        tiled_attention(q, k, v, block_size_q=0)
    with pytest.raises(TypeError, match="block_size_k"):
        tiled_attention(q, k, v, block_size_k=2.5)
    with pytest.raises(TypeError, match="scale"):
        tiled_attention(q, k, v, scale="0.5")


def test_non_causal_query_longer_than_keys_is_fine():
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(g, (1, 2), 12, 5, 8)
    torch.testing.assert_close(tiled_attention(q, k, v, block_size_q=5, block_size_k=2), F.scaled_dot_product_attention(q, k, v), atol=ATOL, rtol=0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 40), block_size=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_online_softmax_equals_softmax(rows, n, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 50
    x[0, : n // 2] = float("-inf")  # masked scores, possibly a whole leading block
    torch.testing.assert_close(online_softmax(x, block_size), torch.softmax(x, dim=-1), atol=1e-6, rtol=0)


def test_online_softmax_fully_masked_row_is_zero_and_update_keeps_no_nan():
    x = torch.full((2, 6), float("-inf"))
    x[1, 4] = 3.0
    out = online_softmax(x, 2)
    assert torch.equal(out[0], torch.zeros(6)) and out[1, 4] == 1.0
    m, denom = torch.full((1, 1), float("-inf")), torch.zeros(1, 1)
    m, denom = online_softmax_update(m, denom, torch.full((1, 3), float("-inf")))
    assert m.item() == float("-inf") and denom.item() == 0.0
    with pytest.raises(ValueError, match="block_size"):
        online_softmax(x, 0)
    with pytest.raises(TypeError, match="floating point"):
        online_softmax(x.long(), 2)
