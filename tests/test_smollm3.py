"""SmolLM3 (layers without RoPE) against transformers' SmolLM3ForCausalLM (random tiny models, no download). Chapter 20."""
from __future__ import annotations

import pytest
import torch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

import attnlib
from attnlib.models.hf_llama import config_from_hf_decoder

SIZES = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
         "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
CONFIGS = {
    "every-4th-nope": dict(),  # transformers' default: no_rope_layer_interval=4, layer 3 without RoPE
    "given-list-untied": dict(no_rope_layers=[0, 1, 0, 1], tie_word_embeddings=False),
    "sliding-nope": dict(no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    torch.manual_seed(0)
    hf = SmolLM3ForCausalLM(SmolLM3Config(**SIZES, **CONFIGS[request.param])).eval()
    for p in hf.parameters():  # non-trivial norm weights, so that loading them matters
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return hf, attnlib.from_hf_smollm3(hf).eval()


def test_nope_layers_read_as_transformers_does():
    """``no_rope_layers[i] == 1`` means layer i USES RoPE: the zeros are attnlib's ``nope_layers``."""
    hf_config = SmolLM3Config(**SIZES)
    assert hf_config.no_rope_layers == [1, 1, 1, 0]
    config = config_from_hf_decoder(hf_config, "smollm3")
    assert config.nope_layers == (3,)
    assert [config.uses_rope(i) for i in range(4)] == [True, True, True, False]
    slide = config_from_hf_decoder(SmolLM3Config(**SIZES, **CONFIGS["sliding-nope"]), "smollm3")
    assert slide.nope_layers == (1, 3) and slide.sliding_window == 5
    assert slide.layer_types == ("full_attention", "sliding_attention", "full_attention", "sliding_attention")


def test_logits_equal(pair):
    hf, ours = pair
    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits
        logits, _ = ours(idx)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_a_nope_layer_matters(pair):
    """The loaded model is not a RoPE-everywhere one: giving the NoPE layers RoPE changes the logits."""
    hf, ours = pair
    rope_everywhere = attnlib.Decoder(ours.config.replace(nope_layers=()))
    rope_everywhere.load_state_dict(ours.state_dict())
    idx = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (rope_everywhere.eval()(idx)[0] - hf(idx).logits).abs().max() > 1e-3


def test_greedy_generation_equal_with_and_without_cache(pair):
    hf, ours = pair
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    cached = ours.generate(prompt, 30, temperature=0.0)
    assert torch.equal(cached, ours.generate(prompt, 30, temperature=0.0, use_cache=False))
    assert torch.equal(cached, hf.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0))


def test_state_dict_and_config_dict():
    torch.manual_seed(0)
    hf = SmolLM3ForCausalLM(SmolLM3Config(**SIZES, no_rope_layers=[1, 0, 1, 1])).eval()
    ours = attnlib.from_hf_smollm3(hf.state_dict(), config=hf.config.to_dict()).eval()
    assert ours.config.nope_layers == (1,)
    idx = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"no_rope_layers": [1, 1]}, "no_rope_layers"),  # shorter than the model
        ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
        ({"no_rope_layers": "1110"}, "no_rope_layers"),
        ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
        ({"layer_types": ["full_attention"] * 3 + ["chunked_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"], "use_sliding_window": False,
          "sliding_window": 4}, "use_sliding_window"),
        ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"], "use_sliding_window": True,
          "sliding_window": None}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "llama"}, "llama"),
    ],
)
def test_unreproducible_configs_are_refused(change, match):
    config = {**SmolLM3Config(**SIZES).to_dict(), **change}
    if "no_rope_layers" not in change and "no_rope_layer_interval" in change:
        config.pop("no_rope_layers")
    with pytest.raises(ValueError, match=match):
        config_from_hf_decoder(config, "smollm3")


def test_a_contradicting_config_is_refused():
    torch.manual_seed(0)
    hf = SmolLM3ForCausalLM(SmolLM3Config(**SIZES)).eval()
    other = SmolLM3Config(**SIZES, no_rope_layers=[1, 0, 1, 1])
    with pytest.raises(ValueError, match="nope_layers"):
        attnlib.from_hf_smollm3(hf, config=other)
