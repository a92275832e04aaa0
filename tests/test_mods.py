"""Score and mask modifications (attnlib.attention.mods) against independent references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

from attnlib.attention import attention, mask_from_mod
from attnlib.attention.mods import alibi, alibi_slopes, causal, chunked, compose, document_mask, sliding_window, softcap


@pytest.mark.parametrize(("T", "window"), [(7, 1), (7, 3), (9, 4), (5, 5), (5, 50)])
def test_sliding_window_mask(T, window):
    mask = mask_from_mod(sliding_window(window), (1, 1, T, T))[0, 0]
    expected = torch.tensor([[i - window < j <= i for j in range(T)] for i in range(T)])
    assert torch.equal(mask, expected)
    assert int(mask.sum(-1).max()) == min(window, T)


def test_window_at_least_T_is_causal():
    T = 6
    assert torch.equal(mask_from_mod(sliding_window(T), (1, 1, T, T)), mask_from_mod(causal, (1, 1, T, T)))


def test_window_for_a_cached_decode_counts_from_the_end():
    # One new query at absolute position 9 over 10 keys, window 4: keys 6..9.
    mask = mask_from_mod(sliding_window(4), (1, 1, 1, 10))[0, 0, 0]
    assert mask.nonzero().flatten().tolist() == [6, 7, 8, 9]


def chunk_loop(T_q, T_k, chunk_size):
    """Llama 4's chunked attention written as a loop: query i (at absolute position T_k - T_q + i) sees key j
    iff j <= i and both lie in one chunk of chunk_size positions."""
    mask = torch.zeros(T_q, T_k, dtype=torch.bool)
    for row in range(T_q):
        i = T_k - T_q + row
        for j in range(T_k):
            mask[row, j] = j <= i and i // chunk_size == j // chunk_size
    return mask


@pytest.mark.parametrize(("T", "chunk_size"), [(7, 1), (7, 3), (9, 4), (8, 4), (5, 5), (5, 50)])
def test_chunked_mask_equals_a_loop(T, chunk_size):
    mask = mask_from_mod(chunked(chunk_size), (2, 3, T, T))
    assert torch.equal(mask, chunk_loop(T, T, chunk_size).expand(2, 3, T, T))
    first = torch.arange(0, T, chunk_size)  # the first query of each chunk sees only itself
    assert torch.equal(mask[0, 0, first].sum(-1), torch.ones(len(first), dtype=torch.long))


def test_chunk_at_least_T_is_causal_and_a_cached_decode_counts_from_the_end():
    assert torch.equal(mask_from_mod(chunked(6), (1, 1, 6, 6)), mask_from_mod(causal, (1, 1, 6, 6)))
    # Two new queries at absolute positions 8 and 9 over 10 keys, chunks of 4: keys 8 (and 9) only.
    mask = mask_from_mod(chunked(4), (1, 1, 2, 10))[0, 0]
    assert torch.equal(mask, chunk_loop(2, 10, 4))
    assert mask.nonzero().tolist() == [[0, 8], [1, 8], [1, 9]]


def test_chunked_attention_equals_each_chunk_alone():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 10, 4, generator=g) for _ in range(3))
    out, _ = attention(q, k, v, mask=mask_from_mod(chunked(4), (1, 1, 10, 10)))
    for start in range(0, 10, 4):
        alone = F.scaled_dot_product_attention(*(t[..., start : start + 4, :] for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[..., start : start + 4, :], alone, atol=1e-6, rtol=1e-5)


def test_compose_applies_the_mods_in_order_and_skips_none():
    score = torch.tensor([[-3.0, 0.5, 4.0]])
    idx = (torch.zeros(()), torch.zeros(()), torch.tensor([[2]]), torch.arange(3)[None])

    def double(score, b, h, q_idx, kv_idx):
        return 2 * score

    def plus_distance(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    # compose(f, g) = g after f: (2 s) + (i - j), not 2 (s + (i - j)).
    torch.testing.assert_close(compose(double, plus_distance)(score, *idx), torch.tensor([[-4.0, 2.0, 8.0]]))
    torch.testing.assert_close(compose(plus_distance, double)(score, *idx), torch.tensor([[-2.0, 3.0, 8.0]]))
    torch.testing.assert_close(compose(double, None, plus_distance, None)(score, *idx), torch.tensor([[-4.0, 2.0, 8.0]]))
    torch.testing.assert_close(compose(double, double, double)(score, *idx), 8 * score)
    assert compose() is None and compose(None) is None and compose(None, None) is None
    assert compose(double) is double and compose(None, double, None) is double


def test_alibi_then_softcap_equals_the_formula_and_differs_from_the_other_order():
    g = torch.Generator().manual_seed(4)
    B, H, T, d = 1, 4, 7, 8
    q, k, v = (torch.randn(B, H, T, d, generator=g) * 3 for _ in range(3))
    cap = 1.5
    _, weights = attention(q, k, v, is_causal=True, score_mod=compose(alibi(H), softcap(cap)))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    scores = q @ k.transpose(-2, -1) / d**0.5 - alibi_slopes(H)[:, None, None] * (i - j)  # ALiBi first
    expected = torch.softmax((cap * torch.tanh(scores / cap)).masked_fill(j > i, float("-inf")), dim=-1)  # then the cap
    torch.testing.assert_close(weights, expected)
    _, other = attention(q, k, v, is_causal=True, score_mod=compose(softcap(cap), alibi(H)))
    assert (other - weights).abs().max() > 1e-2


@pytest.mark.parametrize("n_heads", [1, 2, 4, 6, 8, 12, 16, 20, 32])
def test_alibi_slopes_equal_bloom(n_heads):
    torch.testing.assert_close(alibi_slopes(n_heads), _get_alibi_slopes(n_heads, "cpu").float())


def test_alibi_slopes_of_the_paper():
    # Press et al. 2022, §3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_alibi_attention_equals_sdpa_with_the_bias():
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 4, 6, 8
    q, k, v = (torch.randn(B, H, T, d, generator=g) for _ in range(3))
    out, _ = attention(q, k, v, is_causal=True, score_mod=alibi(H))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    bias = -alibi_slopes(H)[:, None, None] * (i - j)  # (H, T, T)
    bias = bias.masked_fill(j > i, float("-inf"))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias), atol=1e-6, rtol=1e-5)


def test_softcap_bounds_scores_and_matches_the_formula():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g) * 10 for _ in range(3))
    out, weights = attention(q, k, v, score_mod=softcap(3.0))
    scores = q @ k.transpose(-2, -1) / 2.0
    expected = torch.softmax(3.0 * torch.tanh(scores / 3.0), dim=-1)
    torch.testing.assert_close(weights, expected)
    small = torch.tensor([0.01, -0.02])
    torch.testing.assert_close(softcap(50.0)(small, 0, 0, 0, 0), small, atol=1e-8, rtol=1e-6)
    assert softcap(5.0)(torch.tensor([1e6, -1e6]), 0, 0, 0, 0).abs().max() <= 5.0


def test_document_mask_equals_a_loop():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    B, T = doc_ids.shape
    mask = mask_from_mod(document_mask(doc_ids), (B, 3, T, T))
    expected = torch.tensor([[[doc_ids[b, i] == doc_ids[b, j] for j in range(T)] for i in range(T)] for b in range(B)])
    assert torch.equal(mask, expected[:, None].expand(B, 3, T, T))
    shared = mask_from_mod(document_mask(doc_ids[0]), (2, 1, T, T))  # (T,): every sequence alike
    assert torch.equal(shared, expected[0].expand(2, 1, T, T))


def test_document_mask_with_causal_attention_equals_each_document_alone():
    g = torch.Generator().manual_seed(2)
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g) for _ in range(3))
    out, _ = attention(q, k, v, mask=mask_from_mod(document_mask(doc_ids), (1, 1, 9, 9)), is_causal=True)
    for start, stop in [(0, 3), (3, 5), (5, 9)]:
        alone = F.scaled_dot_product_attention(*(t[..., start:stop, :] for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[..., start:stop, :], alone, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("doc_ids", "error", "match"),
    [
        ([0, 0, 1], TypeError, "doc_ids must be an integer torch.Tensor"),
        (torch.tensor([0.0, 1.0]), TypeError, "doc_ids must hold integer document ids; got dtype torch.float32"),
        (torch.tensor([True, False]), TypeError, "got dtype torch.bool"),
        (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"doc_ids must be \(T,\) or \(B, T\); got shape \(1, 2, 3\)"),
    ],
)
def test_document_mask_bad_inputs(doc_ids, error, match):
    with pytest.raises(error, match=match):
        document_mask(doc_ids)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sliding_window(0), "window must be an int >= 1, got 0"),
        (lambda: sliding_window(2.5), "window must be an int >= 1, got 2.5"),
        (lambda: chunked(0), "chunk_size must be an int >= 1, got 0"),
        (lambda: chunked(True), "chunk_size must be an int >= 1, got True"),
        (lambda: alibi_slopes(0), "n_heads must be an int >= 1, got 0"),
        (lambda: alibi(True), "n_heads must be an int >= 1, got True"),
        (lambda: softcap(0.0), "cap must be a finite number > 0, got 0.0"),
        (lambda: softcap(float("inf")), "cap must be a finite number > 0, got inf"),
        (lambda: attention(*(torch.randn(1, 3, 4, 2) for _ in range(3)), score_mod=alibi(4)),
         r"alibi\(4\) got scores with 3 heads"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
