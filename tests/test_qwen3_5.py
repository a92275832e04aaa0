"""Qwen3.5 (dense hybrid: three gated DeltaNet layers to one gated softmax layer) against transformers'
Qwen3_5ForCausalLM, random tiny models built locally (no download). Chapter 21."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

import attnlib
from attnlib import DecoderConfig
from attnlib.cache import LayerCache, RecurrentState
from attnlib.models.hf_qwen3_5 import config_from_hf_qwen3_5
from attnlib.positional import LeadingRotaryEmbedding

VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=96, rms_norm_eps=1e-6,
             initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
#: Qwen3-Next's and Qwen3.5's long-context recipe in small: YaRN on the turned quarter of each head.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24, "rope_theta": 1e4,
        "partial_rotary_factor": 0.25}
CONFIGS = {
    "grouped-values": dict(),  # transformers' layout: layers 0-2 DeltaNet, 3 full; 2 key heads serve 4 value heads
    "tied-half-rotary": dict(tie_word_embeddings=True, linear_num_value_heads=2, linear_conv_kernel_dim=2,
                             layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1e5, "partial_rotary_factor": 0.5}),
    "yarn-quarter-rotary": dict(rope_parameters=YARN),  # a context stretched 4x (96 of 24): positions past 24 tested
}


def tiny(seed: int = 0, **fields) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    return _norms_moved(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**SIZES, **fields})).eval())


def _norms_moved(hf):
    for name, p in hf.named_parameters():  # norms away from their init (0: x · (1 + 0); 1 for the gated norm)
        if name.endswith("norm.weight") and ".visual." not in name:
            p.data.uniform_(0.5, 1.5) if "linear_attn" in name else p.data.uniform_(-0.5, 0.5)
    return hf


#: A vision tower of one block: Qwen3.5 as published is Qwen3_5ForConditionalGeneration.
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
#: Its text config's RoPE, with the multimodal sections (text positions turn them all alike).
MROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
         "mrope_interleaved": True}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = tiny(**CONFIGS[request.param])
    return hf, attnlib.from_hf_qwen3_5(hf).eval()


def tokens(shape, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_config_read_as_transformers_does():
    c = config_from_hf_qwen3_5(Qwen3_5TextConfig(**SIZES))
    assert config_from_hf_qwen3_5(Qwen3_5Config(text_config=SIZES).to_dict()) == c  # a vision-language config's text
    with pytest.raises(ValueError, match="tie_word_embeddings='false' must be a bool"):
        config_from_hf_qwen3_5({**Qwen3_5Config(text_config=SIZES).to_dict(), "tie_word_embeddings": "false"})
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # full_attention_interval = 4
    assert (c.partial_rotary_factor, c.attn_output_gate, c.linear_conv_kernel_dim) == (0.25, True, 4)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (2, 4, 8, 12)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.qk_norm, c.feedforward) == (4, 2, 16, True, "swiglu")


def test_logits_equal(pair):
    hf, ours = pair
    idx = tokens((2, 40))
    with torch.no_grad():
        expected = hf(idx).logits
        logits, _ = ours(idx)
    assert expected.abs().max() > 1.0  # logits of some size: a 1e-5 agreement means something
    # measured: max |Δ| 7.9e-6 / 1.7e-6 at logits up to 3.3 / 3.9 (float32 rounding; both chunk the delta rule)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_every_weight_is_loaded(pair):
    """No parameter of ours is left at its initialisation: each has a transformers counterpart."""
    hf, _ = pair
    fresh = attnlib.Decoder(config_from_hf_qwen3_5(hf.config))
    ours = attnlib.from_hf_qwen3_5(hf)
    same = [n for n, p in ours.named_parameters() if torch.equal(p, dict(fresh.named_parameters())[n])]
    assert same == []


@pytest.mark.parametrize("change", ["full RoPE", "no output gate", "no convolution"])
def test_each_qwen_piece_matters(pair, change):
    """A model without one of Qwen3.5's pieces (otherwise the same weights) gives other logits."""
    hf, ours = pair
    fields = {"full RoPE": dict(partial_rotary_factor=None), "no output gate": dict(attn_output_gate=False),
              "no convolution": dict(linear_conv_kernel_dim=None)}[change]
    other = attnlib.Decoder(ours.config.replace(**fields)).eval()
    other.load_state_dict(ours.state_dict(), strict=False)  # the gate's or convolution's weights left out
    idx = tokens((1, 24), seed=3)
    with torch.no_grad():
        assert (other(idx)[0] - hf(idx).logits).abs().max() > 1e-3


