"""Bad inputs to the long-context / modern-decoder API: each gets a clear error naming it, never a silent wrong answer.

RoPE and its scalings (attnlib.positional), DecoderConfig.llama / Decoder, the Hugging Face loaders, the caches
(full, window, sink, the model's), and the score/mask mods. Each case asserts the exception's type and message.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from attnlib import Decoder, DecoderConfig
from attnlib.cache import KVCache, LayerCache, RingLayerCache, SinkLayerCache
from attnlib.models.hf_llama import config_from_hf_decoder
from attnlib.positional import RotaryEmbedding, rope_frequencies

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def _raises(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rope_scaling": {"rope_type": "linear", "type": "dynamic", "factor": 2.0}}, ValueError,
         "rope_scaling gives rope_type='linear' and type='dynamic'; give one type"),
        ({"rope_scaling": {"rope_type": ["linear"], "factor": 2.0}}, ValueError,
         "rope_scaling type ['linear'] is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": "abc"}}, ValueError,
         "rope_scaling['rope_theta'] must be a finite number, got 'abc'"),
        ({"rope_scaling": {**YARN, "beta_fast": 0}}, ValueError, "rope_scaling['beta_fast'] must be > 0.0, got 0"),
        ({"rope_scaling": {**YARN, "beta_slow": 0.0}}, ValueError, "rope_scaling['beta_slow'] must be > 0.0, got 0.0"),
        ({"rope_scaling": {**YARN, "beta_fast": 1, "beta_slow": 32}}, ValueError,
         "rope_scaling['beta_fast']=1 must be >= beta_slow=32"),
        ({"rope_scaling": {**YARN, "attention_factor": 0.0}}, ValueError,
         "rope_scaling['attention_factor'] must be > 0.0, got 0.0"),
        ({"rope_scaling": {**YARN, "truncate": "no"}}, ValueError, "rope_scaling['truncate'] must be a bool, got 'no'"),
        ({"rope_scaling": {**LLAMA3, "factor": float("nan")}}, ValueError,
         "rope_scaling['factor'] must be a finite number, got nan"),
        ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32.0}}, TypeError,
         "rope_scaling['original_max_position_embeddings'] must be an int; got 32.0 (float)"),
        ({"rope_scaling": DYNAMIC, "max_position_embeddings": 16, "seq_len": 20.5}, TypeError,
         "seq_len must be an int; got 20.5 (float)"),
        ({"rope_scaling": DYNAMIC, "max_position_embeddings": 16, "seq_len": -5}, ValueError,
         "seq_len=-5 must be a positive integer"),
        ({"max_position_embeddings": 16.0}, TypeError, "max_position_embeddings must be an int; got 16.0 (float)"),
    ],
    ids=["type-conflict", "type-list", "theta-str", "beta-fast-0", "beta-slow-0", "beta-fast-below-slow",
         "attention-factor-0", "truncate-str", "factor-nan", "original-float", "seq-len-float", "seq-len-negative",
         "max-positions-float"],
)
def test_rope_frequencies_refuses(kwargs, error, message):
    _raises(lambda: rope_frequencies(8, **kwargs), error, message)


def test_dynamic_needs_head_dim_above_two():
    _raises(lambda: rope_frequencies(2, rope_scaling=DYNAMIC, max_position_embeddings=16), ValueError,
            "rope_scaling of type 'dynamic' needs head_dim >= 4 (its base grows with the exponent "
            "head_dim / (head_dim - 2)); got head_dim=2")


@pytest.mark.parametrize("scaling", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_original_context_longer_than_served_is_transformers_answer(scaling):
    """A model served on fewer positions than it was trained on: the frequencies do not depend on
    max_position_embeddings for llama3 / yarn with a factor, so they equal transformers' (which only warns)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16, max_position_embeddings=16,
                         rope_parameters={**scaling, "rope_theta": 10000.0})
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, None)
    ours, factor = rope_frequencies(16, 10000.0, scaling, 16)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert math.isclose(factor, expected_factor, rel_tol=1e-6)


