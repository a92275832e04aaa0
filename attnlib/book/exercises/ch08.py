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

Every grader draws its test tensors from a local ``torch.Generator``; ``grade`` runs it
inside ``torch.random.fork_rng``, so checking an answer never moves the notebook's global
random state.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

import attnlib.kv_memory
from attnlib.attention import ATTENTION_REGISTRY
from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    call_for_int,
    exercise,
    expect,
    expect_close,
)
from attnlib.cache import KVCache
from attnlib.config import GPTConfig
from attnlib.functional import attention, causal_mask

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
    out = cache.update(k, v)
    if out is None:
        raise NotSolved("update(k, v) should return (k_win, v_win), not None")
    expect(
        isinstance(out, (tuple, list))
        and len(out) == 2
        and all(isinstance(t, torch.Tensor) for t in out),
        f"{step}: update(k, v) should return a pair of tensors (k_win, v_win); "
        f"got {type(out).__name__}",
    )
    return out[0], out[1]


@exercise("08.1")
def check_ring_cache(ring_cache_class) -> None:
    """Check ``RingCache(window).update(k, v) -> (k_win, v_win)`` against windowed attention."""
    g = torch.Generator().manual_seed(801)
    for lead, width, window, steps, dtype in _RING_CASES:
        cache = ring_cache_class(window)
        k = torch.randn(*lead, steps, width, generator=g, dtype=dtype)
        v = torch.randn(*lead, steps, width, generator=g, dtype=dtype)
        q = torch.randn(*lead, steps, width, generator=g, dtype=dtype)
        storage = None
        for t in range(steps):
            k_t, v_t = k[..., t : t + 1, :].clone(), v[..., t : t + 1, :].clone()
            given = (k_t.clone(), v_t.clone())
            step = (
                f"RingCache(window={window}), update {t + 1} (position {t}) of shape "
                f"{tuple(k_t.shape)}"
            )
            k_win, v_win = _ring_call(cache, k_t, v_t, step)
            expect(
                torch.equal(k_t, given[0]) and torch.equal(v_t, given[1]),
                f"{step}: update changed the tensors it was given",
            )
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
                    "t % window, replacing the oldest one"
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

    first, second = ring_cache_class(2), ring_cache_class(2)
    _ring_call(first, torch.ones(1, 1, 2), torch.ones(1, 1, 2), "two caches")
    k2, _ = _ring_call(second, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), "two caches")
    expect(
        k2.shape[-2] == 1 and torch.equal(k2, torch.zeros(1, 1, 2)),
        "updating one RingCache changed another; keep the ring and the count on the "
        "instance (self), not on the class",
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


def _last_rows(q_full, k, v, T_new, scale=None, mask="causal", kv="interleave"):
    """The last T_new rows of causal attention over all T_k positions (or a known mistake)."""
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
    mask = masks[mask]
    mask = None if mask is None else mask[None, None]  # (T_new, T_k) -> the scores' rank
    return attention(q, k, v, mask=mask, scale=scale)[0]


@exercise("08.2")
def check_cached_attention(cached_attention) -> None:
    """Check ``cached_attention(q, k_cache, v_cache)`` against full causal attention."""
    g = torch.Generator().manual_seed(8082)
    for B, n_heads, n_kv, T_new, T_k, head_dim in _ATTENTION_CASES:
        q_full = torch.randn(B, n_heads, T_k, head_dim, generator=g)
        k = torch.randn(B, n_kv, T_k, head_dim, generator=g)
        v = torch.randn(B, n_kv, T_k, head_dim, generator=g)
        q = q_full[..., -T_new:, :].clone()  # the queries of the newest tokens
        given = (q.clone(), k.clone(), v.clone())
        case = (
            f"(B={B}, n_heads={n_heads}, n_kv_heads={n_kv}, T_new={T_new}, T_k={T_k}, "
            f"head_dim={head_dim})"
        )
        with torch.no_grad():
            got = cached_attention(q, k, v)
        if got is None:
            raise NotSolved("return the outputs of shape (B, n_heads, T_new, head_dim), not None")
        expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
        expect(
            all(torch.equal(a, b) for a, b in zip((q, k, v), given)),
            f"{case}: your function changed q, k_cache or v_cache; the cache must stay as it is",
        )
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
        expect(
            not _close(got, _last_rows(q_full, k, v, T_new, scale=1.0)),
            f"{case}: the scores are not scaled; divide q @ k^T by sqrt(head_dim)",
        )
        expect_close(got, expected, f"{case}: the outputs of the new tokens")


# ---------------------------------------------------------------- 08.3
_GPT2 = dict(vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768)
_BYTES_CONFIGS = [
    GPTConfig(),  # the book's small model, multi-head (n_kv_heads None: not given)
    GPTConfig(attention="gqa"),  # GQA without n_kv_heads: one kv head per query head
    GPTConfig(n_kv_heads=2, attention="gqa"),
    GPTConfig(attention="mqa"),  # one key/value head (n_kv_heads None)
    GPTConfig(n_layers=3, kv_latent_dim=24, attention="mla"),
    GPTConfig(n_layers=2, attention="talking_heads"),
    GPTConfig(n_layers=5, n_heads=8, d_model=64, n_kv_heads=2, attention="gqa"),
    GPTConfig(**_GPT2),  # GPT-2 small
    GPTConfig(**_GPT2, n_kv_heads=4, attention="gqa"),
    GPTConfig(**_GPT2, attention="mqa"),
    GPTConfig(**_GPT2, attention="mla"),  # kv_latent_dim None: the default d_model // 4
]
_BYTES_CALLS = [
    (1, 1, torch.float32),
    (3, 7, torch.bfloat16),
    (64, None, torch.float16),
    (2, 5, torch.float64),
]


def _measured_bytes_per_token(config: GPTConfig, dtype: torch.dtype) -> int:
    """Bytes one token of one sequence takes in a KVCache, measured on the buffers.

    The layers are built on the meta device (shapes, no memory) and each runs on a meta
    input with its own LayerCache; what they allocate is what is measured.
    """
    with torch.device("meta"):
        layers = [
            ATTENTION_REGISTRY[config.attention](config).to(dtype)
            for _ in range(config.n_layers)
        ]
        x = torch.empty(1, 2, config.d_model, dtype=dtype)
    cache = KVCache(config.n_layers, config.block_size)
    for layer, layer_cache in zip(layers, cache.layers):
        layer(x, cache=layer_cache)
    return cache.bytes_per_token()


class _BuiltAModel(RuntimeError):
    pass


@contextlib.contextmanager
def _from_config_only():
    """Make building a module, or calling the library's estimator, raise (rule of 08.3)."""
    message = (
        "compute the bytes from the config's fields; do not build a model or an attention "
        "layer, and do not call attnlib's own estimator"
    )

    def refuse(*args, **kwargs):
        raise _BuiltAModel(message)

    saved = nn.Module.__init__, attnlib.kv_memory.kv_cache_bytes
    nn.Module.__init__ = refuse
    attnlib.kv_memory.kv_cache_bytes = refuse
    try:
        yield
    finally:
        nn.Module.__init__, attnlib.kv_memory.kv_cache_bytes = saved


@exercise("08.3")
def check_kv_cache_bytes(kv_cache_bytes) -> None:
    """Check ``kv_cache_bytes(config, batch_size, context, dtype) -> int``.

    The expected value is measured: bytes per token of a KVCache filled by the layers
    (meta device), times batch_size * context.
    """
    for config in _BYTES_CONFIGS:
        measured = {}
        for batch_size, context, dtype in _BYTES_CALLS:
            context = config.block_size if context is None else context
            case = (
                f"kv_cache_bytes(attention={config.attention!r}, n_layers={config.n_layers}, "
                f"n_heads={config.n_heads}, n_kv_heads={config.n_kv_heads}, "
                f"head_dim={config.head_dim}, kv_latent_dim={config.kv_latent_dim}; "
                f"batch_size={batch_size}, context={context}, {dtype})"
            )
            with _from_config_only():
                got = call_for_int(
                    kv_cache_bytes, (config, batch_size, context, dtype), case, config
                )
            if dtype not in measured:
                measured[dtype] = _measured_bytes_per_token(config, dtype)
            size = dtype.itemsize
            tokens = batch_size * context
            expected = measured[dtype] * tokens
            if got == expected:
                continue
            per_layer = measured[dtype] // (config.n_layers * size)  # numbers per token, layer
            case = f"{case} = {got:,}, expected {expected:,}"
            every = config.n_layers * tokens * size
            mistakes = [
                (per_layer * tokens * size, "multiply by n_layers: every layer has its own cache"),
                (
                    per_layer * config.n_layers * context * size,
                    "multiply by batch_size: every sequence has its own cache",
                ),
                (
                    per_layer * config.n_layers * batch_size * size,
                    "multiply by context: one entry per token",
                ),
                (
                    expected * 8,
                    "that is bits, not bytes: dtype.itemsize is already in bytes "
                    f"({dtype} takes {size})",
                ),
                (
                    per_layer * config.n_layers * tokens,
                    f"multiply by the bytes of one number: {dtype} takes {size} "
                    "(dtype.itemsize)",
                ),
                (
                    per_layer * config.n_layers * tokens * 4,
                    f"{dtype} takes {size} bytes per number, not 4 (dtype.itemsize)",
                ),
                (
                    per_layer * config.n_layers * batch_size * config.block_size * size,
                    "count the context tokens, not the block_size positions that KVCache "
                    "reserves up front",
                ),
            ]
            name = config.attention
            all_heads = 2 * config.n_heads * config.head_dim * every
            if name == "mqa":
                mistakes.append(
                    (all_heads, "MQA has one key/value head (config.kv_heads is 1), not n_heads")
                )
            if name == "gqa":
                mistakes.append(
                    (all_heads, "GQA caches n_kv_heads key/value heads, not n_heads")
                )
            if name == "mla":
                mistakes += [
                    (
                        2 * config.latent_dim * every,
                        "MLA caches the latent once: keys and values are both decoded from it",
                    ),
                    (
                        all_heads,
                        "MLA caches only the latent, config.latent_dim numbers per token "
                        "and layer",
                    ),
                ]
            if name in ("mha", "talking_heads", "gqa", "mqa"):
                mistakes.append(
                    (per_layer // 2 * every, "keys AND values are cached: a factor 2")
                )
            for value, hint in mistakes:
                expect(value == expected or got != value, f"{case}: {hint}")
            raise Wrong(
                f"{case}. Numbers per token per layer: 'mha' and 'talking_heads' "
                "2*n_heads*head_dim, 'gqa' 2*kv_heads*head_dim, 'mqa' 2*head_dim, "
                "'mla' latent_dim"
            )


# ---------------------------------------------------------------- 08.4
_CHUNK_CASES = [  # (attention, overrides, B, T, chunk_size)
    ("mha", {}, 2, 11, 4),
    ("gqa", dict(n_kv_heads=2), 1, 9, 3),  # T a multiple of the chunk
    ("mla", {}, 2, 7, 2),
    ("mqa", {}, 1, 6, 1),  # one token per call
    ("mha", {}, 2, 5, 8),  # one chunk holds the whole prompt
]


@exercise("08.4")
def check_chunked_prefill(chunked_prefill) -> None:
    """Check ``chunked_prefill(model, idx, chunk_size) -> (logits, cache)`` on several GPTs.

    Every forward call of the model is recorded: none may receive more than chunk_size
    tokens. The logits must equal one forward pass of the whole prompt, and the cache must
    go on decoding as if the prompt had been prefilled at once.
    """
    from attnlib import GPT

    g = torch.Generator().manual_seed(804)
    base = GPTConfig(vocab_size=13, block_size=16, n_layers=2, n_heads=4, d_model=32)
    for name, overrides, B, T, chunk in _CHUNK_CASES:
        config = base.replace(attention=name, **overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
            model = GPT(config).eval()
        idx = torch.randint(0, config.vocab_size, (B, T), generator=g)
        nxt = torch.randint(0, config.vocab_size, (B, 1), generator=g)
        with torch.no_grad():
            reference, _ = model(idx)
            after, _ = model(torch.cat([idx, nxt], dim=1))
        case = f"chunked_prefill({name} GPT, idx of shape {(B, T)}, chunk_size={chunk})"

        calls = []
        forward = model.forward

        def recording_forward(idx_in, *args, _calls=calls, _forward=forward, **kwargs):
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            _calls.append((idx_in.shape[-1], cache))
            return _forward(idx_in, *args, **kwargs)

        model.forward = recording_forward
        try:
            with torch.no_grad():
                out = chunked_prefill(model, idx.clone(), chunk)
        finally:
            del model.forward
        if out is None:
            raise NotSolved("return (logits, cache), not None")
        expect(
            isinstance(out, (tuple, list)) and len(out) == 2,
            f"{case}: return a pair (logits, cache); got {type(out).__name__}",
        )
        logits, cache = out
        expect(calls, f"{case}: the model was never called; feed the chunks through model(...)")
        biggest = max(n for n, _ in calls)
        expect(
            biggest <= chunk,
            f"{case}: a forward call got {biggest} tokens, more than chunk_size={chunk}; "
            "feed idx[:, s : s + chunk_size] for s = 0, chunk_size, 2 * chunk_size, ...",
        )
        expect(
            all(c is not None for _, c in calls),
            f"{case}: a forward call got no cache; pass the same KVCache to every chunk so "
            "that each chunk sees the chunks before it",
        )
        expect(
            len({id(c) for _, c in calls}) == 1,
            f"{case}: the chunks went through different caches; create ONE KVCache and "
            "pass it to every chunk, so that each chunk sees the chunks before it",
        )
        expect(
            isinstance(logits, torch.Tensor),
            f"{case}: the logits should be a tensor; got {type(logits).__name__}",
        )
        expect(
            isinstance(cache, KVCache),
            f"{case}: return the KVCache the chunks filled; got {type(cache).__name__}",
        )
        expect(
            cache.length == T,
            f"{case}: the cache holds {cache.length} positions, expected T={T}: the chunks "
            "overlap or leave tokens out",
        )
        expect(
            tuple(logits.shape) == tuple(reference.shape),
            f"{case}: logits of shape {tuple(logits.shape)}, expected (B, T, vocab_size) = "
            f"{tuple(reference.shape)}: concatenate the logits of every chunk on dim 1",
        )
        expect_close(logits, reference, f"{case}: the logits")
        with torch.no_grad():
            next_logits, _ = model(nxt, cache=cache)
        expect_close(
            next_logits, after[:, -1:], f"{case}: a decode step after the chunked prefill"
        )
