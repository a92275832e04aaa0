"""Exercise checks for chapter 22 (long context and serving in practice).

* 22.1 ``check_reused_tokens``: ``reused_tokens(cached_prompts, prompt, page_size) -> int``, the positions of a
  new request's prompt that a vLLM-style prefix cache (every full page of the earlier prompts, keyed by the
  whole prefix up to its end) spares its prefill, the last token always run; attnlib's prefix allocator,
  paged cache and ``serve`` refused; a wrong count is explained by the slips that give the answer's count in
  every case.
* 22.2 ``check_kivi_keys``: ``kivi_keys(k, bits, group_size)``, KIVI's keys quantised per channel over groups of
  ``group_size`` tokens (asymmetric min-max, round to nearest) and read back, by hand (attnlib's quantisers and
  torch's quantisation functions refused); compared with a float64 reference, a level either side of an exact
  half allowed; constant channels, outlier channels, groups of one token.
* 22.3 ``check_snapkv_keep``: ``snapkv_keep(weights, window, budget, kernel_size)``, the prompt positions SnapKV
  keeps (:mod:`._ch22_snapkv`).

Every learner call goes through :func:`~attnlib.book.exercises._run.run`; besides fixed edge cases, the
random cases come from :func:`~attnlib.book.exercises._core.case_rng` (fresh each run).
"""
from __future__ import annotations

import torch

from attnlib.book.exercises._ch22_snapkv import check_snapkv_keep  # 22.3
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_int, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.cache import quantize
from attnlib.cache.paged import PagedKVCache
from attnlib.cache.prefix import PrefixPageAllocator
from attnlib.cache.quantized import Int8LayerCache, KIVILayerCache
from attnlib.serving import batching, scheduler

__all__ = ["check_kivi_keys", "check_reused_tokens", "check_snapkv_keep"]


# ---------------------------------------------------------------- 22.1
_BY_HAND_PREFIX = Refuse("compare the prompts yourself, without attnlib's prefix cache or serve",
                         PrefixPageAllocator, PagedKVCache, batching.serve, scheduler.run_schedule)


