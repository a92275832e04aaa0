"""GPT-2 sizes and loading Hugging Face GPT-2 weights, checked against transformers' own model (built locally)."""
import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.gpt2 import from_hf_gpt2, parameter_breakdown, saved_activation_bytes

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
    ours = GPT.from_hf_gpt2(hf_model)
    idx = torch.randint(0, 97, (3, 24))
    with torch.no_grad():
        expected = hf_model(idx).logits
        logits, _ = ours(idx)
    assert (logits - expected).abs().max().item() <= 1e-4


def test_greedy_generation_equals_hugging_face(hf_model):
    ours = GPT.from_hf_gpt2(hf_model)
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
        from_hf_gpt2(state, GPTConfig(**{**config.__dict__, "block_size": 32}))
    with pytest.raises(ValueError, match="tanh GELU"):
        from_hf_gpt2(state, GPTConfig(vocab_size=97, block_size=24, n_layers=3, n_heads=4, d_model=48))
    with pytest.raises(TypeError, match="GPT2LMHeadModel or its state_dict"):
        from_hf_gpt2([1, 2])


def test_unsupported_hf_variants_are_refused():
    config = transformers.GPT2Config(
        vocab_size=11, n_positions=8, n_embd=16, n_layer=1, n_head=2, activation_function="relu",
        bos_token_id=0, eos_token_id=0,
    )
    with pytest.raises(ValueError, match="activation_function='relu'"):
        GPT.from_hf_gpt2(transformers.GPT2LMHeadModel(config))


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
