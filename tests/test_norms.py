"""LayerNorm and RMSNorm written out equal PyTorch's layers (chapter 10)."""
import pytest
import torch
from torch import nn

from attnlib.norms import LayerNorm, RMSNorm


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_equals_torch(eps):
    ours, ref = RMSNorm(12, eps=eps), nn.RMSNorm(12, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(12))
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 12) * 3
    torch.testing.assert_close(ours(x), ref(x))


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


def test_norm_errors():
    with pytest.raises(ValueError):
        RMSNorm(8, eps=-1.0)
    with pytest.raises(ValueError):
        LayerNorm(8)(torch.randn(2, 7))
    with pytest.raises(TypeError):
        RMSNorm(0.5)
