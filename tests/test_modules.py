"""Attention modules: equal to each other and to PyTorch's references after weight mapping; causal; clear errors."""
import pytest
import torch
from torch import nn

from attnlib import (
    ATTENTION_REGISTRY,
    CausalAttention,
    GPTConfig,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
)
from attnlib.functional import causal_mask

ATOL = 1e-5


def copy_v2_into_v1(v2: SelfAttentionV2, v1: SelfAttentionV1) -> None:
    """nn.Linear stores (head_dim, d_model) and computes x @ W.T; V1 computes x @ W, so copy the transpose."""
    with torch.no_grad():
        v1.W_query.copy_(v2.W_query.weight.T)
        v1.W_key.copy_(v2.W_key.weight.T)
        v1.W_value.copy_(v2.W_value.weight.T)


def wrapper_into_batched(wrapper: MultiHeadAttentionWrapper, mha: MultiHeadAttention) -> None:
    """Stack the heads' projections into qkv; out_proj becomes the identity (the wrapper has none)."""
    with torch.no_grad():
        for block, name in enumerate(("W_query", "W_key", "W_value")):
            rows = torch.cat([getattr(head, name).weight for head in wrapper.heads], dim=0)  # (d_model, d_model)
            mha.qkv.weight[block * mha.d_model : (block + 1) * mha.d_model] = rows
        mha.qkv.bias.zero_()
        mha.out_proj.weight.copy_(torch.eye(mha.d_model))
        mha.out_proj.bias.zero_()


def test_v1_equals_v2_after_weight_transfer():
    v2, v1 = SelfAttentionV2(6, 4), SelfAttentionV1(6, 4)
    x = torch.randn(2, 5, 6)
    assert not torch.allclose(v1(x), v2(x), atol=ATOL)  # different random weights before the transfer
    copy_v2_into_v1(v2, v1)
    torch.testing.assert_close(v1(x), v2(x), atol=ATOL, rtol=0)


def test_causal_attention_is_v2_with_a_mask():
    head = CausalAttention(6, 4, block_size=8)
    x = torch.randn(3, 8, 6)
    q, k, v = head.project(x)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(head(x), expected, atol=ATOL, rtol=0)


