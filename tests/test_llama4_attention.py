"""Llama 4's attention against transformers' Llama4TextAttention, layer by layer (random tiny config, no download).

Layer 0 is a RoPE layer (chunked attention, L2 QK-norm), layer 3 a NoPE layer (full attention, temperature
tuning). Chapter 20.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import Llama4TextConfig
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

import attnlib
from attnlib.attention.masks import mask_positions
from attnlib.attention.temperature import AttentionTemperature, L2Norm
from attnlib.models.hf_llama4 import attention_from_hf, config_from_hf_llama4

CHUNK, T = 4, 11  # 11 positions: two whole chunks and part of a third
SIZES = dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=4, intermediate_size=64, intermediate_size_mlp=96, num_local_experts=2,
             max_position_embeddings=64, attention_chunk_size=CHUNK, floor_scale=3, attn_scale=0.5,
             pad_token_id=None, bos_token_id=None, eos_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def hf_config(**changes) -> Llama4TextConfig:
    config = Llama4TextConfig(**{**SIZES, **changes})
    config._attn_implementation = "eager"  # returns its weights
    return config


def hf_attention(config, layer: int, bias: bool = False) -> Llama4TextAttention:
    torch.manual_seed(layer)
    module = Llama4TextAttention(config, layer).eval()
    if bias:
        for p in module.parameters():
            if p.dim() == 1:
                p.data.uniform_(-0.5, 0.5)
    return module


def hf_forward(module, x, cache=None):
    """transformers' layer at positions ``cache length, …`` with the model's mask for its layer type."""
    config = module.config
    past = 0 if cache is None else cache.get_seq_length(module.layer_idx)
    position_ids = torch.arange(past, past + x.shape[1])[None]
    make = create_chunked_causal_mask if config.layer_types[module.layer_idx] == "chunked_attention" else create_causal_mask
    mask = make(config=config, inputs_embeds=x, attention_mask=None, past_key_values=cache, position_ids=position_ids,
                layer_idx=module.layer_idx)
    return module(x, Llama4TextRotaryEmbedding(config)(x, position_ids), mask, past_key_values=cache)


@pytest.mark.parametrize("rope_parameters", [None, LLAMA3], ids=["default-rope", "llama3-rope"])
@pytest.mark.parametrize(("layer", "bias"), [(0, False), (3, False), (0, True)], ids=["rope-chunked", "nope-temperature", "rope-bias"])
def test_layer_equals_transformers_outputs_weights_and_input_gradients(layer, bias, rope_parameters):
    config = hf_config(rope_parameters=rope_parameters, attention_bias=bias)
    theirs = hf_attention(config, layer, bias)
    ours = attention_from_hf(theirs).eval()
    assert (ours.chunk_size, ours.rope is None, ours.temperature is None) == \
        ((CHUNK, False, True) if layer == 0 else (None, True, False))
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    expected, expected_weights = hf_forward(theirs, x)
    out, weights = ours(x, return_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, expected_weights, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    (expected_grad,) = torch.autograd.grad(expected, x, g)
    (grad,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [0, 3], ids=["rope-chunked", "nope-temperature"])
def test_cached_decode_and_chunked_prefill_equal_one_pass_and_transformers(layer):
    """Pieces of 3, 2, 1, 1, 4 positions (crossing the chunk boundaries at 4 and 8), through attnlib's cache (a
    chunked cache keeps only the current chunk) and transformers' DynamicCache: each piece as the one pass."""
    theirs = hf_attention(hf_config(), layer)
    ours = attention_from_hf(theirs).eval()
    x = torch.randn(1, T, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        whole = ours(x)
        torch.testing.assert_close(whole, hf_forward(theirs, x)[0], atol=1e-5, rtol=1e-5)
        cache, hf_cache, start = ours.new_cache(64), DynamicCache(), 0
        for size in (3, 2, 1, 1, 4):
            piece = x[:, start:start + size]
            out = ours(piece, cache=cache)
            torch.testing.assert_close(out, whole[:, start:start + size], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, hf_forward(theirs, piece, hf_cache)[0], atol=1e-5, rtol=1e-5)
            start += size
        assert cache.length == T
        if layer == 0:  # the chunked cache holds at most one chunk, the current one (8, 9, 10) in it
            held = cache.held(T).tolist()
            assert cache.capacity == CHUNK and len(held) <= CHUNK and {8, 9, 10} <= set(held)


def test_chunked_mask_at_chunk_boundaries_equals_transformers():
    """Which keys each query sees, from the weights: transformers' chunked mask, also after a cache."""
    theirs = hf_attention(hf_config(), 0)
    ours = attention_from_hf(theirs).eval()
    x = torch.randn(1, T, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        cache = ours.new_cache(64, windows=False)  # a full cache: the weights cover every key
        ours(x[:, :3], cache=cache)
        _, weights = ours(x[:, 3:], cache=cache, return_weights=True)
        hf_cache = DynamicCache()
        hf_forward(theirs, x[:, :3], hf_cache)
        _, expected = hf_forward(theirs, x[:, 3:], hf_cache)
    assert torch.equal(weights > 0, expected > 0)
    seen = (weights[0, 0] > 0).nonzero().tolist()
    assert [k for q, k in seen if q == 1] == [4]  # position 4, the first of its chunk, sees itself only
    assert [k for q, k in seen if q == 0] == [0, 1, 2, 3]  # position 3, the last of chunk 0, sees 0..3


def test_temperature_factors_follow_the_formula():
    temp = AttentionTemperature(floor_scale=3, attn_scale=0.5)
    p = torch.arange(20)
    expected = torch.tensor([math.log(math.floor((i + 1) / 3) + 1) * 0.5 + 1 for i in range(20)])
    torch.testing.assert_close(temp.factors(p), expected)
    assert temp.factors(p)[:2].eq(1).all() and temp.factors(p)[2] > 1  # the first floor_scale - 1 positions: 1
    q = torch.randn(2, 4, 5, 8)
    torch.testing.assert_close(temp(q, start=6), q * expected[6:11, None])  # the cache's start counts


def test_l2_norm_equals_transformers_and_commutes_with_rope():
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64) * 3
    torch.testing.assert_close(L2Norm(1e-5)(x), Llama4TextL2Norm(1e-5)(x))
    rope = attnlib.RotaryEmbedding(16, 10000.0)
    pos = torch.arange(5)
    torch.testing.assert_close(L2Norm(1e-5)(rope.rotate(x, pos)), rope.rotate(L2Norm(1e-5)(x), pos))
    assert not list(L2Norm().parameters())


def test_a_left_padded_row_equals_the_unpadded_one():
    """attnlib scales a query by its own position (left-padded rows count from their first real token)."""
    ours = attention_from_hf(hf_attention(hf_config(), 3)).eval()
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(9))
    padded = torch.cat([torch.randn(1, 2, 64), x], dim=1)
    attention_mask = torch.tensor([[False, False] + [True] * 9])
    with torch.no_grad():
        alone = ours(x)
        out = ours(padded, attention_mask=attention_mask, positions=mask_positions(attention_mask))
    torch.testing.assert_close(out[:, 2:], alone, atol=1e-6, rtol=1e-6)


