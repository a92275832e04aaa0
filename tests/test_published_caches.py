"""Chapter 20's published caches: computed from the configs, cross-checked against transformers' models built on
the meta device, and one by hand."""
import pytest
import torch

from attnlib.book.experiments import published_caches as pc


@pytest.mark.parametrize("name", pc.PUBLISHED)
def test_config_plan_is_what_the_model_builds(name):
    """Each layer's cached width from the config (heads x head_dim x 2, 0 for a shared layer) is what transformers'
    model, built on the meta device, gives its k_proj and v_proj."""
    plan = pc.config_plan(pc.hf_config(name))
    shared_from = len(plan["layer_types"]) - plan["num_kv_shared_layers"]
    planned = [0 if i >= shared_from else 2 * h * d
               for i, (h, d) in enumerate(zip(plan["n_kv_heads"], plan["head_dim"]))]
    assert pc.model_widths(name) == planned
    assert len(planned) == pc.PUBLISHED[name]["fields"]["num_hidden_layers"]


def test_by_hand():
    """gpt-oss-120b at 131,072 tokens in bfloat16: 18 full layers keep every token, 18 sliding layers 128; each token
    8 key/value heads of 64, keys and values, 2 bytes. Llama 4 Scout: 12 full layers, 36 chunked of 8,192."""
    T = 131072
    per_token = 2 * 8 * 64 * 2
    assert pc.cache_bytes("gpt-oss-120b", T) == 18 * per_token * T + 18 * per_token * 128
    assert pc.cache_bytes("Llama 4 Scout", T) == 2 * 8 * 128 * 2 * (12 * T + 36 * 8192)
    # Gemma 4 E4B: 24 layers keep their own keys and values (20 sliding of width 256, 4 global of width 512)
    assert pc.cache_bytes("Gemma 4 E4B", T, torch.float32) == 2 * 2 * 4 * (20 * 256 * 512 + 4 * 512 * T)


def test_patterns_read_from_the_configs():
    rows = {r["model"]: r for r in pc.table((1024,))}
    assert (rows["Gemma 3 27B"]["full"], rows["Gemma 3 27B"]["sliding"]) == (10, 52)
    assert (rows["gpt-oss-120b"]["full"], rows["gpt-oss-120b"]["sliding"]) == (18, 18)
    assert (rows["Llama 4 Scout"]["full"], rows["Llama 4 Scout"]["chunked"]) == (12, 36)
    assert rows["SmolLM3 3B"]["full"] == 36 and rows["SmolLM3 3B"]["bytes"] == rows["SmolLM3 3B"]["all_full_bytes"]
    assert rows["Gemma 4 E4B"]["shared"] == 18


def test_unknown_name():
    with pytest.raises(ValueError, match="name='Gemma 5' is not one of"):
        pc.hf_config("Gemma 5")
