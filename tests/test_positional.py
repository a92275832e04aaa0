"""Positional encodings (chapter 10): sinusoidal values, learned table, RoPE's relative-offset property."""
import math
import re

import pytest
import torch

from attnlib.attention import MultiHeadAttention
from attnlib.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
)


def test_sinusoidal_formula_values():
    pe = sinusoidal_encoding(50, 16)
    assert pe.shape == (50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)
    assert torch.equal(pe[0, 0::2], torch.zeros(8)) and torch.equal(pe[0, 1::2], torch.ones(8))


def test_sinusoidal_module_adds_table_and_checks_length():
    layer = SinusoidalPositionalEncoding(8, block_size=10)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(layer(x), x + sinusoidal_encoding(6, 8))
    assert len(list(layer.parameters())) == 0
    with pytest.raises(ValueError, match=re.escape("sequence length T=11 exceeds block_size=10")):
        layer(torch.randn(1, 11, 8))
    with pytest.raises(ValueError, match=re.escape("d_model=7 must be even")):
        sinusoidal_encoding(4, 7)


def test_learned_embedding():
    layer = LearnedPositionalEmbedding(10, 8)
    x = torch.zeros(3, 4, 8)
    torch.testing.assert_close(layer(x), layer.weight.weight[:4].expand(3, 4, 8))
    with pytest.raises(ValueError, match=re.escape("sequence length T=11 exceeds block_size=10")):
        layer(torch.zeros(1, 11, 8))


def test_rope_scores_depend_only_on_offset():
    rope = RotaryEmbedding(16)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def score(m, n):
        qm = rope.rotate(q[None, :], torch.tensor([m]))
        kn = rope.rotate(k[None, :], torch.tensor([n]))
        return (qm * kn).sum().item()

    for m, n, s in [(3, 1, 5), (0, 7, 20), (10, 10, 33)]:
        assert score(m, n) == pytest.approx(score(m + s, n + s), abs=1e-4)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3  # but it does depend on the offset


def test_rope_is_a_rotation_and_half_split():
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 5, 8)
    y = rope.rotate(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])  # position 0: no rotation
    # half-split pairing: pair 0 is (x[0], x[4]), rotated by 1 radian at position 1
    v = torch.zeros(1, 2, 8)
    v[0, 1, 0] = 1.0
    out = rope.rotate(v)
    assert out[0, 1, 0].item() == pytest.approx(math.cos(1.0), abs=1e-6)
    assert out[0, 1, 4].item() == pytest.approx(math.sin(1.0), abs=1e-6)


def test_rope_errors():
    with pytest.raises(ValueError, match=re.escape("head_dim=7 must be even")):
        RotaryEmbedding(7)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=re.escape("got (2, 5, 6)")):
        rope.rotate(torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match=re.escape("positions must be a tensor whose last dimension is T=5; got shape (4,)")):
        rope.rotate(torch.randn(2, 5, 8), torch.arange(4))


def test_rope_does_not_shadow_module_apply():
    """nn.Module.apply(fn) visits every submodule: RoPE's rotation must not take its name."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), RotaryEmbedding(8))
    seen = []
    assert model.apply(lambda m: seen.append(type(m).__name__)) is model
    assert seen == ["Linear", "RotaryEmbedding", "Sequential"]
    model.apply(lambda m: torch.nn.init.zeros_(m.weight) if isinstance(m, torch.nn.Linear) else None)
    assert torch.equal(model[0].weight, torch.zeros(8, 8))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(model[1](x), model[1].rotate(x))  # forward is the rotation


@pytest.mark.parametrize(
    "base, error, message",
    [
        (0.0, ValueError, "base=0.0"),
        (-10.0, ValueError, "base=-10.0"),
        (1.0, ValueError, "base=1.0"),
        (float("nan"), ValueError, "base=nan"),
        (float("inf"), ValueError, "base=inf"),
        ("10000", TypeError, "'10000'"),
        (True, TypeError, "True"),
    ],
    ids=["zero", "negative", "one", "nan", "inf", "str", "bool"],
)
def test_rope_base_must_be_a_finite_number_above_one(base, error, message):
    with pytest.raises(error, match=re.escape(message)):
        RotaryEmbedding(8, base=base)


def _rope_reference(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as complex multiplication (RoFormer eq. 34), pairs (x[i], x[i + d/2]) as z = x1 + i x2."""
    half = x.shape[-1] // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    turn = torch.polar(torch.ones_like(theta), positions.double()[..., None] * theta)  # e^{i m θ}
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * turn
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("positions", [torch.arange(6), torch.tensor([[3, 4, 5, 9, 10, 11], [0, 1, 2, 3, 4, 5]])[:, None]],
                         ids=["shared", "per-row"])
