"""Gated DeltaNet (chapter 18): recurrent = chunked, = transformers' Qwen3-Next reference, the layer, bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from attnlib import GPT, GPTConfig
from attnlib.attention import GatedDeltaNet, gated_delta_rule
from attnlib.cache import LayerCache, RecurrentState


def inputs(T=37, dtype=torch.float32, B=2, h=3, d=8, d_v=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, T, d, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, h, T, d, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, h, T, d_v, generator=g, dtype=dtype)
    beta = torch.rand(B, h, T, generator=g, dtype=dtype)
    decay = -torch.rand(B, h, T, generator=g, dtype=dtype)  # log α in (-1, 0]
    return q, k, v, beta, decay


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("T,chunk", [(1, 4), (37, 1), (37, 5), (37, 8), (37, 64), (64, 16)])
@pytest.mark.parametrize("gated", [True, False])
def test_recurrent_equals_chunked(dtype, tol, T, chunk, gated):
    q, k, v, beta, g = inputs(T, dtype)
    g = g if gated else None
    r, S_r = gated_delta_rule(q, k, v, beta, g, "recurrent", return_state=True)
    c, S_c = gated_delta_rule(q, k, v, beta, g, "chunked", chunk_size=chunk, return_state=True)
    assert torch.allclose(r, c, atol=tol, rtol=0) and torch.allclose(S_r, S_c, atol=tol, rtol=0)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_equals_transformers_qwen3_next_reference(mode):
    q, k, v, beta, g = inputs(45)
    S0 = torch.randn(2, 3, 8, 6) * 0.1
    ours, S = gated_delta_rule(q, k, v, beta, g, mode, chunk_size=16, initial_state=S0, return_state=True)

    def t(x):  # transformers wants (B, T, h, d)
        return x.transpose(1, 2)

    for ref in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
        kw = {"chunk_size": 16} if ref is torch_chunk_gated_delta_rule else {}
        o, S_ref = ref(t(q), t(k), t(v), t(g), t(beta), initial_state=S0, output_final_state=True, **kw)
        assert torch.allclose(t(o), ours, atol=1e-5) and torch.allclose(S_ref, S, atol=1e-5)


def test_gradients_of_the_two_forms_agree():
    tensors = [x.requires_grad_() for x in inputs(21, torch.float64)]
    grads = []
    for mode in ("recurrent", "chunked"):
        out = gated_delta_rule(*tensors, mode, chunk_size=4)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, 6, dtype=out.dtype)).sum(), tensors))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-10)


def test_the_delta_rule_overwrites_what_a_key_stores():
    """β = 1, no decay: writing v₁ then v₂ under the same key leaves only v₂ (linear attention would keep v₁ + v₂)."""
    k = F.normalize(torch.randn(1, 1, 1, 8), dim=-1).expand(1, 1, 2, 8)
    v = torch.randn(1, 1, 2, 4)
    out = gated_delta_rule(k * 8**0.5, k, v, torch.ones(1, 1, 2), None, "recurrent")  # query = key, unscaled
    assert torch.allclose(out[0, 0, 1], v[0, 0, 1], atol=1e-6)


def test_state_continues_the_sequence():
    q, k, v, beta, g = inputs(30, torch.float64)
    whole = gated_delta_rule(q, k, v, beta, g, "recurrent")
    first, S = gated_delta_rule(q[:, :, :13], k[:, :, :13], v[:, :, :13], beta[:, :, :13], g[:, :, :13],
                                "chunked", chunk_size=4, return_state=True)
    rest = gated_delta_rule(q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], beta[:, :, 13:], g[:, :, 13:],
                            "chunked", chunk_size=8, initial_state=S)
    assert torch.allclose(torch.cat([first, rest], 2), whole, atol=1e-12)


def test_gpt_with_gated_deltanet_generates_the_same_with_its_state_as_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=24, n_layers=2, n_heads=2, d_model=16,
                          layer_types=("linear_attention",) * 2, linear_layer="gated_deltanet"))
    for block in model.blocks:
        assert isinstance(block.attn, GatedDeltaNet) and block.attn.block_size == 24
        block.attn.chunk_size = 5  # chunks that do not divide the prompt
    model.eval()
    prompt = torch.randint(0, 40, (2, 7))
    cached = model.generate(prompt, 30, temperature=0.0)
    assert torch.equal(cached, model.generate(prompt, 30, temperature=0.0, use_cache=False))
    cache = model.new_cache()
    with torch.no_grad():
        logits, _ = model(cached[:, :20])
        model(cached[:, :9], cache=cache)
        step = [model(cached[:, t : t + 1], cache=cache)[0] for t in range(9, 20)]
    assert torch.allclose(torch.cat(step, 1), logits[:, 9:20], atol=1e-5)
    assert cache.layers[0].nbytes() == 2 * model.blocks[0].attn.state_bytes() == 2 * 2 * 8 * 8 * 4
    assert all(isinstance(layer, RecurrentState) for layer in cache.layers)


def test_the_layer_continues_from_its_recurrent_state():
    """layer(x) ≡ the same sequence fed in pieces through layer.new_cache(block_size) (a RecurrentState)."""
    layer = GatedDeltaNet(16, 2, block_size=20, chunk_size=3).double()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    with torch.no_grad():
        whole = layer(x)
        state = layer.new_cache(20)
        assert isinstance(state, RecurrentState) and state.read() is None
        pieces = [layer(x[:, a:b], cache=state) for a, b in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole)
    assert state.length == 20 and state.read()[0].shape == (2, 2, 8, 8)


def test_bad_inputs_name_the_value():
    q, k, v, beta, g = inputs(6)
    with pytest.raises(ValueError, match="chunk_size=0 must be a positive integer"):
        gated_delta_rule(q, k, v, beta, g, chunk_size=0)
    with pytest.raises(ValueError, match="beta must lie in"):
        gated_delta_rule(q, k, v, beta + 1, g)
    with pytest.raises(ValueError, match="g is a log decay and must be <= 0"):
        gated_delta_rule(q, k, v, beta, -g)
    with pytest.raises(ValueError, match=r"q and k must have the same shape .* \(2, 3, 6, 8\) and \(2, 3, 5, 8\)"):
        gated_delta_rule(q, k[:, :, :5], v, beta, g)
    with pytest.raises(ValueError, match=r"beta must have shape \(B, n_heads, T\) = \(2, 3, 6\); got \(2, 3, 5\)"):
        gated_delta_rule(q, k, v, beta[..., :5], g)
    with pytest.raises(ValueError, match="mode='parallel' is not one of"):
        gated_delta_rule(q, k, v, beta, g, "parallel")
    with pytest.raises(ValueError, match=r"initial_state must have shape \(2, 3, 8, 6\)"):
        gated_delta_rule(q, k, v, beta, g, initial_state=torch.zeros(2, 3, 6, 8))
    with pytest.raises(ValueError, match="d_model=16 is not divisible by n_heads=3"):
        GatedDeltaNet(16, 3)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=16\)"):
        GatedDeltaNet(16, 2)(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="sequence length T=9 .* exceeds block_size=8"):
        GatedDeltaNet(16, 2, block_size=8)(torch.randn(1, 9, 16))
    layer, x = GatedDeltaNet(16, 2), torch.randn(2, 3, 16)
    for kwargs in ({"attention_mask": torch.ones(2, 3, dtype=torch.bool)}, {"positions": torch.zeros(2, 3, dtype=torch.long)}):
        with pytest.raises(ValueError, match="a gated DeltaNet layer takes no attention_mask or positions"):
            layer(x, **kwargs)
    with pytest.raises(TypeError, match="cache must be an attnlib.cache.RecurrentState .*; got LayerCache"):
        layer(x, cache=LayerCache(8))


def test_the_committed_comparison_holds_every_model_and_seed():
    from attnlib.book.experiments import beyond_softmax

    results = beyond_softmax.load_results()
    assert results["meta"]["complete"] and len(results["seeds"]) >= 2
    assert set(results["variants"]) == {"softmax", "linear", "deltanet", "gated"}
    for name, run in results["variants"].items():
        assert sorted(run["by_seed"]) == sorted(map(str, results["seeds"]))
        assert run["parameters"] == beyond_softmax.build_model(name, 0).num_parameters()
    assert results["topk"]["k"] == [32, 16, 8, 4]
    for seed in results["seeds"]:
        assert abs(results["topk"]["by_seed"][str(seed)][0] - results["topk"]["dense"][str(seed)]) < 1e-4