X = torch.randn(2, 3, 5, 8)  # (B, heads, T, head_dim)


@pytest.mark.parametrize(
    ("positions", "error", "message"),
    [
        ([0, 1, 2, 3, 4], TypeError, "positions must be a torch.Tensor of integer or float positions; got list"),
        (torch.ones(5, dtype=torch.bool), TypeError, "positions must hold integer or float positions; got dtype torch.bool"),
        (torch.arange(5) * (1 + 1j), TypeError, "got dtype torch.complex64"),
        (torch.tensor(3), ValueError, "positions must be a tensor whose last dimension is T=5; got shape ()"),
        (torch.arange(5).expand(7, 5), ValueError,
         "positions of shape (7, 5) do not broadcast to x's (2, 3, 5) (x without head_dim)"),
        (torch.arange(5).expand(4, 1, 1, 5), ValueError, "positions of shape (4, 1, 1, 5) do not broadcast"),
        (torch.tensor([0.0, 1.0, float("nan"), 3.0, 4.0]), ValueError, "positions hold nan or inf; expected finite positions"),
        (torch.arange(5, device="meta"), ValueError, "positions are on the meta device (no values) but x is on cpu"),
    ],
    ids=["list", "bool", "complex", "0-d", "not-broadcastable", "more-dims-than-x", "nan", "meta"],
)
def test_rotate_refuses_positions(positions, error, message):
    _raises(lambda: RotaryEmbedding(8).rotate(X, positions), error, message)


def test_rotate_refuses_x_on_another_device():
    _raises(lambda: RotaryEmbedding(8).rotate(X.to("meta")), ValueError,
            "x is on meta but this RotaryEmbedding is on cpu; move one of them (module.to(device))")


def test_dynamic_rope_refuses_nan_positions_and_keeps_negative_ones_unscaled():
    rope = RotaryEmbedding(8, rope_scaling=DYNAMIC, max_position_embeddings=4)
    _raises(lambda: rope.rotate(X, torch.tensor([0.0, 1.0, float("inf"), 3.0, 4.0])), ValueError,
            "positions hold nan or inf")
    positions = torch.arange(-10, -5)  # all before the trained length: the base does not grow
    angle = positions[:, None].float() / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)  # (T, 4), by hand
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    expected = X * cos + torch.cat([-X[..., 4:], X[..., :4]], dim=-1) * sin
    torch.testing.assert_close(rope.rotate(X, positions), expected, atol=1e-6, rtol=1e-6)


def test_rope_scaling_checked_before_it_is_copied():
    _raises(lambda: RotaryEmbedding(8, rope_scaling="linear"), TypeError, "rope_scaling must be a dict or None, got str")


SMALL = {"vocab_size": 50, "block_size": 16, "n_layers": 1, "n_heads": 2, "d_model": 16}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"norm_eps": "1e-6"}, TypeError, "norm_eps must be a number; got '1e-6' (str)"),
        ({"norm_eps": 0.0}, ValueError, "norm_eps=0.0 must be > 0 (it keeps the norm's division away from 0)"),
        ({"norm_eps": -1e-5}, ValueError, "norm_eps=-1e-05 must be > 0"),
        ({"norm_eps": float("nan")}, ValueError, "norm_eps=nan must be a finite number"),
        ({"rope_base": "1e4"}, TypeError, "rope_base must be a number; got '1e4' (str)"),
        ({"rope_base": 0.5}, ValueError, "rope_base=0.5 must be a finite number > 1"),
        ({"attn_softcap": "50"}, TypeError, "attn_softcap must be a number; got '50' (str)"),
        ({"attn_softcap": -1.0}, ValueError, "attn_softcap must be a finite number > 0, got -1.0"),
        ({"position": ["rope"]}, ValueError, "position=['rope'] is not one of ('learned', 'rope', 'alibi', 'nope')"),
        ({"position": "alibi", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ValueError,
         "rope_scaling={'rope_type': 'linear', 'factor': 2.0} is given but position='alibi' does not use RoPE"),
        ({"rope_scaling": "linear"}, TypeError, "rope_scaling must be a dict or None, got str"),
        ({"d_model": 14}, ValueError, "head_dim=7 must be even (dimensions are used in pairs)"),
    ],
    ids=["eps-str", "eps-zero", "eps-negative", "eps-nan", "base-str", "base-below-1", "softcap-str",
         "softcap-negative", "position-list", "scaling-without-rope", "scaling-str", "odd-head-with-rope"],
)
def test_modern_config_refuses(kwargs, error, message):
    _raises(lambda: DecoderConfig.llama(**{**SMALL, **kwargs}), error, message)


