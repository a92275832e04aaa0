"""Attention modules: equal to each other and to PyTorch's references after weight mapping; causal; clear errors."""
import re

import pytest
import torch
from torch import nn

from attnlib import (
    ATTENTION_FUNCTIONS,
    CausalAttention,
    GPTConfig,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
)
from attnlib.attention import causal_mask, padding_mask
from attnlib.models.config import ATTENTION_VARIANTS
from attnlib.models.layers import ATTENTION_LAYERS, build_attention
from attnlib.positional import RotaryEmbedding

ATOL = 1e-5


def copy_v2_into_v1(v2: SelfAttentionV2, v1: SelfAttentionV1) -> None:
    """nn.Linear stores (head_dim, d_model) and computes x @ W.T; V1 computes x @ W, so copy the transpose."""
    with torch.no_grad():
        v1.W_query.copy_(v2.W_query.weight.T)
        v1.W_key.copy_(v2.W_key.weight.T)
        v1.W_value.copy_(v2.W_value.weight.T)


def wrapper_into_batched(wrapper: MultiHeadAttentionWrapper, mha: MultiHeadAttention) -> None:
    """Stack the heads' projections into qkv; out_proj becomes the identity (the wrapper has none)."""
    with torch.no_grad():
        for block, name in enumerate(("W_query", "W_key", "W_value")):
            rows = torch.cat([getattr(head, name).weight for head in wrapper.heads], dim=0)  # (d_model, d_model)
            mha.qkv.weight[block * mha.d_model : (block + 1) * mha.d_model] = rows
        mha.qkv.bias.zero_()
        mha.out_proj.weight.copy_(torch.eye(mha.d_model))
        mha.out_proj.bias.zero_()


def test_v1_equals_v2_after_weight_transfer():
    v2, v1 = SelfAttentionV2(6, 4), SelfAttentionV1(6, 4)
    x = torch.randn(2, 5, 6)
    assert not torch.allclose(v1(x), v2(x), atol=ATOL)  # different random weights before the transfer
    copy_v2_into_v1(v2, v1)
    torch.testing.assert_close(v1(x), v2(x), atol=ATOL, rtol=0)


def test_causal_attention_is_v2_with_a_mask():
    head = CausalAttention(6, 4, block_size=8)
    x = torch.randn(3, 8, 6)
    q, k, v = head.project(x)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(head(x), expected, atol=ATOL, rtol=0)


