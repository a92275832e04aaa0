"""attnlib.positional.scaling.rope_frequencies against transformers' own RoPE initialisation (1e-6)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from attnlib.positional import RotaryEmbedding, rope_frequencies

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
CASES = [
    # (head_dim, base, rope_scaling, max_position_embeddings)
    (64, 10000.0, {"rope_type": "linear", "factor": 4.0}, 2048),
    (128, 500000.0, {"type": "linear", "factor": 2.5}, 4096),
    (64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 512),
    (128, 500000.0, LLAMA3, 131072),
    (64, 10000.0, {**LLAMA3, "original_max_position_embeddings": 256, "factor": 4.0}, 1024),
    (64, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),
    (128, 1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    (64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
                   "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.707}, 163840),
    (32, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                   "attention_factor": 1.25, "truncate": False}, 4096),
]


def hf_config(head_dim, base, rope_scaling, max_position_embeddings):
    params = {k: v for k, v in rope_scaling.items() if k != "type"}
    params["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type"))
    params["rope_theta"] = base
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_position_embeddings, rope_parameters=params)


@pytest.mark.parametrize(("head_dim", "base", "rope_scaling", "max_pos"), CASES)
def test_equal_to_transformers(head_dim, base, rope_scaling, max_pos):
    config = hf_config(head_dim, base, rope_scaling, max_pos)
    expected, expected_factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None)
    inv_freq, factor = rope_frequencies(head_dim, base, rope_scaling, max_pos)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-6)


@pytest.mark.parametrize("seq_len", [100, 512, 1500, 4096])
def test_dynamic_ntk_at_a_longer_sequence(seq_len):
    config = hf_config(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 512)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=seq_len)
    inv_freq, _ = rope_frequencies(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 512, seq_len=seq_len)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    if seq_len > 512:  # the base grew: every pair but the first turns more slowly
        assert (inv_freq[1:] < rope_frequencies(64, 10000.0)[0][1:]).all()


def test_plain_rope_equal_to_llama_rotary_embedding():
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=500000.0)
    expected = LlamaRotaryEmbedding(config).inv_freq
    torch.testing.assert_close(rope_frequencies(64, 500000.0)[0], expected, rtol=1e-6, atol=0)


def test_llama3_keeps_fast_pairs_and_divides_slow_ones():
    # Independent of transformers: the three bands of the Llama 3.1 rule.
    plain, _ = rope_frequencies(128, 500000.0)
    scaled, _ = rope_frequencies(128, 500000.0, LLAMA3)
    wavelen = 2 * torch.pi / plain
    fast, slow = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert fast.any() and slow.any()
    torch.testing.assert_close(scaled[fast], plain[fast])
    torch.testing.assert_close(scaled[slow], plain[slow] / 8)
    middle = ~fast & ~slow
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_rotary_embedding_with_yarn_scales_cos_and_sin():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(16, rope_scaling=scaling, max_position_embeddings=256)
    inv_freq, factor = rope_frequencies(16, 10000.0, scaling, 256)
    x = torch.randn(2, 5, 16)
    out = rope.rotate(x, torch.arange(5))
    angle = torch.arange(5.0)[:, None] * inv_freq
    cos, sin = factor * angle.cos(), factor * angle.sin()
    x1, x2 = x[..., :8], x[..., 8:]
    torch.testing.assert_close(out, torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, ValueError, "type 'longrope' is not supported"),
        ({"rope_scaling": {"factor": 2.0}}, ValueError, "type None is not supported"),
        ({"rope_scaling": {"rope_type": "linear"}}, ValueError, r"needs the field\(s\) \['factor'\]"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, ValueError,
         r"needs the field\(s\) \['original_max_position_embeddings'\]"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, ValueError, r"\['factor'\] must be >= 1.0, got 0.5"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, ValueError, "must be a finite number, got '2'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, ValueError,
         r"\['partial_rotary_factor'\] that attnlib does not reproduce"),
        ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}}, ValueError, "high_freq_factor'\\]=4.0 must be greater"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ValueError, "needs max_position_embeddings"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}, ValueError,
         "disagrees with base=10000.0"),
        ({"rope_scaling": ["linear", 2.0]}, TypeError, "rope_scaling must be a dict or None, got list"),
        ({"base": 1.0}, ValueError, "base must be a finite number > 1, got 1.0"),
    ],
)
def test_bad_scaling_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        rope_frequencies(64, **kwargs)


def test_bad_head_dim():
    with pytest.raises(ValueError, match="head_dim=63 must be even"):
        rope_frequencies(63)
