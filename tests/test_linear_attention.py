"""Linear attention (chapter 18): three equal forms, an outside reference, the state, bad input."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlib import GPT, GPTConfig
from attnlib.attention import FEATURE_MAPS, LinearAttention, linear_attention
from attnlib.cache import LayerCache


def qkv(T=37, dtype=torch.float32, B=2, h=3, d=8, d_v=5):
    g = torch.Generator().manual_seed(T)
    return (torch.randn(B, h, T, d, generator=g, dtype=dtype), torch.randn(B, h, T, d, generator=g, dtype=dtype),
            torch.randn(B, h, T, d_v, generator=g, dtype=dtype))


def reference(q, k, v, phi):
    """torch's SDPA with a zero query and log-weights as the mask: softmax(log w) = w / Σ w."""
    w = (phi(q) @ phi(k).transpose(-2, -1)).tril()  # unnormalised causal weights φ(q_i)·φ(k_j)
    return F.scaled_dot_product_attention(torch.zeros_like(q), k, v, attn_mask=w.log())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("T,chunk", [(1, 4), (37, 1), (37, 5), (37, 37), (37, 64), (64, 16)])
def test_three_forms_equal(dtype, tol, T, chunk):
    q, k, v = qkv(T, dtype)
    parallel = linear_attention(q, k, v, "parallel")
    assert torch.allclose(linear_attention(q, k, v, "recurrent"), parallel, atol=tol, rtol=0)
    assert torch.allclose(linear_attention(q, k, v, "chunked", chunk_size=chunk), parallel, atol=tol, rtol=0)


@pytest.mark.parametrize("name", list(FEATURE_MAPS))
def test_parallel_equals_normalised_weights_through_sdpa(name):
    q, k, v = qkv(29, torch.float64)
    if name == "relu":  # keep every row's normaliser > 0 (its first key must share a positive coordinate)
        q, k = q.abs(), k.abs()
    out = linear_attention(q, k, v, "parallel", feature_map=name, eps=0.0)
    assert torch.allclose(out, reference(q, k, v, FEATURE_MAPS[name]), atol=1e-10)


def test_a_positive_callable_is_accepted_and_used():
    q, k, v = qkv(11, torch.float64)
    out = linear_attention(q, k, v, "chunked", feature_map=torch.exp, chunk_size=4, eps=0.0)
    assert torch.allclose(out, reference(q, k, v, torch.exp), atol=1e-10)
    # with φ = exp(x / √d) per coordinate the weights are not softmax's exp(q·k / √d): the point of the chapter
    soft = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(out, soft, atol=1e-3)


def test_a_feature_map_that_changes_the_width_is_probed_at_the_head_width():
    W = torch.randn(8, 20, dtype=torch.float64)  # random features: (..., d_k=8) -> (..., 20)

    def features(x):
        return torch.exp(x @ W / 8 - (x * x).sum(-1, keepdim=True) / 16)

    q, k, v = qkv(9, torch.float64)
    out = linear_attention(q, k, v, "recurrent", feature_map=features, eps=0.0)
    assert torch.allclose(out, reference(q, k, v, features), atol=1e-10)


def test_state_continues_the_sequence():
    q, k, v = qkv(40, torch.float64)
    whole = linear_attention(q, k, v, "parallel")
    first, state = linear_attention(q[..., :17, :], k[..., :17, :], v[..., :17, :], "chunked", chunk_size=8,
                                    return_state=True)
    rest = linear_attention(q[..., 17:, :], k[..., 17:, :], v[..., 17:, :], "recurrent", initial_state=state)
    assert torch.allclose(torch.cat([first, rest], -2), whole, atol=1e-12)


