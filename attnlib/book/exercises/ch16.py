"""Exercise checks for chapter 16 (the modern decoder).

* 16.1 ``check_swiglu_hidden``: the SwiGLU width of Meta's Llama code (2/3 of ``4 · d_model``,
  an optional ``ffn_dim_multiplier``, rounded up to ``multiple_of``), checked against the
  published widths of Llama 2 and Llama 3 and against other sizes.
* 16.2 ``check_to_interleaved``: half-split query/key weights and QK-norm gains converted to
  Meta's interleaved RoPE layout, checked by the attention scores of both conventions.
* 16.3 ``check_count_parameters``: the parameters of a Llama or Qwen3 config by formula,
  checked against :class:`attnlib.Decoder` built on the meta device.

Every grader draws its test tensors from a local ``torch.Generator``; ``grade`` runs it inside
``torch.random.fork_rng``, so checking an answer never moves the notebook's random state.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._ch16_pairing import (
    _NAMES,
    _PAIRING_CASES,
    _half_split_rope,
    _interleaved_rope,
    _pairing_mistakes,
    _scores,
)
from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect
from attnlib.models import Decoder
from attnlib.models.hf_llama import config_from_hf_decoder

__all__ = ["check_count_parameters", "check_swiglu_hidden", "check_to_interleaved"]


def _int_answer(got, case: str) -> int:
    if got is None:
        raise NotSolved("return the width (or count) as an int, not None")
    expect(
        isinstance(got, int) and not isinstance(got, bool),
        f"{case}: return a Python int; got {type(got).__name__} {got!r} (int(...) truncates a float)",
    )
    return got


# ---------------------------------------------------------------- 16.1
def _meta_width(d: int, multiple_of: int, multiplier: float | None) -> int:
    """``FeedForward.__init__`` of Meta's Llama code (llama/model.py), from ``hidden_dim = 4 * dim``."""
    hidden = int(2 * (4 * d) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


_SWIGLU_CASES = [  # (name, d_model, multiple_of, ffn_dim_multiplier, published intermediate_size)
    ("Llama 2 7B", 4096, 256, None, 11008),
    ("Llama 2 13B", 5120, 256, None, 13824),
    ("Llama 2 70B", 8192, 4096, 1.3, 28672),
    ("Llama 3 8B", 4096, 1024, 1.3, 14336),
    ("Llama 3 70B", 8192, 4096, 1.3, 28672),
    ("Llama 3.1 405B", 16384, 4096, 1.2, 53248),
    ("d_model=96, multiple_of 64", 96, 64, None, None),  # 2/3 * 4 * 96 = 256: already a multiple
    ("d_model=100", 100, 1, None, None),
    ("d_model=100, multiplier 1.3", 100, 1, 1.3, None),
    ("d_model=250, multiplier 1.5", 250, 1, 1.5, None),
    ("d_model=64, multiple_of 48", 64, 48, None, None),
    ("d_model=96, multiple_of 7, multiplier 1.1", 96, 7, 1.1, None),
    ("d_model=96, multiplier 1.1", 96, 1, 1.1, None),
    ("d_model=9, multiplier 1.3", 9, 1, 1.3, None),
    ("d_model=8", 8, 1, None, None),
]


def _up(hidden: int, m: int) -> int:
    return m * math.ceil(hidden / m)


def _times(mult: float | None, x: float) -> float:
    return (1.0 if mult is None else mult) * x


# Widths a learner gets from plausible slips, each as a rule over (d_model, multiple_of, multiplier), with its hint.
# A hint is given only when its rule gives the learner's width in every case, so two slips that agree on one size
# are told apart by the others.
_SWIGLU_MISTAKES = [
    (lambda d, m, mult: _up(int(_times(mult, 4 * d)), m), "you kept the GELU MLP's 4 * d_model. SwiGLU has three "
     "matrices, not two, so Meta's code first takes 2/3 of 4 * d_model (that keeps the parameter count)"),
    (lambda d, m, mult: _up(int(8 * d / 3), m), "you ignored ffn_dim_multiplier: multiply the 2/3 * 4 * d_model "
     "width by it (truncating to an int) before rounding"),
    (lambda d, m, mult: m * (int(_times(mult, int(8 * d / 3))) // m), "you rounded down to a multiple of "
     "multiple_of; the rule rounds up, to the next multiple"),
    (lambda d, m, mult: m * (int(_times(mult, int(8 * d / 3))) // m + 1), "you added a whole multiple_of even "
     "when the width already is a multiple of it; rounding up leaves a multiple unchanged: "
     "multiple_of * ceil(hidden / multiple_of)"),
    (lambda d, m, mult: _up(int(_times(mult, 8 * d / 3)), m), "truncate 2/3 * 4 * d_model to an int before "
     "multiplying by ffn_dim_multiplier: Meta's code calls int() twice"),
    (lambda d, m, mult: _up(int(2 * int(_times(mult, 4 * d)) / 3), m), "you applied ffn_dim_multiplier to "
     "4 * d_model, before taking 2/3 of it; Meta's code takes int(2/3 * 4 * d_model) first, then multiplies"),
    (lambda d, m, mult: _up(round(_times(mult, round(8 * d / 3))), m), "int() truncates, round() rounds to "
     "nearest: Meta's code truncates both times"),
    (lambda d, m, mult: _up(int(_times(mult, math.ceil(8 * d / 3))), m), "you rounded 2/3 * 4 * d_model up; "
     "Meta's code truncates it with int()"),
    (lambda d, m, mult: _up(math.ceil(_times(mult, int(8 * d / 3))), m), "you rounded the width times "
     "ffn_dim_multiplier up; Meta's code truncates it with int(), and rounds up only to the multiple"),
    (lambda d, m, mult: int(_times(mult, int(8 * d / 3))), "you did not round to a multiple of multiple_of"),
]


@exercise("16.1")
def check_swiglu_hidden(swiglu_hidden) -> None:
    """Check ``swiglu_hidden(d_model, multiple_of, ffn_dim_multiplier)`` against Meta's rule."""
    results = []  # (case, d, m, mult, got, expected, published)
    for name, d, m, mult, published in _SWIGLU_CASES:
        case = f"{name} (d_model={d}, multiple_of={m}, ffn_dim_multiplier={mult})"
        got = _int_answer(swiglu_hidden(d, m, mult), case)
        expected = _meta_width(d, m, mult)
        assert published is None or published == expected, name  # the rule reproduces the published widths
        results.append((case, d, m, mult, got, expected, published))
    wrong = [r for r in results if r[4] != r[5]]
    if not wrong:
        return
    case, d, m, mult, got, expected, published = wrong[0]
    message = f"{case}: got {got}, expected {expected}"
    for rule, hint in _SWIGLU_MISTAKES:  # a slip that gives every one of the learner's widths
        if all(rule(d_, m_, mult_) == got_ for _, d_, m_, mult_, got_, _, _ in results):
            raise Wrong(f"{message}: {hint}")
    for rule, hint in _SWIGLU_MISTAKES:  # else one that gives this width
        if rule(d, m, mult) == got:
            raise Wrong(f"{message}: {hint}")
    raise Wrong(message + (" (the published width)" if published else ""))


# ---------------------------------------------------------------- 16.2
@exercise("16.2")
def check_to_interleaved(to_interleaved) -> None:
    """Check ``to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)`` by the scores of both RoPEs."""
    g = torch.Generator().manual_seed(1602)
    for n_heads, n_kv_heads, head_dim, d in _PAIRING_CASES:
        case = f"n_heads={n_heads}, n_kv_heads={n_kv_heads}, d_h={head_dim}, d={d}"
        w_q = torch.randn(n_heads * head_dim, d, generator=g, dtype=torch.float64)
        w_k = torch.randn(n_kv_heads * head_dim, d, generator=g, dtype=torch.float64)
        q_gain = torch.rand(head_dim, generator=g, dtype=torch.float64) + 0.5
        k_gain = torch.rand(head_dim, generator=g, dtype=torch.float64) + 0.5
        given = [t.clone() for t in (w_q, w_k, q_gain, k_gain)]
        out = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
        if out is None:
            raise NotSolved("return the four tensors (w_q, w_k, q_gain, k_gain)")
        expect(isinstance(out, (tuple, list)) and len(out) == 4 and all(isinstance(t, torch.Tensor) for t in out),
               f"{case}: return a tuple of four tensors (w_q, w_k, q_gain, k_gain); got {type(out).__name__}")
        expect(all(torch.equal(a, b) for a, b in zip((w_q, w_k, q_gain, k_gain), given)),
               f"{case}: your function changed its inputs in place; return new tensors")
        for got, ref, name in zip(out, given, _NAMES):
            expect(tuple(got.shape) == tuple(ref.shape),
                   f"{case}: {name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
            expect(got.dtype == ref.dtype, f"{case}: {name} is {got.dtype}, the input was {ref.dtype}: a "
                   "permutation moves numbers, it does not need to change their type")
        x = torch.randn(7, d, generator=g, dtype=torch.float64)
        half = _scores(x, *given, n_heads, n_kv_heads, _half_split_rope)
        inter = _scores(x, *(t.double() for t in out), n_heads, n_kv_heads, _interleaved_rope)
        if torch.allclose(inter, half, atol=1e-8, rtol=1e-8):
            continue
        right, mistakes = _pairing_mistakes(*given, n_heads, n_kv_heads)
        for wrong, hint in mistakes:
            if all(torch.equal(a.double(), b) for a, b in zip(out, wrong)):
                raise Wrong(f"{case}: {hint}")
        diff = (inter - half).abs().max().item()
        hint = (f"{case}: interleaved RoPE on your weights gives scores off by up to {diff:.3g} from half-split "
                "RoPE on the originals")
        ok = [name for name, a, b in zip(_NAMES, out, right) if torch.equal(a.double(), b)]
        if ok == ["w_q", "w_k"]:
            raise Wrong(f"{hint}. w_q and w_k are right, the gains are not: each gain multiplies one coordinate "
                        "of a head, so it moves by the same permutation as the rows of W_q and W_k")
        if ok:
            bad = [name for name in _NAMES if name not in ok]
            raise Wrong(f"{hint}. {', '.join(ok)} right, {', '.join(bad)} not: every one of the four is "
                        "reordered, inside each head, so that the pair (i, i + d_h/2) lands on (2i, 2i + 1)")
        raise Wrong(f"{hint}; reorder each head's rows of W_q and W_k (and the gains) so that the pair "
                    "(i, i + d_h/2) lands on (2i, 2i + 1)")


# ---------------------------------------------------------------- 16.3
QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=True)
_COUNT_CASES = [
    ("a small Qwen3", dict(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=160,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                           tie_word_embeddings=False)),
    ("Llama 3 8B", dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        tie_word_embeddings=False)),
    ("Llama 3.2 1B", dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          tie_word_embeddings=True)),
    ("Qwen3-8B", dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      tie_word_embeddings=False)),
    ("Qwen3-0.6B", QWEN3_0_6B),
    ("a small Llama", dict(model_type="llama", vocab_size=50, hidden_size=48, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                           tie_word_embeddings=True)),
]


