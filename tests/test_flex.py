"""attnlib.attention.mods are valid FlexAttention functions: through ``flex_attention`` they give attnlib's attention.

``torch.nn.attention.flex_attention.flex_attention`` runs here without ``torch.compile``
(an unfused reference that materialises the scores, traced once per new function by
dynamo's "eager" backend: about a second each on the CPU). Compiling it is measured
outside the tests. Sizes are tiny so that the file runs in seconds.
"""
from __future__ import annotations

import pytest
import torch

from attnlib.attention import attention, mask_from_mod
from attnlib.attention.mods import alibi, causal, chunked, compose, document_mask, sliding_window, softcap

flex = pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, H, T, D = 2, 4, 20, 8
TOL = dict(atol=1e-5, rtol=1e-5)
DOC_IDS = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3],
                        [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]])


def qkv(T_q=T, T_k=T, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g).requires_grad_(requires_grad) for n in (T_q, T_k, T_k)]


def block_mask(mask_mod, T_q=T, T_k=T):
    return flex.create_block_mask(mask_mod, B, H, T_q, T_k, device="cpu")


# (name, FlexAttention's arguments, attnlib.attention.attention's arguments): the same mods in both.
CASES = {
    "causal": (lambda: dict(block_mask=block_mask(causal)), lambda: dict(is_causal=True)),
    "sliding_window": (lambda: dict(block_mask=block_mask(sliding_window(5))),
                       lambda: dict(mask=mask_from_mod(sliding_window(5), (1, 1, T, T)))),
    "alibi": (lambda: dict(score_mod=alibi(H), block_mask=block_mask(causal)),
              lambda: dict(score_mod=alibi(H), is_causal=True)),
    "softcap": (lambda: dict(score_mod=softcap(2.0)), lambda: dict(score_mod=softcap(2.0))),
    "document": (lambda: dict(block_mask=block_mask(flex.and_masks(causal, document_mask(DOC_IDS)))),
                 lambda: dict(mask=mask_from_mod(document_mask(DOC_IDS), (B, 1, T, T)), is_causal=True)),
    "chunked": (lambda: dict(block_mask=block_mask(chunked(6))),
                lambda: dict(mask=mask_from_mod(chunked(6), (1, 1, T, T)))),
    "alibi+softcap": (lambda: dict(score_mod=compose(alibi(H), softcap(2.0)), block_mask=block_mask(causal)),
                      lambda: dict(score_mod=compose(alibi(H), softcap(2.0)), is_causal=True)),
    "softcap+window": (lambda: dict(score_mod=softcap(1.5), block_mask=block_mask(sliding_window(7))),
                       lambda: dict(score_mod=softcap(1.5), mask=mask_from_mod(sliding_window(7), (1, 1, T, T)))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mods_through_flex_attention_equal_attnlib(name):
    flex_kwargs, ours_kwargs = (make() for make in CASES[name])
    q, k, v = qkv(seed=len(name))
    expected, _ = attention(q, k, v, **ours_kwargs)
    torch.testing.assert_close(flex.flex_attention(q, k, v, **flex_kwargs), expected, **TOL)


def test_gradients_through_flex_attention_equal_attnlib_where_flex_has_a_cpu_backward():
    # ALiBi + causal. torch 2.13 refuses FlexAttention's backward on the CPU (NotImplementedError, checked here:
    # attnlib's flash_attention is the CPU's blockwise backward); where a later torch has one, it must equal autograd's.
    q, k, v = qkv(seed=7, requires_grad=True)
    d_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(8))
    try:
        got = flex.flex_attention(q, k, v, score_mod=alibi(H), block_mask=block_mask(causal))
    except NotImplementedError as e:
        assert "does not support backward on CPU" in str(e)
        return
    want, _ = attention(q, k, v, is_causal=True, score_mod=alibi(H))
    for a, b in zip(torch.autograd.grad(got, (q, k, v), d_out), torch.autograd.grad(want, (q, k, v), d_out)):
        torch.testing.assert_close(a, b, **TOL)


def test_flex_counts_queries_from_zero_where_attnlib_counts_from_the_end():
    # With T_q < T_k (a cached decode), attnlib's q_idx is the query's absolute position T_k - T_q + i;
    # FlexAttention's is i. The same causal mask_mod needs the offset added on Flex's side.
    T_q, offset = 6, T - 6
    q, k, v = qkv(T_q=T_q, seed=9)
    expected, _ = attention(q, k, v, is_causal=True)

    def shifted_causal(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx + offset, kv_idx)

    torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=block_mask(shifted_causal, T_q)), expected, **TOL)
    unshifted = flex.flex_attention(q, k, v, block_mask=block_mask(causal, T_q))  # top-left: hides most keys
    assert (unshifted - expected).abs().max() > 0.1


def test_block_mask_agrees_with_mask_from_mod():
    # create_block_mask's dense form (create_mask) and attnlib's mask_from_mod call the mod the same way.
    for mod in (causal, sliding_window(4), chunked(3), document_mask(DOC_IDS)):
        torch.testing.assert_close(flex.create_mask(mod, B, H, T, T, device="cpu"), mask_from_mod(mod, (B, H, T, T)))