@pytest.mark.parametrize("position", ["alibi", "learned", "nope"])
def test_odd_head_width_is_fine_without_rope(position):
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.llama(**{**SMALL, "d_model": 14, "position": position})).eval()  # heads of 7
    assert not hasattr(model, "rope") and all(block.attn.rope is None for block in model.blocks)
    idx = torch.randint(0, 50, (2, 9))
    logits = model(idx)[0]
    assert logits.shape == (2, 9, 50) and torch.isfinite(logits).all()
    assert torch.equal(model.generate(idx[:, :3], 5, temperature=0.0),
                       model.generate(idx[:, :3], 5, temperature=0.0, use_cache=False))


def test_config_keeps_its_own_rope_scaling():
    scaling = {"rope_type": "linear", "factor": 2.0}
    config = DecoderConfig.llama(**SMALL, rope_scaling=scaling)
    scaling["factor"] = 0.5  # an edit after checking must not reach the config
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_meta_model_with_dynamic_rope_gives_shapes():
    with torch.device("meta"):
        model = Decoder(DecoderConfig.llama(**SMALL, rope_scaling=DYNAMIC))
    logits = model(torch.zeros(2, 5, dtype=torch.long, device="meta"))[0]
    assert logits.device.type == "meta" and logits.shape == (2, 5, 50)


HF_SIZES = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5}


def _llama_dict(**changes):
    from transformers import LlamaConfig

    return {**LlamaConfig(**HF_SIZES).to_dict(), **changes}


@pytest.mark.parametrize(
    ("hf_config", "error", "message"),
    [
        (None, TypeError, "hf_config must be a transformers config or its dict; got NoneType"),
        ("meta-llama/Llama-3.2-1B", TypeError, "hf_config must be a transformers config or its dict; got str"),
        (_llama_dict(tie_word_embeddings="False"), ValueError, "tie_word_embeddings='False' must be a bool (true/false)"),
        (_llama_dict(attention_bias="yes"), ValueError, "attention_bias='yes' must be a bool (true/false)"),
        (_llama_dict(mlp_bias="false"), ValueError, "mlp_bias='false' must be a bool (true/false)"),
        (_llama_dict(max_position_embeddings=None), ValueError,
         "max_position_embeddings=None must be an int >= 1 (the config's max_position_embeddings)"),
        (_llama_dict(intermediate_size=None), ValueError, "intermediate_size=None must be an int >= 1"),
        (_llama_dict(num_hidden_layers=2.0), ValueError, "num_hidden_layers=2.0 must be an int >= 1"),
        (_llama_dict(head_dim="8"), ValueError, "head_dim='8' must be an int >= 1"),
        (_llama_dict(rms_norm_eps=None), ValueError, "rms_norm_eps=None must be a finite number > 0"),
        (_llama_dict(rms_norm_eps=0.0), ValueError, "rms_norm_eps=0.0 must be a finite number > 0"),
        (_llama_dict(rope_parameters={"rope_type": "default", "rope_theta": "abc"}), ValueError,
         "rope_theta='abc' must be a number"),
        (_llama_dict(rope_parameters="linear"), ValueError,
         "rope_parameters / rope_scaling must be a dict or None; got 'linear'"),
        (_llama_dict(rope_parameters={"rope_type": ["linear"], "factor": 2.0}), ValueError,
         "cannot reproduce rope_parameters={'rope_type': ['linear'], 'factor': 2.0}: RoPE type ['linear']"),
        (_llama_dict(partial_rotary_factor=0.5), ValueError,
         "cannot reproduce partial_rotary_factor=0.5: partial rotary (RoPE on part of each head) is not reproduced"),
    ],
    ids=["none", "str", "tie-str", "attention-bias-str", "mlp-bias-str", "no-max-positions", "no-intermediate",
         "layers-float", "head-dim-str", "eps-none", "eps-zero", "theta-str", "rope-str", "rope-type-list",
         "partial-rotary-top-level"],
)
def test_config_from_hf_refuses(hf_config, error, message):
    _raises(lambda: config_from_hf_decoder(hf_config, "llama"), error, message)


