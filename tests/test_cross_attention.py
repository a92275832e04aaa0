"""Cross-attention: MultiHeadAttention(causal=False) over a context, ≡ nn.MultiheadAttention, padding, no causal mask."""
import torch
from torch import nn

from attnlib import ATTENTION_FUNCTIONS, MultiHeadAttention
from attnlib.attention import padding_mask

ATOL = 1e-5


def torch_reference(ours: MultiHeadAttention) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(ours.d_model, ours.n_heads, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)  # rows [W_q; W_k; W_v]: queries from x, keys/values from the context
        ref.in_proj_bias.copy_(ours.qkv.bias)
        ref.out_proj.load_state_dict(ours.out_proj.state_dict())
    return ref


def test_shapes_with_different_lengths_and_equal_to_torch():
    ours = MultiHeadAttention(16, 4, causal=False)
    ref = torch_reference(ours)
    x, context = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    real = padding_mask([9, 4], 9)  # (B, T_k) True = real
    for attn_fn in ATTENTION_FUNCTIONS:
        ours.attn_fn = attn_fn
        y = ours(x, context, attention_mask=real)
        assert y.shape == (2, 5, 16)
        expected, _ = ref(x, context, context, key_padding_mask=~real, need_weights=False)  # torch: True = ignore
        torch.testing.assert_close(y, expected, atol=ATOL, rtol=0, msg=attn_fn)


def test_grouped_cross_attention_equals_torch_with_repeated_heads():
    ours = MultiHeadAttention(16, 4, n_kv_heads=2, causal=False)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        w_q, w_k, w_v = ours.qkv.weight.split([16, 8, 8])
        b_q, b_k, b_v = ours.qkv.bias.split([16, 8, 8])
        repeat = lambda t: t.view(2, 4, -1).repeat_interleave(2, dim=0).reshape(16, *t.shape[1:])  # noqa: E731
        ref.in_proj_weight.copy_(torch.cat([w_q, repeat(w_k), repeat(w_v)]))
        ref.in_proj_bias.copy_(torch.cat([b_q, repeat(b_k[:, None])[:, 0], repeat(b_v[:, None])[:, 0]]))
        ref.out_proj.load_state_dict(ours.out_proj.state_dict())
    x, context = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    torch.testing.assert_close(ours(x, context), ref(x, context, context, need_weights=False)[0], atol=ATOL, rtol=0)


def test_not_causal_every_query_sees_the_whole_context():
    ours = MultiHeadAttention(16, 4, causal=False).eval()
    x, context = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    _, weights = ours(x, context, return_weights=True)
    assert (weights[..., 0, 1:] > 0).all()  # the first query attends to later context positions
    changed = context.clone()
    changed[:, -1] += 1.0
    assert not torch.allclose(ours(x, context)[:, 0], ours(x, changed)[:, 0])  # the last position moves query 0


def test_padding_positions_get_no_weight():
    ours = MultiHeadAttention(8, 2, causal=False)
    real = torch.tensor([[True, True, False, False]])
    _, weights = ours(torch.randn(1, 3, 8), torch.randn(1, 4, 8), attention_mask=real, return_weights=True)
    assert torch.equal(weights[..., 2:], torch.zeros_like(weights[..., 2:]))
