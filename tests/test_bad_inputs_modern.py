"""Bad inputs to the long-context / modern-decoder API: each gets a clear error naming it, never a silent wrong answer.

RoPE and its scalings (attnlib.rope, attnlib.positional), ModernConfig / ModernDecoder, the Hugging Face loaders,
the window and sink caches, kv_memory and the score/mask mods. Each case asserts the exception's type and message.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from attnlib.positional import RotaryEmbedding
from attnlib.rope import rope_frequencies

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def _raises(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rope_scaling": {"rope_type": "linear", "type": "dynamic", "factor": 2.0}}, ValueError,
         "rope_scaling gives rope_type='linear' and type='dynamic'; give one type"),
        ({"rope_scaling": {"rope_type": ["linear"], "factor": 2.0}}, ValueError,
         "rope_scaling type ['linear'] is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": "abc"}}, ValueError,
         "rope_scaling['rope_theta'] must be a finite number, got 'abc'"),
        ({"rope_scaling": {**YARN, "beta_fast": 0}}, ValueError, "rope_scaling['beta_fast'] must be > 0.0, got 0"),
        ({"rope_scaling": {**YARN, "beta_slow": 0.0}}, ValueError, "rope_scaling['beta_slow'] must be > 0.0, got 0.0"),
        ({"rope_scaling": {**YARN, "beta_fast": 1, "beta_slow": 32}}, ValueError,
         "rope_scaling['beta_fast']=1 must be >= beta_slow=32"),
        ({"rope_scaling": {**YARN, "attention_factor": 0.0}}, ValueError,
         "rope_scaling['attention_factor'] must be > 0.0, got 0.0"),
        ({"rope_scaling": {**YARN, "truncate": "no"}}, ValueError, "rope_scaling['truncate'] must be a bool, got 'no'"),
        ({"rope_scaling": {**LLAMA3, "factor": float("nan")}}, ValueError,
         "rope_scaling['factor'] must be a finite number, got nan"),
        ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32.0}}, TypeError,
         "rope_scaling['original_max_position_embeddings'] must be an int; got 32.0 (float)"),
        ({"rope_scaling": DYNAMIC, "max_position_embeddings": 16, "seq_len": 20.5}, TypeError,
         "seq_len must be an int; got 20.5 (float)"),
        ({"rope_scaling": DYNAMIC, "max_position_embeddings": 16, "seq_len": -5}, ValueError,
         "seq_len=-5 must be a positive integer"),
        ({"max_position_embeddings": 16.0}, TypeError, "max_position_embeddings must be an int; got 16.0 (float)"),
    ],
    ids=["type-conflict", "type-list", "theta-str", "beta-fast-0", "beta-slow-0", "beta-fast-below-slow",
         "attention-factor-0", "truncate-str", "factor-nan", "original-float", "seq-len-float", "seq-len-negative",
         "max-positions-float"],
)
def test_rope_frequencies_refuses(kwargs, error, message):
    _raises(lambda: rope_frequencies(8, **kwargs), error, message)


def test_dynamic_needs_head_dim_above_two():
    _raises(lambda: rope_frequencies(2, rope_scaling=DYNAMIC, max_position_embeddings=16), ValueError,
            "rope_scaling of type 'dynamic' needs head_dim >= 4 (its base grows with the exponent "
            "head_dim / (head_dim - 2)); got head_dim=2")


@pytest.mark.parametrize("scaling", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_original_context_longer_than_served_is_transformers_answer(scaling):
    """A model served on fewer positions than it was trained on: the frequencies do not depend on
    max_position_embeddings for llama3 / yarn with a factor, so they equal transformers' (which only warns)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16, max_position_embeddings=16,
                         rope_parameters={**scaling, "rope_theta": 10000.0})
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, None)
    ours, factor = rope_frequencies(16, 10000.0, scaling, 16)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert math.isclose(factor, expected_factor, rel_tol=1e-6)


X = torch.randn(2, 3, 5, 8)  # (B, heads, T, head_dim)


@pytest.mark.parametrize(
    ("positions", "error", "message"),
    [
        ([0, 1, 2, 3, 4], TypeError, "positions must be a torch.Tensor of integer or float positions; got list"),
        (torch.ones(5, dtype=torch.bool), TypeError, "positions must hold integer or float positions; got dtype torch.bool"),
        (torch.arange(5) * (1 + 1j), TypeError, "got dtype torch.complex64"),
        (torch.tensor(3), ValueError, "positions must be a tensor whose last dimension is T=5; got shape ()"),
        (torch.arange(5).expand(7, 5), ValueError,
         "positions of shape (7, 5) do not broadcast to x's (2, 3, 5) (x without head_dim)"),
        (torch.arange(5).expand(4, 1, 1, 5), ValueError, "positions of shape (4, 1, 1, 5) do not broadcast"),
        (torch.tensor([0.0, 1.0, float("nan"), 3.0, 4.0]), ValueError, "positions hold nan or inf; expected finite positions"),
        (torch.arange(5, device="meta"), ValueError, "positions are on the meta device (no values) but x is on cpu"),
    ],
    ids=["list", "bool", "complex", "0-d", "not-broadcastable", "more-dims-than-x", "nan", "meta"],
)
def test_rotate_refuses_positions(positions, error, message):
    _raises(lambda: RotaryEmbedding(8).rotate(X, positions), error, message)


def test_rotate_refuses_x_on_another_device():
    _raises(lambda: RotaryEmbedding(8).rotate(X.to("meta")), ValueError,
            "x is on meta but this RotaryEmbedding is on cpu; move one of them (module.to(device))")


def test_dynamic_rope_refuses_nan_positions_and_keeps_negative_ones_unscaled():
    rope = RotaryEmbedding(8, rope_scaling=DYNAMIC, max_position_embeddings=4)
    _raises(lambda: rope.rotate(X, torch.tensor([0.0, 1.0, float("inf"), 3.0, 4.0])), ValueError,
            "positions hold nan or inf")
    positions = torch.arange(-10, -5)  # all before the trained length: the base does not grow
    angle = positions[:, None].float() / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)  # (T, 4), by hand
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    expected = X * cos + torch.cat([-X[..., 4:], X[..., :4]], dim=-1) * sin
    torch.testing.assert_close(rope.rotate(X, positions), expected, atol=1e-6, rtol=1e-6)


def test_rope_scaling_checked_before_it_is_copied():
    _raises(lambda: RotaryEmbedding(8, rope_scaling="linear"), TypeError, "rope_scaling must be a dict or None, got str")