def test_cached_one_token_at_a_time_equals_one_pass(pair):
    """In float64 (float32 rounds the recurrent and chunked forms apart by ~2e-5 at logits of ~3)."""
    ours = copy.deepcopy(pair[1]).double()
    idx = tokens((2, 30), seed=4)
    cache = ours.new_cache()
    c = ours.config
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [RecurrentState if t == "linear_attention" else LayerCache for t in c.layer_types]
    with torch.no_grad():
        whole, _ = ours(idx)
        steps = torch.cat([ours(idx[:, i:i + 1], cache=cache)[0] for i in range(idx.shape[1])], dim=1)
    torch.testing.assert_close(steps, whole, atol=1e-10, rtol=0)  # measured: max |Δ| ~ 1e-13
    first_linear = c.layer_types.index("linear_attention")
    S, conv = cache.layers[first_linear].state  # the delta rule's state and the convolution's last inputs
    channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    assert S.shape == (2, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    assert conv.shape == (2, channels, c.linear_conv_kernel_dim - 1)
    assert cache.layers[first_linear].nbytes() == 2 * ours.blocks[first_linear].attn.state_bytes()
    full = c.layer_types.index("full_attention")
    assert cache.layers[full].length == 30 and ours.blocks[full].attn.cache_width == 2 * c.n_kv_heads * c.head_dim


def test_chunked_prefill_equals_one_pass(pair):
    """The prompt in pieces through the cache (one shorter than the convolution's kernel) = one pass (float64)."""
    ours = copy.deepcopy(pair[1]).double()
    idx = tokens((2, 40), seed=5)
    cache = ours.new_cache()
    with torch.no_grad():
        whole, _ = ours(idx)
        pieces = torch.cat([ours(idx[:, a:b], cache=cache)[0] for a, b in ((0, 2), (2, 19), (19, 40))], dim=1)
    torch.testing.assert_close(pieces, whole, atol=1e-10, rtol=0)


def test_greedy_generation_equals_transformers(pair):
    hf, ours = pair
    prompt = tokens((2, 6), seed=2)
    cached = ours.generate(prompt, 12, temperature=0.0)
    assert torch.equal(cached, ours.generate(prompt, 12, temperature=0.0, use_cache=False))
    assert torch.equal(cached, hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0))
    assert len(set(cached[0, 6:].tolist())) > 1  # not one token repeated


@pytest.mark.parametrize(("rope", "ties"), [
    (MROPE, {}),
    ({**YARN, "mrope_section": [1, 1, 0], "mrope_interleaved": True}, {}),
    (MROPE, {"tie_word_embeddings": True}),  # the whole model's flag ties the head
    (MROPE, {"text": True}),  # the text config's flag alone does not (transformers ties by the outer config)
], ids=["mrope", "mrope-yarn", "tied", "text-flag-only"])
def test_vision_language_checkpoint_loads_its_language_model(rope, ties):
    """A Qwen3_5ForConditionalGeneration (its Qwen3_5Config) loads as its language model: the same text logits,
    from the model or from its state dict and config dict; the vision tower's weights are not asked for."""
    torch.manual_seed(0)
    text = {**SIZES, "rope_parameters": rope, "tie_word_embeddings": ties.pop("text", False)}
    config = Qwen3_5Config(text_config=text, vision_config=VISION, **ties)
    hf = _norms_moved(Qwen3_5ForConditionalGeneration(config).eval())
    tied = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == bool(config.tie_word_embeddings) == attnlib.from_hf_qwen3_5(hf).config.tie_embeddings
    assert any(k.startswith("model.visual.") for k in hf.state_dict())
    idx = tokens((2, 40))
    with torch.no_grad():  # (float32 rounding of the two chunked delta rules: up to 1.5e-5 measured at logits ~4;
        expected = hf(input_ids=idx).logits  # transformers' fallback computes it in float32 even for float64 models)
        for ours in (attnlib.from_hf_qwen3_5(hf), attnlib.from_hf_qwen3_5(hf.state_dict(), config=config.to_dict())):
            torch.testing.assert_close(ours.eval()(idx)[0], expected, atol=5e-5, rtol=1e-5)
    state = {k: v for k, v in hf.state_dict().items() if k != "model.language_model.norm.weight"}
    with pytest.raises(ValueError, match=r"language \(model\.language_model\.\* read as model\.\*\).*missing "
                                         r"\['model\.norm\.weight'\]"):  # its own weights are still all needed
        attnlib.from_hf_qwen3_5(state, config=config)


