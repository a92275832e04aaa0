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


SMALL = {"vocab_size": 50, "block_size": 16, "n_layers": 1, "n_heads": 2, "d_model": 16}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"norm_eps": "1e-6"}, TypeError, "norm_eps must be a number; got '1e-6' (str)"),
        ({"norm_eps": 0.0}, ValueError, "norm_eps=0.0 must be > 0 (it keeps RMSNorm's division away from 0)"),
        ({"norm_eps": -1e-5}, ValueError, "norm_eps=-1e-05 must be > 0"),
        ({"norm_eps": float("nan")}, ValueError, "norm_eps=nan must be a finite number"),
        ({"rope_base": "1e4"}, TypeError, "rope_base must be a number; got '1e4' (str)"),
        ({"rope_base": 0.5}, ValueError, "rope_base=0.5 must be a finite number > 1"),
        ({"attn_softcap": "50"}, TypeError, "attn_softcap must be a number; got '50' (str)"),
        ({"attn_softcap": -1.0}, ValueError, "attn_softcap must be a finite number > 0, got -1.0"),
        ({"position": ["rope"]}, ValueError, "position=['rope'] is not one of ('rope', 'alibi', 'learned', 'nope')"),
        ({"position": "alibi", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ValueError,
         "rope_scaling={'rope_type': 'linear', 'factor': 2.0} is given but position='alibi' does not use RoPE"),
        ({"rope_scaling": "linear"}, TypeError, "rope_scaling must be a dict or None, got str"),
        ({"d_model": 14}, ValueError, "head_dim=7 must be even (dimensions are used in pairs)"),
    ],
    ids=["eps-str", "eps-zero", "eps-negative", "eps-nan", "base-str", "base-below-1", "softcap-str",
         "softcap-negative", "position-list", "scaling-without-rope", "scaling-str", "odd-head-with-rope"],
)
def test_modern_config_refuses(kwargs, error, message):
    from attnlib import ModernConfig

    _raises(lambda: ModernConfig(**{**SMALL, **kwargs}), error, message)


@pytest.mark.parametrize("position", ["alibi", "learned", "nope"])
def test_odd_head_width_is_fine_without_rope(position):
    from attnlib import ModernConfig, ModernDecoder

    torch.manual_seed(0)
    model = ModernDecoder(ModernConfig(**{**SMALL, "d_model": 14, "position": position})).eval()  # heads of 7
    assert model.rope is None
    idx = torch.randint(0, 50, (2, 9))
    logits = model(idx)[0]
    assert logits.shape == (2, 9, 50) and torch.isfinite(logits).all()
    assert torch.equal(model.generate(idx[:, :3], 5, temperature=0.0),
                       model.generate(idx[:, :3], 5, temperature=0.0, use_cache=False))


def test_config_keeps_its_own_rope_scaling():
    from attnlib import ModernConfig

    scaling = {"rope_type": "linear", "factor": 2.0}
    config = ModernConfig(**SMALL, rope_scaling=scaling)
    scaling["factor"] = 0.5  # an edit after checking must not reach the config
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_meta_model_with_dynamic_rope_gives_shapes():
    from attnlib import ModernConfig, ModernDecoder

    with torch.device("meta"):
        model = ModernDecoder(ModernConfig(**SMALL, rope_scaling=DYNAMIC))
    logits = model(torch.zeros(2, 5, dtype=torch.long, device="meta"))[0]
    assert logits.device.type == "meta" and logits.shape == (2, 5, 50)
