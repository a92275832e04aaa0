"""Exercise checks for chapter 08 (the KV cache).

* 08.1 ``check_mini_cache``: a cache class that pre-allocates ``max_len`` positions, appends
  along the time axis (``-2``) and returns views, checked against :class:`attnlib.cache.LayerCache`.
* 08.2 ``check_cached_attention``: the outputs of the newest tokens, attending over cached keys
  and values (bottom-right causal mask, shared key/value heads), checked against the last rows
  of full causal attention.
* 08.3 ``check_kv_cache_bytes``: the bytes a :class:`attnlib.cache.KVCache` holds for a batch of
  sequences, for every attention variant and dtype.

Every grader draws its test tensors from a local ``torch.Generator``; ``grade`` runs it inside
``torch.random.fork_rng``, so checking an answer never moves the notebook's global random state.
"""
from __future__ import annotations

import math

import torch

from attnlib.attention import ATTENTION_REGISTRY
from attnlib.book.exercises._core import NotSolved, Wrong, call_for_int, exercise, expect, expect_close
from attnlib.cache import LayerCache
from attnlib.config import GPTConfig
from attnlib.functional import attention, causal_mask

__all__ = ["check_cached_attention", "check_kv_cache_bytes", "check_mini_cache"]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- 08.1
_MINI_CASES = [  # (leading shape, key width, value width, max_len, positions per update, dtype)
    ((2, 3), 4, 4, 10, (4, 1, 1, 3), torch.float32),  # (B, n_heads, T, head_dim)
    ((1,), 5, 3, 6, (1, 1, 2, 1), torch.float64),  # (B, T, width), like MLA's latent; other widths and dtype
    ((3, 1), 2, 2, 4, (4,), torch.float32),  # one update fills the cache
]


def _call_update(cache, k: torch.Tensor, v: torch.Tensor, step: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = cache.update(k, v)
    if out is None:
        raise NotSolved("update(k, v) should return (k_all, v_all), not None")
    expect(
        isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out),
        f"{step}: update(k, v) should return a pair of tensors (k_all, v_all); got {type(out).__name__}",
    )
    return out[0], out[1]


