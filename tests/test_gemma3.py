"""``from_hf_gemma3`` against transformers' ``Gemma3ForCausalLM`` (random tiny models built locally). Chapter 20.

Seven layers with a window of 5 and 40-token inputs: the 5:1 pattern (layer 5 global, the others sliding) and
the window both change the logits; the local RoPE base differs from the global one, which is linearly scaled;
``query_pre_attn_scalar`` differs from ``head_dim``; the norms' weights are drawn around 0 (Gemma stores
``w`` for ``1 + w``), so that loading them as ``w + 1`` matters. Measured (float32, CPU): logits within
4e-7 of transformers' eager attention.
"""
from __future__ import annotations

import pytest
import torch
from test_modern import test_logits_equal  # noqa: F401  (run on this file's pair: logits and loss)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

import attnlib
from attnlib import DecoderConfig
from attnlib.layers import RMSNorm
from attnlib.models.hf_gemma import config_from_hf_gemma3

SIZES = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 7,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
         "sliding_window": 5, "query_pre_attn_scalar": 24}
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
CONFIGS = {
    "gemma3": dict(SIZES, rope_parameters=ROPE),
    # a logit soft cap small enough to bite, MQA, biases, an untied head
    "gemma3-softcap-mqa-bias-untied": dict(SIZES, rope_parameters=ROPE, final_logit_softcapping=3.0,
                                           num_key_value_heads=1, attention_bias=True, tie_word_embeddings=False),
}


def _hf(name: str, **change) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**{**CONFIGS[name], **change}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms around 0 (1 + w ≠ w), biases non-zero
            if p.dim() == 1:
                p.uniform_(-0.5, 0.5)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = _hf(request.param)
    return hf, attnlib.from_hf_gemma3(hf).eval()


def test_the_pattern_is_gemma3s(pair):
    assert pair[1].config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")


def test_greedy_tokens_equal_transformers_with_and_without_cache(pair):
    hf, ours = pair
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))  # 7 + 12 > the window of 5
    cached = ours.generate(prompt, 12, temperature=0.0)
    assert torch.equal(cached, ours.generate(prompt, 12, temperature=0.0, use_cache=False))
    hf.generation_config.eos_token_id = None  # Gemma's eos (1) would stop transformers early
    assert torch.equal(cached, hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0))


def test_cached_decoding_past_the_window_equals_one_pass(pair):
    _, ours = pair
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    cache = ours.new_cache()  # the sliding layers keep only their window
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[5] != kinds[0] and len(set(kinds[:5] + kinds[6:])) == 1
    with torch.no_grad():
        whole = ours(idx)[0]
        steps = [ours(idx[:, :9], cache=cache)[0]]  # a prompt longer than the window, then one token at a time
        steps += [ours(idx[:, t:t + 1], cache=cache)[0] for t in range(9, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_gemma_norm_loaded_as_w_plus_1_is_bit_exact_in_float32():
    torch.manual_seed(0)
    theirs = Gemma3RMSNorm(32, eps=1e-6)
    ours = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        theirs.weight.uniform_(-0.5, 0.5)
        ours.weight.copy_(theirs.weight.float() + 1.0)
        x = torch.randn(3, 5, 32) * 4
        assert torch.equal(ours(x), theirs(x))


def test_every_tensor_is_mapped_and_none_is_left_over():
    hf = _hf("gemma3-softcap-mqa-bias-untied")
    state = hf.state_dict()
    ours = attnlib.from_hf_gemma3(hf)
    assert ours.num_parameters() == hf.num_parameters()  # every parameter of ours has its source, and the converse
    config = hf.config.to_dict()
    for key in state:  # each tensor is needed: without it the load fails and names it
        with pytest.raises(ValueError, match=rf"missing \[{key!r}\]"):
            attnlib.from_hf_gemma3({k: v for k, v in state.items() if k != key}, config=config)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.extra.weight'\]"):
        attnlib.from_hf_gemma3({**state, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, config=config)


def test_a_state_dict_with_a_dict_config_new_or_old_format():
    hf = _hf("gemma3")
    idx = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    new = hf.config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 500_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # config.json as Google published Gemma 3
    assert config_from_hf_gemma3(old) == config_from_hf_gemma3(new) == config_from_hf_gemma3(hf.config)
    with torch.no_grad():
        expected = hf(idx).logits
        for config in (new, old):
            torch.testing.assert_close(attnlib.from_hf_gemma3(hf.state_dict(), config=config)(idx)[0], expected,
                                       atol=1e-5, rtol=1e-5)


def test_the_preset_has_transformers_defaults():
    sizes = {k: v for k, v in SIZES.items() if k != "query_pre_attn_scalar"}
    loaded = config_from_hf_gemma3(Gemma3TextConfig(**{**sizes, "num_hidden_layers": 13, "query_pre_attn_scalar": 16}))
    preset = DecoderConfig.gemma3(sliding_window=5, vocab_size=97, block_size=64, n_layers=13, n_heads=4, d_model=32,
                                  n_kv_heads=2, head_dim=16, d_ff=48, attention_scale=16 ** -0.5)
    assert loaded == preset
    assert [i for i, kind in enumerate(preset.layer_types) if kind == "full_attention"] == [5, 11]


BAD = [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: transformers' Gemma3ForCausalLM ignores it"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"rope_parameters": {**ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     r"rope_parameters\['sliding_attention'\].*only 'default'"),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "longrope", "rope_theta": 1e4}}},
     r"rope_parameters\['full_attention'\].*longrope"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "per-layer-type"),
    ({"layer_types": ["sliding_attention"] * 6 + ["chunked_attention"]}, "layer_types=.*chunked_attention"),
    ({"layer_types": ["full_attention"] * 6}, "expected 7 of"),
    ({"model_type": "gemma3"}, r"model_type='gemma3' \(vision-language\) config without a text_config"),
    ({"model_type": "llama"}, "'llama' config"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping=-1.0"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' must be a bool"),
    ({"sliding_window": None}, "sliding_window=None"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[next(iter(c)) for c, _ in BAD])
def test_a_config_attnlib_cannot_reproduce_is_refused(change, message):
    config = {**Gemma3TextConfig(**CONFIGS["gemma3"]).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        config_from_hf_gemma3(config)


def test_bad_arguments_are_refused():
    hf = _hf("gemma3")
    state = hf.state_dict()
    with pytest.raises(ValueError, match="a state dict needs its transformers config"):
        attnlib.from_hf_gemma3(state)
    with pytest.raises(TypeError, match="expected a transformers model or a state dict; got list"):
        attnlib.from_hf_gemma3([state])
    with pytest.raises(TypeError, match="hf_config must be a transformers config or its dict; got str"):
        config_from_hf_gemma3("gemma3")
    with pytest.raises(ValueError, match="config contradicts the model's own config: .*sliding_window"):
        attnlib.from_hf_gemma3(hf, config={**hf.config.to_dict(), "sliding_window": 3})
    untied = {**state, "lm_head.weight": state["lm_head.weight"] + 1}
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        attnlib.from_hf_gemma3(untied, config=hf.config.to_dict())
    bad_shape = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 32)}
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(16, 32\); expected \(32, 32\)"):
        attnlib.from_hf_gemma3(bad_shape, config=hf.config.to_dict())
