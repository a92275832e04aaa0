"""Differential attention (Ye et al. 2024) against its formula and transformers' DiffLlama (tiny random models,
built locally, no download). Chapter 20."""
from __future__ import annotations

import math

import pytest
import torch

# chapter 16's parity checks (logits 1e-5 and loss; greedy tokens equal to transformers', cached = uncached),
# collected here again on this module's DiffLlama `pair`
from test_modern import test_greedy_generation_equal_with_and_without_cache, test_logits_equal  # noqa: F401
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig
from transformers.models.diffllama import modeling_diffllama

import attnlib
from attnlib import Decoder, DecoderConfig, DifferentialAttention
from attnlib.attention import lambda_init_schedule
from attnlib.models.hf_diffllama import config_from_hf_diffllama

SIZES = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
         "lambda_std_dev": 0.3}  # λ well away from λ_init, so that the λ vectors matter
CONFIGS = {
    "diffllama": DiffLlamaConfig(**SIZES),
    "gqa-8-heads": DiffLlamaConfig(**{**SIZES, "num_attention_heads": 8}),  # groups of 4 query heads, head_dim 8
    "mha-tied-bias-head_dim": DiffLlamaConfig(**{**SIZES, "num_key_value_heads": 4}, tie_word_embeddings=True,
                                              attention_bias=True, head_dim=24),  # head_dim apart from d_model / n_heads
}


def hf_model(name: str, implementation: str = "eager") -> DiffLlamaForCausalLM:
    torch.manual_seed(0)
    config = DiffLlamaConfig(**CONFIGS[name].to_dict())
    config._attn_implementation = implementation
    hf = DiffLlamaForCausalLM(config).eval()
    for n, p in hf.named_parameters():  # non-trivial norm weights and biases, so that loading them matters
        if p.dim() == 1 and "lambda" not in n:
            p.data.uniform_(0.5, 1.5)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = hf_model(request.param)
    return hf, attnlib.from_hf_diffllama(hf).eval()


@pytest.mark.parametrize("attn_fn", ["eager", "sdpa"])
def test_transformers_sdpa_path_and_ours_agree(attn_fn):
    """transformers' sdpa path (its default) gives the eager path's logits; ours with either function too."""
    hf_eager, hf_sdpa = hf_model("gqa-8-heads"), hf_model("gqa-8-heads", "sdpa")
    ours = Decoder(config_from_hf_diffllama(hf_eager.config).replace(attn_fn=attn_fn))
    ours.load_state_dict(attnlib.from_hf_diffllama(hf_eager).state_dict())
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_eager(idx).logits
        torch.testing.assert_close(hf_sdpa(idx).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.eval()(idx)[0], expected, atol=1e-5, rtol=1e-5)


def test_lambda_per_layer_equals_transformers_and_the_paper():
    hf = hf_model("diffllama")
    ours = attnlib.from_hf_diffllama(hf)
    for i, (block, layer) in enumerate(zip(ours.blocks, hf.model.layers, strict=True)):
        attn = layer.self_attn
        # The paper's eq. 3 counts layers from l = 1: λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)), l = i + 1.
        assert block.attn.lambda_init == attn.lambda_init == 0.8 - 0.6 * math.exp(-0.3 * i)
        assert lambda_init_schedule(i) == modeling_diffllama.lambda_init_fn(i)
        # Eq. 2 on transformers' own parameters.
        expected = (torch.exp(attn.lambda_q1 @ attn.lambda_k1) - torch.exp(attn.lambda_q2 @ attn.lambda_k2)
                    + attn.lambda_init)
        torch.testing.assert_close(block.attn.lambda_full, expected, atol=1e-6, rtol=1e-6)
        assert abs(block.attn.lambda_full.item() - attn.lambda_init) > 0.01  # the λ vectors matter here
    assert [b.attn.lambda_init for b in ours.blocks] == pytest.approx([0.2, 0.355509, 0.470713], abs=1e-6)