def test_state_is_flat_while_a_kv_cache_grows():
    sizes = {}
    for T in (16, 64, 256):
        q, k, v = qkv(T, B=1, h=4, d=16, d_v=16)
        _, (S, z) = linear_attention(q, k, v, "chunked", return_state=True)
        sizes[T] = (S.numel() + z.numel()) * 4, (k.numel() + v.numel()) * 4
    assert {s for s, _ in sizes.values()} == {4 * 16 * 17 * 4}  # n_heads · d_φ · (d_v + 1) floats
    assert [c for _, c in sizes.values()] == [2 * 4 * 16 * T * 4 for T in (16, 64, 256)]


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunked"])
def test_gpt_with_linear_attention_generates_the_same_with_its_state_as_cache(mode):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=24, n_layers=2, n_heads=2, d_model=16,
                          layer_types=("linear_attention",) * 2, linear_layer="linear"))
    for block in model.blocks:
        assert isinstance(block.attn, LinearAttention) and block.attn.block_size == 24
        block.attn.mode, block.attn.chunk_size = mode, 5
    model.eval()
    prompt = torch.randint(0, 40, (2, 7))
    cached = model.generate(prompt, 30, temperature=0.0)  # past block_size: the window slides
    assert torch.equal(cached, model.generate(prompt, 30, temperature=0.0, use_cache=False))
    cache = model.new_cache()
    with torch.no_grad():
        model(cached[:, :10], cache=cache)
        held = cache.layers[0].nbytes()
        model(cached[:, 10:20], cache=cache)
    assert cache.layers[0].nbytes() == held == model.blocks[0].attn.state_bytes() * 2  # batch of 2
    assert model.kv_cache_bytes_per_token() == 0


@pytest.mark.parametrize("bad", ["identity", "none", "tanh", lambda x: x, torch.tanh, torch.sin,
                                 lambda x: x.abs() - 1.0])
def test_feature_maps_that_give_negative_weights_are_refused(bad):
    q, k, v = qkv(5)
    with pytest.raises(ValueError, match="feature_map=.*negative"):
        linear_attention(q, k, v, feature_map=bad)


def test_a_map_negative_only_on_the_real_inputs_is_refused():
    q, k, v = qkv(5)

    def sneaky(x):  # positive on the probe in [-8, 8], negative beyond 50
        return torch.where(x.abs() > 50, -x.abs(), F.elu(x) + 1)

    with pytest.raises(ValueError, match="negative value .* on q"):
        linear_attention(q * 100, k, v, feature_map=sneaky)


def test_bad_inputs_name_the_value():
    q, k, v = qkv(5)
    with pytest.raises(ValueError, match="chunk_size=0 must be a positive integer"):
        linear_attention(q, k, v, "chunked", chunk_size=0)
    with pytest.raises(ValueError, match="mode='rnn' is not one of"):
        linear_attention(q, k, v, "rnn")
    with pytest.raises(ValueError, match="feature_map='gelu' is not one of"):
        linear_attention(q, k, v, feature_map="gelu")
    with pytest.raises(TypeError, match="feature_map must be a name or a callable; got int"):
        linear_attention(q, k, v, feature_map=3)
    with pytest.raises(ValueError, match=r"q and k must have the same shape .* \(2, 3, 5, 8\) and \(2, 3, 4, 8\)"):
        linear_attention(q, k[..., :4, :], v)
    with pytest.raises(ValueError, match=r"v must have shape .* got \(2, 3, 6, 5\)"):
        linear_attention(q, k, torch.randn(2, 3, 6, 5))
    with pytest.raises(TypeError, match="q must be a floating point tensor"):
        linear_attention(q.long(), k, v)
    with pytest.raises(ValueError, match="initial_state must be"):
        linear_attention(q, k, v, initial_state=(torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ValueError, match="feature_map='identity' can produce negative weights"):
        LinearAttention(16, 2, feature_map="identity")
    with pytest.raises(ValueError, match="d_model=16 is not divisible by n_heads=3"):
        LinearAttention(16, 3)
    with pytest.raises(ValueError, match="return_weights=True"):
        LinearAttention(16, 2)(torch.randn(1, 3, 16), return_weights=True)
    for kwargs in ({"attention_mask": torch.ones(1, 3, dtype=torch.bool)}, {"positions": torch.zeros(1, 3, dtype=torch.long)}):
        with pytest.raises(ValueError, match="a linear attention layer takes no attention_mask or positions"):
            LinearAttention(16, 2)(torch.randn(1, 3, 16), **kwargs)
    with pytest.raises(TypeError, match="cache must be an attnlib.cache.RecurrentState .*; got LayerCache"):
        LinearAttention(16, 2)(torch.randn(1, 3, 16), cache=LayerCache(8))
    assert math.isfinite(linear_attention(q, k, v).sum().item())