def test_state_dict_and_config_dict():
    hf = tiny(seed=1)
    ours = attnlib.from_hf_qwen3_5(hf.state_dict(), config=hf.config.to_dict()).eval()
    idx = tokens((1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


SCALINGS = {  # each RoPE type attnlib reproduces, over a context of 32 (rope_frequencies' types)
    "default": {},
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 8},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_leading_rotary_embedding_equals_transformers(kind, fraction):
    """RoPE on the leading part of each head, at that part's frequencies (not Gemma 4's proportional), scaled as
    transformers scales it: positions 7-39 pass the context of 32 (dynamic grows its base) and YaRN's 8."""
    rope = {"rope_type": kind, **SCALINGS[kind]}
    config = Qwen3_5TextConfig(**{**SIZES, "max_position_embeddings": 32},
                               rope_parameters={**rope, "rope_theta": 1e4, "partial_rotary_factor": fraction})
    positions = torch.arange(7, 40)[None]
    cos, sin = Qwen3_5TextRotaryEmbedding(config)(torch.zeros(1), positions)  # angles in float32, as ours
    q, k = torch.randn(2, 1, 4, 33, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    expected, _ = apply_rotary_pos_emb(q, k, cos, sin)
    ours = LeadingRotaryEmbedding(16, 1e4, fraction, None if kind == "default" else rope, max_position_embeddings=32)
    turned = int(16 * fraction)
    assert not torch.allclose(expected[..., :turned], q[..., :turned])  # the leading part is turned
    torch.testing.assert_close(ours.rotate(q, positions[0]), expected, atol=1e-6, rtol=0)
    assert torch.equal(ours.rotate(q, positions[0])[..., turned:], q[..., turned:])  # the rest is untouched


def test_yarn_is_read_and_matters():
    """The loader keeps YaRN's fields apart from the share turned; the same weights without YaRN differ."""
    config = config_from_hf_qwen3_5(Qwen3_5TextConfig(**SIZES, rope_parameters=YARN))
    assert config.partial_rotary_factor == 0.25 and config.rope_base == 1e4
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24}
    hf = tiny(rope_parameters=YARN)
    unscaled = attnlib.Decoder(config.replace(rope_scaling=None)).eval()
    unscaled.load_state_dict(attnlib.from_hf_qwen3_5(hf).state_dict())
    idx = tokens((1, 40), seed=3)
    with torch.no_grad():
        assert (unscaled(idx)[0] - hf(idx).logits).abs().max() > 1e-3


@pytest.mark.parametrize("config, words", [
    (Qwen3_5MoeTextConfig(**{k: v for k, v in SIZES.items() if k != "intermediate_size"}), "mixture-of-experts"),
    (Qwen3_5TextConfig(**SIZES, hidden_act="gelu"), "hidden_act='gelu'"),
    (Qwen3_5TextConfig(**SIZES, attention_bias=True), "attention_bias=True"),
    (Qwen3_5TextConfig(**SIZES, attention_dropout=0.1), "attention_dropout=0.1"),
    (Qwen3_5TextConfig(**SIZES, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                                                 "short_factor": [1.0] * 2, "long_factor": [1.0] * 2,
                                                 "original_max_position_embeddings": 24}), "RoPE type 'longrope'"),
])
def test_unreproducible_configs_are_refused_by_name(config, words):
    with pytest.raises(ValueError, match=words):
        attnlib.from_hf_qwen3_5(tiny().state_dict(), config=config)


def test_wrong_state_dicts_are_refused_by_name():
    hf = tiny()
    state = hf.state_dict()
    without = {k: v for k, v in state.items() if k != "model.layers.1.linear_attn.in_proj_a.weight"}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.linear_attn.in_proj_a.weight'\]"):
        attnlib.from_hf_qwen3_5(without, config=hf.config)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.extra'\]"):
        attnlib.from_hf_qwen3_5({**state, "model.layers.0.extra": torch.zeros(1)}, config=hf.config)
    other = Qwen3_5TextConfig(**{**SIZES, "linear_conv_kernel_dim": 3})
    with pytest.raises(ValueError, match=r"conv1d.*shape \(80, 1, 4\); expected \(80, 1, 3\)"):
        attnlib.from_hf_qwen3_5(state, config=other)
    with pytest.raises(ValueError, match="q_proj.weight has shape"):
        attnlib.from_hf_qwen3_5(state, config=Qwen3_5TextConfig(**{**SIZES, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="config contradicts the model's own config"):
        attnlib.from_hf_qwen3_5(hf, config=other)
    with pytest.raises(TypeError, match="transformers Qwen3_5TextConfig"):
        attnlib.from_hf_qwen3_5(state, config="qwen3.5")


BASE = dict(vocab_size=50, n_layers=4, n_heads=4, n_kv_heads=2, d_model=64, head_dim=16,
            layer_types=("linear_attention",) * 3 + ("full_attention",))


@pytest.mark.parametrize("fields, error, words", [
    (dict(partial_rotary_factor=0.1), ValueError, "partial_rotary_factor=0.1"),  # int(1.6) = 1 number turned
    (dict(partial_rotary_factor=1.5), ValueError, "partial_rotary_factor=1.5"),
    (dict(partial_rotary_factor=0.5, position="nope"), ValueError, "partial_rotary_factor=0.5"),
    (dict(attn_output_gate="yes"), TypeError, "attn_output_gate"),
    (dict(attn_output_gate=True, attention="differential"), ValueError, "attn_output_gate=True"),
    (dict(attn_output_gate=True, layer_types=("linear_attention",) * 4), ValueError, "attn_output_gate=True"),
    (dict(linear_conv_kernel_dim=0), ValueError, "linear_conv_kernel_dim"),
    (dict(linear_conv_kernel_dim=4, layer_types=None), ValueError, "linear_conv_kernel_dim=4"),
    (dict(linear_conv_kernel_dim=4, linear_layer="linear"), ValueError, "linear_conv_kernel_dim=4"),
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), ValueError, "linear_num_value_heads"),
])
def test_bad_fields_are_refused_by_name(fields, error, words):
    with pytest.raises(error, match=words):
        DecoderConfig.llama(**{**BASE, **fields})


@pytest.mark.parametrize("options, error, words", [
    (dict(n_v_heads=3), ValueError, "n_v_heads"),  # not a multiple of n_heads = 2
    (dict(conv_size=0), ValueError, "conv_size"),
    (dict(head_k_dim=2.5), TypeError, "head_k_dim"),
    (dict(l2norm="l1"), ValueError, "l2norm='l1'"),
    (dict(norm_eps=0.0), ValueError, "norm_eps"),
])
def test_gated_deltanet_bad_options_are_refused_by_name(options, error, words):
    with pytest.raises(error, match=words):
        attnlib.attention.GatedDeltaNet(64, 2, **options)


def test_gated_deltanet_defaults_are_chapter_18s_layer():
    """Without Qwen's options the layer has chapter 18's parameters (no convolution, one head width)."""
    layer = attnlib.attention.GatedDeltaNet(64, 4)
    assert layer.conv1d is None and (layer.n_v_heads, layer.head_k_dim, layer.head_v_dim) == (4, 16, 16)
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == {
        "qkv.weight": (192, 64), "qkv.bias": (192,), "gate.weight": (64, 64), "beta_decay.weight": (8, 64),
        "A_log": (4,), "dt_bias": (4,), "norm_weight": (16,), "out_proj.weight": (64, 64), "out_proj.bias": (64,)}
