"""Exercise checks for chapter 21 (hybrid, compressed and sparse attention).

* 21.1 ``check_kda_chunk``: ``kda_chunk(q, k, v, beta, g, S0) -> (o, S)``, one chunk of Kimi Delta Attention
  (the delta rule with one decay per key channel, decay first) by its recurrence; compared with a float64 loop;
  attnlib's attention code and transformers' delta-rule functions refused (:mod:`._ch21_kda`).
* 21.2 ``check_indexer_topk``: ``indexer_topk(q_idx, k_idx, w, top_k, start)``, the keys DeepSeek-V3.2's lightning
  indexer selects for a chunk of queries under the causal mask (:mod:`._ch21_indexer`).
* 21.3 ``check_break_even_context``: ``break_even_context(config)``, the shortest context at which a hybrid's
  recurrent states, short-convolution states and KV cache take fewer bytes than the KV cache of an all-full-attention
  model of the same depth (``None`` when never); checked exactly against the byte counts, a wrong answer explained by
  the slips that give its answer in every case.

Every learner call goes through :func:`~attnlib.book.exercises._run.run`; besides fixed edge cases, the
random cases come from :func:`~attnlib.book.exercises._core.case_rng` (fresh each run).
"""
from __future__ import annotations

from attnlib.book.exercises._ch21_indexer import check_indexer_topk  # 21.2
from attnlib.book.exercises._ch21_kda import check_kda_chunk  # 21.1
from attnlib.book.exercises._core import case_rng, exercise, expect, randint
from attnlib.book.exercises._run import run

__all__ = ["check_break_even_context", "check_indexer_topk", "check_kda_chunk"]


# ---------------------------------------------------------------- 21.3
KEYS = ("n_full", "n_linear", "n_heads", "n_kv_heads", "head_dim", "n_heads_linear", "d_k", "d_v", "conv_kernel",
        "dtype_bytes", "state_bytes")


def _smallest(per_layer: int, per_token: int, layers: int = 1, strict: bool = True) -> int:
    """The smallest ``T >= 0`` with ``per_layer < T · layers · per_token`` (``<=`` unless ``strict``)."""
    step = layers * per_token
    return per_layer // step + 1 if strict else -(-per_layer // step)


def _break_even(c: dict, *, kv: int = 2, heads: str = "n_kv_heads", state_bytes: str = "state_bytes",
                conv: int | None = 0, state_heads: bool = True, once: bool = False, strict: bool = True,
                floor: bool = False, depth: bool = True, never: bool = True) -> int | None:
    """The expected context; the keyword arguments give the slips' variants (``conv``: positions of the convolution's
    state beyond ``conv_kernel``, ``None`` to leave it out)."""
    if never and c["n_linear"] == 0 or not depth:  # the hybrid is the full model / has the smaller depth's cache
        return None
    per_token = kv * c[heads] * c["head_dim"] * c["dtype_bytes"]  # one full layer's K and V for one position
    state = (c["n_heads_linear"] if state_heads else 1) * c["d_k"] * c["d_v"] * c[state_bytes]
    positions = 0 if conv is None else c["conv_kernel"] + conv
    per_layer = state + positions * c["n_heads_linear"] * (2 * c["d_k"] + c["d_v"]) * c["dtype_bytes"]
    if floor:
        return per_layer // per_token
    return _smallest(per_layer, per_token, max(c["n_linear"], 1) if once else 1, strict)