def test_temperature_tuning_matters():
    """Without temperature the NoPE layer differs from transformers' (the test above could not pass by chance)."""
    config = hf_config()
    theirs = hf_attention(config, 3)
    ours = attention_from_hf(theirs).eval()
    ours.temperature = None
    x = torch.randn(1, T, 64, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        assert (ours(x) - hf_forward(theirs, x)[0]).abs().max() > 1e-4


# ------------------------------------------------------------------ a dense decoder with Llama 4's attention


def llama4_pattern(**changes) -> attnlib.DecoderConfig:
    """Chunked:full 3:1, NoPE every fourth layer (the full ones), L2 QK-norm, temperature tuning."""
    return config_from_hf_llama4(hf_config(num_hidden_layers=8, **changes))


def test_config_from_hf_llama4_reads_the_pattern():
    c = llama4_pattern()
    assert c.layer_types == ("chunked_attention",) * 3 + ("full_attention",) + ("chunked_attention",) * 3 + ("full_attention",)
    assert (c.nope_layers, c.attention_chunk_size, c.qk_norm, c.qk_norm_type) == ((3, 7), CHUNK, True, "l2")
    assert (c.attn_temperature_tuning, c.floor_scale, c.attn_scale, c.d_ff) == (True, 3, 0.5, 96)
    no_nope = config_from_hf_llama4(hf_config(no_rope_layers=[1, 1, 1, 1]))
    assert no_nope.attn_temperature_tuning is False and no_nope.nope_layers == ()  # transformers: no effect


def test_dense_decoder_cached_equals_uncached_and_chunked_prefill():
    torch.manual_seed(0)
    model = attnlib.Decoder(llama4_pattern()).eval()
    assert [b.attn.temperature is not None for b in model.blocks] == [False, False, False, True] * 2
    assert [b.attn.q_norm is not None for b in model.blocks] == [True, True, True, False] * 2
    idx = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        whole, _ = model(idx)
        cache, start = model.new_cache(), 0
        for size in (5, 3, 7, 1, 1, 6):  # chunked prefill, then decode, crossing chunk boundaries
            logits, _ = model(idx[:, start:start + size], cache=cache)
            torch.testing.assert_close(logits, whole[:, start:start + size], atol=1e-5, rtol=1e-5)
            start += size
    prompt = idx[:, :5]
    cached = model.generate(prompt, 10, temperature=0.0)
    assert torch.equal(cached, model.generate(prompt, 10, temperature=0.0, use_cache=False))


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (dict(qk_norm=True, qk_norm_type="l1"), ValueError, "qk_norm_type='l1'"),
        (dict(qk_norm_type="l2"), ValueError, "qk_norm=True"),
        (dict(qk_norm=True, qk_norm_type="l2", nope_layers=(0, 1, 2, 3)), ValueError, "qk_norm_type='l2'"),
        (dict(attn_temperature_tuning=1, nope_layers=(3,)), TypeError, "attn_temperature_tuning"),
        (dict(attn_temperature_tuning=True), ValueError, "attn_temperature_tuning"),  # no NoPE layer
        (dict(attn_temperature_tuning=True, nope_layers=(3,), floor_scale=0), ValueError, "floor_scale"),
        (dict(attn_temperature_tuning=True, nope_layers=(3,), floor_scale=float("nan")), ValueError, "floor_scale"),
        (dict(attn_temperature_tuning=True, nope_layers=(3,), floor_scale="8192"), TypeError, "floor_scale"),
        (dict(attn_temperature_tuning=True, nope_layers=(3,), attn_scale=-0.1), ValueError, "attn_scale"),
        (dict(floor_scale=16.0), ValueError, "floor_scale=16.0 is given but attn_temperature_tuning=False"),
        (dict(attn_scale=0.2), ValueError, "attn_scale=0.2 is given"),
        (dict(attn_temperature_tuning=True, position="learned"), ValueError, "attn_temperature_tuning"),
        (dict(attn_temperature_tuning=True, nope_layers=(3,), attention="mla", n_kv_heads=None), ValueError,
         "attention"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, error, match):
    with pytest.raises(error, match=match):
        attnlib.DecoderConfig.llama(**{"n_layers": 4, **fields})


def test_bad_layer_arguments_are_refused():
    with pytest.raises(TypeError, match="temperature must be None or an AttentionTemperature"):
        attnlib.MultiHeadAttention(32, 4, temperature=0.5)
    with pytest.raises(ValueError, match="causal layers only"):
        attnlib.MultiHeadAttention(32, 4, causal=False, temperature=AttentionTemperature())
    with pytest.raises(ValueError, match="qk_norm_type='rms'"):
        attnlib.MultiHeadAttention(32, 4, qk_norm_type="rms")
    with pytest.raises(ValueError, match="eps"):
        L2Norm(0.0)
    with pytest.raises(TypeError, match="Llama4TextAttention"):
        attention_from_hf(torch.nn.Linear(4, 4))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_qk_norm": "yes"}, "use_qk_norm"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters"),
        ({"model_type": "llama"}, "llama"),
    ],
)
def test_unreproducible_llama4_configs_are_refused(change, match):
    config = {**hf_config().to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        config_from_hf_llama4(config)