@exercise("08.1")
def check_mini_cache(mini_cache_class) -> None:
    """Check ``MiniCache(max_len)``: ``.length`` and ``.update(k, v) -> (k_all, v_all)`` behave as ``LayerCache``."""
    g = torch.Generator().manual_seed(808)
    for lead, k_width, v_width, max_len, sizes, dtype in _MINI_CASES:
        cache = mini_cache_class(max_len)
        reference = LayerCache(max_len)
        expect(getattr(cache, "length", None) == 0, f"a new MiniCache({max_len}) should have length 0")
        storage = None
        earlier: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, T_new in enumerate(sizes):
            k = torch.randn(*lead, T_new, k_width, generator=g, dtype=dtype)
            v = torch.randn(*lead, T_new, v_width, generator=g, dtype=dtype)
            k_given, v_given = k.clone(), v.clone()
            step = f"MiniCache({max_len}), update {i + 1} of {T_new} position(s) of shape {tuple(k.shape)}"
            k_all, v_all = _call_update(cache, k, v, step)
            k_ref, v_ref = reference.update(k=k, v=v)
            expect(torch.equal(k, k_given) and torch.equal(v, v_given), f"{step}: update changed the tensors it was given")
            expect(
                not (k_all.shape[-2] == max_len != reference.length and k_all.shape[:-2] == k_ref.shape[:-2]),
                f"{step}: you returned the whole buffer ({max_len} positions); return only the {reference.length} "
                "filled ones, a view buffer[..., :length, :]",
            )
            expect(
                not (tuple(k_all.shape) == tuple(k.shape) and reference.length > T_new and torch.equal(k_all, k)),
                f"{step}: you returned only the new positions; return every position cached so far",
            )
            expect(
                tuple(k_all.shape) == tuple(k_ref.shape) and tuple(v_all.shape) == tuple(v_ref.shape),
                f"{step}: returned shapes {tuple(k_all.shape)} and {tuple(v_all.shape)}, expected "
                f"{tuple(k_ref.shape)} and {tuple(v_ref.shape)} (the time axis is -2)",
            )
            expect(
                k_all.dtype == dtype and v_all.dtype == dtype,
                f"{step}: the cache returned {k_all.dtype}, but was given {dtype}; allocate the buffers with the "
                "dtype (and device) of the first tensors",
            )
            expect(
                torch.equal(k_all, k_ref) and torch.equal(v_all, v_ref),
                f"{step}: the returned keys/values differ from all positions appended so far, in order "
                "(write the new ones at positions length : length + T_new)",
            )
            expect(
                getattr(cache, "length", None) == reference.length,
                f"{step}: length should now be {reference.length}; got {getattr(cache, 'length', None)}",
            )
            full_bytes = math.prod(lead) * max_len * k_width * k.element_size()
            expect(
                k_all.untyped_storage().nbytes() >= full_bytes,
                f"{step}: the returned keys live in {k_all.untyped_storage().nbytes()} bytes of memory, less than "
                f"the {full_bytes} of max_len={max_len} positions: allocate the buffer for max_len positions on the "
                "first update and return views of it, instead of building a new tensor (torch.cat) each time",
            )
            if storage is None:
                storage = k_all.untyped_storage().data_ptr()
            expect(
                k_all.untyped_storage().data_ptr() == storage,
                f"{step}: the keys moved to new memory; write into the buffer allocated on the first update",
            )
            for j, (k_old, v_old) in enumerate(earlier):  # writing new positions must not touch old ones
                n = k_old.shape[-2]
                expect(
                    torch.equal(k_old, k_ref[..., :n, :]) and torch.equal(v_old, v_ref[..., :n, :]),
                    f"{step}: the keys returned by update {j + 1} changed; only positions length : length + T_new "
                    "may be written",
                )
            earlier.append((k_all, v_all))

        k_over = torch.zeros(*lead, max_len - reference.length + 1, k_width, dtype=dtype)
        v_over = torch.zeros(*lead, max_len - reference.length + 1, v_width, dtype=dtype)
        try:
            cache.update(k_over, v_over)
        except NotImplementedError:
            raise
        except ValueError:
            pass
        except Exception as e:
            raise Wrong(
                f"MiniCache({max_len}) holding {reference.length}: appending {k_over.shape[-2]} more raised "
                f"{type(e).__name__}; check the length first and raise ValueError with a message"
            ) from None
        else:
            raise Wrong(
                f"MiniCache({max_len}) holding {reference.length}: appending {k_over.shape[-2]} more positions "
                "must raise ValueError (it would not fit)"
            )

    first, second = mini_cache_class(4), mini_cache_class(4)
    _call_update(first, torch.ones(1, 2, 3), torch.ones(1, 2, 3), "two caches")
    expect(
        getattr(second, "length", None) == 0,
        "updating one MiniCache changed another; keep the buffers and the length on the instance (self), "
        "not on the class",
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
    if kv == "interleave":
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head i reads kv head i // group
    else:
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)  # head i reads kv head i % n_kv: wrong
    T_k = k.shape[-2]
    q = q_full[..., -T_new:, :]
    masks = {
        "causal": causal_mask(T_new, T_k),
        "top_left": torch.ones(T_new, T_k, dtype=torch.bool).tril(),
        "none": None,
    }
    mask = masks[mask]
    return attention(q, k, v, mask=None if mask is None else mask[None, None], scale=scale)[0]  # (T_new, T_k) -> 4-D


@exercise("08.2")
def check_cached_attention(cached_attention) -> None:
    """Check ``cached_attention(q, k_cache, v_cache)`` against the last rows of full causal attention."""
    g = torch.Generator().manual_seed(8082)
    for B, n_heads, n_kv, T_new, T_k, head_dim in _ATTENTION_CASES:
        q_full = torch.randn(B, n_heads, T_k, head_dim, generator=g)
        k = torch.randn(B, n_kv, T_k, head_dim, generator=g)
        v = torch.randn(B, n_kv, T_k, head_dim, generator=g)
        q = q_full[..., -T_new:, :].clone()  # the queries of the newest tokens
        given = (q.clone(), k.clone(), v.clone())
        case = f"(B={B}, n_heads={n_heads}, n_kv_heads={n_kv}, T_new={T_new}, T_k={T_k}, head_dim={head_dim})"
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
            f"{case}: output shape {tuple(got.shape)}, expected (B, n_heads, T_new, head_dim) = {tuple(expected.shape)}",
        )
        if _close(got, expected):
            continue
        if n_kv < n_heads:
            expect(
                not _close(got, _last_rows(q_full, k, v, T_new, kv="tile")),
                f"{case}: query head i reads key/value head i // (n_heads // n_kv_heads): repeat each cached head "
                "(repeat_interleave), do not tile the cache (repeat)",
            )
        if T_new < T_k:
            expect(
                not _close(got, _last_rows(q_full, k, v, T_new, mask="top_left")),
                f"{case}: your causal mask is aligned top-left (torch.tril, or SDPA's is_causal=True); the new "
                f"queries are the LAST {T_new} of the {T_k} positions, so the mask is tril(diagonal=T_k - T_new): "
                "causal_mask(T_new, T_k)",
            )
        if T_new > 1:
            expect(
                not _close(got, _last_rows(q_full, k, v, T_new, mask="none")),
                f"{case}: with several new tokens a mask is needed: new token i must not see the new tokens after it "
                "(bottom-right causal mask, causal_mask(T_new, T_k))",
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
    GPTConfig(**_GPT2),  # GPT-2 small
    GPTConfig(**_GPT2, n_kv_heads=4, attention="gqa"),
    GPTConfig(**_GPT2, attention="mqa"),
    GPTConfig(**_GPT2, attention="mla"),  # kv_latent_dim None: the default d_model // 4
]
_BYTES_CALLS = [(1, 1, torch.float32), (3, 7, torch.bfloat16), (64, None, torch.float16), (2, 5, torch.float64)]


