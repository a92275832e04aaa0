"""gpt-oss's attention layer: attnlib's MultiHeadAttention(sinks=True) ≡ transformers' GptOssAttention (chapter 20).

A tiny ``GptOssConfig`` built locally (no download): grouped-query heads, attention biases, YaRN
``rope_parameters``, layers alternating a small sliding window and full attention. Outputs and gradients
(inputs, the sinks) within 1e-5 in float32; decoding with attnlib's cache ≡ the uncached pass.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GptOssConfig  # noqa: E402
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding  # noqa: E402

from attnlib.models.hf_gpt_oss import attention_from_hf, rope_from_hf_gpt_oss  # noqa: E402

TOL = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}


def tiny_config(**overrides) -> GptOssConfig:
    fields = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_hidden_layers=2,
                  sliding_window=4, max_position_embeddings=64, rope_parameters=dict(YARN), attention_bias=True,
                  vocab_size=11, intermediate_size=16, num_local_experts=2, num_experts_per_tok=1)
    config = GptOssConfig(**{**fields, **overrides})
    config._attn_implementation = "eager"  # transformers' eager_attention_forward with s_aux: the reference
    return config


def hf_layer(config: GptOssConfig, layer: int, seed: int = 0) -> GptOssAttention:
    torch.manual_seed(seed)
    module = GptOssAttention(config, layer)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.2)  # sinks included: torch.empty until initialised
    return module


def hf_forward(module: GptOssAttention, config: GptOssConfig, x: torch.Tensor, attention_mask=None) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None, :]
    cos_sin = GptOssRotaryEmbedding(config)(x, positions)
    make = create_sliding_window_causal_mask if module.sliding_window else create_causal_mask
    mask = make(config=config, inputs_embeds=x, attention_mask=attention_mask, past_key_values=None,
                position_ids=positions, allow_is_causal_skip=False)
    return module(x, cos_sin, mask)[0]


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("attn_fn", ["eager", "tiled", "flash"])
def test_outputs_and_gradients_equal_transformers(layer, attn_fn):
    config = tiny_config()
    theirs = hf_layer(config, layer)
    ours = attention_from_hf(theirs, attn_fn=attn_fn)
    assert ours.sliding_window == (4 if layer == 0 else None) and ours.sinks is not None
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = hf_forward(theirs, config, x1), ours(x2)
    assert (out - ref).abs().max() < TOL
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert (x2.grad - x1.grad).abs().max() < TOL
    assert (ours.sinks.grad - theirs.sinks.grad).abs().max() < TOL
    assert theirs.sinks.grad.abs().min() > 0  # every sink takes part (a zero grad would hide a dropped sink)
    q_rows, ref_grad = 4 * 12, theirs.q_proj.weight.grad  # sums over every token: entries up to ~10
    assert (ours.qkv.weight.grad[:q_rows] - ref_grad).abs().max() < TOL * ref_grad.abs().max()


def test_sinks_matter_and_the_window_matters():
    """Against a layer without its sinks (or another window) the outputs differ: the comparison can fail."""
    config = tiny_config()
    theirs = hf_layer(config, 0)
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(2))
    ref = hf_forward(theirs, config, x)
    ours = attention_from_hf(theirs)
    with torch.no_grad():
        ours.sinks.fill_(-30.0)  # exp(-30): no sink at all
    assert (ours(x) - ref).abs().max() > 1e-3
    wider = attention_from_hf(theirs, tiny_config(sliding_window=6))
    assert (wider(x) - ref).abs().max() > 1e-3


def test_padding_mask_equals_transformers():
    config = tiny_config()
    theirs = hf_layer(config, 1)
    ours = attention_from_hf(theirs)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3))
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, 5:] = False  # right padding: the padded keys are hidden from every query
    ref = hf_forward(theirs, config, x, pad.long())
    out = ours(x, attention_mask=pad)
    assert (out[0] - ref[0]).abs().max() < TOL and (out[1, :5] - ref[1, :5]).abs().max() < TOL


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_cached_decode_equals_uncached(layer):
    config = tiny_config()
    ours = attention_from_hf(hf_layer(config, layer))
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(4))
    full = ours(x)
    cache = ours.new_cache(64)  # a ring of the window for the sliding layer
    steps = [ours(x[:, :3], cache=cache)] + [ours(x[:, t : t + 1], cache=cache) for t in range(3, 10)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < TOL


def test_rope_is_transformers_yarn():
    config = tiny_config()
    rope = rope_from_hf_gpt_oss(config)
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), torch.arange(40)[None])
    ours_cos, signed_sin = rope.cos_sin(torch.arange(40), torch.float32)[:2]  # (40, 12): halves (cos, cos), (-sin, sin)
    assert rope.attention_factor > 1.0  # YaRN's scale on cos and sin is in play
    assert (ours_cos[..., :6] - cos[0]).abs().max() < 1e-6 and (signed_sin[..., 6:] - sin[0]).abs().max() < 1e-6


@pytest.mark.parametrize(
    ("overrides", "kwargs", "error", "match"),
    [
        (dict(attention_dropout=0.1), {}, ValueError, r"attention_dropout=0\.1"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), {}, ValueError, "cannot reproduce rope_parameters"),
        (dict(rope_parameters={**YARN, "partial_rotary_factor": 0.5}), {}, ValueError, "cannot reproduce rope_parameters"),
        (dict(layer_types=["chunked_attention", "full_attention"]), {}, ValueError,
         r"cannot reproduce layer_types\[0\]='chunked_attention'"),
        ({}, dict(attn_fn="sdpa"), ValueError, "attn_fn='sdpa' cannot add gpt-oss's sinks"),
        (dict(num_attention_heads=8, head_dim=6), {}, ValueError, r"qkv\.weight from the module has shape \(96, 32\); the config expects \(72, 32\)"),
    ],
)
def test_refused_settings(overrides, kwargs, error, match):
    module = hf_layer(tiny_config(), 0)
    config = {**tiny_config().to_dict(), **overrides} if overrides else None  # a config.json dict
    with pytest.raises(error, match=match):
        attention_from_hf(module, config, **kwargs)


def test_not_a_module_is_refused():
    with pytest.raises(TypeError, match="module must be a transformers GptOssAttention; got str"):
        attention_from_hf("layer")
    with pytest.raises(TypeError, match="config must be a transformers GptOssConfig or its dict; got int"):
        rope_from_hf_gpt_oss(3)
