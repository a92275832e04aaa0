"""Exercise checks for chapter 08 (the KV cache).

* 08.1 ``check_ring_cache``: a rolling-window cache (a ring buffer of ``window`` positions)
  that hands a new query the keys and values of the last ``window`` positions, checked
  against sliding-window causal attention over the whole sequence.
* 08.2 ``check_cached_attention``: the outputs of the newest tokens, attending over cached
  keys and values (bottom-right causal mask, shared key/value heads), checked against the
  last rows of full causal attention.
* 08.3 ``check_kv_cache_bytes``: the bytes a :class:`attnlib.cache.KVCache` holds for a
  batch of sequences, for every attention variant and dtype, checked against the bytes
  measured on the cache tensors the layers allocate.
* 08.4 ``check_chunked_prefill``: a prompt fed in chunks through one
  :class:`attnlib.cache.KVCache` gives the logits of one forward pass.

Every learner call goes through :func:`run`; each check has fixed edge cases and fresh ones
drawn from :func:`case_rng`.
"""
from __future__ import annotations

import math

import torch

from attnlib.attention import attention, causal_mask
from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    case_rng,
    exercise,
    expect,
    expect_close,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import run

__all__ = [
    "check_cached_attention",
    "check_chunked_prefill",
    "check_kv_cache_bytes",
    "check_ring_cache",
]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(
        a.double(), b.double(), atol=1e-5, rtol=1e-4
    )


# ---------------------------------------------------------------- 08.1
def _ring_cases(g: torch.Generator) -> list:
    """(leading shape, width, window, steps, dtype): fixed edges, then a fresh case."""
    window = randint(g, 2, 6)
    return _RING_CASES + [((randint(g, 1, 3), randint(g, 1, 3)), randint(g, 1, 5), window,
                           window + randint(g, 1, 2 * window), torch.float32)]


_RING_CASES = [  # (leading shape, width, window, steps, dtype)
    ((2, 3), 4, 4, 11, torch.float32),  # (B, n_heads, T, head_dim)
    ((1,), 5, 3, 8, torch.float64),  # (B, T, width), like MLA's latent
    ((2, 1), 2, 1, 4, torch.float32),  # a window of one position
    ((1, 2), 3, 6, 5, torch.float32),  # never fills
    ((3, 2), 4, 5, 13, torch.float64),
]


def _window_reference(q, k, v, t, window):
    """Output of query t attending over keys max(0, t - window + 1) .. t (one head per row)."""
    lo = max(0, t - window + 1)
    return attention(q, k[..., lo : t + 1, :], v[..., lo : t + 1, :])[0]


def _ring_call(cache, k, v, step):
    out = run(cache.update, k, v, what=step)
    if out is None:
        raise NotSolved("update(k, v) should return (k_win, v_win), not None")
    expect(
        isinstance(out, (tuple, list))
        and len(out) == 2
        and all(type(t) is torch.Tensor for t in out),
        f"{step}: update(k, v) should return a pair of tensors (k_win, v_win); "
        f"got {type(out).__name__}",
    )
    return out[0], out[1]