def _qwen3_dict(**changes):
    from transformers import Qwen3Config

    config = {**Qwen3Config(**HF_SIZES, head_dim=8).to_dict(), **changes}
    return config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layer_types": ["full_attention"]}, "cannot reproduce layer_types=['full_attention']: expected 2 of"),
        ({"layer_types": ["chunked_attention"] * 2}, "cannot reproduce layer_types=['chunked_attention', 'chunked_attention']"),
        ({"use_sliding_window": "true"}, "use_sliding_window='true' must be a bool (true/false)"),
    ],
    ids=["too-few-types", "unknown-type", "flag-str"],
)
def test_qwen3_layer_types_refused(changes, message):
    _raises(lambda: config_from_hf_decoder(_qwen3_dict(**changes), "qwen3"), ValueError, message)


def test_qwen3_layer_types_from_max_window_layers_are_transformers():
    """A config.json without layer_types: layers from max_window_layers on slide, as transformers builds them."""
    from transformers import Qwen3Config

    changes = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    as_dict = {k: v for k, v in _qwen3_dict(**changes).items() if k != "layer_types"}
    config = config_from_hf_decoder(as_dict, "qwen3")
    assert config.layer_types == tuple(Qwen3Config(**as_dict).layer_types) == ("full_attention", "sliding_attention")
    assert config.sliding_window == 4


def _same_logits(hf_model, ours):
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(idx)[0], hf_model.eval()(idx).logits, atol=1e-5, rtol=1e-5)


