"""DeepSeek-V4's compressed attention (chapter 21): attnlib's CompressedAttention ≡ transformers' DeepseekV4Attention.

A tiny ``DeepseekV4Config`` built locally (no download), its three layer types (sliding, compressed sparse
with m = 4 and an indexer keeping 2 entries, heavily compressed with m = 8), plain RoPE and YaRN; only the
attention module is compared (a V4 decoder layer's hyper-connections and mixture of experts are not built in attnlib). Outputs
and input gradients within 1e-5 in float32 (measured about 1e-6); the cache: one token at a time and a prompt
in two chunks (cut inside a group) ≡ one pass; compression with m = 1 ≡ full attention; causality.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DynamicCache  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)

from attnlib.attention.compressed import CompressedAttention, compress, rope_interleaved  # noqa: E402
from attnlib.attention.functions import attention  # noqa: E402
from attnlib.cache.compressed import CompressedLayerCache, compressed_cache_bytes, mla_cache_bytes  # noqa: E402
from attnlib.cache.layer import LayerCache  # noqa: E402
from attnlib.models.hf_deepseek_v4 import from_hf_deepseek_v4_attention  # noqa: E402

TOL = 1e-5
TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
SIZES = dict(q_lora_rank=24, rope_head_dim=8, o_groups=2, o_lora_rank=8, sliding_window=6, index_n_heads=2,
             index_head_dim=8, index_topk=2)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0}  # V4 ships YaRN on its compressed layers (factor 16); here with a tiny context


def tiny_config(**overrides) -> DeepseekV4Config:
    config = DeepseekV4Config(**overrides,
        vocab_size=32, hidden_size=32, num_attention_heads=4, head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5,
        sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, num_hidden_layers=3,
        layer_types=TYPES, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
    config._attn_implementation = "eager"  # transformers' eager_attention_forward with the sinks: the reference
    return config


def hf_layer(config: DeepseekV4Config, layer: int) -> DeepseekV4Attention:
    torch.manual_seed(layer)
    module = DeepseekV4Attention(config, layer).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)  # sinks and position biases included (torch.empty / zeros until initialised)
    return module


def hf_forward(module: DeepseekV4Attention, config: DeepseekV4Config, x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None, :].expand(x.shape[0], -1)
    rotary = DeepseekV4RotaryEmbedding(config)
    embeddings = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None,
                                             past_key_values=None, position_ids=positions)
    return module(x, embeddings, positions, mask)[0]


def ours(layer_type: str, seed: int = 0, **overrides) -> CompressedAttention:
    torch.manual_seed(seed)
    layer = CompressedAttention(32, 4, 16, layer_type=layer_type, **{**SIZES, **overrides})
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer.eval()


@pytest.mark.parametrize("rope", ["default", "yarn"])
@pytest.mark.parametrize("layer", range(3), ids=TYPES)
def test_outputs_and_gradients_equal_transformers(layer, rope):
    config = tiny_config(**({} if rope == "default" else dict(rope_parameters=dict(YARN), max_position_embeddings=256)))
    theirs = hf_layer(config, layer)
    mine = from_hf_deepseek_v4_attention(theirs)
    assert mine.layer_type == TYPES[layer] and mine.compress_rate == [None, 4, 8][layer]
    assert (mine.rope.rope_scaling is not None) == (rope == "yarn" and layer > 0)  # sliding layers: plain RoPE
    x = torch.randn(2, 23, 32, generator=torch.Generator().manual_seed(1))  # 23: a partial group at the end
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = hf_forward(theirs, config, x1), mine(x2)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * probe).sum().backward()
    (out * probe).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("layer", range(3), ids=TYPES)
def test_cached_chunks_equal_transformers_cache(layer):
    """Both caches fed the same chunks (6, 1, 1, 7, 8 tokens: groups cut everywhere): the same outputs."""
    config = tiny_config()
    theirs = hf_layer(config, layer)
    mine = from_hf_deepseek_v4_attention(theirs)
    x = torch.randn(2, 23, 32, generator=torch.Generator().manual_seed(1))
    hf_cache, cache, W = DynamicCache(config=config), mine.new_cache(32), config.sliding_window
    rotary = DeepseekV4RotaryEmbedding(config)
    with torch.no_grad():
        for s, e in [(0, 6), (6, 7), (7, 8), (8, 15), (15, 23)]:
            positions = torch.arange(s, e)[None].expand(2, -1)
            embeddings = {kind: rotary(x[:, s:e], positions, layer_type=kind) for kind in ("main", "compress")}
            keys = torch.arange(s - min(s, W - 1), e)  # transformers keeps the last W - 1 keys
            seen = (keys[None] <= positions[0, :, None]) & (keys[None] > positions[0, :, None] - W)
            mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[None, None].expand(2, 1, -1, -1)
            ref = theirs(x[:, s:e], embeddings, positions, mask, past_key_values=hf_cache)[0]
            torch.testing.assert_close(mine(x[:, s:e], cache=cache), ref, atol=TOL, rtol=0)


def test_the_indexer_selects_fewer_entries_than_are_visible():
    layer = ours("compressed_sparse_attention")
    x = torch.randn(1, 23, 32)
    q_residual = layer.q_a_norm(layer.q_a_proj(x))
    entries, chosen = layer.compressed(x, q_residual, torch.arange(23))
    assert entries.shape == (1, 5, 16)  # 5 whole groups of 4 in 23 tokens
    assert chosen.sum(-1).max() == 2  # top-2 ...
    assert chosen[0, :3].sum() == 0 and chosen[0, 3].tolist() == [True, False, False, False, False]  # ... of complete groups
    dense = ours("compressed_sparse_attention", index_topk=5)
    dense.load_state_dict(layer.state_dict())
    assert not torch.allclose(layer(x)[:, 11:], dense(x)[:, 11:], atol=1e-3)  # 3+ entries visible from t = 11


def test_compress_is_a_gated_mean_per_group():
    B, m, d = 2, 3, 5
    c, z, bias = torch.randn(B, 4 * m + 2, 2 * d), torch.randn(B, 4 * m + 2, 2 * d), torch.randn(m, 2 * d)
    plain = compress(c[..., :d], z[..., :d], bias[:, :d], m)
    for w in range(4):  # one group at a time: exp / sum, per channel
        e = torch.exp(z[:, w * m:(w + 1) * m, :d] + bias[:, :d])
        torch.testing.assert_close(plain[:, w], (e * c[:, w * m:(w + 1) * m, :d]).sum(1) / e.sum(1))
    overlapping = compress(c, z, bias, m, overlap=True)
    for w in range(4):  # 2m slots: group w-1's first half, group w's second half
        cs = [c[:, (w - 1) * m + j, :d] for j in range(m) if w] + [c[:, w * m + j, d:] for j in range(m)]
        zs = [z[:, (w - 1) * m + j, :d] + bias[j, :d] for j in range(m) if w] + \
             [z[:, w * m + j, d:] + bias[j, d:] for j in range(m)]
        e = torch.exp(torch.stack(zs, 1))
        torch.testing.assert_close(overlapping[:, w], (e * torch.stack(cs, 1)).sum(1) / e.sum(1))
    torch.testing.assert_close(compress(c, z, bias[:1], 1), c)  # m = 1: every token is its own entry


def test_m_equal_1_without_window_or_selection_is_full_attention():
    """Each token its own entry: the keys are every past token twice (the local branch and the entries),
    which is full causal attention with each sink lowered by log 2 (an independent reference)."""
    layer = ours("heavily_compressed_attention", compress_rate=1, sliding_window=None)
    with torch.no_grad():  # the compressor's content = the local keys; its gates do not matter with m = 1
        layer.compressor.kv_proj.weight.copy_(layer.kv_proj.weight)
        layer.compressor.kv_norm.weight.copy_(layer.kv_norm.weight)
    B, T, H, d = 2, 9, 4, 16
    x = torch.randn(B, T, 32, dtype=torch.float64)
    layer = layer.double()
    angles = layer.rope.angles(torch.arange(T))
    q = layer.q_b_proj(layer.q_a_norm(layer.q_a_proj(x))).view(B, T, H, d).transpose(1, 2)
    q = rope_interleaved(F.rms_norm(q, (d,), eps=layer.eps), angles)
    k = rope_interleaved(layer.kv_norm(layer.kv_proj(x)).unsqueeze(1), angles)
    y, _ = attention(q, k, k, is_causal=True, sinks=layer.sinks - math.log(2))
    y = rope_interleaved(y, -angles).transpose(1, 2).reshape(B, T, 2, -1)  # two groups of heads
    w = layer.o_a_proj.weight.view(2, 8, -1)
    grouped = torch.cat([y[:, :, g] @ w[g].T for g in range(2)], dim=-1)
    torch.testing.assert_close(layer(x), layer.o_b_proj(grouped), atol=1e-12, rtol=0)


@pytest.mark.parametrize("layer_type", TYPES)
def test_future_tokens_never_change_past_outputs(layer_type):
    layer = ours(layer_type, compress_rate=None if layer_type == "sliding_attention" else 4)
    x = torch.randn(1, 21, 32)
    out = layer(x)
    for t in (2, 7, 8, 13):  # inside a group and at its first token
        changed = x.clone()
        changed[:, t:] = torch.randn(1, 21 - t, 32)
        after = layer(changed)
        torch.testing.assert_close(after[:, :t], out[:, :t], atol=1e-6, rtol=0)
        assert not torch.allclose(after[:, t], out[:, t])


@pytest.mark.parametrize("windows", [True, False], ids=["ring", "full"])
@pytest.mark.parametrize("layer_type", TYPES)
def test_cached_decoding_and_chunked_prefill_equal_one_pass(layer_type, windows):
    layer = ours(layer_type, compress_rate=None if layer_type == "sliding_attention" else 4)
    x = torch.randn(2, 19, 32)
    with torch.no_grad():
        whole = layer(x)
        cache = layer.new_cache(32, windows=windows)
        steps = torch.cat([layer(x[:, t:t + 1], cache=cache) for t in range(19)], dim=1)
        cache2 = layer.new_cache(32, windows=windows)
        chunks = torch.cat([layer(x[:, :6], cache=cache2), layer(x[:, 6:], cache=cache2)], dim=1)  # 6: mid-group
    torch.testing.assert_close(steps, whole, atol=TOL, rtol=0)
    torch.testing.assert_close(chunks, whole, atol=TOL, rtol=0)
    assert cache.length == 19
    if layer_type != "sliding_attention":
        assert cache.n_entries == 4 and cache.held_bytes() == cache2.held_bytes()


@pytest.mark.parametrize("layer_type, overlap, index_head_dim", [
    ("compressed_sparse_attention", True, 8), ("heavily_compressed_attention", False, 0)])
def test_cache_bytes_formula_equals_what_the_cache_holds(layer_type, overlap, index_head_dim):
    layer = ours(layer_type, compress_rate=4)
    cache = layer.new_cache(64)
    x = torch.randn(1, 30, 32)
    with torch.no_grad():
        for t in range(30):
            layer(x[:, t:t + 1], cache=cache)
            expected = compressed_cache_bytes(t + 1, head_dim=16, compress_rate=4, sliding_window=6,
                                              index_head_dim=index_head_dim, overlap=overlap, dtype=torch.float32)
            assert cache.held_bytes() == expected
    assert cache.bytes_per_token() == (16 + index_head_dim) * 4 / 4
    # V4-Flash's CSA at 1M tokens against DeepSeek-V3's MLA, per token (bfloat16): (512 + 128) / 4 vs 576 numbers
    T = 2 ** 20
    ratio = compressed_cache_bytes(T, index_head_dim=128, overlap=True) / mla_cache_bytes(T)
    assert ratio == pytest.approx(160 / 576, rel=1e-3)


def test_bad_inputs_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="layer_type='full_attention'"):
        CompressedAttention(32, 4, 16, layer_type="full_attention", **SIZES)
    with pytest.raises(ValueError, match="rope_head_dim=7"):
        CompressedAttention(32, 4, 16, **{**SIZES, "rope_head_dim": 7})
    with pytest.raises(ValueError, match="o_groups=3"):
        CompressedAttention(32, 4, 16, **{**SIZES, "o_groups": 3})
    with pytest.raises(ValueError, match="compress_rate=0"):
        CompressedAttention(32, 4, 16, compress_rate=0, **SIZES)
    with pytest.raises(ValueError, match="attn_fn='sdpa'"):
        CompressedAttention(32, 4, 16, attn_fn="sdpa", **SIZES)
    layer = ours("compressed_sparse_attention")
    with pytest.raises(ValueError, match="d_model=32"):
        layer(torch.randn(1, 5, 31))
    with pytest.raises(ValueError, match="cache must be this layer's new_cache"):
        layer(torch.randn(1, 5, 32), cache=LayerCache(16))
    with pytest.raises(ValueError, match="compress_rate=4"):
        layer(torch.randn(1, 5, 32), cache=CompressedLayerCache(16, 8, window=6, overlap=True))
    cache = layer.new_cache(16)
    with torch.no_grad():
        layer(torch.randn(1, 5, 32), cache=cache)
    with pytest.raises(ValueError, match="length=3"):
        cache.crop(3)
    with pytest.raises(ValueError, match="compress_rate=0"):
        CompressedLayerCache(16, 0)
    with pytest.raises(ValueError, match="seq_len=0"):
        compressed_cache_bytes(0)
    with pytest.raises(TypeError, match="dtype"):
        mla_cache_bytes(4, dtype="bf16")
    with pytest.raises(ValueError, match="module must be a transformers DeepseekV4Attention"):
        from_hf_deepseek_v4_attention(torch.nn.Linear(2, 2))
