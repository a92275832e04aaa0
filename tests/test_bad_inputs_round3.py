"""Round three of "the right answer or a clear error": the meta device, quantised weights.

A forward pass on the meta device gives shapes (a way to size a model without memory), with or without a padding
mask, as often as asked; generation, which picks tokens by their values, is refused by name. A checkpoint whose
weights are not floating point (an int8 or bool tensor) is refused by name instead of being cast silently or
failing inside ``nn.Module.to``.
"""
import re

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from attnlib import Decoder, DecoderConfig, GPTConfig, from_hf_gpt2, from_hf_llama

CONFIGS = {
    "gpt": GPTConfig(vocab_size=50, block_size=16, n_layers=2, n_heads=2, d_model=16),
    "llama": DecoderConfig.llama(vocab_size=50, block_size=16, n_layers=2, n_heads=2, d_model=16, n_kv_heads=1),
    "mixed": DecoderConfig.llama(vocab_size=50, block_size=16, n_layers=2, n_heads=2, d_model=16,
                                 layer_types=["sliding_attention", "full_attention"], sliding_window=4),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_forward_pass_on_the_meta_device_gives_shapes_with_or_without_a_padding_mask(name):
    with torch.device("meta"):
        model = Decoder(CONFIGS[name])
    idx = torch.zeros(3, 5, dtype=torch.long, device="meta")
    mask = torch.ones(3, 5, dtype=torch.bool, device="meta")
    for _ in range(2):  # the second pass too (RoPE's tables are kept between calls on real devices)
        for kwargs in ({}, {"attention_mask": mask}):
            logits, loss = model(idx, **kwargs)
            assert logits.device.type == "meta" and logits.shape == (3, 5, 50) and loss is None


@pytest.mark.parametrize("name", CONFIGS)
def test_generating_on_the_meta_device_is_refused_by_name(name):
    with torch.device("meta"):
        model = Decoder(CONFIGS[name])
    idx = torch.zeros(1, 3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=re.escape("idx is on the meta device (shapes, no values)")):
        model.generate(idx, 2)


def _llama():
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval(), config


def _gpt2():
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config).eval(), config  # eval: no dropout


def _load_llama(state):
    return from_hf_llama(state, _llama()[1])


def _load_gpt2(state):
    return from_hf_gpt2(state, GPTConfig.gpt2(vocab_size=50, block_size=16, n_layers=1, n_heads=2, d_model=16))


QUANTISED = [  # (the Hugging Face model, a weight, its dtype, the loader)
    *[(_llama, key, dtype, _load_llama) for dtype in (torch.int8, torch.uint8, torch.int32, torch.bool)
      for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight")],
    *[(_gpt2, key, dtype, _load_gpt2) for dtype in (torch.int8, torch.int16, torch.bool)
      for key in ("transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.ln_f.bias")],
]


@pytest.mark.parametrize("make, key, dtype, load", QUANTISED)
def test_the_loaders_refuse_weights_that_are_not_floating_point(make, key, dtype, load):
    state = make()[0].state_dict()
    state[key] = (state[key] * 100).to(dtype)
    with pytest.raises(TypeError, match=re.escape(f"the state dict's {key!r} has dtype {dtype}; expected floating")):
        load(state)


def test_float_checkpoints_still_load_and_equal_transformers():
    model, config = _llama()
    idx = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(from_hf_llama(model.state_dict(), config)(idx)[0], model(idx).logits,
                               atol=1e-5, rtol=1e-5)
    model, _ = _gpt2()
    ours = from_hf_gpt2(model)
    torch.testing.assert_close(ours(idx)[0], model(idx).logits, atol=1e-5, rtol=1e-5)
