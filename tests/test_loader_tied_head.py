"""Every loader refuses a tied config whose state dict holds another output head (it would drop it silently).

An untied tiny model of each family (its own ``lm_head.weight``), loaded through its state dict with a config
that says ``tie_word_embeddings=True``: the head would be the embedding, the logits wrong. Each loader names the
two weights; with the model's own (untied) config each loads and equals transformers. Chapters 16, 20, 21.
"""
from __future__ import annotations

import pytest
import test_diffllama
import test_gemma4
import test_modern
import test_qwen3_5
import test_smollm3
import torch
import transformers

import attnlib

FAMILIES = {  # name: (model class, its untied config, loader)
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**test_modern.SIZES), attnlib.from_hf_llama),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**test_modern.SIZES), attnlib.from_hf_qwen3),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**test_modern.SIZES, sliding_window=8),
                attnlib.from_hf_mistral),
    "smollm3": (transformers.SmolLM3ForCausalLM,
                transformers.SmolLM3Config(**test_smollm3.SIZES, tie_word_embeddings=False), attnlib.from_hf_smollm3),
    "diffllama": (transformers.DiffLlamaForCausalLM, transformers.DiffLlamaConfig(**test_diffllama.SIZES),
                  attnlib.from_hf_diffllama),
    "gemma3": (transformers.Gemma3ForCausalLM,
               transformers.Gemma3TextConfig(**test_modern.SIZES, head_dim=16, sliding_window=8,
                                             tie_word_embeddings=False), attnlib.from_hf_gemma3),
    "gemma4": (transformers.Gemma4ForCausalLM, test_gemma4.hf_config(tie_word_embeddings=False), attnlib.from_hf_gemma4),
    "qwen3_5": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**test_qwen3_5.SIZES),
                attnlib.from_hf_qwen3_5),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tied_config_with_another_head_is_refused(family):
    model_class, config, load = FAMILIES[family]
    torch.manual_seed(0)
    hf = model_class(config).eval()
    state = hf.state_dict()
    assert not config.tie_word_embeddings and not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    tied = {**config.to_dict(), "tie_word_embeddings": True}
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight, but "
                                         r"tie_word_embeddings=True ties them"):
        load(state, config=tied)
    idx = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the model's own config: the head loaded (a wrong one is off by ~1), transformers' logits
        torch.testing.assert_close(load(state, config=config.to_dict()).eval()(idx)[0], hf(idx).logits,
                                   atol=5e-5, rtol=1e-5)  # (Qwen3.5's float32 delta rule: up to 1.5e-5 measured)