def _per_token_per_layer(config: GPTConfig) -> int:
    """Numbers one token leaves in one layer's cache: the layer's own ``cache_width`` (built on the meta device)."""
    with torch.device("meta"):
        return ATTENTION_REGISTRY[config.attention](config).cache_width


@exercise("08.3")
def check_kv_cache_bytes(kv_cache_bytes) -> None:
    """Check ``kv_cache_bytes(config, batch_size, context, dtype) -> int`` against each layer's ``cache_width``."""
    for config in _BYTES_CONFIGS:
        per_layer = _per_token_per_layer(config)
        for batch_size, context, dtype in _BYTES_CALLS:
            context = config.block_size if context is None else context
            case = (
                f"kv_cache_bytes(attention={config.attention!r}, n_layers={config.n_layers}, n_heads={config.n_heads}, "
                f"n_kv_heads={config.n_kv_heads}, head_dim={config.head_dim}, kv_latent_dim={config.kv_latent_dim}; "
                f"batch_size={batch_size}, context={context}, {dtype})"
            )
            got = call_for_int(kv_cache_bytes, (config, batch_size, context, dtype), case, config)
            size = torch.empty((), dtype=dtype).element_size()
            tokens = batch_size * context
            expected = per_layer * config.n_layers * tokens * size
            if got == expected:
                continue
            case = f"{case} = {got:,}, expected {expected:,}"
            name = config.attention
            mistakes = [
                (per_layer * tokens * size, "multiply by n_layers: every layer has its own cache"),
                (per_layer * config.n_layers * context * size, "multiply by batch_size: every sequence has its own cache"),
                (per_layer * config.n_layers * batch_size * size, "multiply by context: one entry per token"),
                (per_layer * config.n_layers * tokens, f"multiply by the bytes of one number: {dtype} takes {size} (dtype.itemsize)"),
                (per_layer * config.n_layers * tokens * 4, f"{dtype} takes {size} bytes per number, not 4 (dtype.itemsize)"),
                (per_layer * config.n_layers * batch_size * config.block_size * size,
                 "count the context tokens, not the block_size positions that KVCache reserves up front"),
            ]
            if name == "mqa":
                mistakes.append((2 * config.n_heads * config.head_dim * config.n_layers * tokens * size,
                                 "MQA has one key/value head (config.kv_heads is 1), not n_heads"))
            if name == "gqa":
                mistakes.append((2 * config.n_heads * config.head_dim * config.n_layers * tokens * size,
                                 "GQA caches n_kv_heads key/value heads, not n_heads"))
            if name == "mla":
                mistakes += [
                    (2 * config.latent_dim * config.n_layers * tokens * size,
                     "MLA caches the latent once: keys and values are both decoded from it"),
                    (2 * config.n_heads * config.head_dim * config.n_layers * tokens * size,
                     "MLA caches only the latent, config.latent_dim numbers per token and layer"),
                ]
            if name in ("mha", "talking_heads", "gqa", "mqa"):
                mistakes.append((per_layer // 2 * config.n_layers * tokens * size, "keys AND values are cached: a factor 2"))
            for value, hint in mistakes:
                expect(value == expected or got != value, f"{case}: {hint}")
            raise Wrong(
                f"{case}. Numbers per token per layer: 'mha' and 'talking_heads' 2*n_heads*head_dim, 'gqa' "
                "2*kv_heads*head_dim, 'mqa' 2*head_dim, 'mla' latent_dim"
            )
