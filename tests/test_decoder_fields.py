"""Gemma's three decoder fields (chapter 20): attention_scale, scale_embeddings, logit_softcap, each against
the same model computed another way."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from attnlib import Decoder, DecoderConfig

SIZES = dict(vocab_size=40, block_size=16, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)


def pair(**fields):
    torch.manual_seed(0)
    base = Decoder(DecoderConfig.llama(**SIZES)).eval()
    other = Decoder(base.config.replace(**fields)).eval()
    other.load_state_dict(base.state_dict())
    return base, other, torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(1))


def test_logit_softcap_is_cap_tanh_of_the_uncapped_logits():
    base, capped, idx = pair(logit_softcap=0.05)
    with torch.no_grad():
        want = 0.05 * torch.tanh(base(idx)[0] / 0.05)
        got = capped(idx)[0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert got.abs().max() < 0.05


def test_scale_embeddings_is_an_embedding_table_times_sqrt_d_model():
    base, scaled, idx = pair(scale_embeddings=True)
    reference = copy.deepcopy(base)
    with torch.no_grad():
        reference.tok_emb.weight.mul_(math.sqrt(SIZES["d_model"]))  # untied head: only the input side scales
        torch.testing.assert_close(scaled(idx)[0], reference(idx)[0], atol=1e-5, rtol=1e-5)


def test_attention_scale_default_is_one_over_sqrt_head_dim_and_a_new_scale_changes_scores():
    base, same, idx = pair(attention_scale=1 / math.sqrt(8))
    _, other, _ = pair(attention_scale=1.0)
    with torch.no_grad():
        torch.testing.assert_close(same(idx)[0], base(idx)[0], atol=1e-6, rtol=1e-6)
        assert (other(idx)[0] - base(idx)[0]).abs().max() > 1e-4
    assert [b.attn.scale for b in other.blocks] == [1.0, 1.0]


@pytest.mark.parametrize("fields, error, words", [
    (dict(attention_scale=0.0), ValueError, "attention_scale"),
    (dict(attention_scale=float("nan")), ValueError, "attention_scale"),
    (dict(attention_scale="1"), TypeError, "attention_scale"),
    (dict(logit_softcap=-2.0), ValueError, "logit_softcap"),
    (dict(scale_embeddings=1), TypeError, "scale_embeddings"),
    (dict(attention="mla", position="learned", attention_scale=0.5), ValueError, "attention_scale"),
])
def test_bad_values_are_refused_by_name(fields, error, words):
    with pytest.raises(error, match=words):
        DecoderConfig.llama(**{**SIZES, "n_kv_heads": None, **fields})
