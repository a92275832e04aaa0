"""Exercise checks for chapter 06 (multi-query and grouped-query attention).

* 06.1 ``check_repeat_kv``: ``repeat_kv(k, n_rep)`` copies each key/value head ``n_rep`` times,
  ``(B, n_kv_heads, T, head_dim)`` → ``(B, n_kv_heads * n_rep, T, head_dim)``, built from
  ``unsqueeze``/``expand``/``reshape``; checked against ``repeat_interleave`` on dim 1.
* 06.2 ``check_gqa_attention``: ``gqa_attention(q, k, v)``, causal grouped-query attention that
  never copies the keys or values; checked against
  ``F.scaled_dot_product_attention(..., enable_gqa=True)``, and its allocations are logged.
* 06.3 ``check_kv_cache_bytes``: ``kv_cache_bytes(config, n_tokens, dtype)``, the bytes a KV
  cache holds for a GPT, checked against the keys and values its attention layers produce.

The graders draw their random inputs from a local ``torch.Generator``; ``grade`` runs them
inside ``torch.random.fork_rng``, so checking an answer never changes the notebook's global
random state.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnlib.attention import ATTENTION_REGISTRY
from attnlib.book.exercises._core import NotSolved, exercise, expect, expect_close
from attnlib.config import GPTConfig
from attnlib.functional import causal_mask

__all__ = ["check_repeat_kv", "check_gqa_attention", "check_kv_cache_bytes"]


def _source(fn) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _heads(B: int, n: int, T: int, head_dim: int, g: torch.Generator) -> torch.Tensor:
    """Random ``(B, n, T, head_dim)`` laid out as ``split_heads`` leaves it: a transposed, non-contiguous view."""
    return torch.randn(B, T, n, head_dim, generator=g).transpose(1, 2)  # (B, T, n, hd) -> (B, n, T, hd)


class _AllocationLog(TorchDispatchMode):
    """Records ``(op name, bytes)`` for every new tensor storage an operation creates (views are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in inputs:
                    self.records.append((func.overloadpacket.__name__, storage.nbytes()))
        return out


# ---------------------------------------------------------------- 06.1
_REPEAT_CASES = [  # (B, n_kv_heads, T, head_dim, n_rep)
    (2, 2, 5, 4, 3),
    (1, 1, 3, 2, 4),
    (3, 4, 2, 8, 1),
    (2, 3, 4, 4, 2),
]


@exercise("06.1")
def check_repeat_kv(repeat_kv) -> None:
    """Check ``repeat_kv(k, n_rep)`` against ``k.repeat_interleave(n_rep, dim=1)``."""
    g = torch.Generator().manual_seed(601)
    for B, n_kv, T, head_dim, n_rep in _REPEAT_CASES:
        k = _heads(B, n_kv, T, head_dim, g)
        before = k.clone()
        case = f"repeat_kv(k of shape {tuple(k.shape)}, n_rep={n_rep})"
        got = repeat_kv(k, n_rep)
        if got is None:
            raise NotSolved("return the repeated tensor, not None")
        expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
        expect(torch.equal(k, before), f"{case} changed k in place; leave the input as it was")
        shape = (B, n_kv * n_rep, T, head_dim)
        expect(tuple(got.shape) == shape, f"{case} has shape {tuple(got.shape)}, expected {shape}")
        expected = k.repeat_interleave(n_rep, dim=1)
        if n_rep > 1 and n_kv > 1 and torch.equal(got, k.repeat(1, n_rep, 1, 1)):
            expect(
                False,
                f"{case}: your head i holds kv head i % n_kv_heads: you tiled the heads (as k.repeat does). "
                "A group of neighbouring query heads shares one kv head, so head i needs kv head i // n_rep: "
                "put the new dimension of size n_rep right after the kv-head dimension (k[:, :, None])",
            )
        expect_close(got, expected, case)
    source = _source(repeat_kv)
    expect(
        source is None or "repeat_interleave" not in source,
        "the values are right, but build it by hand: k[:, :, None].expand(...) then reshape, without repeat_interleave",
    )


# ---------------------------------------------------------------- 06.2
_GQA_CASES = [  # (B, n_heads, n_kv_heads, T_q, T_k, head_dim)
    (2, 4, 2, 5, 5, 8),
    (1, 6, 3, 4, 4, 4),
    (2, 4, 1, 3, 3, 8),  # multi-query
    (2, 4, 4, 3, 3, 8),  # multi-head
    (2, 8, 2, 1, 7, 8),  # one decoding step over 7 cached keys
    (1, 4, 2, 3, 6, 4),  # 3 new queries over 6 keys
]


def _reference(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@exercise("06.2")
def check_gqa_attention(gqa_attention) -> None:
    """Check causal ``gqa_attention(q, k, v)`` against SDPA ``enable_gqa=True``, then that it copies no keys or values."""
    g = torch.Generator().manual_seed(602)
    for B, n_heads, n_kv, T_q, T_k, head_dim in _GQA_CASES:
        q = _heads(B, n_heads, T_q, head_dim, g)
        k, v = _heads(B, n_kv, T_k, head_dim, g), _heads(B, n_kv, T_k, head_dim, g)
        case = f"(B={B}, n_heads={n_heads}, n_kv_heads={n_kv}, T_q={T_q}, T_k={T_k})"
        with torch.no_grad():
            got = gqa_attention(q, k, v)
            if got is None:
                raise NotSolved("return the attention output of shape (B, n_heads, T_q, head_dim), not None")
            expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
            shape = (B, n_heads, T_q, head_dim)
            expect(tuple(got.shape) == shape, f"{case}: output has shape {tuple(got.shape)}, expected {shape}")
            expected = _reference(q, k, v, causal_mask(T_q, T_k))
            if torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                continue
            group = n_heads // n_kv
            if 1 < n_kv < n_heads:
                tiled = _reference(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1), causal_mask(T_q, T_k))
                expect(
                    not torch.allclose(got, tiled, atol=1e-5, rtol=1e-4),
                    f"{case}: query head i reads kv head i % n_kv_heads in your version; it must read kv head "
                    "i // group_size (neighbouring query heads form a group): view q as "
                    "(B, n_kv_heads, group_size, T_q, head_dim), not (B, group_size, n_kv_heads, ...)",
                )
            if T_q < T_k:
                top_left = _reference(q, k, v, torch.ones(T_q, T_k, dtype=torch.bool).tril())
                expect(
                    not torch.allclose(got, top_left, atol=1e-5, rtol=1e-4),
                    f"{case}: your causal mask is aligned top-left; the queries are the last T_q positions, so query i "
                    "sits at T_k - T_q + i (use attnlib.functional.causal_mask(T_q, T_k))",
                )
            unmasked = _reference(q, k, v, None)
            expect(
                T_q == 1 or not torch.allclose(got, unmasked, atol=1e-5, rtol=1e-4),
                f"{case}: no causal mask: query i must not see keys after position T_k - T_q + i",
            )
            expect_close(got, expected, f"{case}: your output")

    # A decoding step: one query per head over a long cache. A copy of K or V would be n_heads / n_kv_heads
    # times the cache; the scores and the output are far smaller than one such copy.
    B, n_heads, n_kv, T_k, head_dim = 2, 8, 2, 256, 32
    q = torch.randn(B, n_heads, 1, head_dim, generator=g)
    k, v = torch.randn(2, B, n_kv, T_k, head_dim, generator=g)  # contiguous, as a KV cache stores them
    copy_bytes = B * n_heads * T_k * head_dim * k.element_size()  # K repeated to every query head
    with torch.no_grad(), _AllocationLog() as log:
        gqa_attention(q, k, v)
    total = sum(nbytes for _, nbytes in log.records)
    largest = ", ".join(f"{name} {nbytes:,} B" for name, nbytes in sorted(log.records, key=lambda r: -r[1])[:4])
    expect(
        total < copy_bytes // 2,
        f"the values are right, but a decoding step (B={B}, n_heads={n_heads}, n_kv_heads={n_kv}, T_k={T_k}, "
        f"head_dim={head_dim}) allocated {total:,} bytes; one copy of K for every query head is {copy_bytes:,}. "
        f"Largest allocations: {largest}. Something copied the keys or values: repeat_interleave does, and so "
        "does torch.matmul when it broadcasts an operand. Use torch.einsum with a letter for the group, or fold "
        "the group into the query rows, (B, n_kv_heads, group_size * T_q, head_dim)",
    )
    source = _source(gqa_attention)
    expect(
        source is None or "scaled_dot_product_attention" not in source,
        "the values are right and nothing is copied, but write the attention yourself instead of calling "
        "F.scaled_dot_product_attention",
    )


# ---------------------------------------------------------------- 06.3
_CACHE_CASES = [  # (config, n_tokens, dtype)
    (GPTConfig(block_size=64), 32, torch.float32),  # "mha", n_kv_heads not given: None
    (GPTConfig(block_size=128, n_kv_heads=2, attention="gqa"), 100, torch.bfloat16),
    (GPTConfig(block_size=16, attention="mqa"), 7, torch.float16),  # n_kv_heads None, one kv head
    (GPTConfig(block_size=16, n_heads=6, d_model=48, attention="gqa"), 16, torch.float32),  # "gqa" without n_kv_heads
    (GPTConfig(block_size=16, n_kv_heads=1, attention="mqa"), 5, torch.float32),
    (GPTConfig(block_size=1024, n_layers=12, n_heads=12, d_model=768, n_kv_heads=4, attention="gqa"), 1024, torch.bfloat16),
    (GPTConfig(block_size=8, n_layers=2, n_heads=6, d_model=48, n_kv_heads=6, attention="gqa"), 3, torch.float64),
    (GPTConfig(block_size=8, n_layers=3, n_heads=8, d_model=64, n_kv_heads=8, attention="mha"), 1, torch.float32),
]

_KV_HEADS_HINT = {
    "mha": "multi-head attention has one kv head per query head (n_heads)",
    "mqa": "multi-query attention has exactly one kv head",
    "gqa": "a \"gqa\" config without n_kv_heads has one kv head per query head (n_heads)",
}


def _measured_cache_bytes(config: GPTConfig, n_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values the config's attention layers produce for ``n_tokens`` tokens (meta tensors)."""
    with torch.device("meta"):  # shapes and dtypes only: no memory, no arithmetic, no random numbers
        layer = ATTENTION_REGISTRY[config.attention](config).to(dtype)
        _, k, v = layer.project(torch.empty(1, n_tokens, config.d_model, dtype=dtype))
    return config.n_layers * (k.nelement() * k.element_size() + v.nelement() * v.element_size())


@exercise("06.3")
def check_kv_cache_bytes(kv_cache_bytes) -> None:
    """Check ``kv_cache_bytes(config, n_tokens, dtype) -> int`` against the keys and values the layers produce."""
    for config, n_tokens, dtype in _CACHE_CASES:
        try:
            got = kv_cache_bytes(config, n_tokens, dtype)
        except TypeError as e:  # arithmetic on config.n_kv_heads = None
            if config.n_kv_heads is None and "NoneType" in str(e):
                expect(
                    False,
                    f"your code raised TypeError: {e}, for attention={config.attention!r} with n_kv_heads=None: "
                    f"GPTConfig keeps its fields as given, and n_kv_heads was not given; "
                    f"{_KV_HEADS_HINT[config.attention]}",
                )
            raise
        if got is None:
            raise NotSolved("return the number of bytes as an int, not None")
        expect(
            isinstance(got, int) and not isinstance(got, bool),
            f"return a Python int; got {type(got).__name__} (use int(...) if you computed a float or a tensor)",
        )
        expected = _measured_cache_bytes(config, n_tokens, dtype)
        case = (
            f'kv_cache_bytes(attention="{config.attention}", n_layers={config.n_layers}, n_heads={config.n_heads}, '
            f"n_kv_heads={config.n_kv_heads}, head_dim={config.head_dim}; n_tokens={n_tokens}, {dtype}) = {got:,}"
        )
        if got == expected:
            continue
        per_head = expected // (config.n_layers * n_tokens)  # bytes per token per layer: 2 * heads * head_dim * size
        expect(got * 2 != expected, f"{case}, expected {expected:,}: the cache holds a key AND a value (a factor 2)")
        expect(got * config.n_layers != expected, f"{case}, expected {expected:,}: every one of the n_layers layers has its own cache")
        expect(got != expected * 8, f"{case}, expected {expected:,}: that is bits; count bytes (dtype.itemsize)")
        element = torch.empty((), dtype=dtype).element_size()
        kv_heads = per_head // (2 * config.head_dim * element)
        for heads, why in [(config.n_heads, "n_heads"), (config.n_kv_heads, "config.n_kv_heads"), (1, "one kv head")]:
            if heads is not None and heads != kv_heads and got == 2 * heads * config.head_dim * element * config.n_layers * n_tokens:
                given = _KV_HEADS_HINT[config.attention] if config.n_kv_heads is None else f"the config gives n_kv_heads={config.n_kv_heads}"
                expect(False, f"{case}, expected {expected:,}: you used {why}; here the layers have {kv_heads}: {given}")
        expect(False, f"{case}, expected {expected:,} = 2 (K and V) x kv heads x head_dim x bytes per number x n_layers x n_tokens")