_OFF = "an off-by-one: "
#: (hint, the slip's variant of :func:`_break_even`), most specific first
_SLIPS = (
    ("a full layer caches a key AND a value per position and key/value head: 2 · n_kv_heads · head_dim numbers",
     dict(kv=1)),
    ("the state is per linear layer: every one of the n_linear layers keeps its own states, as every full layer "
     "keeps its own cache (the break-even does not depend on how many layers of each kind)", dict(once=True)),
    (_OFF + "the hybrid must be smaller, strictly (<): where the two are equal, at T = state / per-token cache, it "
            "is not yet smaller", dict(strict=False)),
    (_OFF + "the smallest T at which the hybrid is smaller is floor(x) + 1, not floor(x), the last at which it is not",
     dict(floor=True)),
    ("the KV cache is per key/value head: n_kv_heads, not the query heads n_heads", dict(heads="n_heads")),
    ("the recurrent state is kept in state_bytes per number (float32 in transformers), not dtype_bytes",
     dict(state_bytes="dtype_bytes")),
    ("a linear layer also keeps its short convolution's last conv_kernel inputs: q, k and v, "
     "n_heads_linear · (2 d_k + d_v) channels, in dtype_bytes", dict(conv=None)),
    ("the convolution's cache holds its last conv_kernel inputs, as transformers keeps them (the next step reads "
     "conv_kernel - 1 of them, but the cache holds one more)", dict(conv=-1)),
    ("the recurrent state is one d_k × d_v matrix per head: n_heads_linear · d_k · d_v numbers per layer",
     dict(state_heads=False)),
    ("the all-full-attention model has the same depth, n_full + n_linear layers, each caching every position",
     dict(depth=False)),
    ("with no linear layer the hybrid is the all-full-attention model: never smaller, return None",
     dict(never=False)),
)


def _config(n_full, n_linear, n_heads, n_kv_heads, head_dim, n_heads_linear, d_k, d_v, conv_kernel, dtype_bytes,
            state_bytes) -> dict:
    return dict(zip(KEYS, (n_full, n_linear, n_heads, n_kv_heads, head_dim, n_heads_linear, d_k, d_v, conv_kernel,
                           dtype_bytes, state_bytes)))


def _cases(g) -> list[dict]:
    """A Qwen3.5-sized model (its break-even exactly at a whole context), no linear layer, no full layer, a
    convolution of 1, a state in the cache's dtype, a break-even between two contexts, and fresh random ones."""
    cases = [_config(6, 18, 16, 4, 256, 32, 128, 128, 4, 2, 4), _config(4, 0, 8, 2, 64, 8, 64, 64, 4, 2, 4),
             _config(0, 4, 8, 4, 16, 4, 16, 16, 1, 4, 4), _config(2, 6, 8, 1, 64, 8, 32, 64, 1, 2, 2),
             _config(1, 3, 4, 2, 24, 6, 10, 14, 3, 2, 4), _config(3, 9, 12, 4, 128, 16, 64, 32, 4, 1, 4)]
    for _ in range(3):
        n_kv = randint(g, 1, 4)
        cases.append(_config(randint(g, 0, 8), randint(g, 1, 24), n_kv * randint(g, 2, 4), n_kv, 8 * randint(g, 1, 32),
                             randint(g, 1, 32), 8 * randint(g, 1, 16), 8 * randint(g, 1, 16), randint(g, 1, 4),
                             (1, 2, 4)[randint(g, 0, 2)], (2, 4)[randint(g, 0, 1)]))
    return cases


def _what(c: dict) -> str:
    return "break_even_context({" + ", ".join(f"{k!r}: {v}" for k, v in c.items()) + "})"


@exercise("21.3")
def check_break_even_context(answer) -> None:
    """Check ``answer(config: dict) -> int | None``: the shortest context at which the hybrid's memory is smaller."""
    cases = _cases(case_rng())
    got = []
    for c in cases:
        what = _what(c)
        out = run(answer, dict(c), what=what)
        expect(out is None or type(out) is int,
               f"{what} returned {out!r} ({type(out).__name__}): return a Python int, the number of positions"
               + (" (use int(...) on a computed float)" if isinstance(out, float) and out == out and abs(out) != float(
                   "inf") else "") + "; None when the hybrid is never smaller (not inf, 0 or -1)")
        got.append(out)
    wants = [_break_even(c) for c in cases]
    if got == wants:
        return
    names = [hint for hint, variant in _SLIPS if all(_break_even(c, **variant) == out for c, out in zip(cases, got))]
    first = next(i for i, (out, want) in enumerate(zip(got, wants)) if out != want)
    c = cases[first]
    if not names and wants[first] is None:
        names = [_SLIPS[-1][0]]
    named = (": " + "; or ".join(dict.fromkeys(names))) if names else (
        ": the hybrid keeps n_linear · (its states) + n_full · T · (a full layer's K and V per position) bytes, the "
        "all-full model (n_full + n_linear) · T · (K and V per position); find the smallest T where the first is "
        "smaller")
    expect(False, f"{_what(c)} returned {got[first]}, expected {wants[first]}{named}")
