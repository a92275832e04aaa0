"""attnlib.functional: the eager reference against PyTorch SDPA, masks, and bad input."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.functional import attention, causal_mask, padding_mask

ATOL = 1e-5


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    n_heads=st.integers(1, 3),
    T_q=st.integers(1, 9),
    extra_keys=st.integers(0, 6),
    head_dim=st.integers(1, 16),
    mask_kind=st.sampled_from(["none", "causal", "random", "padding"]),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    seed=st.integers(0, 2**16),
)
def test_attention_equals_sdpa(batch, n_heads, T_q, extra_keys, head_dim, mask_kind, scale, seed):
    g = torch.Generator().manual_seed(seed)
    T_k = T_q + extra_keys
    q = torch.randn(batch, n_heads, T_q, head_dim, generator=g)
    k = torch.randn(batch, n_heads, T_k, head_dim, generator=g)
    v = torch.randn(batch, n_heads, T_k, head_dim, generator=g)
    if mask_kind == "none":
        mask = None
    elif mask_kind == "causal":
        mask = causal_mask(T_q, T_k)
    elif mask_kind == "random":
        mask = torch.rand(batch, n_heads, T_q, T_k, generator=g) < 0.6
        mask[..., 0] = True  # every row attends somewhere, so SDPA is defined too
    else:
        lengths = torch.randint(1, T_k + 1, (batch,), generator=g)
        mask = padding_mask(lengths, T_k).unsqueeze(1)  # (B, 1, 1, T_k)
    out, weights = attention(q, k, v, mask=mask, scale=scale)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(batch, n_heads, T_q), atol=ATOL, rtol=0)


def test_attention_without_batch_dims_and_default_scale():
    q, k, v = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, 3)
    out, weights = attention(q, k, v)
    expected = torch.softmax(q @ k.T / math.sqrt(8), dim=-1) @ v
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert weights.shape == (4, 6)


def test_is_causal_matches_sdpa():
    q, k, v = (torch.randn(2, 3, 7, 5) for _ in range(3))
    out, _ = attention(q, k, v, mask=causal_mask(7))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=ATOL, rtol=0)


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


def test_causal_mask_is_bottom_right_aligned():
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    m = causal_mask(2, 5)  # two new queries at positions 3 and 4 over five keys
    assert torch.equal(m, torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert causal_mask(1, 7).all()  # one decoding query sees every cached key


def test_causal_mask_decoding_equals_full_attention_rows():
    """Attending the last T_q queries over all keys with a bottom-right mask equals the last rows of full attention."""
    q, k, v = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    full, _ = attention(q, k, v, mask=causal_mask(9))
    tail, _ = attention(q[..., -3:, :], k, v, mask=causal_mask(3, 9))
    torch.testing.assert_close(tail, full[..., -3:, :], atol=ATOL, rtol=0)


def test_padding_mask():
    m = padding_mask(torch.tensor([2, 0, 3]), 3)
    assert m.shape == (3, 1, 3)
    assert torch.equal(m[:, 0], torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool))
    combined = causal_mask(3) & padding_mask([2, 3], 3)
    assert combined.shape == (2, 3, 3)
    assert torch.equal(combined[0, 2], torch.tensor([True, True, False]))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: attention(torch.randn(2, 4), torch.randn(3, 5), torch.randn(3, 5)), ValueError, "head_dim"),
        (lambda: attention(torch.randn(2, 4), torch.randn(3, 4), torch.randn(2, 4)), ValueError, "same length"),
        (lambda: attention(torch.randn(4), torch.randn(4), torch.randn(4)), ValueError, "at least 2 dims"),
        (lambda: attention(*[torch.ones(2, 2, dtype=torch.long)] * 3), TypeError, "floating point"),
        (lambda: attention(*[torch.randn(2, 4)] * 3, mask=torch.ones(2, 2)), TypeError, "boolean"),
        (lambda: attention(*[torch.randn(2, 4)] * 3, mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, "broadcast"),
        (lambda: attention(*[torch.randn(2, 4)] * 3, dropout_p=1.0), ValueError, "dropout_p=1.0"),
        (lambda: causal_mask(0), ValueError, "T_q=0"),
        (lambda: causal_mask(4, 2), ValueError, "T_q=4 > T_k=2"),
        (lambda: causal_mask(2.5), ValueError, "T_q=2.5"),
        (lambda: padding_mask([1, 5], 4), ValueError, "[0, T=4]"),
        (lambda: padding_mask(torch.tensor([1.0]), 4), TypeError, "integers"),
        (lambda: padding_mask(torch.tensor([[1]]), 4), ValueError, "1-D"),
    ],
)
def test_bad_input_gives_clear_errors(call, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()
