"""Cross-attention: different lengths, no causal mask over the context, padding, ≡ nn.MultiheadAttention."""
import pytest
import torch
from torch import nn

from attnlib.attention import CrossAttention

ATOL = 1e-5


def test_shapes_with_different_lengths_and_equal_to_torch():
    ours = CrossAttention(16, 4)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.kv_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.kv_proj.bias]))
        ref.out_proj.load_state_dict(ours.out_proj.state_dict())
    x, context = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    lengths = torch.tensor([9, 4])
    real = torch.arange(9)[None, :] < lengths[:, None]  # (B, T_k) True = real
    y = ours(x, context, key_padding_mask=real)
    assert y.shape == (2, 5, 16)
    expected, _ = ref(x, context, context, key_padding_mask=~real, need_weights=False)  # torch: True = ignore
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)


def test_not_causal_every_query_sees_the_whole_context():
    ours = CrossAttention(16, 4).eval()
    x, context = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    _, weights = ours(x, context, return_weights=True)
    assert (weights[..., 0, 1:] > 0).all()  # the first query attends to later context positions
    changed = context.clone()
    changed[:, -1] += 1.0
    assert not torch.allclose(ours(x, context)[:, 0], ours(x, changed)[:, 0])  # the last position moves query 0


def test_padding_positions_get_no_weight():
    ours = CrossAttention(8, 2)
    real = torch.tensor([[True, True, False, False]])
    _, weights = ours(torch.randn(1, 3, 8), torch.randn(1, 4, 8), key_padding_mask=real, return_weights=True)
    assert torch.equal(weights[..., 2:], torch.zeros_like(weights[..., 2:]))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m(torch.randn(2, 3, 8), torch.randn(3, 4, 8)), ValueError, "the same B"),
        (lambda m: m(torch.randn(2, 3, 8), torch.randn(2, 4, 6)), ValueError, "d_model=8"),
        (lambda m: m(torch.randn(2, 3, 8), torch.randn(2, 4, 8), key_padding_mask=torch.ones(2, 4)), TypeError, "boolean"),
        (lambda m: m(torch.randn(2, 3, 8), torch.randn(2, 4, 8), key_padding_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, r"\(B, T_k\)"),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call(CrossAttention(8, 2))