@exercise("08.1")
def check_ring_cache(ring_cache_class) -> None:
    """Check ``RingCache(window).update(k, v) -> (k_win, v_win)`` against windowed attention."""
    # first: two caches of a window no other case uses must not share state
    first, second = run(ring_cache_class, 7, what="RingCache(7)"), run(ring_cache_class, 7, what="RingCache(7)")
    _ring_call(first, torch.ones(1, 1, 2), torch.ones(1, 1, 2), "two caches")
    k2, _ = _ring_call(second, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), "two caches")
    expect(
        not bool((k2 == 1).any()),  # the first cache's key is not in the second's window
        "updating one RingCache changed another; keep the ring and the count on the "
        "instance (self), not on the class",
    )
    g = case_rng()
    for lead, width, window, steps, dtype in _ring_cases(g):
        cache = run(ring_cache_class, window, what=f"RingCache({window})")
        k = torch.randn(*lead, steps, width, generator=g, dtype=dtype)
        v = torch.randn(*lead, steps, width, generator=g, dtype=dtype)
        q = torch.randn(*lead, steps, width, generator=g, dtype=dtype)
        storage = None
        for t in range(steps):
            k_t, v_t = k[..., t : t + 1, :].clone(), v[..., t : t + 1, :].clone()
            step = (
                f"RingCache(window={window}), update {t + 1} (position {t}) of shape "
                f"{tuple(k_t.shape)}"
            )
            k_win, v_win = _ring_call(cache, k_t, v_t, step)
            n = min(t + 1, window)
            expect(
                k_win.dtype == dtype and v_win.dtype == dtype,
                f"{step}: the cache returned {k_win.dtype}, but was given {dtype}; allocate "
                "the buffers with the dtype (and device) of the first tensors",
            )
            expect(
                tuple(k_win.shape[:-2]) == tuple(lead)
                and k_win.shape[-1] == width
                and tuple(v_win.shape) == tuple(k_win.shape),
                f"{step}: returned shapes {tuple(k_win.shape)} and {tuple(v_win.shape)}; "
                f"expected (..., positions, {width}) with leading shape {tuple(lead)} "
                "(the time axis is -2)",
            )
            if k_win.shape[-2] == window and n < window:
                raise Wrong(
                    f"{step}: you returned all {window} slots while only {n} are filled; the "
                    "empty slots (zeros) would still get softmax weight. Return the filled "
                    "ones, buffer[..., :t + 1, :], until the window is full"
                )
            if k_win.shape[-2] > window:
                raise Wrong(
                    f"{step}: you returned {k_win.shape[-2]} positions, more than the "
                    f"window of {window}: keep only `window` slots, overwriting the oldest "
                    "(position t goes to slot t % window)"
                )
            if k_win.shape[-2] != n:
                raise Wrong(
                    f"{step}: you returned {k_win.shape[-2]} positions; a window of {window} "
                    f"after {t + 1} updates holds {n} (off by one? the window includes the new "
                    "position)"
                )
            got = attention(q[..., t : t + 1, :], k_win, v_win)[0]  # order does not matter
            expected = _window_reference(q[..., t : t + 1, :], k, v, t, window)
            if not _close(got, expected):
                for other in (window - 1, window + 1):
                    if other >= 1 and _close(
                        got, _window_reference(q[..., t : t + 1, :], k, v, t, other)
                    ):
                        raise Wrong(
                            f"{step}: your cache hands attention the last {other} positions, "
                            f"not the last {window}: off by one"
                        )
                raise Wrong(
                    f"{step}: the returned keys/values are not those of the last {n} "
                    f"positions ({max(0, t - window + 1)}..{t}); position t belongs in slot "
                    "t % window, replacing the oldest one, and the slots to return are the "
                    "filled ones, buffer[..., :t + 1, :], until the ring is full"
                )
            full_bytes = math.prod(lead) * window * width * k_t.element_size()
            nbytes = k_win.untyped_storage().nbytes()
            expect(
                nbytes <= 2 * full_bytes,
                f"{step}: the returned keys live in {nbytes} bytes of memory, more than a ring "
                f"of {window} positions needs ({full_bytes}); keep only `window` slots",
            )
            expect(
                n < window or nbytes >= full_bytes,
                f"{step}: the returned keys live in {nbytes} bytes, less than the {full_bytes} "
                f"of {window} slots: allocate the ring once, on the first update, and return "
                "views of it instead of building a new tensor (torch.cat) each step",
            )
            if storage is None:
                storage = k_win.untyped_storage().data_ptr()
            expect(
                k_win.untyped_storage().data_ptr() == storage,
                f"{step}: the keys moved to new memory; write into the ring allocated on the "
                "first update (torch.cat or torch.roll copy the window at every step)",
            )


# ---------------------------------------------------------------- 08.2
_ATTENTION_CASES = [  # (B, n_heads, n_kv_heads, T_new, T_k, head_dim)
    (2, 4, 4, 1, 7, 8),  # one new token, multi-head
    (1, 2, 2, 1, 1, 4),  # the very first token
    (2, 4, 2, 1, 9, 8),  # grouped-query
    (1, 6, 3, 1, 5, 4),
    (2, 8, 1, 1, 10, 4),  # multi-query
    (2, 4, 4, 3, 8, 8),  # several new tokens (a chunk)
    (1, 4, 2, 2, 6, 4),
    (1, 2, 1, 5, 5, 4),  # T_new == T_k: a prefill
]


def _last_rows(q_full, k, v, T_new, scale=None, mask="causal", kv="interleave", over=-1):
    """The last T_new rows of causal attention over all T_k positions (or a known mistake).

    ``mask`` may be an int: the bottom-right mask shifted by that many diagonals; ``over``
    is the axis of the softmax (-1, the keys, is right)."""
    group = q_full.shape[1] // k.shape[1]
    if kv == "interleave":  # head i reads kv head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    else:  # head i reads kv head i % n_kv: wrong
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    T_k = k.shape[-2]
    q = q_full[..., -T_new:, :]
    masks = {
        "causal": causal_mask(T_new, T_k),
        "top_left": torch.ones(T_new, T_k, dtype=torch.bool).tril(),
        "none": None,
    }
    if isinstance(mask, int):  # a diagonal off: -1 hides the token itself, +1 shows the next
        masks[mask] = torch.ones(T_new, T_k, dtype=torch.bool).tril(T_k - T_new + mask)
    mask = masks[mask]
    mask = None if mask is None else mask[None, None]  # (T_new, T_k) -> the scores' rank
    if over == -1:
        return attention(q, k, v, mask=mask, scale=scale)[0]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, h, T_new, T_k)
    scores = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=over).nan_to_num() @ v