def differential_by_hand(layer: DifferentialAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ye et al. 2024, §2.1, one differential head at a time with explicit indices (causal, no RoPE):

    head i of the H/2 = n_heads/2 uses query heads i and i + H/2, key heads j = i // g and j + Hkv/2
    (g = n_heads // n_kv_heads), and the value [v_j ; v_{j + Hkv/2}] of width 2d;
    A_1 = softmax(q_i k_jᵀ / √d), A_2 = softmax(q_{i+H/2} k_{j+Hkv/2}ᵀ / √d) (causal);
    λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init; O_i = (A_1 − λ A_2) V;
    O_i ← (1 − λ_init) · O_i / sqrt(mean(O_i²) + ε); y = [O_0, …, O_{H/2−1}] W_oᵀ + b_o.
    Returns y (B, T, d_model) and the maps A_1 − λ A_2 (B, H/2, T, T).
    """
    B, T, _ = x.shape
    H, Hkv, d = layer.n_heads, layer.n_kv_heads, layer.head_dim
    W, b = layer.qkv.weight, layer.qkv.bias
    proj = x @ W.T + b
    q = proj[..., : H * d].reshape(B, T, H, d)
    k = proj[..., H * d : (H + Hkv) * d].reshape(B, T, Hkv, d)
    v = proj[..., (H + Hkv) * d :].reshape(B, T, Hkv, d)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    lam = (math.exp(layer.lambda_q1 @ layer.lambda_k1) - math.exp(layer.lambda_q2 @ layer.lambda_k2)
           + layer.lambda_init)
    heads, maps = [], []
    for i in range(H // 2):
        j = i // (H // Hkv)
        a1 = torch.softmax((q[:, :, i] @ k[:, :, j].transpose(1, 2) / math.sqrt(d)).masked_fill(future, -math.inf), -1)
        a2 = torch.softmax((q[:, :, i + H // 2] @ k[:, :, j + Hkv // 2].transpose(1, 2) / math.sqrt(d))
                           .masked_fill(future, -math.inf), -1)
        value = torch.cat([v[:, :, j], v[:, :, j + Hkv // 2]], dim=-1)  # (B, T, 2d)
        o = (a1 - lam * a2) @ value
        o = (1 - layer.lambda_init) * o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps)
        heads.append(o)
        maps.append(a1 - lam * a2)
    return torch.cat(heads, dim=-1) @ layer.out_proj.weight.T + layer.out_proj.bias, torch.stack(maps, dim=1)


@pytest.mark.parametrize("attn_fn", ["eager", "sdpa", "tiled", "flash"])
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (8, 2), (4, 2)])
def test_layer_equals_the_formula_written_out(attn_fn, n_heads, n_kv_heads):
    torch.manual_seed(5)
    layer = DifferentialAttention(32, n_heads, n_kv_heads, layer=3, lambda_std=0.3, attn_fn=attn_fn, norm_eps=1e-5)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        expected, maps = differential_by_hand(layer, x)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        y, weights = layer(x, return_weights=True)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, maps, atol=1e-6, rtol=1e-5)
    # Each row of softmax₁ − λ softmax₂ sums to 1 − λ; the future gets nothing.
    torch.testing.assert_close(weights.sum(-1), (1 - layer.lambda_full).expand(2, n_heads // 2, 9))
    assert (weights.triu(1) == 0).all()


@pytest.mark.parametrize("attn_fn", ["eager", "sdpa"])
@pytest.mark.parametrize("window", [None, 4])
def test_cached_decoding_equals_one_pass(attn_fn, window):
    torch.manual_seed(6)
    rope = attnlib.RotaryEmbedding(4, max_position_embeddings=32)
    layer = DifferentialAttention(32, 8, 2, layer=1, lambda_std=0.3, attn_fn=attn_fn, rope=rope, sliding_window=window,
                                  block_size=32).eval()
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        full = layer(x)
        cache, steps = layer.new_cache(32), []
        for start, stop in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 11), (11, 12)):
            steps.append(layer(x[:, start:stop], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_decoder_with_mixed_layers_cached_equals_uncached():
    config = DecoderConfig.llama(vocab_size=31, block_size=48, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32,
                                 attention="differential", sliding_window=5,
                                 layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    torch.manual_seed(7)
    model = Decoder(config).eval()
    assert [b.attn.lambda_init for b in model.blocks] == [lambda_init_schedule(i) for i in range(3)]
    prompt = torch.randint(0, 31, (2, 4), generator=torch.Generator().manual_seed(8))
    assert torch.equal(model.generate(prompt, 16, temperature=0.0),
                       model.generate(prompt, 16, temperature=0.0, use_cache=False))
    # The projections and the cache are multi-head attention's; four λ vectors of head_dim per layer are added.
    gqa = Decoder(config.replace(attention="gqa"))
    assert model.num_parameters() == gqa.num_parameters() + 3 * 4 * config.head_dim
    assert model.kv_cache_bytes_per_token() == gqa.kv_cache_bytes_per_token()


def test_state_dict_and_config_dict():
    hf = hf_model("diffllama")
    ours = attnlib.from_hf_diffllama(hf.state_dict(), config=hf.config.to_dict()).eval()
    idx = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_a_config_contradicting_the_model_is_refused():
    hf = hf_model("diffllama")
    other = DiffLlamaConfig(**{**hf.config.to_dict(), "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8})
    with pytest.raises(ValueError, match=r"config contradicts the model's own config: .*'n_heads'"):
        attnlib.from_hf_diffllama(hf, other)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"attention_dropout": 0.1}, r"cannot reproduce attention_dropout=0.1"),
        ({"num_key_value_heads": 1}, r"cannot reproduce num_key_value_heads=1: .* even"),
        ({"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "gelu"},
         r"cannot reproduce hidden_act='gelu'"),
        ({"model_type": "llama"}, r"this is a 'llama' config; from_hf_diffllama loads 'diffllama' models"),
    ],
)
def test_unreproducible_configs_are_refused(change, match):
    hf = hf_model("diffllama")
    with pytest.raises(ValueError, match=match):
        attnlib.from_hf_diffllama(hf.state_dict(), {**hf.config.to_dict(), **change})


def test_bad_weights_and_arguments_to_the_loader():
    hf = hf_model("diffllama")
    state = hf.state_dict()
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.lambda_k2'\]"):
        attnlib.from_hf_diffllama({k: v for k, v in state.items() if k != "model.layers.1.self_attn.lambda_k2"},
                                  hf.config)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.3.self_attn.lambda_q1'\]"):
        attnlib.from_hf_diffllama({**state, "model.layers.3.self_attn.lambda_q1": torch.zeros(16)}, hf.config)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.lambda_q2 has shape \(8,\); expected \(16,\)"):
        attnlib.from_hf_diffllama({**state, "model.layers.0.self_attn.lambda_q2": torch.zeros(8)}, hf.config)
    with pytest.raises(ValueError, match=r"a state dict needs its transformers config"):
        attnlib.from_hf_diffllama(state)
    with pytest.raises(TypeError, match=r"expected a transformers model or a state dict; got str"):
        attnlib.from_hf_diffllama("kajuma/DiffLlama-0.3B-handcut")
    with pytest.raises(TypeError, match=r"hf_config must be a transformers DiffLlamaConfig or its dict; got int"):
        config_from_hf_diffllama(3)
    with pytest.raises(ValueError, match=r"this is a 'llama' config"):
        config_from_hf_diffllama(LlamaConfig(**{k: v for k, v in SIZES.items() if k != "lambda_std_dev"}))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_heads": 3, "n_kv_heads": 1, "d_model": 24}, ValueError, r"n_heads=3 must be even"),
        ({"n_kv_heads": 1}, ValueError, r"n_kv_heads=1 must be even"),
        ({"causal": False}, ValueError, r"causal=False: DifferentialAttention is causal self-attention"),
        ({"layer": 2, "lambda_init": 0.5}, ValueError, r"give layer=2 .* or lambda_init=0.5, not both"),
        ({"lambda_init": 1.0}, ValueError, r"lambda_init=1.0 must be in \[0, 1\)"),
        ({"lambda_init": "0.8"}, TypeError, r"lambda_init must be a number; got '0.8'"),
        ({"layer": -1}, ValueError, r"layer=-1 must be an int >= 0"),
        ({"layer": 1.0}, TypeError, r"layer must be an int; got 1.0"),
        ({"lambda_std": -0.1}, ValueError, r"lambda_std=-0.1 must be >= 0"),
        ({"n_heads": 5}, ValueError, r"d_model=32 is not divisible by n_heads=5"),
    ],
)
def test_bad_layer_arguments(kwargs, error, match):
    kwargs = {"d_model": 32, "n_heads": 4, **kwargs}
    with pytest.raises(error, match=match):
        DifferentialAttention(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_heads": 3, "d_model": 24}, r"n_heads=3 must be even for attention='differential'"),
        ({"n_kv_heads": 1}, r"n_kv_heads=1 must be even for attention='differential'"),
        ({"position": "alibi"}, r"position='alibi' does not apply to attention='differential'"),
    ],
)
def test_bad_decoder_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**{"attention": "differential", **kwargs})


def test_a_per_head_mask_gives_each_map_its_half():
    torch.manual_seed(9)
    layer = DifferentialAttention(32, 4, 2, lambda_init=0.8, lambda_std=0.3, attn_fn="eager")
    x = torch.randn(1, 6, 32)
    mask = torch.ones(1, 4, 6, 6, dtype=torch.bool)
    mask[:, 2:, :, 0] = False  # the Q2 maps (query heads 2, 3) may not see key 0; the Q1 maps may
    with torch.no_grad():
        _, weights = layer(x, mask=mask, return_weights=True)
        _, plain = layer(x, return_weights=True)
    lam = layer.lambda_full
    # Key 0 gets softmax₁'s weight alone (softmax₂ gives it 0); the first query sees key 0 only.
    assert torch.equal(weights[0, :, 0, 0], torch.ones(2))
    assert not torch.allclose(weights[..., 1:, 0], plain[..., 1:, 0])
    rows = (1 - lam).expand(1, 2, 6).clone()  # each row sums to 1 − λ ...
    rows[..., 0] = 1.0  # ... but the first, where softmax₂ sees no key and gives zeros (never NaN)
    torch.testing.assert_close(weights.sum(-1), rows)
