"""attnlib.attention.tiled: the tiled (flash-style) attention and the online softmax, pinned to PyTorch."""
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.attention.tiled import fold_groups, online_softmax, online_softmax_update, tiled_attention, tiled_forward

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
    tile_size=st.integers(1, 17),
    causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    seed=st.integers(0, 2**16),
)
def test_tiled_equals_sdpa(B, n_heads, T_q, extra_keys, head_dim, tile_size, causal, scale, seed):
    g = torch.Generator().manual_seed(seed)
    T_k = T_q + extra_keys
    q, k, v = _qkv(g, (B, n_heads), T_q, T_k, head_dim)
    out, weights = tiled_attention(q, k, v, is_causal=causal, tile_size=tile_size, scale=scale)
    assert weights is None
    mask = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q) if causal else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T_q, T_k", [(100, 100), (129, 129), (1, 77), (30, 257), (255, 256)])
def test_lengths_that_are_not_multiples_of_the_blocks(causal, T_q, T_k):
    g = torch.Generator().manual_seed(T_q * 1000 + T_k)
    q, k, v = _qkv(g, (2, 3), T_q, T_k, 16)
    mask = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q) if causal else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for tile_size in [128, 64, 7, 1000]:
        out, _ = tiled_attention(q, k, v, is_causal=causal, tile_size=tile_size)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_square_causal_equals_sdpa_is_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(g, (2, 4), 200, 200, 32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(tiled_attention(q, k, v, is_causal=True, tile_size=48)[0], ref, atol=ATOL, rtol=0)


def test_other_value_width_no_batch_dims_and_grouped_heads():
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g, (), 9, 14, 8, head_dim_v=5)
    torch.testing.assert_close(tiled_attention(q, k, v, tile_size=4)[0], F.scaled_dot_product_attention(q, k, v), atol=ATOL, rtol=0)
    q = torch.randn(2, 6, 9, 8, generator=g)  # six query heads sharing two K/V heads (GQA)
    k, v = torch.randn(2, 2, 14, 8, generator=g), torch.randn(2, 2, 14, 5, generator=g)
    out, _ = tiled_attention(q, k, v, is_causal=True, tile_size=4)
    assert out.shape == (2, 6, 9, 5)
    mask = torch.ones(9, 14, dtype=torch.bool).tril(5)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_large_scores_do_not_overflow():
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(g, (1, 2), 20, 20, 8)
    q = q * 300  # scores in the thousands: exp() without the running max overflows
    out, _ = tiled_attention(q, k, v, is_causal=True, tile_size=6)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-4, rtol=0)


def test_gradients_equal_sdpa():
    g = torch.Generator().manual_seed(3)
    q, k, v = (t.requires_grad_() for t in _qkv(g, (2, 2), 19, 23, 8, dtype=torch.float64))
    tiled_attention(q, k, v, is_causal=True, tile_size=5)[0].square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(19, 23, dtype=torch.bool).tril(4)).square().sum().backward()
    for mine, ref in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_dtype_is_kept(dtype):
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(g, (1, 2), 10, 10, 8, dtype=dtype)
    out, _ = tiled_attention(q, k, v, is_causal=True, tile_size=4)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-10 if dtype == torch.float64 else 1e-2, rtol=0)


