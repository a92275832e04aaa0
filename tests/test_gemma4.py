"""Gemma 4 (text): attnlib.from_hf_gemma4 ≡ transformers' Gemma4ForCausalLM, and cross-layer KV sharing. Chapter 20.

A tiny random Gemma 4 built locally (sliding and global layers, the last two layers sharing keys and values,
keys as values and a wider head with proportional RoPE on the global layers, per-layer inputs, every norm
weight and layer scalar moved off 1 so that a wrong mapping shows): logits within 1e-5 in float32, greedy
generation equal, cached = uncached past the window. KV sharing alone on a small Llama-style decoder: cached =
uncached, and the filled cache holds the bytes of the layers with a cache only.
"""
from __future__ import annotations

import pytest
import torch

import attnlib
from attnlib.cache import SharedLayerCache
from attnlib.models.hf_gemma4 import config_from_hf_gemma4, from_hf_gemma4
from attnlib.models.per_layer import PartialRotaryEmbedding

transformers = pytest.importorskip("transformers")

TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
         "full_attention"]
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=4,
             layer_types=TYPES, max_position_embeddings=64, vocab_size_per_layer_input=97,
             hidden_size_per_layer_input=8, attention_k_eq_v=True, num_kv_shared_layers=2)


def hf_config(**changes):
    return transformers.Gemma4TextConfig(**{**SIZES, **changes, "attn_implementation": "eager"})


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(hf_config()).eval()
    with torch.no_grad():  # norms at 1 and scalars at 1 would hide a norm or scalar left unloaded
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(1) + 0.5)
    return hf, from_hf_gemma4(hf).eval()


def test_config_maps_every_gemma4_feature(pair):
    c = pair[1].config
    assert (c.num_kv_shared_layers, c.global_head_dim, c.global_n_kv_heads, c.global_partial_rotary_factor) == (2, 16, 1, 0.25)
    assert c.attention_k_eq_v and c.value_norm and c.layer_scalar and c.d_per_layer_input == 8
    assert [c.kv_source(i) for i in range(6)] == [None, None, None, None, 3, 2]  # transformers' "store" layers: 2, 3
    assert pair[0].config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]


def test_logits_equal_transformers(pair):
    hf, ours = pair
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, mine = hf(idx).logits, ours(idx)[0]
    assert theirs.abs().max() > 0.1  # not a vanishing output
    assert (theirs - mine).abs().max() < 1e-5  # measured 7.3e-7 (float32)


def test_state_dict_with_config_dict_and_left_padding(pair):
    hf = pair[0]
    ours = from_hf_gemma4(hf.state_dict(), hf.config.to_dict()).eval()  # config.json's form
    idx = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False  # row 1 left-padded by 3
    with torch.no_grad():
        mine, theirs = ours(idx, attention_mask=mask)[0], hf(idx, attention_mask=mask.long()).logits
    assert (mine[:, 3:] - theirs[:, 3:]).abs().max() < 1e-5  # measured 4.9e-7


def test_parameters_counted_alike(pair):
    hf, ours = pair  # shared layers: no k/v projections or norms in either; tied head counted once
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_greedy_equal_transformers_and_cache(pair):
    hf, ours = pair
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    cached = ours.generate(prompt, 8, temperature=0.0)  # past the window of 4
    assert torch.equal(cached, ours.generate(prompt, 8, temperature=0.0, use_cache=False))
    assert torch.equal(cached, hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0))