def test_wrapper_equals_batched_after_weight_mapping():
    wrapper = MultiHeadAttentionWrapper(d_model=12, head_dim=4, block_size=10, n_heads=3)
    mha = MultiHeadAttention(12, 3, block_size=10)
    wrapper_into_batched(wrapper, mha)
    x = torch.randn(2, 10, 12)
    torch.testing.assert_close(mha(x), wrapper(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_mha_equals_torch_multihead_attention(bias, causal):
    d_model, n_heads, T = 16, 4, 7
    ours = MultiHeadAttention(d_model, n_heads, bias=bias, causal=causal)
    ref = nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(ours.qkv.bias)
            ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(3, T, d_model)
    # nn.MultiheadAttention's boolean attn_mask has the opposite convention: True = may NOT attend.
    ref_mask = ~causal_mask(T) if causal else None
    expected, _ = ref(x, x, x, attn_mask=ref_mask, need_weights=False)
    torch.testing.assert_close(ours(x), expected, atol=ATOL, rtol=0)


def test_attention_mask_equals_torch_key_padding_mask_with_the_opposite_convention():
    ours = MultiHeadAttention(16, 4, causal=False)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.in_proj_bias.copy_(ours.qkv.bias)
        ref.out_proj.load_state_dict(ours.out_proj.state_dict())
    x = torch.randn(3, 6, 16)
    real = padding_mask([6, 4, 1], 6)  # True = a real token
    expected, _ = ref(x, x, x, key_padding_mask=~real, need_weights=False)  # torch: True = ignore
    torch.testing.assert_close(ours(x, attention_mask=real), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_every_attention_function_gives_the_same_layer(causal, n_kv_heads):
    modules = {fn: MultiHeadAttention(16, 4, n_kv_heads, causal=causal, attn_fn=fn) for fn in ATTENTION_FUNCTIONS}
    for module in modules.values():
        module.load_state_dict(modules["sdpa"].state_dict())
    x = torch.randn(2, 9, 16)
    real = padding_mask([9, 0], 9)  # the second sequence has no real key: its outputs are the out_proj bias
    head_mask = torch.rand(2, 4, 9, 9) < 0.5
    for name, module in modules.items():
        for kwargs in ({}, {"attention_mask": real}, {"mask": head_mask}):
            torch.testing.assert_close(module(x, **kwargs), modules["sdpa"](x, **kwargs), atol=ATOL, rtol=0, msg=name)
    y, weights = modules["sdpa"](x, return_weights=True)  # weights come from the eager function
    torch.testing.assert_close(y, modules["sdpa"](x), atol=ATOL, rtol=0)
    assert weights.shape == (2, 4, 9, 9)
    if causal:
        assert torch.equal(weights[..., ~causal_mask(9)], torch.zeros_like(weights[..., ~causal_mask(9)]))
    _, weights = modules["sdpa"](x, attention_mask=real, return_weights=True)
    assert torch.equal(weights[1], torch.zeros(4, 9, 9))


@pytest.mark.parametrize("fn", sorted(ATTENTION_FUNCTIONS))
@pytest.mark.parametrize("rule", [{}, {"sliding_window": 3}, {"chunk_size": 4}], ids=["full", "window", "chunk"])
def test_masks_cover_the_whole_sequence_when_decoding_with_a_cache(rule, fn):
    """mask and attention_mask describe every position (cached + new), also when the layer's cache (a ring, a
    chunk) returns only some keys: decoding step by step gives the outputs of the whole sequence at once."""
    layer = MultiHeadAttention(16, 4, 2, attn_fn=fn, block_size=9, **rule).eval()
    x = torch.randn(2, 9, 16)
    attention_mask = torch.ones(2, 9, dtype=torch.bool)
    attention_mask[1, :3] = False  # left padding
    head_mask = torch.rand(2, 4, 9, 9) < 0.8
    if "chunk_size" in rule:  # a left-padded row's chunks start at another column than the cache's: refused
        with pytest.raises(ValueError, match=re.escape("masks are not supported with a chunked cache")):
            layer(x[:, :5], cache=layer.new_cache(9), attention_mask=attention_mask[:, :5])
    with torch.no_grad():
        whole = layer(x, mask=head_mask, attention_mask=attention_mask)
        cache = layer.new_cache(9, windows="chunk_size" not in rule)  # a ring cache for the window
        steps = [layer(x[:, :5], cache=cache, mask=head_mask[..., :5, :5], attention_mask=attention_mask[:, :5])]
        for t in range(5, 9):
            steps.append(layer(x[:, t : t + 1], cache=cache, mask=head_mask[..., t : t + 1, : t + 1],
                               attention_mask=attention_mask[:, : t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=ATOL, rtol=0)


def test_cache_width_is_what_a_layer_keeps_per_token():
    assert MultiHeadAttention(64, 8).cache_width == 2 * 8 * 8
    assert MultiHeadAttention(64, 8, 2).cache_width == 2 * 2 * 8
    assert MultiHeadAttention(64, 8, 1).cache_width == 2 * 8
    assert MultiHeadAttention(64, 8, 2).cache_bytes_per_token(torch.float16) == 2 * 2 * 8 * 2
    assert MultiHeadAttention(64, 8).double().cache_bytes_per_token() == 2 * 8 * 8 * 8


def leak_at(module: nn.Module, x: torch.Tensor, t: int) -> float:
    """Largest change of outputs at positions <= t when every input after t is replaced."""
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
    with torch.no_grad():
        return (module(x)[:, : t + 1] - module(x2)[:, : t + 1]).abs().max().item()


def registry_config(name: str, **fields) -> GPTConfig:
    return GPTConfig(d_model=16, n_heads=4, block_size=12, attention=name, n_kv_heads=2 if name == "gqa" else None,
                     **fields)


CAUSAL_MODULES = {
    "CausalAttention": lambda: CausalAttention(16, 4, block_size=12),
    "MultiHeadAttentionWrapper": lambda: MultiHeadAttentionWrapper(16, 4, block_size=12, n_heads=2),
    **{f"MultiHeadAttention/{fn}": (lambda fn=fn: MultiHeadAttention(16, 4, 2, attn_fn=fn)) for fn in ATTENTION_FUNCTIONS},
    "MultiHeadAttention/repeat_interleave": lambda: MultiHeadAttention(16, 4, 2, kv_sharing="repeat_interleave"),
    "MultiHeadAttention/rope+qk_norm": lambda: MultiHeadAttention(16, 4, 2, rope=RotaryEmbedding(4), qk_norm=True),
    "MultiHeadAttention/sliding_window": lambda: MultiHeadAttention(16, 4, 2, sliding_window=3),
    "MultiHeadAttention/chunk_size": lambda: MultiHeadAttention(16, 4, 2, chunk_size=5),
    **{f"registry:{name}": (lambda name=name: build_attention(registry_config(name), 0)) for name in ATTENTION_LAYERS},
    **{f"registry:{name}/sliding": (lambda name=name: build_attention(registry_config(name, sliding_window=3), 0))
       for name in ATTENTION_LAYERS},
    **{f"registry:{name}/chunked": (lambda name=name: build_attention(registry_config(name, attention_chunk_size=5), 0))
       for name in ATTENTION_LAYERS},
}


@pytest.mark.parametrize("name", sorted(CAUSAL_MODULES))
def test_causal_modules_do_not_leak(name):
    module = CAUSAL_MODULES[name]().eval()
    x = torch.randn(2, 12, 16)
    for t in range(11):
        assert leak_at(module, x, t) <= 1e-6, f"{name} leaks future tokens into position {t}"


def test_leak_test_catches_a_non_causal_module():
    module = MultiHeadAttention(16, 4, causal=False).eval()
    assert leak_at(module, torch.randn(2, 12, 16), 5) > 1e-3


def test_dropout_only_in_training():
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    assert not torch.allclose(mha(x), mha(x))


def test_registry_builds_each_variant_with_the_configs_sizes():
    for name in ATTENTION_LAYERS:
        layer = build_attention(registry_config(name), 0)
        assert layer.d_model == 16 and layer.n_heads == 4 and layer.block_size == 12 and layer.causal
        assert layer.mask_mod is None
        assert build_attention(registry_config(name, sliding_window=3), 0).mask_mod.window == 3
        assert build_attention(registry_config(name, attention_chunk_size=5), 0).mask_mod.chunk_size == 5
    assert build_attention(registry_config("mqa"), 0).n_kv_heads == 1
    assert build_attention(registry_config("gqa"), 0).n_kv_heads == 2
    assert build_attention(registry_config("mha"), 0).n_kv_heads == 4
    assert build_attention(registry_config("mla"), 0).kv_latent_dim == 4


def test_the_registry_names_exactly_the_configs_variants():
    assert tuple(ATTENTION_LAYERS) == ATTENTION_VARIANTS  # one list of names: GPTConfig checks against it
