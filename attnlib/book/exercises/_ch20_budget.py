"""Exercise 20.2's check: the ``layer_types`` list with the most full-attention layers whose KV cache fits a budget.

The answer's list is measured, not recomputed: the check builds :class:`attnlib.Decoder` with it, fills the
cache with ``config.block_size`` tokens in the asked dtype and reads ``cache.nbytes()``. The expected list
comes from the statement's arithmetic (a full layer keeps every token, a sliding one its window; a key and
a value per key/value head) and its placement rule; a count that misses is explained by the usual slips,
each one a cache model of its own (:func:`_slips`).
"""
from __future__ import annotations

import torch

from attnlib.book.exercises._core import expect, randint
from attnlib.book.exercises._run import run
from attnlib.models.config import DecoderConfig
from attnlib.models.decoder import Decoder

__all__ = ["budget_cases", "grade_budget", "spread"]

FULL, SLIDING = "full_attention", "sliding_attention"
_RULE = "layer i (from 0) is full when (i + 1) * k // n_layers > i * k // n_layers"


def spread(n_layers: int, k: int) -> list[str]:
    """``k`` full layers among ``n_layers``, spread as the statement says (the last one full when ``k >= 1``)."""
    return [FULL if (i + 1) * k // n_layers > i * k // n_layers else SLIDING for i in range(n_layers)]


def _config(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int, T: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=8, block_size=T, n_layers=n_layers, n_heads=n_heads, d_model=8,
                         n_kv_heads=n_kv_heads, head_dim=head_dim, attention="mha" if n_kv_heads == n_heads else "gqa",
                         sliding_window=window, d_ff=4)


def _most(n: int, full: int, sliding: int, budget: int, strict: bool = False) -> int:
    """The most full layers (each ``full`` bytes, the others ``sliding``) within ``budget`` (``<`` if strict)."""
    fits = [k for k in range(n + 1) if (k * full + (n - k) * sliding < budget if strict
                                        else k * full + (n - k) * sliding <= budget)]
    return max(fits, default=0)


def _sizes(config: DecoderConfig, dtype: torch.dtype, *, kv: int = 2, heads: int | None = None,
           head_dim: int | None = None, itemsize: int | None = None, window: int | None = None,
           T: int | None = None) -> tuple[int, int]:
    """(bytes of a full layer, bytes of a sliding layer) under a cache model; the defaults are the right one."""
    per_position = kv * (heads or config.n_kv_heads) * (head_dim or config.head_dim) * (itemsize or dtype.itemsize)
    T = config.block_size
    return T * per_position, min(T, window if window is not None else config.sliding_window) * per_position


def _slips(config: DecoderConfig, budget: int, dtype: torch.dtype) -> list[tuple[str, int]]:
    """(hint, the count of full layers that slip gives), most specific first."""
    n, w, T = config.n_layers, config.sliding_window, config.block_size
    itemsize = (f"a number of {dtype} takes {dtype.itemsize} bytes: read the size from the dtype given "
                "(dtype.itemsize), not a fixed one")
    models = [
        ("a sliding layer holds only its window, min(sliding_window, context) positions, not the whole "
         "context", dict(window=T)),
        ("a layer caches a key AND a value for each position and key/value head: 2 * n_kv_heads * head_dim "
         "numbers, not n_kv_heads * head_dim", dict(kv=1)),
        (f"a sliding layer keeps sliding_window = {w} positions (the query and the window - 1 before it), "
         f"not window - 1 = {w - 1}", dict(window=w - 1)),
        (f"a sliding layer keeps sliding_window = {w} positions (the query and the window - 1 before it), "
         f"not window + 1 = {w + 1}", dict(window=w + 1)),
        ("the keys and values are cached per key/value head: config.n_kv_heads, not config.n_heads",
         dict(heads=config.n_heads)),
        ("a head's width is config.head_dim (set apart from d_model // n_heads here)",
         dict(head_dim=config.d_model // config.n_heads)),
        (itemsize, dict(itemsize=2)),  # bfloat16's size for every dtype
        (itemsize, dict(itemsize=4)),  # float32's
    ]
    out = []
    for hint, change in models:
        full, sliding = _sizes(config, dtype, **change)
        out.append((hint, _most(n, full, sliding, budget)))
    full, sliding = _sizes(config, dtype)
    out.append(("a cache of exactly budget_bytes fits: the budget is an upper bound (<=), not a strict one",
                _most(n, full, sliding, budget, strict=True)))
    return out


def _measure(config: DecoderConfig, layer_types: list[str], dtype: torch.dtype) -> int:
    """Bytes of the model's KV cache once filled with ``block_size`` tokens (one sequence), in ``dtype``."""
    window = config.sliding_window if SLIDING in layer_types else None  # a window needs a layer that uses it
    model = Decoder(config.replace(layer_types=tuple(layer_types), sliding_window=window)).to(dtype).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(1, config.block_size, dtype=torch.long), cache=cache)
    return cache.nbytes()


def budget_cases(g: torch.Generator) -> list[tuple[DecoderConfig, int, torch.dtype]]:
    """Fixed edges (a budget exactly met, one byte short, every layer full, none, GQA, a head_dim set apart,
    bfloat16) and fresh random ones."""
    f32, bf16 = torch.float32, torch.bfloat16
    cases = []

    def add(sizes: tuple[int, ...], dtype: torch.dtype, k: int, slack) -> None:
        config = _config(*sizes)
        full, sliding = _sizes(config, dtype)
        per_position = full // config.block_size
        budget = k * full + (config.n_layers - k) * sliding
        cases.append((config, budget + slack(full - sliding, (config.n_layers - k) * per_position), dtype))

    add((6, 4, 2, 4, 8, 32), f32, 1, lambda step, more: 0)  # Gemma 3's 5:1, exactly at the budget
    add((12, 4, 4, 3, 6, 40), f32, 3, lambda step, more: step - 1)  # one byte short of one more full layer
    add((10, 2, 2, 6, 5, 20), bf16, 4, lambda step, more: more - 1)  # one byte short of a position more per sliding
    add((8, 4, 1, 3, 4, 24), bf16, 8, lambda step, more: 0)  # every layer full
    add((7, 2, 1, 4, 9, 30), f32, 0, lambda step, more: 0)  # every layer sliding, exactly
    for _ in range(3):
        n, heads = randint(g, 2, 12), (2, 4)[randint(g, 0, 1)]
        kv = (1, heads // 2, heads)[randint(g, 0, 2)]
        T = randint(g, 8, 48)
        sizes = (n, heads, kv, randint(g, 2, 7), randint(g, 2, T - 2), T)
        dtype = (f32, bf16)[randint(g, 0, 1)]
        config = _config(*sizes)
        full, sliding = _sizes(config, dtype)
        k = randint(g, 0, n)
        cases.append((config, k * full + (n - k) * sliding + randint(g, 0, full - sliding - 1), dtype))
    return cases


def _what(config: DecoderConfig, budget: int, dtype: torch.dtype) -> str:
    return (f"layer_types_for_budget(config(n_layers={config.n_layers}, n_heads={config.n_heads}, "
            f"n_kv_heads={config.n_kv_heads}, head_dim={config.head_dim}, sliding_window={config.sliding_window}, "
            f"block_size={config.block_size}), budget_bytes={budget}, dtype={dtype})")


def _answer(answer, config: DecoderConfig, budget: int, dtype: torch.dtype) -> list[str]:
    """The answer's list for one case, its type, length and strings checked."""
    what = _what(config, budget, dtype)
    out = run(answer, config, budget, dtype, what=what)
    expect(type(out) in (list, tuple), f"{what} should return a list of strings, got {type(out).__name__}")
    expect(len(out) == config.n_layers, f"{what} has {len(out)} entries; return one layer type per layer "
                                        f"({config.n_layers})")
    odd = [t for t in out if type(t) is not str or t not in (FULL, SLIDING)]
    expect(not odd, f"{what} contains {odd[0]!r}: use transformers' strings, {FULL!r} and {SLIDING!r}"
           if odd else "")
    return list(out)


def grade_budget(answer, cases: list[tuple[DecoderConfig, int, torch.dtype]]) -> None:
    """Raise :class:`Wrong` unless ``answer(config, budget, dtype)`` is the statement's list in every case.

    Every case runs first; a wrong count is then explained by the slips whose counts match the answer's
    in every case (one case alone often fits several slips).
    """
    answers = [_answer(answer, *case) for case in cases]
    counts = [out.count(FULL) for out in answers]
    slips = None
    for (config, budget, dtype), out, k in zip(cases, answers, counts):
        n = config.n_layers
        full, sliding = _sizes(config, dtype)
        best = _most(n, full, sliding, budget)
        expected = spread(n, best)
        if out == expected:
            continue
        what = _what(config, budget, dtype)
        if slips is None:  # the slips whose counts are the answer's in every case
            table = [_slips(*case) for case in cases]
            slips = [i for i in range(len(table[0])) if all(t[i][1] == c for t, c in zip(table, counts))]
        hints = list(dict.fromkeys(_slips(config, budget, dtype)[i][0] for i in slips))  # this case's words
        named = (": " + "; or ".join(hints)) if hints else ""
        measured = _measure(config, out, dtype)  # the answer's list, as a model caches it
        expect(measured <= budget, f"{what}: your {k} full layers make a cache of {measured} bytes (measured), "
                                   f"over the budget of {budget}{named}")
        expect(k >= best, f"{what}: not the most full layers that fit: {best} fit (a cache of "
                          f"{best * full + (n - best) * sliding} bytes), you have {k}{named}")
        if k > best:  # within the budget as measured, but not by the statement's count: a check's own error
            raise RuntimeError(f"{what}: {k} full layers measure {measured} <= {budget} bytes, yet {best} was computed")
        expect(False, f"{what}: the right number of full layers ({k}), in the wrong places: {_RULE} "
                      f"(here {[i for i, t in enumerate(expected) if t == FULL]})")
