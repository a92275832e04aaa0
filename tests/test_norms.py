"""LayerNorm and RMSNorm written out equal PyTorch's layers (chapter 10)."""
import re

import pytest
import torch
from torch import nn

from attnlib.layers.norms import LayerNorm, RMSNorm


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_equals_torch(eps):
    ours, ref = RMSNorm(12, eps=eps), nn.RMSNorm(12, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(12))
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 12) * 3
    torch.testing.assert_close(ours(x), ref(x))


def test_rmsnorm_backward_gives_autograds_gradients_and_second_derivatives():
    """The written-out backward against autograd through nn.RMSNorm; computed in place (no create_graph) it gives
    the bits of the out-of-place one (create_graph); gradcheck and gradgradcheck in float64, weight included."""
    ours, ref = RMSNorm(12, eps=1e-6), nn.RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(12))
        ref.weight.copy_(ours.weight)
    x = (torch.randn(3, 5, 12) * 3).requires_grad_()
    upstream = torch.randn(3, 5, 12)
    grads = torch.autograd.grad(ours(x), (x, ours.weight), upstream)
    x_ref = x.detach().requires_grad_()
    for got, expected in zip(grads, torch.autograd.grad(ref(x_ref), (x_ref, ref.weight), upstream)):
        torch.testing.assert_close(got, expected)
    differentiable = torch.autograd.grad(ours(x), (x, ours.weight), upstream, create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, differentiable))
    norm = RMSNorm(6).double()
    x64 = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, dtype=torch.float64, requires_grad=True)
    f = lambda t, w: torch.func.functional_call(norm, {"weight": w}, (t,))  # noqa: E731
    assert torch.autograd.gradcheck(f, (x64, weight))
    assert torch.autograd.gradgradcheck(f, (x64, weight))


def test_rmsnorm_unit_rms_and_wrong_formula_differs():
    x = torch.randn(4, 16) * 5
    y = RMSNorm(16)(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4), atol=1e-4, rtol=0)
    wrong = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)  # root taken twice
    assert not torch.allclose(wrong, y, atol=1e-2)


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_equals_torch(bias):
    ours, ref = LayerNorm(10, bias=bias), nn.LayerNorm(10, bias=bias)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(10))
        ref.weight.copy_(ours.weight)
        if bias:
            ours.bias.copy_(torch.randn(10))
            ref.bias.copy_(ours.bias)
    x = torch.randn(2, 7, 10) * 4 + 3
    torch.testing.assert_close(ours(x), ref(x))


@pytest.mark.parametrize("norm", [RMSNorm, LayerNorm])
@pytest.mark.parametrize(
    "eps, error, message",
    [
        (0.0, ValueError, "eps=0.0"),
        (-1.0, ValueError, "eps=-1.0"),
        (float("nan"), ValueError, "eps=nan"),
        (float("inf"), ValueError, "eps=inf"),
        ("1e-5", TypeError, "'1e-5'"),
    ],
    ids=["zero", "negative", "nan", "inf", "str"],
)
def test_eps_must_be_finite_and_positive(norm, eps, error, message):
    with pytest.raises(error, match=re.escape(message)):
        norm(8, eps=eps)


def test_norm_errors():
    with pytest.raises(ValueError, match=re.escape("(..., T, d_model=8); got (2, 7)")):
        LayerNorm(8)(torch.randn(2, 7))
    with pytest.raises(TypeError, match=re.escape("d must be an int; got 0.5")):
        RMSNorm(0.5)
    with pytest.raises(TypeError, match="got list"):
        RMSNorm(4)([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match="torch.int64"):
        LayerNorm(4)(torch.ones(2, 4, dtype=torch.long))


def test_empty_and_one_dimensional_inputs():
    x = torch.randn(0, 8)
    assert RMSNorm(8)(x).shape == (0, 8) and LayerNorm(8)(x).shape == (0, 8)
    v = torch.randn(8)
    torch.testing.assert_close(RMSNorm(8)(v), torch.nn.RMSNorm(8, eps=1e-6)(v))