def test_non_causal_query_longer_than_keys_is_fine():
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(g, (1, 2), 12, 5, 8)
    torch.testing.assert_close(tiled_attention(q, k, v, tile_size=2)[0], F.scaled_dot_product_attention(q, k, v), atol=ATOL, rtol=0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 40), tile_size=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_online_softmax_equals_softmax(rows, n, tile_size, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 50
    x[0, : n // 2] = float("-inf")  # masked scores, possibly a whole leading block
    torch.testing.assert_close(online_softmax(x, tile_size), torch.softmax(x, dim=-1), atol=1e-6, rtol=0)


def test_online_softmax_fully_masked_row_is_zero_and_update_keeps_no_nan():
    x = torch.full((2, 6), float("-inf"))
    x[1, 4] = 3.0
    out = online_softmax(x, 2)
    assert torch.equal(out[0], torch.zeros(6)) and out[1, 4] == 1.0
    m, denom = torch.full((1, 1), float("-inf")), torch.zeros(1, 1)
    m, denom = online_softmax_update(m, denom, torch.full((1, 3), float("-inf")))
    assert m.item() == float("-inf") and denom.item() == 0.0
    with pytest.raises(ValueError, match=re.escape("tile_size=0 must be a positive integer")):
        online_softmax(x, 0)
    with pytest.raises(TypeError, match=re.escape("x must be a floating point tensor; got Tensor torch.int64")):
        online_softmax(x.long(), 2)


@settings(max_examples=40, deadline=None)
@given(
    T_q=st.integers(1, 6),
    n=st.integers(1, 30),
    d_v=st.integers(1, 5),
    tile_size=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_online_softmax_update_with_values_is_softmax_times_v_block_by_block(T_q, n, d_v, tile_size, seed):
    """After each block, acc / denom = softmax(x[:, :seen]) @ v[:seen], m is the running max and denom the
    sum of exp(x - m) (in float64, against torch.softmax); a row of only -inf so far has m = -inf, denom = 0,
    acc = 0, and nothing is ever NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T_q, n, generator=g, dtype=torch.float64) * 20
    x[0, 0] = float("-inf")  # a row that never sees a score
    x[1, :, : n // 2] = float("-inf")  # leading masked blocks: rows that start with only -inf
    x[1, -1, torch.rand(n, generator=g) < 0.3] = float("-inf")  # scattered -inf
    v = torch.randn(2, n, d_v, generator=g, dtype=torch.float64)
    m = torch.full((2, T_q, 1), float("-inf"), dtype=torch.float64)
    denom, acc = torch.zeros(2, T_q, 1, dtype=torch.float64), torch.zeros(2, T_q, d_v, dtype=torch.float64)
    for stop in range(tile_size, n + tile_size, tile_size):
        start, stop = stop - tile_size, min(stop, n)
        m, denom, acc = online_softmax_update(m, denom, x[..., start:stop], v[:, start:stop], acc)
        seen = x[..., :stop]
        assert not (m.isnan().any() or denom.isnan().any() or acc.isnan().any())
        assert torch.equal(m, seen.amax(dim=-1, keepdim=True))
        empty = torch.isneginf(seen).all(dim=-1)  # (2, T_q): rows with nothing to weigh yet
        assert torch.equal(denom[empty], torch.zeros_like(denom[empty]))
        assert torch.equal(acc[empty], torch.zeros_like(acc[empty]))
        rows = ~empty
        torch.testing.assert_close(denom[rows].squeeze(-1), torch.exp(seen - m).sum(-1)[rows])
        expected = torch.softmax(seen, dim=-1) @ v[:, :stop]  # (2, T_q, stop) @ (2, stop, d_v)
        torch.testing.assert_close((acc / denom.clamp(min=1e-300))[rows], expected[rows])
    assert torch.equal(acc[0, 0], torch.zeros(d_v, dtype=torch.float64))


def test_online_softmax_update_with_values_keeps_the_two_result_form_without_them():
    x, v = torch.randn(3, 8), torch.randn(8, 2)
    m, denom = torch.full((3, 1), float("-inf")), torch.zeros(3, 1)
    assert len(online_softmax_update(m, denom, x)) == 2
    m2, denom2, acc = online_softmax_update(m, denom, x, v, torch.zeros(3, 2))
    m1, denom1 = online_softmax_update(m, denom, x)
    assert torch.equal(m1, m2) and torch.equal(denom1, denom2)
    torch.testing.assert_close(acc / denom2, torch.softmax(x, -1) @ v)


@pytest.mark.parametrize("is_causal", [False, True])
def test_tiled_forward_returns_the_log_sum_exp_of_each_row(is_causal):
    """The loop tiled and flash attention share: its O is softmax(S) V and its L is logsumexp(S) per row
    (+inf for a row that may see no key, whose output is 0)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = _qkv(g, (2, 4), 9, 13, 8, head_dim_v=3, dtype=torch.float64)
    k, v = k[:, :2], v[:, :2]  # two K/V heads for four query heads
    mask = torch.rand(2, 4, 9, 13, generator=g) < 0.7
    mask[0, 1, 2] = False
    scale = 0.4
    out, lse = tiled_forward(*fold_groups(q, k, v, mask), is_causal, scale, 4)
    full = mask & torch.ones(9, 13, dtype=torch.bool).tril(4) if is_causal else mask
    scores = (q @ k.repeat_interleave(2, 1).transpose(-2, -1) * scale).masked_fill(~full, float("-inf"))
    empty = ~full.any(-1)
    expected_lse = torch.logsumexp(scores, dim=-1).masked_fill(empty, float("inf"))
    torch.testing.assert_close(lse.reshape(2, 4, 9), expected_lse)
    expected = (torch.softmax(scores.masked_fill(empty[..., None], 0.0), -1) @ v.repeat_interleave(2, 1))
    torch.testing.assert_close(out.reshape(2, 4, 9, 3), expected.masked_fill(empty[..., None], 0.0))
    assert torch.isinf(lse.reshape(2, 4, 9)[0, 1, 2])
