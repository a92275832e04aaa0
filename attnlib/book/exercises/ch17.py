"""Exercise checks for chapter 17 (long context).

* 17.1 ``check_ntk_base``: ``ntk_base(base, head_dim, factor)``, the base of NTK-aware RoPE
  scaling (bloc97 2023) that leaves the fastest pair alone and slows the slowest one by
  ``factor``; checked exactly (relative 1e-9) and against attnlib's dynamic NTK frequencies.
* 17.2 ``check_pattern_cache_bytes``: ``pattern_cache_bytes(windows, n_kv_heads, head_dim,
  seq_len, dtype, batch_size)``, the KV-cache bytes of a model whose layers have the given
  windows (``None`` = global), checked against bytes held by real cache tensors.
* 17.3 ``check_streaming_keys``: ``streaming_keys(position, window, n_sink)``, the absolute
  positions of the keys that the token at ``position`` attends to through a StreamingLLM cache
  (Xiao et al. 2023), checked against :class:`attnlib.cache.SinkLayerCache` filled token by token.
* 17.4 ``check_softcap_grad``: ``softcap_grad(scores, cap)``, the derivative of Gemma 2's soft-cap
  ``cap · tanh(s / cap)``, checked against autograd.
* 17.5 ``check_yarn_frequencies``: ``yarn_frequencies(head_dim, base, factor, original_length,
  beta_fast, beta_slow)``, YaRN's frequencies and attention factor (Peng et al. 2023, §3.2-3.4, as
  its reference code and ``transformers`` compute them), checked against
  :func:`attnlib.positional.rope_frequencies`.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._core import NotSolved, exercise, expect
from attnlib.cache import LayerCache, RingLayerCache, SinkLayerCache
from attnlib.positional import rope_frequencies

__all__ = ["check_ntk_base", "check_pattern_cache_bytes", "check_softcap_grad", "check_streaming_keys",
           "check_yarn_frequencies"]


# ---------------------------------------------------------------- 17.1
@exercise("17.1")
def check_ntk_base(ntk_base) -> None:
    """Check ``ntk_base(base, head_dim, factor) -> float`` = ``base · factor^(d / (d - 2))``."""
    cases = [(10000.0, 128, 4.0), (10000.0, 16, 8.0), (500000.0, 64, 2.5), (1e6, 128, 16.0), (10000.0, 4, 2.0),
             (10000.0, 64, 1.0), (20000.0, 32, 3.0)]
    for base, d, s in cases:
        got = ntk_base(base, d, s)
        if got is None:
            raise NotSolved("return the new base as a float, not None")
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        expect(isinstance(got, (int, float)) and not isinstance(got, bool),
               f"return a number (the new base); got {type(got).__name__}")
        expected = base * s ** (d / (d - 2))
        case = f"ntk_base(base={base:g}, head_dim={d}, factor={s:g}) = {got:.6g}, expected {expected:.6g}"
        if math.isclose(got, expected, rel_tol=1e-9):
            continue

        def close(x, got=got):
            return math.isclose(got, x, rel_tol=1e-9)

        expect(not close(base * s),
               f"{case}: with base * factor the slowest pair (exponent (d_h - 2)/d_h) is slowed by only "
               "factor**((d_h - 2)/d_h); raise factor to the power that makes it exactly factor")
        expect(not close(base * s ** ((d - 2) / d)),
               f"{case}: the exponent is upside down: theta_last = base**(-(d_h - 2)/d_h), so the base "
               "must grow by factor**(d_h/(d_h - 2)) for theta_last to shrink by factor")
        expect(not close(base / s ** (d / (d - 2))) and not close(base / s),
               f"{case}: a smaller base makes every pair turn faster; to slow the slow pairs down the base grows")
        expect(not close(base * s ** (d / 2)),
               f"{case}: base**(-2i/d_h) for the slowest pair has i = d_h/2 - 1, not d_h/2 (its exponent is "
               "(d_h - 2)/d_h, not 1)")
        plain = base ** (-(d - 2) / d)
        slowed = plain / got ** (-(d - 2) / d) if got > 0 else float("nan")
        expect(False, f"{case}: with your base the slowest pair turns {slowed:.4g} times slower, not factor={s:g} "
                      "times; the fastest pair (i = 0) never changes")
    # the same base as transformers' / attnlib's dynamic NTK at seq_len = factor * L (factor field 1.0)
    ours, _ = rope_frequencies(64, 10000.0, {"rope_type": "dynamic", "factor": 1.0}, 100, seq_len=400)
    mine = 1.0 / float(ntk_base(10000.0, 64, 4.0)) ** (torch.arange(0, 64, 2).float() / 64)
    expect(torch.allclose(mine, ours, rtol=1e-5), "your base does not give dynamic NTK's frequencies at 4 x L")


# ---------------------------------------------------------------- 17.3
def _streaming_reference(position: int, window: int, n_sink: int) -> list[int]:
    """Fill a SinkLayerCache token by token (key = its position) and read what the last token sees."""
    cache = SinkLayerCache(block_size=position + 1, window=window, n_sink=n_sink)
    for p in range(position + 1):
        (keys,) = cache.update(torch.full((1, 1, 1), float(p)))  # (B, T_new, width) = (1, 1, 1)
    at = cache.key_positions  # (n_keys,) the positions of the returned keys; the query is the last
    visible = cache.mask_mod(None, None, at[-1:, None], at[None, :])[0]  # the cache's own rule: (n_keys,)
    return sorted(int(k) for k in keys.flatten()[visible].tolist())


@exercise("17.3")
def check_streaming_keys(streaming_keys) -> None:
    """Check ``streaming_keys(position, window, n_sink) -> list[int]`` against a SinkLayerCache."""
    cases = [(0, 4, 2), (3, 4, 2), (5, 4, 2), (10, 4, 2), (100, 8, 4), (9, 5, 0), (6, 3, 3), (2, 8, 4), (37, 6, 1)]
    for position, window, n_sink in cases:
        got = streaming_keys(position, window, n_sink)
        if got is None:
            raise NotSolved("return the list of key positions, not None")
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        expect(isinstance(got, (list, tuple)) and all(isinstance(p, int) and not isinstance(p, bool) for p in got),
               f"return a list of ints (absolute positions); got {got!r}")
        got = list(got)
        expected = _streaming_reference(position, window, n_sink)
        case = f"streaming_keys(position={position}, window={window}, n_sink={n_sink}) = {got}, expected {expected}"
        if got == expected:
            continue
        expect(len(got) == len(set(got)),
               f"{case}: a position that is both a sink and in the window is one key: list it once")
        expect(got == sorted(got), f"{case}: list the positions in ascending order")
        expect(not (got == list(range(len(got))) and len(expected) == len(got) and expected != got),
               f"{case}: absolute positions in the stream, not the positions 0, 1, ... that the cache renumbers "
               "them to for RoPE")
        expect(position in got, f"{case}: the token attends to itself (its own key is in the window)")
        expect(all(p <= position for p in got), f"{case}: a sink exists only once its token has arrived "
                                                 "(positions after the current one are not keys)")
        recent = [p for p in got if p >= n_sink]
        expect(not (n_sink and not any(p < n_sink for p in got) and position >= n_sink),
               f"{case}: the first n_sink={n_sink} tokens are never evicted: they are the attention sinks")
        expect(not (recent and min(recent) == position - window and position - window >= n_sink),
               f"{case}: the window counts the token itself: positions position - window + 1 ... position "
               f"({window} keys), not {window + 1}")
        expect(not (recent and min(recent) == position - window + n_sink + 1 and n_sink),
               f"{case}: the window is the recent positions besides the sinks: a cache of n_sink + window "
               "positions, not window in all")
        expect(not (recent and min(recent) == position - window + 2 and position - window + 2 > n_sink),
               f"{case}: the window holds window={window} keys, the token itself and the {window - 1} before "
               f"it (position - window + 1 ... position), not {window - 1}")
        expect(False, f"{case}: the sinks 0 ... n_sink - 1, then position - window + 1 ... position")


# ---------------------------------------------------------------- 17.2
def _held(cache: LayerCache) -> int:
    """Bytes of the positions the cache holds (a ring buffer's all, a plain cache's filled part)."""
    total = 0
    for buffer in cache.buffers:
        n = min(cache.length, buffer.shape[-2])
        total += buffer[..., :n, :].numel() * buffer.element_size()
    return total


def _measured(windows, n_kv_heads, head_dim, T, dtype, B) -> int:
    total = 0
    for w in windows:
        cache = LayerCache(T) if w is None else RingLayerCache(T, w)
        k = torch.zeros(B, n_kv_heads, T, head_dim, dtype=dtype)
        cache.update(k, k.clone())  # the whole context at once (a prefill)
        total += _held(cache)
    return total


@exercise("17.2")
def check_pattern_cache_bytes(pattern_cache_bytes) -> None:
    """Check ``pattern_cache_bytes(windows, n_kv_heads, head_dim, seq_len, dtype, batch_size) -> int``."""
    cases = [  # (windows, n_kv_heads, head_dim, T, dtype, B)
        ([5, 5, 5], 3, 8, 40, torch.float64, 1),
        ([16] * 5 + [None] + [16] * 5 + [None], 2, 8, 100, torch.float32, 1),
        ([None, 8, None, 8], 4, 16, 6, torch.bfloat16, 2),  # T < window
        ([8, None] * 3, 1, 32, 50, torch.float16, 3),
        ([None, 4, 12, 30, None], 2, 4, 20, torch.float32, 2),  # windows of several sizes
        ([None, None], 2, 8, 9, torch.bfloat16, 1),
    ]
    for windows, n_kv, hd, T, dtype, B in cases:
        got = pattern_cache_bytes(list(windows), n_kv, hd, T, dtype, B)
        if got is None:
            raise NotSolved("return the number of bytes as an int, not None")
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"return a Python int (bytes); got {type(got).__name__} {got!r}")
        expected = _measured(windows, n_kv, hd, T, dtype, B)
        case = (f"windows={windows}, n_kv_heads={n_kv}, head_dim={hd}, seq_len={T}, dtype={dtype}, "
                f"batch_size={B}: {got:,} bytes, the caches hold {expected:,}")
        if got == expected:
            continue
        per = n_kv * hd * dtype.itemsize * B  # one position of K (or V) in one layer
        kept = [T if w is None else min(w, T) for w in windows]
        expect(got != sum(kept) * per, f"{case}: each layer keeps a key AND a value per position (x 2)")
        expect(got != 2 * per * sum(T if w is None else w for w in windows),
               f"{case}: a local layer holds min(seq_len, window) positions: fewer than its window "
               "while the text is shorter")
        expect(got != 2 * per * T * len(windows),
               f"{case}: a local layer keeps only its window, not the whole context")
        expect(got != 2 * n_kv * hd * 2 * B * sum(kept),
               f"{case}: use dtype's element size (dtype.itemsize: {dtype.itemsize} bytes), not 2")
        expect(got != 2 * n_kv * hd * dtype.itemsize * sum(kept),
               f"{case}: there are batch_size={B} sequences, each with its own cache")
        expect(got != 2 * per * sum(T if w is None else min(w + 1, T) for w in windows),
               f"{case}: a window of w keeps w positions (the newest token included), not w + 1")
        expect(False, f"{case}: sum over layers of 2 x n_kv_heads x head_dim x itemsize x batch_size x "
                      "(seq_len, or min(window, seq_len))")


# ---------------------------------------------------------------- 17.4
@exercise("17.4")
def check_softcap_grad(softcap_grad) -> None:
    """Check ``softcap_grad(scores, cap) -> d/ds [cap · tanh(s / cap)]`` against autograd (float64)."""
    g = torch.Generator().manual_seed(17)
    for cap, spread in [(50.0, 80.0), (5.0, 10.0), (1.0, 3.0), (0.3, 1.0), (30.0, 100.0)]:
        scores = (torch.randn(2, 3, 7, 7, generator=g, dtype=torch.float64) * spread)
        before = scores.clone()
        got = softcap_grad(scores, cap)
        if got is None:
            raise NotSolved("return the derivative, a tensor shaped like scores, not None")
        case = f"cap={cap:g}"
        expect(torch.equal(scores, before), f"{case}: your code changed scores in place")
        expect(isinstance(got, torch.Tensor) and got.shape == scores.shape,
               f"{case}: return a tensor shaped like scores {tuple(scores.shape)}; got {getattr(got, 'shape', got)}")
        s = scores.clone().requires_grad_(True)
        (cap * torch.tanh(s / cap)).sum().backward()
        expected = s.grad
        got = got.detach().double()
        if torch.allclose(got, expected, rtol=1e-6, atol=1e-9):
            continue
        t = torch.tanh(scores / cap)

        def close(x, got=got):
            return torch.allclose(got, x, rtol=1e-6, atol=1e-9)

        expect(not close(cap * (1 - t**2)),
               f"{case}: chain rule: d/ds tanh(s/cap) = (1 - tanh^2(s/cap)) / cap, and the 1/cap cancels the "
               "cap in front")
        expect(not close(1 - torch.tanh(scores) ** 2), f"{case}: the tanh is of s / cap, not of s")
        expect(not close(1 / torch.cosh(scores / cap)),
               f"{case}: the derivative of tanh is sech^2 = 1 / cosh^2 = 1 - tanh^2 (squared)")
        expect(not close(torch.where(scores == 0, torch.ones_like(t), cap * t / scores)),
               f"{case}: cap * tanh(s/cap) / s is the slope from the origin (the secant), not the derivative")
        expect(False, f"{case}: differs from autograd's derivative by {(got - expected).abs().max().item():.3g}")


# ---------------------------------------------------------------- 17.5
def _yarn_variant(head_dim: int, base: float, factor: float, L: int, beta_fast: float, beta_slow: float, *,
                  ramp_in_turns: bool = False, rounded: bool = True, clamped: bool = True,
                  reversed_bands: bool = False) -> torch.Tensor:
    """YaRN's frequencies, or one of the ways of getting them wrong (to name a learner's mistake)."""
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def pair(turns: float) -> float:  # the pair index that makes `turns` turns in L tokens
        return head_dim * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(base))

    if ramp_in_turns:  # the paper's gamma(r), linear in r = L / wavelength
        ramp = 1 - (L * theta / (2 * math.pi) - beta_slow) / (beta_fast - beta_slow)
    else:
        low, high = pair(beta_fast), pair(beta_slow)
        if rounded:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = (torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)
    if clamped:
        ramp = ramp.clamp(0, 1)
    if reversed_bands:
        ramp = 1 - ramp
    return theta / factor * ramp + theta * (1 - ramp)  # ramp 0: kept, 1: divided by factor


@exercise("17.5")
def check_yarn_frequencies(yarn_frequencies) -> None:
    """Check ``yarn_frequencies(head_dim, base, factor, original_length, beta_fast, beta_slow)``.

    It must return ``(inv_freq, attention_factor)``: YaRN's frequencies ``(head_dim / 2,)`` and the
    factor on cos and sin, equal to :func:`attnlib.positional.rope_frequencies` (which equals
    ``transformers``' ``_compute_yarn_parameters``) for several heads, bases, factors and lengths.
    """
    cases = [  # (head_dim, base, factor, original_length, beta_fast, beta_slow)
        (128, 500000.0, 8.0, 8192, 32.0, 1.0),  # Llama 3.1's heads
        (16, 10000.0, 4.0, 32, 32.0, 1.0),  # the chapter's experiment: the fast edge below pair 0
        (64, 10000.0, 16.0, 2048, 32.0, 1.0),
        (128, 1e6, 4.0, 4096, 16.0, 2.0),
        (32, 10000.0, 2.5, 512, 32.0, 1.0),
        (64, 500000.0, 8.0, 1024, 8.0, 0.5),
    ]
    for d, base, s, L, fast, slow in cases:
        got = yarn_frequencies(d, base, s, L, fast, slow)
        if got is None:
            raise NotSolved("return (inv_freq, attention_factor), not None")
        expect(isinstance(got, tuple) and len(got) == 2,
               f"return a pair (inv_freq, attention_factor); got {type(got).__name__}")
        inv_freq, factor = got
        if isinstance(factor, torch.Tensor) and factor.numel() == 1:
            factor = factor.item()
        expect(isinstance(inv_freq, torch.Tensor) and inv_freq.shape == (d // 2,),
               f"inv_freq: a tensor of head_dim / 2 = {d // 2} frequencies; got {getattr(inv_freq, 'shape', inv_freq)}")
        expect(isinstance(factor, (int, float)) and not isinstance(factor, bool),
               f"attention_factor: a float; got {type(factor).__name__}")
        case = (f"yarn_frequencies(head_dim={d}, base={base:g}, factor={s:g}, original_length={L}, "
                f"beta_fast={fast:g}, beta_slow={slow:g})")
        rope_scaling = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L,
                        "beta_fast": fast, "beta_slow": slow}
        expected, expected_factor = rope_frequencies(d, base, rope_scaling)
        mine = inv_freq.detach().double()
        # the factor first: it does not depend on the frequencies
        if not math.isclose(factor, expected_factor, rel_tol=1e-6):
            expect(not math.isclose(factor, 1.0),
                   f"{case}: attention_factor = 1.0, but YaRN also multiplies cos and sin by 0.1 ln(factor) + 1 "
                   f"= {expected_factor:.4f} (temperature: sharper softmax at the longer length)")
            expect(not math.isclose(factor, expected_factor**2, rel_tol=1e-6),
                   f"{case}: attention_factor = {factor:.4f} is the factor on the scores (1/t); cos and sin "
                   f"each take its square root, 0.1 ln(factor) + 1 = {expected_factor:.4f}")
            expect(not math.isclose(factor, 0.1 * math.log10(s) + 1, rel_tol=1e-6),
                   f"{case}: attention_factor uses the natural logarithm, ln(factor), not log10")
            expect(False, f"{case}: attention_factor = {factor:.6g}, expected 0.1 ln(factor) + 1 = "
                          f"{expected_factor:.6g}")
        if torch.allclose(mine, expected.double(), rtol=1e-5, atol=0):
            continue

        def close(mine=mine, args=(d, base, s, L, fast, slow), **variant):
            return torch.allclose(mine, _yarn_variant(*args, **variant), rtol=1e-5, atol=0)

        plain = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        expect(not torch.allclose(mine, plain / s, rtol=1e-5, atol=0),
               f"{case}: every pair divided by factor is linear scaling (position interpolation); YaRN keeps "
               "the fast pairs (more than beta_fast turns in original_length) unchanged")
        expect(not close(reversed_bands=True),
               f"{case}: the bands are swapped: the fast pairs (many turns in original_length) are kept and "
               "the slow pairs (fewer than beta_slow turns) are divided by factor, not the other way round")
        expect(not close(ramp_in_turns=True),
               f"{case}: a ramp linear in the number of turns r is the paper's gamma(r); the reference code "
               "(and transformers) ramps linearly over the pair index i, between the band edges")
        expect(not close(rounded=False),
               f"{case}: round the band edges outward to whole pairs first: floor for the fast edge "
               "(beta_fast), ceil for the slow edge (beta_slow)")
        expect(not close(clamped=False),
               f"{case}: clamp the ramp to [0, 1]: pairs outside the two edges are kept or divided by factor, "
               "not extrapolated along the ramp")
        worst = int((mine / expected.double() - 1).abs().argmax())
        expect(False, f"{case}: pair {worst} turns at {mine[worst].item():.6g} radians per position, expected "
                      f"{expected[worst].item():.6g}")
