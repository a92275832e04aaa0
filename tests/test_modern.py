"""The modern decoder against transformers' Llama, Qwen3 and Mistral (random tiny models, no download)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

import attnlib
from attnlib import Decoder, DecoderConfig, RotaryEmbedding
from attnlib.models.hf_llama import config_from_hf_decoder
from attnlib.positional.rotary import interleaved_to_half_split

SIZES = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}
MODELS = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SIZES), attnlib.from_hf_llama),
    "llama-tied-bias-mqa": (LlamaForCausalLM, LlamaConfig(**{**SIZES, "num_key_value_heads": 1},
                            tie_word_embeddings=True, attention_bias=True), attnlib.from_hf_llama),
    "llama3-rope": (LlamaForCausalLM, LlamaConfig(**SIZES, rope_parameters=LLAMA3), attnlib.from_hf_llama),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SIZES, head_dim=24), attnlib.from_hf_qwen3),
    "mistral-window": (MistralForCausalLM, MistralConfig(**SIZES, sliding_window=6), attnlib.from_hf_mistral),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    cls, config, load = MODELS[request.param]
    torch.manual_seed(0)
    hf = cls(config).eval()
    for p in hf.parameters():  # non-trivial norm weights and biases, so that loading them matters
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return hf, load(hf).eval()


def test_logits_equal(pair):
    hf, ours = pair
    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits
        logits, loss = ours(idx, idx)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(expected.flatten(0, 1), idx.flatten()))


def test_greedy_generation_equal_with_and_without_cache(pair):
    hf, ours = pair
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    cached = ours.generate(prompt, 30, temperature=0.0)
    assert torch.equal(cached, ours.generate(prompt, 30, temperature=0.0, use_cache=False))
    hf.generation_config.eos_token_id = None  # LlamaConfig's default eos (2) would stop transformers early
    assert torch.equal(cached, hf.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0))


def test_state_dict_and_config():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    ours = attnlib.from_hf_llama(hf.state_dict(), config=hf.config.to_dict()).eval()
    idx = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "rope_base"),
        ("llama", {"rms_norm_eps": 1e-6}, "norm_eps"),
        ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}, "n_heads"),  # 8 x 8, not 4 x 16
        ("mistral", {"sliding_window": 3}, "sliding_window"),
    ],
)
def test_a_config_contradicting_the_model_is_refused(family, change, field):
    cls, config, load = MODELS["mistral-window" if family == "mistral" else "llama"]
    torch.manual_seed(0)
    hf = cls(config).eval()
    other = type(config)(**{**config.to_dict(), **change})
    idx = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(idx).logits
        # Every weight has the shape the other config asks for: loaded with it, the model would run, and differ.
        wrong = load(hf.state_dict(), config=other).eval()
        assert not torch.allclose(wrong(idx)[0], expected, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match=f"config contradicts the model's own config: .*'{field}'"):
            load(hf, other)
        for same in (hf.config, hf.config.to_dict()):  # the model's own config, given again, is accepted
            torch.testing.assert_close(load(hf, same).eval()(idx)[0], expected, atol=1e-5, rtol=1e-5)


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Meta's Llama reference: pairs (x[2i], x[2i+1]) as complex numbers times e^{i m θ_i}."""
    head_dim = x.shape[-1]
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    rot = torch.polar(torch.ones(len(positions), head_dim // 2), positions[:, None].float() * theta)
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], head_dim // 2, 2))
    return torch.view_as_real(z * rot).flatten(-2)


def test_interleaved_weights_permuted_give_the_same_scores():
    torch.manual_seed(3)
    n_heads, head_dim, d, T = 2, 8, 16, 7
    w_q, w_k, x = torch.randn(n_heads * head_dim, d), torch.randn(n_heads * head_dim, d), torch.randn(T, d)
    pos = torch.arange(T)

    def heads(t):
        return t.view(T, n_heads, head_dim).transpose(0, 1)  # (n_heads, T, head_dim)

    q_i, k_i = interleaved_rope(heads(x @ w_q.T), pos), interleaved_rope(heads(x @ w_k.T), pos)
    rope = RotaryEmbedding(head_dim)
    q_h = rope.rotate(heads(x @ interleaved_to_half_split(w_q, n_heads).T), pos)
    k_h = rope.rotate(heads(x @ interleaved_to_half_split(w_k, n_heads).T), pos)
    torch.testing.assert_close(q_h @ k_h.transpose(-2, -1), q_i @ k_i.transpose(-2, -1), atol=1e-4, rtol=1e-5)
    # Without the permutation the scores differ: the pairing matters.
    q_wrong = rope.rotate(heads(x @ w_q.T), pos)
    k_wrong = rope.rotate(heads(x @ w_k.T), pos)
    assert not torch.allclose(q_wrong @ k_wrong.transpose(-2, -1), q_i @ k_i.transpose(-2, -1), atol=1e-2)


def test_llama3_8b_parameters_on_the_meta_device():
    # Llama 3 8B's published configuration (Meta, config.json of Meta-Llama-3-8B).
    hf_config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                            rms_norm_eps=1e-5, rope_theta=500000.0)
    config = config_from_hf_decoder(hf_config, "llama")
    with torch.device("meta"):
        ours, theirs = Decoder(config), LlamaForCausalLM(hf_config)
    d, ff, L, V, kv = 4096, 14336, 32, 128256, 8 * 128
    by_formula = 2 * V * d + L * (2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d) + d
    assert ours.num_parameters() == by_formula == sum(p.numel() for p in theirs.parameters()) == 8_030_261_248


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "cannot reproduce hidden_act='gelu'"),
        ({"mlp_bias": True}, "cannot reproduce mlp_bias=True"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                              "long_factor": [1.0] * 8, "original_max_position_embeddings": 16}},
         "cannot reproduce rope_parameters=.*RoPE type 'longrope'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5,
                              "rope_theta": 1e4}}, "cannot reproduce rope_parameters"),
    ],
)
def test_unreproducible_configs_are_refused(change, match):
    hf = LlamaForCausalLM(LlamaConfig(**{**SIZES, "num_hidden_layers": 1}, **change))
    with pytest.raises(ValueError, match=match):
        attnlib.from_hf_llama(hf)