def test_rope_gradient_is_the_inverse_rotation(positions):
    """The written-out backward: d(R x)/dx applied to g is R(-θ) g, against a complex-number reference."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    upstream = torch.randn(2, 3, 6, 8, dtype=torch.float64, generator=g)
    rope = RotaryEmbedding(8)
    y = rope.rotate(x, positions)
    (grad,) = torch.autograd.grad(y, x, upstream)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = _rope_reference(x_ref, positions)
    (grad_ref,) = torch.autograd.grad(y_ref, x_ref, upstream)
    # the angles m·θ are float32, as in transformers: ~1e-7 of the angle, whatever x's dtype
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-6)
    # R(θ) is orthogonal, so the gradient is the upstream gradient turned back: same length per pair
    torch.testing.assert_close(grad.norm(dim=-1), upstream.norm(dim=-1))


def test_rope_backward_gives_autograds_bits_and_second_derivatives():
    """float32: the same bits as autograd through x·cos + rotate_half(x)·sin; gradgradcheck in float64."""
    rope = RotaryEmbedding(16)
    x = torch.randn(4, 2, 7, 16, requires_grad=True)
    upstream = torch.randn(4, 2, 7, 16)
    positions = torch.arange(5, 12)
    angle = positions.float()[:, None] * rope.inv_freq
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    rotate_half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
    y_autograd = x * cos + rotate_half * sin  # transformers' apply_rotary_pos_emb
    y = rope.rotate(x, positions)
    assert torch.equal(y, y_autograd)
    assert torch.equal(torch.autograd.grad(y, x, upstream)[0], torch.autograd.grad(y_autograd, x, upstream)[0])
    x64 = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    rope8 = RotaryEmbedding(8)
    assert torch.autograd.gradcheck(lambda t: rope8.rotate(t, torch.arange(2, 5)), (x64,))
    assert torch.autograd.gradgradcheck(lambda t: rope8.rotate(t, torch.arange(2, 5)), (x64,))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "rope+qk_norm"])
def test_multi_head_attention_with_rope_equals_rotated_queries_and_keys_in_sdpa(qk_norm):
    """MultiHeadAttention(rope=RotaryEmbedding(head_dim)): queries and keys (RMS-normed first with qk_norm, as
    Qwen3) rotated by their positions (the complex-number reference above), then causal SDPA; per-row positions
    (B, T) rotate each row by its own."""
    torch.manual_seed(0)
    H, G, d = 4, 2, 8
    layer = MultiHeadAttention(32, H, G, rope=RotaryEmbedding(d), qk_norm=qk_norm, bias=False).double()
    if qk_norm:
        with torch.no_grad():
            layer.q_norm.weight.copy_(torch.rand(d) + 0.5)
            layer.k_norm.weight.copy_(torch.rand(d) + 0.5)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    q, k, v = layer.qkv(x).split([H * d, G * d, G * d], dim=-1)
    q, k, v = (t.view(2, 6, -1, d).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
    if qk_norm:
        rms = torch.nn.RMSNorm(d, eps=1e-6, dtype=torch.float64)
        q = rms(q) * layer.q_norm.weight
        k = rms(k) * layer.k_norm.weight
    for pos in (None, positions):
        at = torch.arange(6) if pos is None else pos[:, None]
        q_rot, k_rot = _rope_reference(q, at), _rope_reference(k, at)
        y = torch.nn.functional.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)
        expected = layer.out_proj(y.transpose(1, 2).reshape(2, 6, H * d))
        with torch.no_grad():
            # the angles are float32 (as in transformers): 1e-6, as for the rotation above
            torch.testing.assert_close(layer(x, positions=pos), expected.detach(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=re.escape("rope must be a RotaryEmbedding of head_dim=8")):
        MultiHeadAttention(32, H, G, rope=RotaryEmbedding(16))
