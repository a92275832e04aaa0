"""Chapter 18's library code given bad or edge-case inputs: a clear error, or the right answer.

Covers what tests/test_linear_attention.py, test_deltanet.py and test_sparse_attention.py do not:
types, dtypes, devices, NaN, empty batches, zero widths, -inf decays, half precision.
References are by-hand loops (no library code compared with itself).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlib.attention import (
    GatedAttention,
    GatedDeltaNet,
    LightningIndexer,
    LinearAttention,
    TopKAttention,
    gated_delta_rule,
    linear_attention,
    topk_attention,
)
from attnlib.attention.sparse import topk_mask
from attnlib.cache import LayerCache


def qkv(B=2, h=3, T=6, d=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, T, d, generator=g, dtype=dtype) for _ in range(3))


def delta_inputs(B=2, h=3, T=40, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, d, generator=g, dtype=dtype) for _ in range(3))
    beta = torch.rand(B, h, T, generator=g, dtype=dtype)
    log_alpha = -torch.rand(B, h, T, generator=g, dtype=dtype)
    return q, F.normalize(k, dim=-1), v, beta, log_alpha


def delta_by_hand(q, k, v, beta, g):
    """The gated delta rule, one token at a time, written from its formula (float64)."""
    q, k, v, beta, g = (t.double() for t in (q, k, v, beta, g))
    S = torch.zeros(*q.shape[:2], q.shape[-1], v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(q.shape[2]):
        S = torch.exp(g[:, :, t])[..., None, None] * S  # exp(-inf) = 0: the state emptied
        read = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        S = S + beta[:, :, t, None, None] * torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t] - read)
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]) / q.shape[-1] ** 0.5)
    return torch.stack(out, 2)


# ---------------------------------------------------------------- linear attention
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"eps": -1.0}, ValueError, r"eps=-1.0 must be >= 0"),
        ({"eps": float("nan")}, ValueError, r"eps=nan must be a finite number"),
        ({"eps": "1e-6"}, TypeError, r"eps must be a number; got '1e-6'"),
        ({"initial_state": torch.zeros(2, 3, 4, 4)}, TypeError, r"initial_state must be a pair of tensors"),
        ({"initial_state": ([[0.0]], torch.zeros(2, 3, 4))}, TypeError, r"initial_state must be a pair of tensors"),
        ({"feature_map": lambda x: (x > 0).long()}, TypeError, r"must return its input's dtype torch.float32; got torch.int64"),
        ({"feature_map": lambda x: F.elu(x) + 1 + torch.where(x > 3, math.nan, 0.0)}, ValueError,
         r"produced NaN on the probe"),
    ],
)
def test_linear_attention_refuses_bad_arguments(kwargs, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        linear_attention(q, k, v, **kwargs)


def test_linear_attention_refuses_zero_width_and_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q and k must have a width d_k >= 1; got shape \(2, 3, 6, 0\)"):
        linear_attention(q[..., :0], k[..., :0], v)
    with pytest.raises(ValueError, match="q, k, v must be on one device; got cpu, meta, cpu"):
        linear_attention(q, k.to("meta"), v)


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunked"])
def test_linear_attention_on_an_empty_batch_and_empty_values(mode):
    q, k, v = qkv()
    assert linear_attention(q[:0], k[:0], v[:0], mode, chunk_size=4).shape == (0, 3, 6, 4)
    assert linear_attention(q, k, v[..., :0], mode, chunk_size=4).shape == (2, 3, 6, 0)


@pytest.mark.parametrize("layer", [LinearAttention, GatedDeltaNet])
def test_recurrent_layers_check_their_input(layer):
    with pytest.raises(ValueError, match="block_size=0 must be a positive integer"):
        layer(8, 2, block_size=0)
    with pytest.raises(TypeError, match="block_size must be an int; got '8'"):
        layer(8, 2, block_size="8")
    m = layer(8, 2)
    with pytest.raises(TypeError, match="x must be a floating point tensor .* got torch.int64"):
        m(torch.zeros(1, 3, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="x must be a floating point tensor .* got list"):
        m([[0.0] * 8])
    with pytest.raises(TypeError, match="x is torch.float64 but the module's weights are torch.float32"):
        m(torch.zeros(1, 3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=8\) with T >= 1; got \(1, 0, 8\)"):
        m(torch.zeros(1, 0, 8))
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=8\) with T >= 1; got \(3, 8\)"):
        m(torch.zeros(3, 8))
    for cache in ({}, LayerCache(8)):  # a softmax layer's cache is no state
        with pytest.raises(TypeError, match=rf"cache must be an attnlib.cache.RecurrentState \(layer.new_cache\(...\)\); "
                                            rf"got {type(cache).__name__}"):
            m(torch.zeros(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="takes no attention_mask or positions: it would fold the padding"):
        m(torch.zeros(1, 3, 8), attention_mask=torch.ones(1, 3, dtype=torch.bool))
    m = layer(8, 2, block_size=4)
    state = m.new_cache(4)
    with torch.no_grad():
        m(torch.zeros(1, 3, 8), cache=state)
        with pytest.raises(ValueError, match=r"sequence length T=5 \(cached 3 \+ new 2\) exceeds block_size=4"):
            m(torch.zeros(1, 2, 8), cache=state)
    with torch.no_grad():
        assert m(torch.zeros(0, 3, 8)).shape == (0, 3, 8)  # an empty batch: an empty output


# ---------------------------------------------------------------- gated delta rule
@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@pytest.mark.parametrize("reset", [-math.inf, -1e38, -1e5])
def test_a_decay_of_minus_infinity_empties_the_state_in_both_forms(mode, reset):
    q, k, v, beta, g = delta_inputs()
    g[:, :, 5] = reset  # alpha = 0: a hard reset (the chunked form gave NaN: -inf - -inf)
    g[:, 1, 17] = reset
    expected = delta_by_hand(q, k, v, beta, g.clamp(min=-1e4))  # exp(-1e4) = 0 exactly as well
    for C in (1, 7, 16, 64):
        got = gated_delta_rule(q, k, v, beta, g, mode, chunk_size=C)
        assert not got.isnan().any()
        torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_the_chunked_form_works_in_half_precision(dtype, tol):
    q, k, v, beta, g = delta_inputs(T=20)
    got = gated_delta_rule(*(t.to(dtype) for t in (q, k, v, beta, g)), "chunked", chunk_size=8)
    assert got.dtype == dtype
    assert (got.double() - delta_by_hand(q, k, v, beta, g)).abs().max() < tol


def test_gates_in_another_float_dtype_are_used_in_q_dtype():
    q, k, v, beta, g = delta_inputs(T=9)
    for mode in ("recurrent", "chunked"):
        got = gated_delta_rule(q, k, v, beta.double(), g.double(), mode, chunk_size=4)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), delta_by_hand(q, k, v, beta, g), atol=1e-5, rtol=1e-5)


def test_gated_delta_rule_refuses_bad_arguments():
    q, k, v, beta, g = delta_inputs(T=6)
    cases = [
        (lambda: gated_delta_rule(q, k, v, torch.full_like(beta, math.nan), g), ValueError,
         r"beta holds NaN; it must lie in \[0, 1\]"),
        (lambda: gated_delta_rule(q, k, v, beta, g * math.nan, "recurrent"), ValueError,
         r"g holds NaN; it must be <= 0"),
        (lambda: gated_delta_rule(q.double(), k, v, beta, g), TypeError,
         r"q, k, v must share a dtype; got q torch.float64 and k torch.float32"),
        (lambda: gated_delta_rule(q, k, v, beta.to("meta"), g), ValueError, r"beta is on meta but q is on cpu"),
        (lambda: gated_delta_rule(q[..., :0], k[..., :0], v, beta, g), ValueError,
         r"q holds no positions or has width d_k = 0; got shape \(2, 3, 6, 0\)"),
        (lambda: gated_delta_rule(q, k, v, beta, g, scale="0.5"), TypeError, r"scale must be a number; got '0.5'"),
        (lambda: gated_delta_rule(q, k, v, beta, g, scale=math.inf), ValueError, r"scale=inf must be a finite number"),
        (lambda: gated_delta_rule(q, k, v, beta, g, initial_state=[[0.0]]), TypeError,
         r"initial_state must be a tensor \(B, n_heads, d_k, d_v\); got list"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_gated_delta_rule_on_an_empty_batch(mode):
    q, k, v, beta, g = delta_inputs(T=6)
    assert gated_delta_rule(q[:0], k[:0], v[:0], beta[:0], g[:0], mode).shape == (0, 3, 6, 8)


# ---------------------------------------------------------------- top-k and gated attention
def test_topk_attention_refuses_bad_arguments():
    q, k, v = qkv(T=5)
    cases = [
        (lambda: topk_attention(q.tolist(), k, v, 2), TypeError, r"q, k, v must be float tensors of one dtype; q is list"),
        (lambda: topk_attention(q.long(), k.long(), v.long(), 2), TypeError, r"q is torch.int64"),
        (lambda: topk_attention(q.double(), k, v, 2), TypeError, r"k is torch.float32, q torch.float64"),
        (lambda: topk_attention(q, k.to("meta"), v, 2), ValueError, r"got q on cpu and k on meta"),
        (lambda: topk_attention(q[..., :0], k[..., :0], v, 2), ValueError, r"q and k must have a width d >= 1"),
        (lambda: topk_attention(q, k, v, 2, scale="x"), TypeError, r"scale must be a number; got 'x'"),
        (lambda: topk_attention(q, k, v, 2, scale=math.nan), ValueError, r"scale=nan must be a finite number"),
        (lambda: topk_attention(q, k, v, 2, [[0.0]]), TypeError, r"index_scores must be a float tensor"),
        (lambda: topk_attention(q, k, v, 2, torch.zeros(2, 1, 5, 5, dtype=torch.long)), TypeError,
         r"index_scores must be a float tensor; got torch.int64"),
        (lambda: topk_attention(q, k, v, 2, torch.zeros(3, 1, 5, 5)), ValueError,
         r"index_scores must have shape \(B=2, h=3 or 1, T_q=5, T_k=5\); got \(3, 1, 5, 5\)"),
        (lambda: topk_attention(q, k, v, 2, torch.zeros(2, 2, 5, 5)), ValueError, r"got \(2, 2, 5, 5\)"),
        (lambda: topk_attention(q, k, v, 2, torch.full((2, 1, 5, 5), math.nan)), ValueError,
         r"index_scores holds NaN"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_topk_attention_on_empty_inputs():
    q, k, v = qkv(T=5)
    assert topk_attention(q[:0], k[:0], v[:0], 2).shape == (0, 3, 5, 4)
    assert topk_attention(q[:, :, :0], k, v, 2).shape == (2, 3, 0, 4)  # no queries


def test_topk_mask_refuses_bad_arguments():
    with pytest.raises(TypeError, match=r"scores must be a float tensor \(..., T_q, T_k\)"):
        topk_mask([[0.0]], 1)
    with pytest.raises(TypeError, match=r"scores must be a float tensor"):
        topk_mask(torch.zeros(5), 1)
    with pytest.raises(TypeError, match="allowed must be a bool tensor; got torch.float32"):
        topk_mask(torch.zeros(5, 5), 2, torch.ones(5, 5))
    with pytest.raises(ValueError, match=r"allowed \(3, 3\) does not broadcast to scores \(5, 5\)"):
        topk_mask(torch.zeros(5, 5), 2, torch.ones(3, 3, dtype=torch.bool))


def test_lightning_indexer_and_layers_check_their_input():
    indexer = LightningIndexer(8)
    with pytest.raises(ValueError, match=r"x and context must have shape \(B, T, d_model=8\) with one B; "
                                         r"got \(1, 3, 8\) and \(2, 3, 8\)"):
        indexer(torch.zeros(1, 3, 8), torch.zeros(2, 3, 8))  # was broadcast to batch 2 silently
    with pytest.raises(ValueError, match=r"got \(1, 3, 4\) and \(1, 3, 4\)"):
        indexer(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    with pytest.raises(TypeError, match="x must be a float tensor of the weights' dtype torch.float32; got torch.int64"):
        indexer(torch.zeros(1, 3, 8, dtype=torch.long), torch.zeros(1, 3, 8))
    with pytest.raises(TypeError, match="indexer must be True or False; got 'yes'"):
        TopKAttention(8, 2, top_k=2, indexer="yes")
    with torch.no_grad():  # empty batches: empty outputs (a reshape error before)
        assert TopKAttention(8, 2, top_k=2)(torch.zeros(0, 3, 8)).shape == (0, 3, 8)
        assert GatedAttention(8, 2)(torch.zeros(0, 3, 8)).shape == (0, 3, 8)
        assert GatedAttention(8, 2, gate="headwise")(torch.zeros(0, 3, 8)).shape == (0, 3, 8)
