"""GPT-2 sizes and loading Hugging Face GPT-2 weights, checked against transformers' own model (built locally)."""
import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.models.hf_gpt2 import from_hf_gpt2, parameter_breakdown, saved_activation_bytes

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    """A small GPT2LMHeadModel with random weights: no download."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=24, n_embd=48, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # make every weight matter: random biases and LayerNorm parameters too
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.normal_(0.0, 0.1 if name.endswith("bias") else 1.0)
    return model


def test_logits_equal_hugging_face(hf_model):
    ours = from_hf_gpt2(hf_model)
    idx = torch.randint(0, 97, (3, 24))
    with torch.no_grad():
        expected = hf_model(idx).logits
        logits, _ = ours(idx)
    assert (logits - expected).abs().max().item() <= 1e-4


def test_greedy_generation_equals_hugging_face(hf_model):
    ours = from_hf_gpt2(hf_model)
    prompt = torch.randint(0, 97, (1, 5))
    tokens = prompt
    with torch.no_grad():
        for _ in range(15):  # greedy decoding with HF's logits
            tokens = torch.cat([tokens, hf_model(tokens).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(ours.generate(prompt, 15, temperature=0), tokens)
    assert torch.equal(ours.generate(prompt, 15, temperature=0, use_cache=False), tokens)


def test_state_dict_needs_a_config_and_matching_shapes(hf_model):
    state = hf_model.state_dict()
    with pytest.raises(ValueError, match="does not say n_heads"):
        from_hf_gpt2(state)
    config = GPTConfig(vocab_size=97, block_size=24, n_layers=3, n_heads=4, d_model=48, gelu_approximate="tanh")
    model = from_hf_gpt2(state, config)
    torch.testing.assert_close(model.tok_emb.weight, state["transformer.wte.weight"])
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn.weight' has shape \(48, 100\)"):
        from_hf_gpt2({**state, "transformer.h.0.attn.c_attn.weight": torch.zeros(48, 100)}, config)
    with pytest.raises(ValueError, match="has no 'transformer.ln_f.bias'"):
        from_hf_gpt2({k: v for k, v in state.items() if k != "transformer.ln_f.bias"}, config)
    with pytest.raises(ValueError, match=r"transformer.wpe.weight.*\(24, 48\).*\(32, 48\)"):
        from_hf_gpt2(state, config.replace(block_size=32))
    with pytest.raises(ValueError, match="gelu_approximate='none': GPT-2 uses the tanh GELU"):
        from_hf_gpt2(state, GPTConfig(vocab_size=97, block_size=24, n_layers=3, n_heads=4, d_model=48))
    with pytest.raises(TypeError, match="GPT2LMHeadModel or its state_dict"):
        from_hf_gpt2([1, 2])


def tiny_hf(**changes):
    torch.manual_seed(1)
    fields = dict(vocab_size=11, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**fields, **changes})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.normal_(0.0, 0.1 if name.endswith("bias") else 1.0)
    return model


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(activation_function="relu"), "activation_function='relu'"),
        (dict(activation_function="silu"), "activation_function='silu'"),
        (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06 cannot be reproduced"),
        (dict(n_inner=24), "n_inner=24 cannot be reproduced: attnlib's MLP is 4 \\* n_embd = 64"),
        (dict(scale_attn_weights=False), "scale_attn_weights=False cannot be reproduced"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True cannot be reproduced"),
        (dict(tie_word_embeddings=False), "tie_word_embeddings=False cannot be reproduced"),
        (dict(add_cross_attention=True), "add_cross_attention=True cannot be reproduced"),
    ],
)
def test_unsupported_hf_variants_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        from_hf_gpt2(tiny_hf(**changes))


@pytest.mark.parametrize("changes", [dict(activation_function="gelu"), dict(reorder_and_upcast_attn=True),
                                     dict(activation_function="gelu_pytorch_tanh")])
def test_reproducible_hf_variants_give_the_same_logits(changes):
    """The exact GELU and the fp32-upcast attention are reproduced, not refused: same logits as transformers."""
    hf = tiny_hf(**changes)
    if "reorder_and_upcast_attn" in changes:
        hf.config._attn_implementation = "eager"  # the upcast path is eager-only in transformers
    ours = from_hf_gpt2(hf)
    idx = torch.randint(0, 11, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_layers=1), "config.n_layers=1 does not match the source model's n_layer \\(config.n_layers=2"),
        (dict(n_heads=4), "config.n_heads=4 does not match the source model's n_head \\(config.n_heads=2"),
        (dict(d_model=32, n_heads=2), "config.d_model=32 does not match the source model's n_embd"),
        (dict(vocab_size=12), "config.vocab_size=12 does not match the source model's vocab_size"),
        (dict(block_size=16), "config.block_size=16 does not match the source model's n_positions"),
        (dict(gelu_approximate="none"), "config.gelu_approximate='none' does not match the source model's activation"),
        (dict(bias=False), "config.bias=False: GPT-2's layout has bias=True"),
        (dict(norm="rmsnorm"), "config.norm='rmsnorm': GPT-2's layout has norm='layernorm'"),
        (dict(sliding_window=4), "config.layer_types=\\('sliding_attention', 'sliding_attention'\\): GPT-2's layout"),
        (dict(attention="talking_heads"), "config.attention='talking_heads'"),
        (dict(attention_sinks=True), "config.attention_sinks=True: GPT-2's layout has attention_sinks=False"),
        (dict(scale_embeddings=True), "config.scale_embeddings=True: GPT-2's layout"),
        (dict(logit_softcap=30.0), "config.logit_softcap=30.0: GPT-2's layout"),
        (dict(attention_scale=0.5), "config.attention_scale=0.5: GPT-2's layout"),
    ],
)
def test_an_explicit_config_must_match_the_source_model(changes, message):
    config = GPTConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=2, d_model=16, gelu_approximate="tanh")
    hf = tiny_hf()
    from_hf_gpt2(hf, config)  # the matching config is accepted
    with pytest.raises(ValueError, match=message):
        from_hf_gpt2(hf, config.replace(**changes))


def test_a_state_dict_that_does_not_fit_is_refused():
    hf = tiny_hf()
    state = hf.state_dict()
    config = GPTConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=2, d_model=16, gelu_approximate="tanh")
    with pytest.raises(ValueError, match="has 2 layers but config.n_layers=1"):
        from_hf_gpt2(state, config.replace(n_layers=1))
    untied = {**state, "lm_head.weight": state["transformer.wte.weight"] + 1.0}
    with pytest.raises(ValueError, match="'lm_head.weight' differs from 'transformer.wte.weight'"):
        from_hf_gpt2(untied, config)
    with pytest.raises(ValueError, match="'transformer.h.0.crossattention.c_attn.weight' \\(1 unknown keys\\)"):
        from_hf_gpt2({**state, "transformer.h.0.crossattention.c_attn.weight": torch.zeros(16, 48)}, config)
    with pytest.raises(TypeError, match="config must be an attnlib.GPTConfig or None; got dict"):
        from_hf_gpt2(state, config.to_dict())


def test_a_model_that_is_not_gpt2_is_refused():
    bert = transformers.BertConfig(vocab_size=11, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32)
    with pytest.raises(TypeError, match="model_type='bert'"):
        from_hf_gpt2(transformers.BertForMaskedLM(bert))


def test_from_hf_gpt2_is_a_function_of_the_package():
    import attnlib

    assert attnlib.from_hf_gpt2 is from_hf_gpt2
    assert not hasattr(GPT, "from_hf_gpt2")  # the classmethod made an import cycle model <-> gpt2


def test_gpt2_small_has_124_439_808_parameters():
    rows = dict(parameter_breakdown(GPTConfig.gpt2("small")))
    assert rows["total"] == 124_439_808
    assert rows["token embedding (tied output head)"] == 50257 * 768
    assert rows["position embedding"] == 1024 * 768
    assert rows["block: attn"] == 3 * 768 * 768 + 3 * 768 + 768 * 768 + 768 == 2_362_368
    assert rows["one block"] == 7_087_872 and rows["12 blocks"] == 12 * 7_087_872
    assert rows["final LayerNorm"] == 2 * 768
    assert rows["total"] == rows["token embedding (tied output head)"] + rows["position embedding"] + rows["12 blocks"] + rows["final LayerNorm"]


@pytest.mark.parametrize("size, total", [("medium", 354_823_168), ("large", 774_030_080), ("xl", 1_557_611_200)])
def test_gpt2_presets(size, total):
    assert dict(parameter_breakdown(GPTConfig.gpt2(size)))["total"] == total
    with pytest.raises(ValueError, match="size='huge'"):
        GPTConfig.gpt2("huge")


def test_saved_activations_grow_linearly_with_the_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=31, block_size=16, n_layers=2, n_heads=2, d_model=16))
    one = saved_activation_bytes(model, torch.randint(0, 31, (1, 16)))
    four = saved_activation_bytes(model, torch.randint(0, 31, (4, 16)))
    assert one > 0 and four == pytest.approx(4 * one, rel=0.05)
