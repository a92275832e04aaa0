"""Gated attention output and top-k sparse attention (chapter 18): dense when k >= T / no gate, references, bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlib import GPT, GPTConfig
from attnlib.attention import (
    GatedAttention,
    LightningIndexer,
    MultiHeadAttention,
    TopKAttention,
    topk_attention,
    topk_mask,
)


def qkv(T_q=19, T_k=19, B=2, h=4, d=8):
    g = torch.Generator().manual_seed(T_q * 100 + T_k)
    return (torch.randn(B, h, T_q, d, generator=g), torch.randn(B, h, T_k, d, generator=g),
            torch.randn(B, h, T_k, d, generator=g))


def mask_by_hand(scores, k):
    """For each row, the (at most k) causal keys of highest score, chosen by sorting, one row at a time."""
    B, h, T_q, T_k = scores.shape
    keep = torch.zeros_like(scores, dtype=torch.bool)
    for b in range(B):
        for head in range(h):
            for i in range(T_q):
                visible = T_k - T_q + i + 1
                order = scores[b, head, i, :visible].argsort(descending=True)[:k]
                keep[b, head, i, order] = True
    return keep


@pytest.mark.parametrize("T_q,T_k", [(19, 19), (1, 19), (5, 19)])
def test_topk_at_least_T_equals_dense_causal_sdpa(T_q, T_k):
    q, k, v = qkv(T_q, T_k)
    causal = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    for top_k in (T_k, T_k + 5):
        assert torch.allclose(topk_attention(q, k, v, top_k), dense, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 3, 8])
@pytest.mark.parametrize("T_q,T_k", [(19, 19), (4, 12)])
def test_topk_equals_sdpa_with_the_by_hand_mask(top_k, T_q, T_k):
    q, k, v = qkv(T_q, T_k)
    keep = mask_by_hand(q @ k.transpose(-2, -1), top_k)
    assert torch.equal(topk_mask(q @ k.transpose(-2, -1), top_k), keep)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.allclose(topk_attention(q, k, v, top_k), expected, atol=1e-6)
    scores = torch.randn(2, 1, T_q, T_k)  # an indexer's scores: one choice shared by the heads
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_by_hand(scores, top_k))
    assert torch.allclose(topk_attention(q, k, v, top_k, scores), expected, atol=1e-6)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_topk_layer_with_k_at_least_T_equals_multi_head_attention(n_kv_heads):
    mha = MultiHeadAttention(32, 4, n_kv_heads, block_size=16)
    sparse = TopKAttention(32, 4, n_kv_heads, top_k=16, block_size=16)
    sparse.load_state_dict(mha.state_dict())
    x = torch.randn(2, 16, 32)
    assert torch.allclose(sparse(x), mha(x), atol=1e-6)


def test_topk_gpt_decodes_the_same_with_a_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=24, n_layers=2, n_heads=2, d_model=16))
    for block in model.blocks:
        sparse = TopKAttention(16, 2, top_k=3, block_size=24)
        sparse.load_state_dict(block.attn.state_dict())
        block.attn = sparse
    model.eval()
    prompt = torch.randint(0, 40, (2, 5))
    assert torch.equal(model.generate(prompt, 25, temperature=0.0),
                       model.generate(prompt, 25, temperature=0.0, use_cache=False))


def test_lightning_indexer_equals_its_formula():
    idx = LightningIndexer(16, index_heads=3, index_dim=4)
    x = torch.randn(2, 6, 16)
    scores = idx(x, x)
    q = idx.q_proj(x).view(2, 6, 3, 4)
    k, w = idx.k_proj(x), idx.w_proj(x)
    for t in range(6):
        for s in range(6):
            expected = sum(w[:, t, j] * torch.relu(q[:, t, j] @ k[0, s]) for j in range(3))
            assert torch.allclose(scores[0, 0, t, s], expected[0], atol=1e-6)
    layer = TopKAttention(16, 2, top_k=2, indexer=True)
    assert layer(x).shape == (2, 6, 16)


def test_gated_attention_without_gate_or_with_an_open_gate_is_multi_head_attention():
    x = torch.randn(2, 11, 32)
    mha = MultiHeadAttention(32, 4)
    off = GatedAttention(32, 4, gate=None)
    off.load_state_dict(mha.state_dict())
    assert torch.equal(off(x), mha(x))
    for kind in ("elementwise", "headwise"):
        gated = GatedAttention(32, 4, gate=kind)
        gated.load_state_dict(mha.state_dict(), strict=False)
        torch.nn.init.zeros_(gated.gate_proj.weight)
        torch.nn.init.constant_(gated.gate_proj.bias, 40.0)  # σ(40) = 1 in float32
        assert torch.allclose(gated(x), mha(x), atol=1e-6)


@pytest.mark.parametrize("kind", ["elementwise", "headwise"])
def test_gated_attention_equals_sdpa_times_sigmoid_gate(kind):
    layer = GatedAttention(32, 4, gate=kind)
    x = torch.randn(2, 9, 32)
    q, k, v = layer.qkv(x).view(2, 9, 3, 4, 8).permute(2, 0, 3, 1, 4)  # (3, B, h, T, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)  # (B, T, h, hd)
    gate = torch.sigmoid(layer.gate_proj(x)).view(2, 9, 4, -1)  # (B, T, h, hd or 1)
    expected = layer.out_proj((y * gate).reshape(2, 9, 32))
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_bad_inputs_name_the_value():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="top_k=0 must be a positive integer"):
        topk_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="top_k=-2 must be a positive integer"):
        TopKAttention(32, 4, top_k=-2)
    with pytest.raises(ValueError, match=r"q \(B, h, T_q, d\), k .* do not match"):
        topk_attention(q, k[..., :4], v, 2)
    with pytest.raises(ValueError, match="T_q=19 queries but only T_k=5 keys"):
        topk_attention(q, k[:, :, :5], v[:, :, :5], 2)
    with pytest.raises(ValueError, match=r"index_scores must have shape .* got \(2, 1, 3, 3\)"):
        topk_attention(q, k, v, 2, torch.zeros(2, 1, 3, 3))
    with pytest.raises(ValueError, match="gate='sigmoid' is not one of"):
        GatedAttention(32, 4, gate="sigmoid")
    layer = TopKAttention(16, 2, top_k=2, indexer=True, block_size=8)
    with pytest.raises(ValueError, match="indexer=True.* cannot use a cache"):
        layer(torch.randn(1, 3, 16), cache=GPT(GPTConfig(vocab_size=5, block_size=8, n_layers=1, n_heads=2,
                                                         d_model=16)).new_cache().layers[0])
