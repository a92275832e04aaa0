"""The chapter 17 exercise checks: the solution is correct, plausible mistakes are wrong with a hint naming them."""
import math

import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, ch17, grade  # noqa: F401  (ch17 registers 17.x)


# ---------------------------------------------------------------- 17.1
def ntk_base(base, head_dim, factor):
    return base * factor ** (head_dim / (head_dim - 2))


# ---------------------------------------------------------------- 17.3
def streaming_keys(position, window, n_sink, sinks=True, extra=0, dedup=True, sinks_in_window=False,
                   future_sinks=False):
    first = list(range(n_sink if future_sinks else min(n_sink, position + 1))) if sinks else []
    span = window - n_sink if sinks_in_window else window
    recent = list(range(max(0, position - span + 1 - extra), position + 1))
    keys = first + recent
    return sorted(set(keys)) if dedup else sorted(keys)


def streaming_renumbered(position, window, n_sink):
    return list(range(len(streaming_keys(position, window, n_sink))))


# ---------------------------------------------------------------- 17.2
def pattern_cache_bytes(windows, n_kv_heads, head_dim, seq_len, dtype, batch_size, kv=2, use_min=True,
                        itemsize=None, batch=True, extra=0, ignore_windows=False):
    per = n_kv_heads * head_dim * (itemsize or dtype.itemsize) * (batch_size if batch else 1)
    total = 0
    for w in windows:
        if w is None or ignore_windows:
            total += kv * per * seq_len
        else:
            total += kv * per * (min(w + extra, seq_len) if use_min else w + extra)
    return total


# ---------------------------------------------------------------- 17.4
def softcap_grad(scores, cap):
    return 1 - torch.tanh(scores / cap) ** 2


def softcap_grad_in_place(scores, cap):
    return 1 - scores.div_(cap).tanh_() ** 2


# ---------------------------------------------------------------- 17.5
def yarn_frequencies(head_dim, base, factor, original_length, beta_fast=32.0, beta_slow=1.0, attention=True,
                     log=math.log, ramp_over="pairs", rounded=True, clamped=True, swapped=False):
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)

    def pair(turns):  # the pair index i that makes `turns` turns in original_length tokens
        return head_dim * math.log(original_length / (turns * 2 * math.pi)) / (2 * math.log(base))

    if ramp_over == "turns":  # the paper's gamma(r), r = original_length / wavelength
        ramp = 1 - (original_length * theta / (2 * math.pi) - beta_slow) / (beta_fast - beta_slow)
    else:
        low, high = pair(beta_fast), pair(beta_slow)
        if rounded:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = (torch.arange(head_dim // 2).float() - low) / (high - low)
    ramp = ramp.clamp(0, 1) if clamped else ramp
    ramp = 1 - ramp if swapped else ramp
    inv_freq = theta / factor * ramp + theta * (1 - ramp)
    factor_on_cos_sin = 0.1 * log(factor) + 1 if attention is True else attention
    return inv_freq, factor_on_cos_sin


def yarn_factor_on_scores(d, b, s, L, fast, slow):
    inv_freq, f = yarn_frequencies(d, b, s, L, fast, slow)
    return inv_freq, f**2


CORRECT_ANSWERS = [
    ("17.1", ntk_base),
    ("17.3", streaming_keys),
    ("17.2", pattern_cache_bytes),
    ("17.4", softcap_grad),
    ("17.5", yarn_frequencies),
]


@pytest.mark.parametrize("exercise_id, answer", CORRECT_ANSWERS)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("17.1", lambda b, d, s: b * s, "slowed by only"),
        ("17.1", lambda b, d, s: b * s ** ((d - 2) / d), "exponent is upside down"),
        ("17.1", lambda b, d, s: b / s, "a smaller base makes every pair turn faster"),
        ("17.1", lambda b, d, s: b * s ** (d / 2), "i = d_h/2 - 1"),
        ("17.1", lambda b, d, s: b * s ** (d / (d - 1)), "the fastest pair (i = 0) never changes"),
        ("17.1", lambda b, d, s: torch.tensor([b, s]), "return a number"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, sinks=False), "never evicted"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, extra=1), "the window counts the token itself"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, dedup=False), "list it once"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, sinks_in_window=True), "besides the sinks"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, future_sinks=True), "once its token has arrived"),
        ("17.3", streaming_renumbered, "not the positions 0, 1, ..."),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n)[::-1], "ascending order"),
        ("17.3", lambda p, w, n: streaming_keys(p, w, n, extra=-1), "keys, the token itself and the"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, kv=1), "a key AND a value"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, use_min=False), "min(seq_len, window)"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, ignore_windows=True), "keeps only its window"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, itemsize=2), "dtype.itemsize"),
        ("17.2", lambda *a: pattern_cache_bytes(*a, batch=False), "batch_size="),
        ("17.2", lambda *a: pattern_cache_bytes(*a, extra=1), "not w + 1"),
        ("17.2", lambda *a: float(pattern_cache_bytes(*a)), "return a Python int"),
        ("17.4", lambda s, c: c * (1 - torch.tanh(s / c) ** 2), "chain rule"),
        ("17.4", lambda s, c: 1 - torch.tanh(s) ** 2, "the tanh is of s / cap"),
        ("17.4", lambda s, c: 1 / torch.cosh(s / c), "(squared)"),
        ("17.4", lambda s, c: torch.where(s == 0, torch.ones_like(s), c * torch.tanh(s / c) / s), "the secant"),
        ("17.4", softcap_grad_in_place, "changed scores in place"),
        ("17.5", lambda *a: yarn_frequencies(*a, attention=1.0), "also multiplies cos and sin"),
        ("17.5", yarn_factor_on_scores, "the factor on the scores"),
        ("17.5", lambda *a: yarn_frequencies(*a, log=math.log10), "natural logarithm"),
        ("17.5", lambda *a: yarn_frequencies(*a, swapped=True), "the bands are swapped"),
        ("17.5", lambda *a: yarn_frequencies(*a, ramp_over="turns"), "linearly over the pair index"),
        ("17.5", lambda *a: yarn_frequencies(*a, rounded=False), "round the band edges outward"),
        ("17.5", lambda *a: yarn_frequencies(*a, clamped=False), "clamp the ramp"),
        ("17.5", lambda d, b, s, L, f, sl: (1 / b ** (torch.arange(0, d, 2) / d) / s, 0.1 * math.log(s) + 1),
         "linear scaling"),
        ("17.5", lambda *a: (yarn_frequencies(*a)[0][:-1], yarn_frequencies(*a)[1]), "head_dim / 2"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


@pytest.mark.parametrize("config", [(128, 500000.0, 8.0, 8192, 32.0, 1.0), (64, 10000.0, 16.0, 2048, 8.0, 0.5)])
def test_yarn_answer_equals_transformers(config):
    """The accepted answer of 17.5 against transformers' own YaRN (an outside reference)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d, base, s, L, fast, slow = config
    hf_config = LlamaConfig(hidden_size=2 * d, num_attention_heads=2, head_dim=d, max_position_embeddings=int(s * L),
                            rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": s,
                                             "original_max_position_embeddings": L, "beta_fast": fast,
                                             "beta_slow": slow})
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, None)
    inv_freq, factor = yarn_frequencies(*config)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert math.isclose(factor, expected_factor, rel_tol=1e-9)


@pytest.mark.parametrize("exercise_id", ["17.1", "17.2", "17.3", "17.4", "17.5"])
def test_stub_is_not_solved(exercise_id):
    def stub(*args):
        raise NotImplementedError("write it")

    assert grade(exercise_id, stub).status == NOT_SOLVED
