"""Dynamic NTK (chapter 17): its base depends on the current length, so cached and uncached passes differ.

The base rule of attnlib equals transformers' ``_compute_dynamic_ntk_parameters`` and the formula
``base * (factor * T / L - (factor - 1)) ** (d / (d - 2))`` once ``T > L``. A cache stores keys rotated
with the base of the length when they arrived; a pass without a cache rotates every key with the base of
the whole text. attnlib's ``RotaryEmbedding`` and transformers' ``LlamaForCausalLM`` both behave so: equal
up to the trained length, different past it.
"""
import math

import pytest
import torch

from attnlib.positional import RotaryEmbedding, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402


def _hf_config(head_dim, base, factor, L, **sizes):
    sizes = {"hidden_size": 2 * head_dim, "num_attention_heads": 2, "head_dim": head_dim, **sizes}
    return LlamaConfig(max_position_embeddings=L, **sizes,
                       rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": base})


@pytest.mark.parametrize("head_dim, base, factor, L, T", [
    (16, 10000.0, 1.0, 32, 16), (16, 10000.0, 1.0, 32, 32), (16, 10000.0, 1.0, 32, 128),
    (64, 500000.0, 2.0, 100, 450), (8, 10000.0, 4.0, 10, 11), (128, 1e6, 1.5, 4096, 20000),
])
def test_the_base_rule_equals_transformers_and_the_formula(head_dim, base, factor, L, T):
    rule = {"rope_type": "dynamic", "factor": factor}
    ours, _ = rope_frequencies(head_dim, base, rule, L, seq_len=T)
    theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(head_dim, base, factor, L), None, seq_len=T)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    s = factor * max(T, L) / L - (factor - 1)  # 1 up to L: the trained frequencies
    grown = base * s ** (head_dim / (head_dim - 2))
    formula = 1.0 / grown ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(ours.double(), formula, rtol=1e-6, atol=0)


def _two_ways(rope, T, seed=0):
    """Scores of the newest query: keys rotated all at once (no cache) and one at a time (a cache)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 16, generator=g), torch.randn(2, T, 16, generator=g)
    positions = torch.arange(T)
    q_rot = rope.rotate(q, positions[-1:])
    at_once = rope.rotate(k, positions)
    as_cached = torch.cat([rope.rotate(k[:, p : p + 1], positions[p : p + 1]) for p in range(T)], dim=1)
    return q_rot @ at_once.transpose(-2, -1), q_rot @ as_cached.transpose(-2, -1)


def test_attnlib_rotates_with_the_base_of_the_longest_position_it_is_given():
    rope = RotaryEmbedding(16, 10000.0, {"rope_type": "dynamic", "factor": 1.0}, 32)
    x = torch.randn(1, 100, 16, dtype=torch.float64)
    inv_freq, _ = rope_frequencies(16, 10000.0, {"rope_type": "dynamic", "factor": 1.0}, 32, seq_len=100)
    angle = torch.arange(100)[:, None].double() * inv_freq.double()  # the base of 100 tokens for all
    x1, x2 = x[..., :8], x[..., 8:]
    expected = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)
    torch.testing.assert_close(rope.rotate(x, torch.arange(100)), expected, rtol=1e-5, atol=1e-5)


def test_attnlib_cached_and_uncached_agree_up_to_the_trained_length_and_differ_past_it():
    rope = RotaryEmbedding(16, 10000.0, {"rope_type": "dynamic", "factor": 1.0}, 32)
    for T in (5, 31, 32):
        uncached, cached = _two_ways(rope, T)
        torch.testing.assert_close(cached, uncached)  # the trained base for every key
    for T in (33, 64, 128):
        uncached, cached = _two_ways(rope, T)
        assert (uncached - cached).abs().max() > 1e-3, T
        torch.testing.assert_close(cached[..., -1], uncached[..., -1])  # the newest key: the same base


def test_plain_rope_has_no_such_difference():
    uncached, cached = _two_ways(RotaryEmbedding(16, 10000.0), 128)
    torch.testing.assert_close(cached, uncached)


@pytest.fixture(scope="module")
def hf_dynamic_llama():
    torch.manual_seed(0)
    config = _hf_config(16, 10000.0, 1.0, 8, vocab_size=50, intermediate_size=48, num_hidden_layers=2,
                        num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # scores of order 1 (the init's are near 0): positions then move the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(25.0)
            layer.self_attn.k_proj.weight.mul_(25.0)
    return model


def _hf_cached_logits(model, idx):
    cache, steps = DynamicCache(config=model.config), []
    with torch.no_grad():
        for t in range(idx.shape[1]):
            out = model(idx[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    return torch.stack(steps, dim=1)  # (B, T, vocab)


def test_transformers_does_the_same(hf_dynamic_llama):
    """transformers' Llama with dynamic RoPE: token by token with its cache vs one pass, L = 8."""
    L = hf_dynamic_llama.config.max_position_embeddings
    idx = torch.randint(0, 50, (1, 3 * L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # first: the module keeps a grown base for a later call of L tokens
        within = hf_dynamic_llama(idx[:, :L]).logits  # a text of L tokens: the trained base
    cached = _hf_cached_logits(hf_dynamic_llama, idx)
    with torch.no_grad():
        uncached = hf_dynamic_llama(idx).logits  # every key with the base of 3 L
    torch.testing.assert_close(cached[:, :L], within, rtol=1e-5, atol=1e-5)
    gap = (cached[:, L:] - uncached[:, L:]).abs().amax(-1)[0]  # (2 L,) per position past L
    assert gap.min() > 1e-4 and gap.max() > 1e-3, gap
    # and the uncached pass over 3 L differs from the trained base already within L
    assert (uncached[:, :L] - within).abs().max() > 1e-4


def test_transformers_dynamic_rope_equals_attnlibs_rotation(hf_dynamic_llama):
    """One uncached call of transformers' rotary module = attnlib's RotaryEmbedding over the same positions."""
    rotary = hf_dynamic_llama.model.rotary_emb
    x = torch.zeros(1, 1, 40, 16)
    cos, sin = rotary(x, torch.arange(40)[None])  # grows its base to 40 tokens
    ours = RotaryEmbedding(16, 10000.0, {"rope_type": "dynamic", "factor": 1.0}, 8)
    angle = ours.angles(torch.arange(40))  # (40, 8)
    torch.testing.assert_close(cos[0], torch.cat([angle.cos(), angle.cos()], -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[0], torch.cat([angle.sin(), angle.sin()], -1), rtol=1e-5, atol=1e-5)
    assert math.isclose(float(rotary.attention_scaling), ours.attention_factor)
