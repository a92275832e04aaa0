"""Gemma 3 and Gemma 4 as published (``...ForConditionalGeneration``) load as their text decoder (chapter 20).

Random tiny models built locally: Gemma 3 with a vision tower of one layer, Gemma 4 with its text decoder alone
(its towers are optional). On token ids the loaded decoder gives transformers' logits, from the model or from its
state dict and config dict; its head is tied exactly when transformers ties it (by the outer config's flag, which
may disagree with the ``text_config``'s). Qwen3.5's checkpoint is tested in ``test_qwen3_5.py``.
"""
from __future__ import annotations

import pytest
import test_gemma3
import test_gemma4
import torch
import transformers

import attnlib

GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                     patch_size=14)


def _gemma3(outer: bool, text: bool):
    config = transformers.Gemma3Config(text_config={**test_gemma3.CONFIGS["gemma3"], "tie_word_embeddings": text},
                                       vision_config=GEMMA3_VISION, mm_tokens_per_image=4, tie_word_embeddings=outer)
    return transformers.Gemma3ForConditionalGeneration(config), attnlib.from_hf_gemma3


def _gemma4(outer: bool, text: bool):
    config = transformers.Gemma4Config(text_config=test_gemma4.hf_config(tie_word_embeddings=text).to_dict(),
                                       tie_word_embeddings=outer)
    return transformers.Gemma4ForConditionalGeneration(config), attnlib.from_hf_gemma4


@pytest.mark.parametrize(("outer", "text"), [(True, True), (False, False), (False, True), (True, False)])
@pytest.mark.parametrize("family", [_gemma3, _gemma4], ids=["gemma3", "gemma4"])
def test_a_vision_language_checkpoint_loads_as_its_text_decoder(family, outer, text):
    torch.manual_seed(0)
    hf, load = family(outer, text)
    hf.eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights of some size (logits of order 1); norms around 0 (Gemma's 1 + w), not at init
        for p in hf.model.language_model.parameters():
            p.normal_(0, 0.1, generator=g) if p.dim() > 1 else p.uniform_(-0.5, 0.5, generator=g)
        if not outer:  # an untied head of its own
            hf.lm_head.weight.normal_(0, 0.1, generator=g)
    tied = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    ours = load(hf).eval()
    assert ours.config.tie_embeddings == tied == outer  # transformers ties by the outer config's flag
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=idx).logits
        assert expected.abs().max() > 0.5  # logits of some size: a 1e-5 agreement means something
        for model in (ours, load(hf.state_dict(), config=hf.config.to_dict()).eval()):
            torch.testing.assert_close(model(idx)[0], expected, atol=1e-5, rtol=1e-5)


def test_a_vision_language_checkpoints_missing_weight_is_named_as_read():
    hf, load = _gemma3(True, True)
    state = {k: v for k, v in hf.state_dict().items() if k != "model.language_model.norm.weight"}
    with pytest.raises(ValueError, match=r"Gemma 3 language \(model\.language_model\.\* read as model\.\*\).*missing "
                                         r"\['model\.norm\.weight'\]"):
        load(state, config=hf.config.to_dict())
    with pytest.raises(TypeError, match="text_config must be a transformers config or its dict; got str"):
        load(hf.state_dict(), config={**hf.config.to_dict(), "text_config": "gemma3_text"})