def test_windows_that_transformers_ignores_are_ignored():
    """Llama has no sliding window (transformers ignores the field), and a Qwen3 config.json without
    layer_types slides only from max_window_layers on: here no layer, so no window (both were windowed)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    import attnlib

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**HF_SIZES, sliding_window=4))
    assert attnlib.from_hf_llama(llama).config.sliding_window is None
    _same_logits(llama, attnlib.from_hf_llama(llama))
    qwen = Qwen3ForCausalLM(Qwen3Config(**HF_SIZES, head_dim=8, use_sliding_window=True, sliding_window=4,
                                        max_window_layers=28))
    as_dict = {k: v for k, v in qwen.config.to_dict().items() if k != "layer_types"}  # an older config.json
    ours = attnlib.from_hf_qwen3(qwen.state_dict(), config=as_dict)
    assert ours.config.sliding_window is None
    _same_logits(qwen, ours)


def _llama_state():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_SIZES))
    return model.state_dict(), model.config


def test_state_dict_names_the_missing_projection():
    import attnlib

    state, config = _llama_state()
    del state["model.layers.1.self_attn.k_proj.weight"]
    _raises(lambda: attnlib.from_hf_llama(state, config=config), ValueError,
            "missing ['model.layers.1.self_attn.k_proj.weight'], unexpected []")


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 16), ValueError,
         "model.layers.0.self_attn.k_proj.weight has shape (16, 16); expected (16, 32)"),
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(24, 32), ValueError,
         "model.layers.0.self_attn.q_proj.weight has shape (24, 32); expected (32, 32)"),
        ("model.norm.weight", [1.0] * 32, TypeError, "the state dict's 'model.norm.weight' is a list; expected a torch.Tensor"),
        ("model.norm.weight", torch.empty(32, device="meta"), ValueError,
         "the state dict's 'model.norm.weight' is on the meta device (no values): load the weights first"),
    ],
    ids=["k-proj-columns", "q-proj-rows", "not-a-tensor", "meta"],
)
def test_state_dict_bad_values(key, value, error, message):
    import attnlib

    state, config = _llama_state()
    state[key] = value
    _raises(lambda: attnlib.from_hf_llama(state, config=config), error, message)


def test_model_takes_the_embedding_dtype_not_a_stray_buffer():
    import attnlib

    state, config = _llama_state()
    state = {"model.rotary_emb.inv_freq": torch.ones(4), **{k: v.to(torch.bfloat16) for k, v in state.items()}}
    ours = attnlib.from_hf_llama(state, config=config)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: KVCache(4), TypeError, "layers must be a list of per-layer caches; got int"),
        (lambda: KVCache("ab"), TypeError, "layers must be a list of per-layer caches; got str"),
        (lambda: KVCache([]), TypeError, "layers must hold one per-layer cache per layer; got an empty list"),
        (lambda: KVCache([LayerCache(8), 8]), TypeError, "layers[1] (int) is not a layer cache: it lacks ['length',"),
        (lambda: SinkLayerCache(10, 4, n_sink="2"), TypeError, "n_sink must be an int >= 0, got '2'"),
        (lambda: SinkLayerCache(10, 4, n_sink=2.0), TypeError, "n_sink must be an int >= 0, got 2.0"),
        (lambda: LayerCache(8).crop(-1), ValueError, "length=-1 must be an int >= 0"),
        (lambda: LayerCache(8).crop(1.5), TypeError, "length must be an int; got 1.5 (float)"),
        (lambda: KVCache([LayerCache(8), LayerCache(8)]).crop(-2), ValueError, "length=-2 must be an int >= 0"),
        (lambda: _filled(LayerCache(8)).reorder([0]), TypeError, "index must be a 1-D integer tensor of batch rows; got list"),
        (lambda: _filled(LayerCache(8)).reorder(torch.tensor([0.0])), TypeError,
         "index must be a 1-D integer tensor of batch rows; got torch.float32"),
        (lambda: _filled(LayerCache(8)).reorder(torch.tensor([0, 5])), ValueError,
         "index must be a 1-D tensor of rows of the cached batch of 2; got [0, 5]"),
        (lambda: _filled(LayerCache(8)).reorder(torch.tensor([-1])), ValueError, "of the cached batch of 2; got [-1]"),
    ],
    ids=["layers-int", "layers-str", "layers-empty", "layer-not-a-cache", "n-sink-str", "n-sink-float", "crop-negative",
         "crop-float", "kv-crop-negative", "reorder-list", "reorder-float", "reorder-out-of-batch", "reorder-negative"],
)
def test_cache_refuses(call, error, message):
    _raises(call, error, message)


def _filled(cache):
    cache.update(torch.randn(2, 3, 4))
    return cache


def test_cropping_a_cache_with_a_window_layer_leaves_every_layer_in_step():
    cache = KVCache([LayerCache(8), RingLayerCache(8, 4)])
    for layer in cache.layers:
        layer.update(torch.randn(1, 7, 2))  # the ring holds positions 3..6; the token at 2 would need 0 and 1
    _raises(lambda: cache.crop(2), ValueError,
            "RingLayerCache cannot crop to length=2: it no longer holds positions [0, 1]... that the next token needs")
    assert cache.length == 7  # the full layer was not cropped before the ring refused


@pytest.mark.parametrize(
    ("doc_ids", "shape", "message"),
    [
        (torch.tensor([0, 0, 1]), (1, 1, 4, 4), "doc_ids labels 3 positions; the scores have T_k=4 keys"),
        (torch.zeros(2, 4, dtype=torch.long), (3, 1, 4, 4), "doc_ids has 2 rows; the scores have a batch of 3"),
    ],
    ids=["fewer-positions-than-keys", "fewer-rows-than-batch"],
)
def test_document_mask_refuses_indices_it_does_not_label(doc_ids, shape, message):
    from attnlib.attention.masks import mask_from_mod
    from attnlib.attention.mods import document_mask

    _raises(lambda: mask_from_mod(document_mask(doc_ids), shape), ValueError, message)
