"""Exercise checks for chapter 16 (the modern decoder).

* 16.1 ``check_rerotate``: ``rerotate(k, old_positions, new_positions, base)``, keys stored already
  rotated (half-split RoPE) moved to other positions without the unrotated keys; checked against
  keys rotated at the new positions from scratch (float64), on fresh random positions each run.
* 16.2 ``check_to_interleaved``: half-split query/key weights and QK-norm gains converted to
  Meta's interleaved RoPE layout, checked by the attention scores of both conventions.
* 16.3 ``check_count_parameters``: the parameters of a Llama or Qwen3 config by formula (no model
  built), checked against :class:`attnlib.Decoder` built on the meta device.

Every learner call goes through :func:`~attnlib.book.exercises._run.run`; the random cases come from
:func:`~attnlib.book.exercises._core.case_rng` (fresh each run), besides fixed edge cases.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib.book.exercises._ch16_count import COUNT_MISTAKES
from attnlib.book.exercises._ch16_pairing import (
    _NAMES,
    _half_split_rope,
    _interleaved_rope,
    _pairing_mistakes,
    _scores,
)
from attnlib.book.exercises._core import Wrong, case_rng, exercise, expect, expect_int, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.models import Decoder
from attnlib.models.hf_llama import config_from_hf_decoder

__all__ = ["check_count_parameters", "check_rerotate", "check_to_interleaved", "QWEN3_0_6B"]


# ---------------------------------------------------------------- 16.1
def _rerotate_cases(g: torch.Generator) -> list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor, float]]:
    """(name, (B, n_kv, d_h), old positions, new positions, base): fixed edges, then fresh random ones."""
    t = torch.tensor
    cases = [
        ("a sink cache renumbering its keys", (1, 2, 8), t([0, 1, 2, 3, 57, 58, 59, 60]), torch.arange(8),
         10000.0),
        ("Llama 3's base, keys 3,000 positions back", (2, 1, 16), torch.arange(5) + 3000, torch.arange(5),
         500000.0),
        ("keys moved forward", (1, 3, 4), torch.arange(6), torch.arange(6) + 5, 1e6),
        ("one pair per head", (1, 1, 2), t([9, 4]), t([1, 0]), 10000.0),
    ]
    for n in range(3):
        B, n_kv, d_h, T = randint(g, 1, 2), randint(g, 1, 3), 2 * randint(g, 1, 16), randint(g, 2, 9)
        old = torch.randint(0, 2000, (T,), generator=g)
        new = torch.randint(0, 2000, (T,), generator=g)
        base = (10000.0, 500000.0, 1e6)[randint(g, 0, 2)]
        cases.append((f"random case {n + 1}", (B, n_kv, d_h), old, new, base))
    return cases


@exercise("16.1")
def check_rerotate(rerotate) -> None:
    """Check ``rerotate(k, old_positions, new_positions, base)`` against keys rotated at the new positions."""
    g = case_rng()
    for name, (B, n_kv, d_h), old, new, base in _rerotate_cases(g):
        T = old.shape[0]
        x = torch.randn(B, n_kv, T, d_h, generator=g, dtype=torch.float64)  # the keys before any rotation
        k = _half_split_rope(x, old, base).float()  # what the cache holds: (B, n_kv, T, d_h)
        what = (f"{name}: rerotate(k of shape {tuple(k.shape)}, old_positions={old.tolist()}, "
                f"new_positions={new.tolist()}, base={base:g})")
        out = run(rerotate, k, old.clone(), new.clone(), base, what=what)
        expect_tensor(out, what, shape=tuple(k.shape), dtype=torch.float32)
        expected = _half_split_rope(x, new, base)  # (B, n_kv, T, d_h) rotated from scratch, float64
        got = out.detach().double()
        if (got - expected).abs().max().item() <= 1e-3:
            continue
        k64, shift = k.double(), new - old

        def close(candidate: torch.Tensor, got: torch.Tensor = got) -> bool:
            return (got - candidate).abs().max().item() <= 1e-3

        expect(not close(_half_split_rope(k64, new, base)),
               f"{what}: k is already turned by its old positions; turning it by new_positions turns it twice. "
               "Turn each key by new_positions - old_positions (rotations add up)")
        expect(not close(_half_split_rope(k64, -shift, base)),
               f"{what}: you turned the keys the wrong way, by old_positions - new_positions; a key at "
               "position p that should sit at q is turned by q - p")
        expect(not close(_interleaved_rope(k64, shift, base)),
               f"{what}: you turned the pairs (x[2i], x[2i+1]); the keys were rotated with half-split pairs "
               "(x[i], x[i + d_h/2]), as in the chapter's rope()")
        expect(base == 10000.0 or not close(_half_split_rope(k64, shift, 10000.0)),
               f"{what}: your frequencies are base 10,000's; use the given base={base:g}")
        expect(T == 1 or not close(_half_split_rope(k64, shift[:1].expand(T), base)),
               f"{what}: every key moved by the first key's shift; each key moves by its own "
               "new_positions[j] - old_positions[j]")
        diff = (got - expected).abs().max().item()
        raise Wrong(f"{what}: your keys differ from keys rotated at new_positions by up to {diff:.3g}")


# ---------------------------------------------------------------- 16.2
def _pairing_cases(g: torch.Generator) -> list[tuple[int, int, int, int]]:
    """(n_heads, n_kv_heads, head_dim, d_model): fixed (GQA, MQA, d_h = 4 where P is its own inverse), random."""
    cases = [(4, 2, 8, 16), (2, 2, 12, 8), (6, 3, 16, 24), (4, 1, 8, 12), (8, 2, 4, 16)]
    for _ in range(2):
        n_kv = randint(g, 1, 3)
        cases.append((n_kv * randint(g, 1, 3), n_kv, 2 * randint(g, 3, 10), 2 * randint(g, 2, 12)))
    return cases


@exercise("16.2")
def check_to_interleaved(to_interleaved) -> None:
    """Check ``to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)`` by the scores of both RoPEs."""
    g = case_rng()
    for n_heads, n_kv_heads, head_dim, d in _pairing_cases(g):
        case = f"n_heads={n_heads}, n_kv_heads={n_kv_heads}, d_h={head_dim}, d={d}"
        given = (torch.randn(n_heads * head_dim, d, generator=g, dtype=torch.float64),
                 torch.randn(n_kv_heads * head_dim, d, generator=g, dtype=torch.float64),
                 torch.rand(head_dim, generator=g, dtype=torch.float64) + 0.5,
                 torch.rand(head_dim, generator=g, dtype=torch.float64) + 0.5)
        out = run(to_interleaved, *given, n_heads, n_kv_heads, what=f"to_interleaved({case})")
        expect(type(out) in (tuple, list) and len(out) == 4,
               f"{case}: return a tuple of four tensors (w_q, w_k, q_gain, k_gain); got {type(out).__name__}")
        for got, ref, name in zip(out, given, _NAMES):
            expect_tensor(got, f"{case}: {name}", shape=tuple(ref.shape))
            expect(got.dtype == ref.dtype, f"{case}: {name} is {got.dtype}, the input was {ref.dtype}: a "
                   "permutation moves numbers, it does not need to change their type")
        x = torch.randn(7, d, generator=g, dtype=torch.float64)
        half = _scores(x, *given, n_heads, n_kv_heads, _half_split_rope)
        inter = _scores(x, *(t.detach() for t in out), n_heads, n_kv_heads, _interleaved_rope)
        if torch.allclose(inter, half, atol=1e-8, rtol=1e-8):
            continue
        right, mistakes = _pairing_mistakes(*given, n_heads, n_kv_heads)
        for wrong, hint in mistakes:
            if all(torch.equal(a.detach(), b) for a, b in zip(out, wrong)):
                raise Wrong(f"{case}: {hint}")
        diff = (inter - half).abs().max().item()
        hint = (f"{case}: interleaved RoPE on your weights gives scores off by up to {diff:.3g} from half-split "
                "RoPE on the originals")
        ok = [name for name, a, b in zip(_NAMES, out, right) if torch.equal(a.detach(), b)]
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


def _random_config(g: torch.Generator) -> dict:
    n_kv = randint(g, 1, 4)
    h, d_h = n_kv * randint(g, 1, 4), 2 * randint(g, 2, 12)
    config = dict(model_type=("llama", "qwen3")[randint(g, 0, 1)], vocab_size=randint(g, 10, 400),
                  intermediate_size=randint(g, 8, 300), num_hidden_layers=randint(g, 1, 5),
                  num_attention_heads=h, num_key_value_heads=n_kv, tie_word_embeddings=bool(randint(g, 0, 1)))
    if randint(g, 0, 1):  # a head width of its own, hidden_size free
        return dict(config, hidden_size=4 * randint(g, 2, 24), head_dim=d_h)
    return dict(config, hidden_size=h * d_h)


def _reference_count(config: dict) -> int:
    full = dict(config, max_position_embeddings=64, rms_norm_eps=1e-6)
    with torch.device("meta"):
        return Decoder(config_from_hf_decoder(full, config["model_type"])).num_parameters()


#: "by formula (no model built)": building any nn.Module (attnlib's, transformers', on the meta device) is refused.
_BY_FORMULA = Refuse("count by formula: no model built, not even on the meta device", nn.Module.__init__)


@exercise("16.3")
def check_count_parameters(count_parameters) -> None:
    """Check ``count_parameters(config_dict)`` against attnlib's Decoder on the meta device."""
    g = case_rng()
    cases = _COUNT_CASES + [(f"random config {n + 1}", _random_config(g)) for n in range(3)]
    results = []  # (name, config, got, expected)
    for name, config in cases:
        given = dict(config)
        got = run(count_parameters, given, what=f"{name}: count_parameters({config})", refuse=_BY_FORMULA,
                  copy_args=False)
        expect(given == config, f"{name}: your function changed the config dict it was given in place; read "
                                "it, do not edit it")
        got = expect_int(got, f"{name}: count_parameters(...)")
        results.append((name, config, got, _reference_count(config)))
    wrong = [r for r in results if r[2] != r[3]]
    if not wrong:
        return
    name, config, got, expected = wrong[0]
    message = f"{name}: got {got:,}, expected {expected:,}"
    for rule, hint in COUNT_MISTAKES:  # a slip that gives every one of the learner's counts
        if all(rule(c) == n for _, c, n, _ in results):
            raise Wrong(f"{message}: {hint}")
    for rule, hint in COUNT_MISTAKES:  # else one that gives this count
        if rule(config) == got:
            raise Wrong(f"{message}: {hint}")
    raise Wrong(f"{message} (off by {got - expected:+,})")
