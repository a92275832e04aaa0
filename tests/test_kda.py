"""Kimi Delta Attention (chapter 21): chunked = recurrent, = the scalar gate when the channels agree,
= transformers' kimi_linear kernels and layer (torch fallbacks: no fla), the cache, bad inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.kimi_linear.modeling_kimi_linear import (
    KimiLinearDeltaAttention,
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from attnlib.attention.deltanet import gated_delta_rule
from attnlib.attention.kda import KimiDeltaAttention, kimi_delta_rule, short_convolution
from attnlib.cache import LayerCache, RecurrentState
from tests.test_deltanet import inputs as scalar_inputs


def inputs(T=37, dtype=torch.float64, B=2, h=3, d=8, d_v=6, seed=0):
    """Chapter 18's test inputs, with one log decay per key channel in (-2, 0] and a random initial state."""
    q, k, v, beta, _ = scalar_inputs(T, dtype, B, h, d, d_v, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    g = -2 * torch.rand(B, h, T, d, generator=gen, dtype=dtype)
    return q, k, v, beta, g, 0.3 * torch.randn(B, h, d, d_v, generator=gen, dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("T,chunk", [(1, 4), (37, 1), (37, 5), (37, 16), (64, 64)])
def test_chunked_equals_recurrent(dtype, tol, T, chunk):
    """Measured max |diff| over these cases: float64 2.2e-15, float32 2.4e-6."""
    q, k, v, beta, g, S0 = inputs(T, dtype)
    o_r, S_r = kimi_delta_rule(q, k, v, beta, g, "recurrent", initial_state=S0)
    o_c, S_c = kimi_delta_rule(q, k, v, beta, g, "chunked", chunk_size=chunk, initial_state=S0)
    torch.testing.assert_close(o_c, o_r, atol=tol, rtol=0)
    torch.testing.assert_close(S_c, S_r, atol=tol, rtol=0)


def test_gradients_of_the_two_forms_agree():
    tensors = [t.requires_grad_() for t in inputs(21)]
    grads = []
    for mode in ("recurrent", "chunked"):
        o, S = kimi_delta_rule(*tensors[:5], mode, chunk_size=4, initial_state=tensors[5])
        loss = (o * torch.linspace(-1, 1, 6, dtype=o.dtype)).sum() + (S * S).sum()
        grads.append(torch.autograd.grad(loss, tensors))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_equal_decays_on_every_channel_give_the_scalar_gate(mode):
    """g the same on every channel ≡ gated DeltaNet's per-head gate (chapter 18's scalar path)."""
    q, k, v, beta, g, S0 = inputs(29)
    g_head = g[..., 0]  # (B, h, T)
    o, S = kimi_delta_rule(q, k, v, beta, g_head[..., None].expand_as(q), mode, chunk_size=8, initial_state=S0)
    o_ref, S_ref = gated_delta_rule(q, k, v, beta, g_head, "recurrent", initial_state=S0, return_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=1e-12, rtol=0)


def test_each_row_of_the_state_decays_at_its_channels_rate():
    """With β = 0 nothing is written: S_T = Diag(exp(Σ_t g_t)) S_0, row c fading by its own channel's decays."""
    q, k, v, beta, g, S0 = inputs(12)
    for mode in ("recurrent", "chunked"):
        _, S = kimi_delta_rule(q, k, v, torch.zeros_like(beta), g, mode, chunk_size=5, initial_state=S0)
        torch.testing.assert_close(S, g.sum(2).exp()[..., None] * S0, atol=1e-14, rtol=0)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_equals_transformers_kimi_linear_kernels(mode):
    """transformers' torch fallbacks of fla's kernels work in float32 on (B, T, h, d) tensors; max |diff| ~6e-7."""
    q, k, v, beta, g, S0 = (t.float() for t in inputs(45))
    o, S = kimi_delta_rule(q, k, v, beta, g, mode, chunk_size=16, initial_state=S0)

    def t(x):  # (B, h, T, ...) -> (B, T, h, ...)
        return x.transpose(1, 2)

    o_rec, S_rec = recurrent_kimi_delta_attention(t(q), t(k), t(v), t(g), t(beta), S0, True)
    o_chk, S_chk = chunk_kimi_delta_attention(t(q), t(k), t(v), t(g), t(beta), 16, S0, True)
    for o_ref, S_ref in ((o_rec, S_rec), (o_chk, S_chk)):
        torch.testing.assert_close(o, t(o_ref), atol=1e-5, rtol=0)
        torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=0)


def layers(dtype, d_model=16, n_heads=2, head_dim=6, kernel=3, chunk_size=16):
    """transformers' KimiLinearDeltaAttention (random weights, std 0.4) and ours with its weights."""
    torch.manual_seed(0)
    config = transformers.KimiLinearConfig(
        hidden_size=d_model, num_hidden_layers=1, num_attention_heads=2, vocab_size=8, linear_num_heads=n_heads,
        linear_head_dim=head_dim, linear_conv_kernel_dim=kernel, pad_token_id=None, bos_token_id=None,
        eos_token_id=None)
    ref = KimiLinearDeltaAttention(config, layer_idx=0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.4 * torch.randn_like(p))
    ours = KimiDeltaAttention(d_model, n_heads, head_dim, conv_kernel_size=kernel, eps=config.rms_norm_eps,
                              chunk_size=chunk_size)
    names = {"forget_gate.": "", "o_norm.weight": "norm_weight", "o_proj": "out_proj"}
    state = {}
    for key, value in ref.state_dict().items():
        for old, new in names.items():
            key = key.replace(old, new)
        state[key] = value.reshape(-1) if key == "A_log" else value  # (1, 1, h, 1) -> (h,)
    ours.load_state_dict(state)
    return ref.to(dtype).eval(), ours.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_layer_equals_transformers_kimi_linear(dtype):
    """head_dim 6 ≠ d_model / n_heads, 70 positions (5 of our chunks, 2 of transformers' 64), K = 3.

    Measured max |diff| 1.3e-6 to 5.9e-6 over random inputs (outputs ~1), float32 and float64 alike:
    transformers computes the forget gate and the KDA kernels in float32 whatever the input's dtype,
    so float64 cannot be tighter here; the float64 checks above (1e-12) test the recurrence itself.
    """
    ref, ours = layers(dtype)
    x = torch.randn(2, 70, 16, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_cached_equals_one_pass():
    """One token at a time, and a prompt in two pieces then tokens, ≡ the whole sequence (float64, 1e-12)."""
    _, layer = layers(torch.float64)
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    with torch.no_grad():
        whole = layer(x)
        for cuts in ((0, *range(1, 21)), (0, 2, 11, 12, 20)):  # T = 2 < K - 1 + 1 checks the conv state's padding
            cache = layer.new_cache(20)
            assert isinstance(cache, RecurrentState)
            pieces = [layer(x[:, a:b], cache=cache) for a, b in zip(cuts, cuts[1:])]
            torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-12, rtol=0)
    S, conv = cache.read()
    assert cache.length == 20 and S.shape == (2, 2, 6, 6) and conv.shape == (2, 3 * 12, 2)
    assert cache.nbytes() == 2 * layer.state_bytes() == 2 * (12 * 6 + 36 * 2) * 8
    last = x[:, -2:]  # the conv state: the projections of the last K - 1 = 2 positions, (B, channels, K - 1)
    with torch.no_grad():
        torch.testing.assert_close(conv, torch.cat([layer.q_proj(last), layer.k_proj(last), layer.v_proj(last)],
                                                   -1).transpose(1, 2))


def test_bad_inputs_name_the_argument():
    q, k, v, beta, g, _ = inputs(6)
    with pytest.raises(ValueError, match=r"g must have shape \(B, n_heads, T, d_k\) = \(2, 3, 6, 8\) .*; got \(2, 3, 6, 7\)"):
        kimi_delta_rule(q, k, v, beta, g[..., :7])
    with pytest.raises(ValueError, match=r"g must have shape .*; got \(2, 3, 6\)"):
        kimi_delta_rule(q, k, v, beta, g[..., 0])
    with pytest.raises(TypeError, match="g must be a floating point tensor; got torch.int64"):
        kimi_delta_rule(q, k, v, beta, g.long())
    with pytest.raises(TypeError, match="q must be a floating point tensor; got torch.int64"):
        kimi_delta_rule(q.long(), k, v, beta, g)
    with pytest.raises(ValueError, match=r"v must have shape \(B, n_heads, T, d_v\)"):
        kimi_delta_rule(q, k, v[:, :, :4], beta, g)
    with pytest.raises(ValueError, match="g is a log decay and must be <= 0"):
        kimi_delta_rule(q, k, v, beta, -g)
    with pytest.raises(ValueError, match="beta must lie in"):
        kimi_delta_rule(q, k, v, beta + 1, g)
    with pytest.raises(ValueError, match="mode='parallel' is not one of"):
        kimi_delta_rule(q, k, v, beta, g, "parallel")
    with pytest.raises(ValueError, match=r"g must have shape \(B, n_heads, T\) = \(2, 3, 6\) .* or .*; got \(2, 3, 6, 7\)"):
        gated_delta_rule(q, k, v, beta, g[..., :7])
    with pytest.raises(ValueError, match="d_model=16 is not divisible by n_heads=3"):
        KimiDeltaAttention(16, 3)
    with pytest.raises(ValueError, match="head_dim=0 must be a positive integer"):
        KimiDeltaAttention(16, 2, 0)
    with pytest.raises(ValueError, match="eps"):
        KimiDeltaAttention(16, 2, eps=0.0)
    layer = KimiDeltaAttention(16, 3, 4, block_size=8)  # head_dim given: 3 heads of 4 need not divide 16
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=16\)"):
        layer(torch.randn(1, 3, 12))
    with pytest.raises(TypeError, match="x must be a floating point tensor"):
        layer(torch.ones(1, 3, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length T=9 .* exceeds block_size=8"):
        layer(torch.randn(1, 9, 16))
    with pytest.raises(ValueError, match="a Kimi Delta Attention layer takes no attention_mask"):
        layer(torch.randn(1, 3, 16), attention_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="cache must be an attnlib.cache.RecurrentState .*; got LayerCache"):
        layer(torch.randn(1, 3, 16), cache=LayerCache(8))
    x, w = torch.randn(2, 5, 6), torch.randn(6, 1, 3)
    with pytest.raises(ValueError, match=r"weight must have shape \(channels=6, 1, K >= 1\); got \(4, 1, 3\)"):
        short_convolution(x, w[:4])
    with pytest.raises(ValueError, match=r"state must be a tensor of shape \(B, channels, K - 1\) = \(2, 6, 2\); got \(2, 6, 3\)"):
        short_convolution(x, w, torch.zeros(2, 6, 3))
    with pytest.raises(TypeError, match="x must be a floating point tensor; got torch.int64"):
        short_convolution(x.long(), w)


def test_short_convolution_is_a_causal_depthwise_convolution():
    """= nn.Conv1d(groups=channels) with K - 1 zeros on the left, then SiLU; the state is the last K - 1 inputs."""
    x, conv = torch.randn(2, 7, 6), torch.nn.Conv1d(6, 6, 3, groups=6, bias=False, padding=2)
    y, state = short_convolution(x, conv.weight)
    torch.testing.assert_close(y, F.silu(conv(x.transpose(1, 2))[..., :7]).transpose(1, 2))
    torch.testing.assert_close(state, x[:, -2:].transpose(1, 2))