def test_cached_equals_uncached_past_the_window(pair):
    ours = pair[1]
    idx = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(idx)[0]
        cache = ours.new_cache()
        steps = [ours(idx[:, :6], cache=cache)[0]] + [ours(idx[:, t:t + 1], cache=cache)[0] for t in range(6, 13)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5
    assert [type(layer).__name__ for layer in cache.layers][4:] == ["SharedLayerCache"] * 2
    assert cache.layers[4].nbytes() == cache.layers[5].nbytes() == 0


def test_state_dict_keys_missing_or_unexpected_are_named(pair):
    hf = pair[0]
    state = hf.state_dict()
    del state["model.layers.2.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.2.self_attn.k_proj.weight'\]"):
        from_hf_gemma4(state, hf.config)
    state = {**hf.state_dict(), "model.layers.0.self_attn.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.extra.weight'\]"):
        from_hf_gemma4(state, hf.config)
    ignored = {**hf.state_dict(), "model.layers.4.self_attn.k_proj.weight": torch.zeros(16, 32)}  # as transformers
    assert from_hf_gemma4(ignored, hf.config).num_parameters() == pair[1].num_parameters()


@pytest.mark.parametrize("change, name", [
    (dict(enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=8), "enable_moe_block"),
    (dict(use_double_wide_mlp=True), "use_double_wide_mlp"),
    (dict(use_bidirectional_attention="vision"), "use_bidirectional_attention"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
     "rope_parameters"),
    (dict(vocab_size_per_layer_input=50), "vocab_size_per_layer_input"),
])
def test_unreproducible_settings_refused_by_name(change, name):
    with pytest.raises(ValueError, match=f"cannot reproduce {name}"):
        config_from_hf_gemma4(hf_config(**change))


def test_other_model_type_refused():
    with pytest.raises(ValueError, match="'llama'"):
        config_from_hf_gemma4(transformers.LlamaConfig())


def test_proportional_rope_equals_transformers():
    hf = transformers.Gemma4ForCausalLM(hf_config()).model.rotary_emb
    ours = PartialRotaryEmbedding(16, 1e6, 0.25)
    assert torch.equal(ours.inv_freq, hf.full_attention_inv_freq)  # 2 of 8 pairs turned, the rest 0
    x = torch.randn(1, 1, 5, 16)
    assert torch.equal(ours.rotate(x)[..., 2:8], x[..., 2:8]) and torch.equal(ours.rotate(x)[..., 10:], x[..., 10:])


# ------------------------------------------------------------------ KV sharing alone, on a small decoder

def llama_config(**changes):
    fields = dict(vocab_size=50, block_size=32, n_layers=6, n_heads=4, d_model=32, attention="gqa", n_kv_heads=2,
                  layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=4, num_kv_shared_layers=2)
    return attnlib.DecoderConfig.llama(**{**fields, **changes})


def test_kv_sharing_cached_equals_uncached():
    torch.manual_seed(0)
    model = attnlib.Decoder(llama_config()).eval()
    assert [b.attn.kv_source for b in model.blocks] == [None, None, None, None, 2, 3]
    idx = torch.randint(0, 50, (2, 14))
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache()
        steps = [model(idx[:, :7], cache=cache)[0]] + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(7, 14)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5


def test_kv_sharing_changes_the_model():
    torch.manual_seed(0)
    shared = attnlib.Decoder(llama_config())
    torch.manual_seed(0)
    own = attnlib.Decoder(llama_config(num_kv_shared_layers=0))
    idx = torch.randint(0, 50, (1, 8))
    assert not torch.allclose(shared(idx)[0], own(idx)[0])  # the shared layers really read other keys


def test_filled_cache_bytes_count_layers_with_a_cache_only():
    model = attnlib.Decoder(llama_config())
    B, per_key = 2, 2 * 8 * 4  # n_kv_heads · head_dim · float32 bytes
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 50, (B, 10)), cache=cache)
    # layers 0, 2 (ring of the window, 4) and 1, 3 (block_size, 32) hold a key and a value; 4 and 5 nothing
    assert cache.nbytes() == B * 2 * per_key * (4 + 32 + 4 + 32)
    assert model.kv_cache_bytes_per_token() == 4 * 2 * per_key
    unshared = attnlib.Decoder(llama_config(num_kv_shared_layers=0))
    assert unshared.kv_cache_bytes_per_token() - model.kv_cache_bytes_per_token() == 2 * 2 * per_key
    assert isinstance(cache.layers[4], SharedLayerCache) and cache.layers[4].source is cache.layers[2]


def test_kv_sharing_gradients_reach_the_source():
    model = attnlib.Decoder(llama_config(n_layers=3, layer_types=["full_attention"] * 3, sliding_window=None,
                                         num_kv_shared_layers=2))
    model(torch.randint(0, 50, (1, 8)), torch.randint(0, 50, (1, 8)))[1].backward()
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.blocks[1].attn.qkv.weight.shape == (4 * 8, 32)  # queries only


def test_crop_keeps_the_shared_layers_in_step():
    torch.manual_seed(0)
    model = attnlib.Decoder(llama_config(sliding_window=None, layer_types=None)).eval()
    idx = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        cache = model.new_cache()
        model(idx[:, :10], cache=cache)
        cache.crop(8)
        again = model(idx[:, 8:12], cache=cache)[0]
        assert (again - model(idx)[0][:, 8:]).abs().max() < 1e-5


def test_shared_layer_without_its_cache_refused():
    model = attnlib.Decoder(llama_config())
    with pytest.raises(ValueError, match="needs the cache that brings them"):
        model.blocks[4].attn(torch.randn(1, 3, 32))
    with pytest.raises(ValueError, match="no cache of its own"):
        model.blocks[4].attn.new_cache(32)
    with pytest.raises(ValueError, match="sink cache"):
        attnlib.cache.KVCache.streaming(model, window=4)
    with pytest.raises(ValueError, match="layer 4 attends with layer 2's keys and values"):
        attnlib.cache.PagedKVCache.for_model(model, n_pages=4)


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers=6 must be an int in"),
    (dict(layer_types=["sliding_attention"] * 4 + ["full_attention"] * 2), "has no earlier 'full_attention'"),
    (dict(global_n_kv_heads=1, attention="mha", n_kv_heads=None), "global_n_kv_heads=1 needs attention='gqa'"),
    (dict(attention_k_eq_v=True, layer_types=["sliding_attention"] * 6), "attention_k_eq_v=True is for the 'full"),
    (dict(global_partial_rotary_factor=1.5), r"global_partial_rotary_factor=1.5 must be in \(0, 1\]"),
    (dict(global_head_dim=7), "global_head_dim=7 must be even"),
    (dict(num_kv_shared_layers=1, layer_types=["full_attention"] * 5 + ["linear_attention"], sliding_window=None),
     "linear layer"),
    (dict(value_norm=True, attention="mla", n_kv_heads=None, position="learned", num_kv_shared_layers=0,
          sliding_window=None, layer_types=None), "value_norm=True is for attention="),
])
def test_bad_kv_reuse_configs_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        llama_config(**change)