@exercise("08.2")
def check_cached_attention(cached_attention) -> None:
    """Check ``cached_attention(q, k_cache, v_cache)`` against full causal attention."""
    g = case_rng()
    n_kv, group, T_new = randint(g, 1, 3), randint(g, 1, 3), randint(g, 1, 4)
    fresh = [(randint(g, 1, 3), n_kv * group, n_kv, T_new, T_new + randint(g, 0, 8), 2 * randint(g, 1, 4))]
    for B, n_heads, n_kv, T_new, T_k, head_dim in _ATTENTION_CASES + fresh:
        q_full = torch.randn(B, n_heads, T_k, head_dim, generator=g)
        k = torch.randn(B, n_kv, T_k, head_dim, generator=g)
        v = torch.randn(B, n_kv, T_k, head_dim, generator=g)
        q = q_full[..., -T_new:, :].clone()  # the queries of the newest tokens
        case = (
            f"(B={B}, n_heads={n_heads}, n_kv_heads={n_kv}, T_new={T_new}, T_k={T_k}, "
            f"head_dim={head_dim})"
        )
        with torch.no_grad():
            got = run(cached_attention, q, k, v, what=f"cached_attention{case}")
        if got is None:
            raise NotSolved("return the outputs of shape (B, n_heads, T_new, head_dim), not None")
        expect_tensor(got, f"{case}: the output")
        expected = _last_rows(q_full, k, v, T_new)
        expect(
            tuple(got.shape) == tuple(expected.shape),
            f"{case}: output shape {tuple(got.shape)}, expected (B, n_heads, T_new, head_dim) = "
            f"{tuple(expected.shape)}",
        )
        if _close(got, expected):
            continue
        if n_kv < n_heads:
            expect(
                not _close(got, _last_rows(q_full, k, v, T_new, kv="tile")),
                f"{case}: query head i reads key/value head i // (n_heads // n_kv_heads): "
                "repeat each cached head (repeat_interleave), do not tile the cache (repeat)",
            )
        if T_new < T_k:
            expect(
                not _close(got, _last_rows(q_full, k, v, T_new, mask="top_left")),
                f"{case}: your causal mask is aligned top-left (torch.tril, or SDPA's "
                f"is_causal=True); the new queries are the LAST {T_new} of the {T_k} "
                "positions, so the mask is tril(diagonal=T_k - T_new): "
                "causal_mask(T_new, T_k)",
            )
        if T_new > 1:
            expect(
                not _close(got, _last_rows(q_full, k, v, T_new, mask="none")),
                f"{case}: with several new tokens a mask is needed: new token i must not see "
                "the new tokens after it (bottom-right causal mask, causal_mask(T_new, T_k))",
            )
        for shift, what in ((-1, "hides the new token from itself"),
                            (1, "lets a new token see the one after it")):
            expect(
                not _close(got, _last_rows(q_full, k, v, T_new, mask=shift)),
                f"{case}: your mask is off by one diagonal: it {what}. New token i "
                f"(of {T_new}) sees positions 0..T_k - T_new + i, itself included: "
                "tril(diagonal=T_k - T_new)",
            )
        expect(
            not _close(got, _last_rows(q_full, k, v, T_new, over=-2)),
            f"{case}: the softmax runs over the queries' axis; each query's weights must "
            "sum to 1 over the keys: softmax(dim=-1)",
        )
        expect(
            not _close(got, _last_rows(q_full, k, v, T_new, scale=1.0)),
            f"{case}: the scores are not scaled; divide q @ k^T by sqrt(head_dim)",
        )
        expect(
            not _close(got, _last_rows(q_full, k, v, T_new, scale=1.0 / head_dim)),
            f"{case}: the scores are divided by head_dim; divide by sqrt(head_dim)",
        )
        expect_close(got, expected, f"{case}: the outputs of the new tokens")


# ---------------------------------------------------------------- 08.3


# 08.3 and 08.4 live in their own module (no module over 350 lines); importing it registers them.
from attnlib.book.exercises._ch08_plan import check_chunked_prefill, check_kv_cache_bytes  # noqa: E402