def test_wrapper_equals_batched_after_weight_mapping():
    wrapper = MultiHeadAttentionWrapper(d_model=12, head_dim=4, block_size=10, n_heads=3)
    mha = MultiHeadAttention(12, 3, block_size=10)
    wrapper_into_batched(wrapper, mha)
    x = torch.randn(2, 10, 12)
    torch.testing.assert_close(mha(x), wrapper(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_mha_equals_torch_multihead_attention(bias, causal):
    d_model, n_heads, T = 16, 4, 7
    ours = MultiHeadAttention(d_model, n_heads, bias=bias, causal=causal)
    ref = nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(ours.qkv.bias)
            ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(3, T, d_model)
    # nn.MultiheadAttention's boolean attn_mask has the opposite convention: True = may NOT attend.
    ref_mask = ~causal_mask(T) if causal else None
    expected, _ = ref(x, x, x, attn_mask=ref_mask, need_weights=False)
    torch.testing.assert_close(ours(x), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_eager_path_equals_sdpa_path(causal):
    sdpa = MultiHeadAttention(16, 4, causal=causal, backend="sdpa")
    eager = MultiHeadAttention(16, 4, causal=causal, backend="eager")
    eager.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, 9, 16)
    key_mask = torch.rand(2, 1, 1, 9) < 0.7
    key_mask[..., 0] = True
    torch.testing.assert_close(eager(x), sdpa(x), atol=ATOL, rtol=0)
    torch.testing.assert_close(eager(x, mask=key_mask), sdpa(x, mask=key_mask), atol=ATOL, rtol=0)
    y, weights = sdpa(x, return_weights=True)
    torch.testing.assert_close(y, sdpa(x), atol=ATOL, rtol=0)
    assert weights.shape == (2, 4, 9, 9)
    if causal:
        assert torch.equal(weights[..., ~causal_mask(9)], torch.zeros_like(weights[..., ~causal_mask(9)]))


def leak_at(module: nn.Module, x: torch.Tensor, t: int) -> float:
    """Largest change of outputs at positions <= t when every input after t is replaced."""
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
    with torch.no_grad():
        return (module(x)[:, : t + 1] - module(x2)[:, : t + 1]).abs().max().item()


CAUSAL_MODULES = {
    "CausalAttention": lambda: CausalAttention(8, 4, block_size=12),
    "MultiHeadAttentionWrapper": lambda: MultiHeadAttentionWrapper(8, 4, block_size=12, n_heads=2),
    "MultiHeadAttention/sdpa": lambda: MultiHeadAttention(8, 2, backend="sdpa"),
    "MultiHeadAttention/eager": lambda: MultiHeadAttention(8, 2, backend="eager"),
    **{f"registry:{name}": (lambda cls=cls: cls(GPTConfig(d_model=8, n_heads=2, block_size=12))) for name, cls in ATTENTION_REGISTRY.items()},
}


@pytest.mark.parametrize("name", sorted(CAUSAL_MODULES))
def test_causal_modules_do_not_leak(name):
    module = CAUSAL_MODULES[name]().eval()
    x = torch.randn(2, 12, 8)
    for t in range(11):
        assert leak_at(module, x, t) <= 1e-6, f"{name} leaks future tokens into position {t}"


def test_leak_test_catches_a_non_causal_module():
    module = MultiHeadAttention(8, 2, causal=False).eval()
    assert leak_at(module, torch.randn(2, 12, 8), 5) > 1e-3


def test_dropout_only_in_training():
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    assert not torch.allclose(mha(x), mha(x))


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: MultiHeadAttention(770, 12), ValueError, "d_model=770 is not divisible by n_heads=12"),
        (lambda: MultiHeadAttention(16, 0), ValueError, "n_heads=0"),
        (lambda: MultiHeadAttention(16, 4, backend="flash"), ValueError, "backend='flash'"),
        (lambda: MultiHeadAttention(16, 4, dropout=1.5), ValueError, "dropout=1.5"),
        (lambda: SelfAttentionV1(0, 4), ValueError, "d_model=0"),
        (lambda: SelfAttentionV2(4, 2.0), TypeError, "head_dim must be an int"),
        (lambda: CausalAttention(4, 2, block_size=-1), ValueError, "block_size=-1"),
        (lambda: MultiHeadAttentionWrapper(4, 2, 8, n_heads=0), ValueError, "n_heads=0"),
    ],
)
def test_bad_construction_gives_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize(
    "module, x, error, message",
    [
        (MultiHeadAttention(8, 2), torch.randn(2, 5, 6), ValueError, r"d_model=8\); got \(2, 5, 6\)"),
        (MultiHeadAttention(8, 2), torch.randn(5, 8), ValueError, r"got \(5, 8\)"),
        (MultiHeadAttention(8, 2, block_size=4), torch.randn(1, 5, 8), ValueError, "T=5 exceeds block_size=4"),
        (MultiHeadAttention(8, 2), torch.ones(1, 5, 8, dtype=torch.long), TypeError, "floating point"),
        (CausalAttention(8, 4, block_size=4), torch.randn(1, 5, 8), ValueError, "T=5 exceeds block_size=4"),
        (SelfAttentionV1(8, 4), [[1.0] * 8], TypeError, "torch.Tensor"),
    ],
)
def test_bad_input_gives_clear_errors(module, x, error, message):
    with pytest.raises(error, match=message):
        module(x)


def test_sdpa_path_rejects_float_mask():
    with pytest.raises(TypeError, match="boolean"):
        MultiHeadAttention(8, 2)(torch.randn(1, 3, 8), mask=torch.ones(3, 3))