def _reference_count(config: dict) -> int:
    full = dict(config, max_position_embeddings=64, rms_norm_eps=1e-6)
    with torch.device("meta"):
        return Decoder(config_from_hf_decoder(full, config["model_type"])).num_parameters()


def _formula(c: dict) -> int:
    """The count by formula (used only to recognise mistakes; the reference is the model itself)."""
    V, d, L = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d_h = c.get("head_dim") or d // h
    attention = 2 * d * h * d_h + 2 * d * kv * d_h + (2 * d_h if c["model_type"] == "qwen3" else 0)
    return V * d + L * (attention + 3 * d * c["intermediate_size"] + 2 * d) + d + (0 if c["tie_word_embeddings"]
                                                                                   else V * d)


def _sizes(c: dict) -> tuple[int, int, int, int, int, int, bool]:
    d, h = c["hidden_size"], c["num_attention_heads"]
    return (c["vocab_size"], d, c["num_hidden_layers"], h, c["num_key_value_heads"], c.get("head_dim") or d // h,
            c["model_type"] == "qwen3")


def _slip(change):
    """A rule: the right count of a config plus ``change(V, d, L, h, kv, d_h, qwen3, config)``."""
    return lambda c: _formula(c) + change(*_sizes(c), c)


# Counts a learner gets from plausible slips, each as a rule over the config, with its hint. A hint is given only
# when its rule gives the learner's count for every config, so slips that agree on one model are told apart.
_COUNT_MISTAKES = [
    (_slip(lambda V, d, L, h, kv, d_h, q, c: V * d if c["tie_word_embeddings"] else 0),
     "the head is tied (tie_word_embeddings=True): it is the embedding's matrix, count it once"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: 0 if c["tie_word_embeddings"] else -V * d),
     "the head is not tied here (tie_word_embeddings=False): it has its own |V| x d matrix"),
    (lambda c: _formula({k: v for k, v in c.items() if k != "head_dim"}), "the head width is head_dim, "
     "not hidden_size / heads: W_q has num_attention_heads * head_dim rows"),
    (lambda c: _formula(dict(c, num_key_value_heads=c["num_attention_heads"])), "keys and values have "
     "num_key_value_heads heads (GQA), not num_attention_heads"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * d * (h - kv) * d_h), "W_O takes all num_attention_heads heads "
     "back to d: it has num_attention_heads * head_dim x hidden_size weights, like W_q (only W_k and W_v are "
     "shared)"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * d * kv * d_h), "keys and values are two matrices, W_k and W_v, "
     "each num_key_value_heads * head_dim x hidden_size"),
    (lambda c: _formula(dict(c, model_type="llama")) if c["model_type"] == "qwen3" else None,
     "Qwen3's QK-norm adds two gains of head_dim per layer"),
    (lambda c: _formula(dict(c, model_type="qwen3")) if c["model_type"] == "llama" else None,
     "Llama has no QK-norm: no per-head gains"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: L * (h + kv - 2) * d_h if q else 0), "QK-norm has one gain of "
     "head_dim for the queries and one for the keys, shared by all the heads of a layer, not one per head"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: 2 * L * (d - d_h) if q else 0), "the QK-norm gains have head_dim "
     "numbers, not hidden_size: the norm runs over each head's d_h numbers"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: L * (h + 2 * kv) * d_h), "the projections have no biases "
     "(Qwen2 had q/k/v biases; Llama and Qwen3 have none)"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -(2 * L + 1) * d),
     "the RMSNorm gains are parameters too: two per layer and a final one"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * 2 * d), "two RMSNorm gains per layer (before attention, before "
     "the MLP)"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * d), "two RMSNorm gains per layer (before attention, before the "
     "MLP); you counted one"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -d), "the final RMSNorm has a gain of d parameters"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * c["intermediate_size"] * d),
     "SwiGLU has three matrices: gate, up and down"),
]


@exercise("16.3")
def check_count_parameters(count_parameters) -> None:
    """Check ``count_parameters(config_dict)`` against attnlib's Decoder on the meta device."""
    results = []  # (name, config, got, expected)
    for name, config in _COUNT_CASES:
        given = dict(config)
        got = _int_answer(count_parameters(given), name)
        expect(given == config, f"{name}: your function changed the config dict it was given")
        results.append((name, config, got, _reference_count(config)))
    wrong = [r for r in results if r[2] != r[3]]
    if not wrong:
        return
    name, config, got, expected = wrong[0]
    message = f"{name}: got {got:,}, expected {expected:,}"
    for rule, hint in _COUNT_MISTAKES:  # a slip that gives every one of the learner's counts
        if all(rule(c) == g for _, c, g, _ in results):
            raise Wrong(f"{message}: {hint}")
    for rule, hint in _COUNT_MISTAKES:  # else one that gives this count
        if rule(config) == got:
            raise Wrong(f"{message}: {hint}")
    raise Wrong(f"{message} (off by {got - expected:+,})")