def test_wrong_family_and_inputs():
    qwen = Qwen3ForCausalLM(Qwen3Config(**{**SIZES, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="this is a 'qwen3' config; from_hf_llama loads 'llama' models"):
        attnlib.from_hf_llama(qwen)
    with pytest.raises(ValueError, match="a state dict needs its transformers config"):
        attnlib.from_hf_qwen3(qwen.state_dict())
    with pytest.raises(TypeError, match="expected a transformers model or a state dict; got str"):
        attnlib.from_hf_qwen3("Qwen/Qwen3-0.6B")
    state = qwen.state_dict()
    del state["model.layers.0.self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.q_norm.weight'\]"):
        attnlib.from_hf_qwen3(state, config=qwen.config)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_heads": 4, "n_kv_heads": 3}, ValueError, "n_heads=4 is not divisible by n_kv_heads=3"),
        ({"sliding_window": 0}, ValueError, "sliding_window=0 must be a positive integer"),
        ({"rope_scaling": {"rope_type": "ntk"}}, ValueError, "type 'ntk' is not supported"),
        ({"qk_norm": 1}, TypeError, "qk_norm must be a bool; got 1"),
        ({"attn_fn": "xformers"}, ValueError, r"attn_fn='xformers' is not one of \['eager', 'flash', 'sdpa', 'tiled'\]"),
        ({"position": "alibi", "attn_fn": "flash"}, ValueError, "attn_fn='flash' cannot modify scores"),
    ],
)
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        DecoderConfig.llama(**kwargs)


@pytest.mark.parametrize("position", ["rope", "alibi", "learned", "nope"])
@pytest.mark.parametrize("attn_softcap", [None, 5.0])
def test_positions_and_softcap_cached_equals_uncached(position, attn_softcap):
    torch.manual_seed(0)
    config = DecoderConfig.llama(vocab_size=50, block_size=64, n_layers=2, n_heads=4, d_model=32, position=position,
                                 attn_softcap=attn_softcap)
    model = Decoder(config).eval()
    prompt = torch.randint(0, 50, (2, 7))
    assert torch.equal(model.generate(prompt, 30, temperature=0.0), model.generate(prompt, 30, temperature=0.0,
                                                                                     use_cache=False))
    expected_fn = "eager" if position == "alibi" or attn_softcap else "sdpa"
    assert model.blocks[0].attn.attn_fn == expected_fn
    learned = 64 * 32 if position == "learned" else 0
    base = Decoder(config.replace(position="nope", attn_softcap=None)).num_parameters()
    assert model.num_parameters() == base + learned


def test_alibi_layer_equals_sdpa_with_the_bias():
    from attnlib.attention.mods import alibi_slopes

    torch.manual_seed(0)
    model = Decoder(DecoderConfig.llama(vocab_size=50, block_size=16, n_layers=1, n_heads=4, d_model=32,
                                        position="alibi")).eval()
    attn, x = model.blocks[0].attn, torch.randn(2, 9, 32)
    q, k, v = attn.project(x)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    bias = (-alibi_slopes(4)[:, None, None] * (i - j)).masked_fill(j > i, float("-inf"))
    expected = attn.merge(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    with torch.no_grad():
        torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"position": "sinusoidal"}, ValueError, r"position='sinusoidal' is not one of \('learned', 'rope', 'alibi'"),
        ({"attn_softcap": 0.0}, ValueError, "attn_softcap must be a finite number > 0, got 0.0"),
    ],
)
def test_bad_position_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        DecoderConfig.llama(**kwargs)


def test_score_mod_needs_a_function_that_can_apply_it():
    from attnlib.attention.mods import softcap

    with pytest.raises(ValueError, match="score_mod needs attn_fn='eager' or 'tiled'"):
        attnlib.MultiHeadAttention(16, 2, score_mod=softcap(5.0))
    with pytest.raises(TypeError, match="score_mod must be callable"):
        attnlib.MultiHeadAttention(16, 2, attn_fn="eager", score_mod=5.0)