def _common(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _pages(cached: list[list[int]], prompt: list[int], P: int, rule) -> int:
    """Leading full pages of ``prompt`` for which ``rule(i, page)`` holds (a page lookup of the slips)."""
    n = 0
    while (n + 1) * P <= len(prompt) and rule(n, tuple(prompt[n * P:(n + 1) * P])):
        n += 1
    return n


def _reused_slips(cached: list[list[int]], prompt: list[int], P: int) -> list[tuple[str, int]]:
    """(hint, the count that slip gives), most specific first."""
    T = len(prompt)
    longest = max((_common(c, prompt) for c in cached), default=0)
    pages = longest // P
    at_index = {(i, tuple(c[i * P:(i + 1) * P])) for c in cached for i in range(len(c) // P)}
    anywhere = {page for _, page in at_index}
    by_prefix = ("a page is found by the whole prefix up to its end, not by its own tokens: the same tokens after "
                 "another prefix have other keys and values (a position's keys depend on every token before it)")
    return [
        (by_prefix, min(P * _pages(cached, prompt, P, lambda i, page: (i, page) in at_index), T - 1)),
        (by_prefix, min(P * _pages(cached, prompt, P, lambda i, page: page in anywhere), T - 1)),
        ("only full pages are cached and shared: round the shared prefix down to whole pages",
         min(longest, T - 1)),
        ("only full pages are cached and shared: round the shared prefix down to whole pages, not up",
         min(-(-longest // P) * P, T - 1)),
        ("the prompt's last token always goes through the model (its logits give the first new token): at most "
         "len(prompt) - 1 positions are reused", pages * P),
        ("when the whole prompt is cached only its last position is run again: its last page is shared and "
         "copied before that write (copy-on-write), so len(prompt) - 1 positions are reused, not a page fewer",
         (pages - 1) * P if pages * P == T else pages * P),
        ("return the number of positions (tokens) reused, not of pages", min(pages, T - 1)),
        ("the cache holds the full pages of every earlier prompt: take the longest match over all of them, not "
         "only the last prompt's", min(_common(cached[-1], prompt) // P * P, T - 1) if cached else 0),
        ("the cache holds the full pages of every earlier prompt: take the longest match over all of them, not "
         "only the first prompt's", min(_common(cached[0], prompt) // P * P, T - 1) if cached else 0),
    ]


def _reused(cached: list[list[int]], prompt: list[int], P: int) -> int:
    """The expected count, page by page: a page is reused when the prompt up to its end is an earlier prompt's."""
    keys = {tuple(c[:end]) for c in cached for end in range(P, len(c) + 1, P)}  # every full page's prefix
    n = 0
    while (n + 1) * P <= len(prompt) and tuple(prompt[:(n + 1) * P]) in keys:
        n += 1
    return min(n * P, len(prompt) - 1)


def _branches(g: torch.Generator) -> tuple[list[list[int]], list[int], int]:
    """Prompts that branch off one base at random points, over a small vocabulary (pages often repeat)."""
    P, vocab = randint(g, 1, 5), randint(g, 2, 4)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    base = tokens(randint(g, 4, 22))
    cached = [base[:randint(g, 0, len(base))] + tokens(randint(g, 0, 6)) for _ in range(randint(g, 1, 4))]
    cached = [c for c in cached if c] or [base]
    if randint(g, 0, 3) == 0:  # a prompt met before, whole
        prompt = list(cached[randint(g, 0, len(cached) - 1)])
    else:
        prompt = base[:randint(g, 0, len(base))] + tokens(randint(g, 0, 6))
    return cached, prompt or tokens(1), P


def _reused_cases(g: torch.Generator) -> list[tuple[list[list[int]], list[int], int]]:
    """Fixed edges (an empty cache, a whole prompt cached, a partial page, a page met after another prefix, a
    match with an earlier prompt only, pages of one token, a one-token prompt) and fresh random cases."""
    cases = [([], [1, 2, 3, 4, 5], 4),
             ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 8], 4),  # the whole prompt: 7
             ([[1, 2, 3, 4, 5, 6, 7, 8, 9]], [1, 2, 3, 4, 5, 6, 7, 8], 4),  # the whole prompt, inside a longer one
             ([[1, 2, 3, 4, 5, 6]], [1, 2, 3, 4, 5, 6, 7, 8, 9], 4),  # the earlier prompt's last page is partial
             ([[1, 2, 3, 4, 0, 0, 0, 0], [9, 9, 9, 9, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 8, 9], 4),  # page 1 elsewhere
             ([[1, 2, 3, 4, 7], [5, 6, 7, 8, 1, 1, 1, 1]], [1, 2, 3, 4, 5, 6, 7, 8, 2], 4),  # page 1 as another's page 0
             ([[7, 7], [1, 2, 3, 4, 5, 6, 3], [1, 2, 9]], [1, 2, 3, 4, 5, 6, 8, 8], 2),  # the middle prompt matches
             ([[3, 1, 4, 1, 5]], [3, 1, 4, 2], 1),
             ([[1, 2, 3, 4, 5]], [1, 2, 3], 4),  # a prompt shorter than a page
             ([[5]], [5], 1)]  # one token, cached: it still runs
    return cases + [_branches(g) for _ in range(4)]


@exercise("22.1")
def check_reused_tokens(answer) -> None:
    """Check ``answer(cached_prompts, prompt, page_size) -> int``: the positions a prefix cache spares the prefill."""
    cases = _reused_cases(case_rng())
    counts = []
    for cached, prompt, P in cases:
        what = f"reused_tokens({cached}, {prompt}, page_size={P})"
        counts.append(expect_int(run(answer, [list(c) for c in cached], list(prompt), P, what=what,
                                     refuse=_BY_HAND_PREFIX), what))
    wants = [_reused(*case) for case in cases]
    if counts == wants:
        return
    table = [_reused_slips(*case) for case in cases]  # the slips that give the answer's count in every case
    hints = [table[0][i][0] for i in range(len(table[0])) if all(t[i][1] == c for t, c in zip(table, counts))]
    first = next(i for i, (c, w) in enumerate(zip(counts, wants)) if c != w)
    cached, prompt, P = cases[first]
    named = (": " + "; or ".join(dict.fromkeys(hints))) if hints else (
        ": a page is reused when the prompt up to the page's end equals an earlier prompt's first tokens")
    expect(False, f"reused_tokens({cached}, {prompt}, page_size={P}) returned {counts[first]}, expected "
                  f"{wants[first]}{named}")


# ---------------------------------------------------------------- 22.2
_BY_HAND_QUANT = Refuse(
    "quantise by hand, without attnlib's quantisers or torch's quantisation functions",
    quantize.quantize_minmax, quantize.dequantize_minmax, quantize.quantize_absmax, quantize.dequantize_absmax,
    KIVILayerCache, Int8LayerCache, torch.quantize_per_channel, torch.quantize_per_tensor,
    torch.fake_quantize_per_channel_affine, torch.fake_quantize_per_tensor_affine)


def _grouped(k: torch.Tensor, G: int) -> torch.Tensor:
    B, H, T, d = k.shape
    return k.double().reshape(B, H, T // G, G, d)  # (B, H, groups, G, d): a group's tokens on dim -2


def _minmax(x: torch.Tensor, bits: int, dim: int, levels: int | None = None, how=torch.round,
            clamp: bool = True) -> torch.Tensor:
    """x read back after asymmetric quantisation along ``dim`` (float64); the slips change the levels or rounding."""
    L = levels if levels is not None else 2**bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / L
    q = how(torch.where(scale > 0, (x - lo) / torch.where(scale > 0, scale, 1), 0))
    return lo + (q.clamp(0, 2**bits - 1) if clamp else q) * scale


def _kivi_slips(k: torch.Tensor, bits: int, G: int) -> dict[str, torch.Tensor]:
    """What the usual slips read back (float64, ``k``'s shape), keyed by the hint."""
    B, H, T, d = k.shape
    x = _grouped(k, G)
    L, half = 2**bits - 1, 2**(bits - 1) - 1
    absmax = x.abs().amax(-2, keepdim=True)
    s = absmax / max(half, 1)
    symmetric = torch.where(s > 0, (x / torch.where(s > 0, s, 1)).round().clamp(-half, half) * s, 0)
    step = (x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)) / L
    zero_point = torch.where(step > 0, (-x.amin(-2, keepdim=True) / torch.where(step > 0, step, 1)).round(), 0)
    integer_zero = (torch.where(step > 0, (x / torch.where(step > 0, step, 1)).round(), 0) + zero_point).clamp(0, L)
    two_bits = ("the levels are 0 … 2^bits - 1: scale = (max - min) / (2^bits - 1), so that min and max are both "
                "levels; dividing by 2^bits leaves the max between two levels")
    slips = {
        "keys are quantised per channel: a scale and zero point for each channel over a group of group_size "
        "tokens (reduce over the tokens), not per token over its channels (that is KIVI's values)":
            _minmax(k.double(), bits, -1),
        "a channel gets one scale per group of group_size tokens, not one over all T tokens":
            _minmax(k.double(), bits, -2),
        "KIVI is asymmetric: zero point = the group's min, scale = (max - min) / (2^bits - 1), levels 0 … "
        "2^bits - 1, not a symmetric scale max|x| / (2^(bits-1) - 1)": symmetric,
        two_bits: _minmax(x, bits, -2, levels=2**bits),
        two_bits + " (and a code of 2^bits does not fit in bits)": _minmax(x, bits, -2, levels=2**bits, clamp=False),
        "round to the nearest level (torch.round), not down": _minmax(x, bits, -2, how=torch.floor),
        "KIVI's zero point is the group's min itself, a float, not rounded to an integer code as in integer "
        "inference's affine quantisation": (integer_zero - zero_point) * step,
    }
    return {hint: value.reshape(B, H, T, d) if value.dim() == 5 else value for hint, value in slips.items()}


def _kivi_cases(g: torch.Generator) -> list[dict]:
    """(B, H, T, d), group_size, bits, dtype, and what to do: constant channels, outliers, groups of one token."""
    f32, f64 = torch.float32, torch.float64
    cases = [dict(size=(1, 1, 4, 2), G=4, bits=2, dtype=f32),
             dict(size=(2, 2, 12, 4), G=4, bits=2, dtype=f32, constant=True),  # constant channels: read back exactly
             dict(size=(1, 3, 16, 8), G=8, bits=4, dtype=f32, outlier=True),  # a channel 20 times the others
             dict(size=(1, 2, 6, 3), G=1, bits=2, dtype=f32),  # a group of one token: every channel constant
             dict(size=(2, 1, 9, 5), G=3, bits=4, dtype=f64, constant=True, outlier=True)]
    for _ in range(3):
        G = randint(g, 1, 8)
        cases.append(dict(size=(randint(g, 1, 2), randint(g, 1, 3), G * randint(g, 1, 4), randint(g, 1, 8)), G=G,
                          bits=(2, 4)[randint(g, 0, 1)], dtype=(f32, f64)[randint(g, 0, 1)],
                          constant=randint(g, 0, 1) == 1, outlier=randint(g, 0, 1) == 1))
    return cases


def _keys(g: torch.Generator, case: dict) -> torch.Tensor:
    B, H, T, d = case["size"]
    k = torch.randn(B, H, T, d, generator=g, dtype=torch.float64) + torch.randn(d, generator=g, dtype=torch.float64)
    if case.get("outlier"):
        k[..., randint(g, 0, d - 1)] *= 20  # KIVI's reason for per-channel keys
    if case.get("constant"):  # one channel constant over the first group, another over every token
        G = case["G"]
        k[..., :G, randint(g, 0, d - 1)] = 0.75
        k[..., randint(g, 0, d - 1)] = -1.5
    return k.to(case["dtype"])


@exercise("22.2")
def check_kivi_keys(answer) -> None:
    """Check ``answer(k (B, H, T, d), bits, group_size) -> (B, H, T, d)``: KIVI's keys quantised and read back."""
    g = case_rng()
    for case in _kivi_cases(g):
        k, G, bits = _keys(g, case), case["G"], case["bits"]
        what = f"kivi_keys(k {tuple(k.shape)} {k.dtype}, bits={bits}, group_size={G})"
        got = run(answer, k, bits, G, what=what, refuse=_BY_HAND_QUANT)
        expect_tensor(got, what, shape=tuple(k.shape))
        expect(got.dtype == k.dtype, f"{what} has dtype {got.dtype}: return the keys read back (codes times scale "
                                     f"plus zero point) in k's dtype, {k.dtype}")
        expect(not got.isnan().any(), f"{what} has NaN: a channel constant over a group has max = min, a scale of "
                                      "0; give it code 0 (it reads back exactly as the min) instead of dividing by 0")
        # the expected keys, after the answer ran: float64, and a level either side where rounding is a tie
        x = _grouped(k, G)
        lo, L = x.amin(-2, keepdim=True), 2**bits - 1
        scale = (x.amax(-2, keepdim=True) - lo) / L
        r = torch.where(scale > 0, (x - lo) / torch.where(scale > 0, scale, 1), 0)
        below, above = ((lo + (r + e).round().clamp(0, L) * scale).reshape(k.shape) for e in (-1e-4, 1e-4))
        tol = 1e-5 * max(1.0, k.abs().max().item())  # float32 arithmetic on keys of this size
        diff = torch.minimum((got.double() - below).abs(), (got.double() - above).abs())
        if bool((diff <= tol).all()):
            exact = (scale == 0).expand_as(x).reshape(k.shape)
            expect(torch.equal(got[exact], k[exact]), f"{what}: a channel constant over a group must read back "
                                                      "exactly (its code is 0 and its zero point the value)")
            continue
        for hint, value in _kivi_slips(k, bits, G).items():
            if not torch.allclose(value, below, atol=tol, rtol=0):
                expect(not torch.allclose(got.double(), value, atol=tol, rtol=0), f"{what}: {hint}")
        at = tuple(int(i) for i in (diff > tol).nonzero()[0])
        expect(False, f"{what} differs from the expected keys by up to {diff.max().item():.3g}; first at index "
                      f"{at}: {got[at].item():.6g}, expected {below[at].item():.6g} (the channel's min over the "
                      f"group plus round((x - min) / scale) · scale, scale = (max - min) / (2^bits - 1))")
