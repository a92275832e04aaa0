"""Exercise checks for chapter 06 (multi-query and grouped-query attention).

* 06.1 ``check_kv_head_of``: ``kv_head_of(attend, n_heads, n_kv_heads, head_dim)`` finds, by probing a
  grouped-query attention function it cannot read, which key/value head each query head reads
  (the grouped order of Llama's ``repeat_kv``, the tiled order of ``repeat``, or any other).
* 06.2 ``check_gqa_attention``: ``gqa_attention(q, k, v)``, causal grouped-query attention that
  never copies the keys or values; checked against
  ``F.scaled_dot_product_attention(..., enable_gqa=True)``, and its allocations are logged.
* 06.3 ``check_pool_kv_heads``: ``pool_kv_heads(mha, n_kv_heads)`` turns a multi-head layer into a
  grouped-query one by mean-pooling the key and value projection heads of each group (Ainslie et
  al. 2023, §2.1: the checkpoint conversion before uptraining); checked against the check's own
  pooled weights and a GQA forward pass written out here.

Every learner call goes through :func:`~attnlib.book.exercises._run.run`: PyTorch's and attnlib's
attention functions are refused with a :class:`~attnlib.book.exercises._run.Refuse` in 06.2, and the
allocation log (a ``TorchDispatchMode``) runs in the answer's thread (``inside=``). Each check has
fixed edge cases and fresh random ones from :func:`~attnlib.book.exercises._core.case_rng`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnlib.attention import MultiHeadAttention, attention, causal_mask
from attnlib.attention.flash import flash_attention
from attnlib.attention.functions import sdpa_attention
from attnlib.attention.tiled import tiled_attention
from attnlib.book.exercises._core import (
    NotSolved,
    case_rng,
    exercise,
    expect,
    expect_close,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import HF_ATTENTION as _HF_ATTENTION
from attnlib.book.exercises._run import Refuse, run

__all__ = ["check_kv_head_of", "check_gqa_attention", "check_pool_kv_heads"]


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


def _gqa_with(kv_of: list[int]):
    """A causal GQA attention function in which query head ``i`` reads key/value head ``kv_of[i]``."""
    index = torch.tensor(kv_of)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            raise TypeError("attend(q, k, v) takes three 4-D tensors: q (B, n_heads, T, head_dim), "
                            "k and v (B, n_kv_heads, T, head_dim)")
        if q.shape[1] != len(kv_of) or k.shape[1] != int(index.max()) + 1 or k.shape != v.shape \
                or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
            raise ValueError(f"attend expects q of shape (B, {len(kv_of)}, T, head_dim) and k, v of shape "
                             f"(B, {int(index.max()) + 1}, T, head_dim); got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        mask = causal_mask(q.shape[-2], k.shape[-2])
        return F.scaled_dot_product_attention(q, k[:, index], v[:, index], attn_mask=mask)  # (B, n_heads, T, hd)

    return attend


@exercise("06.1")
def check_kv_head_of(kv_head_of) -> None:
    """Check ``kv_head_of(attend, n_heads, n_kv_heads, head_dim)`` on attention functions of several head orders."""
    g = case_rng()
    orders = {
        "grouped": lambda h, n: [i // (h // n) for i in range(h)],
        "tiled": lambda h, n: [i % n for i in range(h)],
    }
    cases = [("grouped", 8, 2), ("tiled", 8, 2), ("grouped", 6, 3), ("tiled", 6, 3), ("grouped", 4, 1)]
    for _ in range(3):  # any assignment of query heads to kv heads (every kv head used), fresh each run
        n_kv = randint(g, 2, 4)
        n_heads = n_kv * randint(g, 1, 3)
        kv_of = torch.cat([torch.arange(n_kv), torch.randint(0, n_kv, (n_heads - n_kv,), generator=g)])
        cases.append((kv_of[torch.randperm(n_heads, generator=g)].tolist(), n_heads, n_kv))
    for order, n_heads, n_kv in cases:
        kv_of = orders[order](n_heads, n_kv) if isinstance(order, str) else order
        head_dim = randint(g, 2, 8)
        kind = f"{order} order" if isinstance(order, str) else "its own order"
        what = f"kv_head_of(attend, n_heads={n_heads}, n_kv_heads={n_kv}, head_dim={head_dim}) ({kind})"
        got = run(kv_head_of, _gqa_with(kv_of), n_heads, n_kv, head_dim, what=what)
        if got is None:
            raise NotSolved("return a tensor of n_heads kv-head indices, not None")
        expect_tensor(got, what, shape=(n_heads,))
        expect(got.dtype == torch.int64, f"{what} has dtype {got.dtype}; return integer indices (torch.long), "
                                         "e.g. with .argmax() or .round().long()")
        if torch.equal(got, torch.tensor(kv_of)):
            continue
        for name, rule in (("grouped", "i // group_size"), ("tiled", "i % n_kv_heads")):
            if orders[name](n_heads, n_kv) != kv_of and got.tolist() == orders[name](n_heads, n_kv):
                expect(False, f"{what}: you returned the {name} order, {rule}, but this attend shares its heads "
                              f"another way ({kv_of}): find the mapping by probing attend (give each kv head's "
                              "values its own constant), do not assume it")
        expect(False, f"{what}: query head i reads kv head {kv_of}[i]; you said {got.tolist()}. Give each kv "
                      "head's values a different constant: a head's output is an average of the values it reads")


# ---------------------------------------------------------------- 06.2
_GQA_CASES = [  # (B, n_heads, n_kv_heads, T_q, T_k, head_dim)
    (2, 4, 2, 5, 5, 8),
    (1, 6, 3, 4, 4, 4),
    (2, 4, 1, 3, 3, 8),  # multi-query
    (2, 4, 4, 3, 3, 8),  # multi-head
    (2, 8, 2, 1, 7, 8),  # one decoding step over 7 cached keys
    (1, 4, 2, 3, 6, 4),  # 3 new queries over 6 keys
]

#: 06.2 asks for the attention written by hand: the library's and PyTorch's functions are refused.
_OWN_ATTENTION = Refuse("write the attention yourself (scores, causal mask, softmax, weighted sum of the values)",
                        F.scaled_dot_product_attention, attention, sdpa_attention, tiled_attention, flash_attention,
                        flex_attention, aten="scaled_dot_product", named=_HF_ATTENTION)


def _reference(q, k, v, mask, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


@exercise("06.2")
def check_gqa_attention(gqa_attention) -> None:
    """Check causal ``gqa_attention(q, k, v)`` against SDPA ``enable_gqa=True``, then that it copies no keys or values."""
    g = case_rng()
    cases = list(_GQA_CASES)
    for _ in range(3):  # fresh sizes each run: 1 < n_kv_heads < n_heads and fewer queries than keys
        n_kv, group = randint(g, 2, 3), randint(g, 2, 3)
        T_k = randint(g, 2, 8)
        cases.append((randint(g, 1, 3), n_kv * group, n_kv, randint(g, 1, T_k), T_k, randint(g, 2, 8)))
    for B, n_heads, n_kv, T_q, T_k, head_dim in cases:
        q = _heads(B, n_heads, T_q, head_dim, g)
        k, v = _heads(B, n_kv, T_k, head_dim, g), _heads(B, n_kv, T_k, head_dim, g)
        case = f"(B={B}, n_heads={n_heads}, n_kv_heads={n_kv}, T_q={T_q}, T_k={T_k})"
        with torch.no_grad():
            got = run(gqa_attention, q, k, v, what=f"gqa_attention{case}", refuse=_OWN_ATTENTION)
            if got is None:
                raise NotSolved("return the attention output of shape (B, n_heads, T_q, head_dim), not None")
            expect_tensor(got, f"{case}: the output", shape=(B, n_heads, T_q, head_dim))
            expected = _reference(q, k, v, causal_mask(T_q, T_k))
            if torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                continue
            group = n_heads // n_kv
            if 1 < n_kv < n_heads:
                tiled = _reference(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1), causal_mask(T_q, T_k))
                expect(not torch.allclose(got, tiled, atol=1e-5, rtol=1e-4),
                       f"{case}: query head i reads kv head i % n_kv_heads in your version; it must read kv head "
                       "i // group_size (neighbouring query heads form a group): view q as "
                       "(B, n_kv_heads, group_size, T_q, head_dim), not (B, group_size, n_kv_heads, ...)")
            if T_q < T_k:
                top_left = _reference(q, k, v, torch.ones(T_q, T_k, dtype=torch.bool).tril())
                expect(not torch.allclose(got, top_left, atol=1e-5, rtol=1e-4),
                       f"{case}: your causal mask is aligned top-left; the queries are the last T_q positions, so "
                       "query i sits at T_k - T_q + i (use attnlib.attention.causal_mask(T_q, T_k))")
            expect(T_q == 1 or not torch.allclose(got, _reference(q, k, v, None), atol=1e-5, rtol=1e-4),
                   f"{case}: no causal mask: query i must not see keys after position T_k - T_q + i")
            expect(not torch.allclose(got, _reference(q, k, v, causal_mask(T_q, T_k), 1.0), atol=1e-5, rtol=1e-4),
                   f"{case}: the scores are not scaled: divide q . k by sqrt(head_dim) before the softmax")
            expect_close(got, expected, f"{case}: your output")

    # A decoding step: one query per head over a long cache. A copy of K or V would be n_heads / n_kv_heads
    # times the cache; the scores and the output are far smaller than one such copy.
    B, n_heads, n_kv, T_k, head_dim = 2, 8, 2, randint(g, 200, 300), 32
    q = torch.randn(B, n_heads, 1, head_dim, generator=g)
    k, v = torch.randn(2, B, n_kv, T_k, head_dim, generator=g)  # contiguous, as a KV cache stores them
    copy_bytes = B * n_heads * T_k * head_dim * k.element_size()  # K repeated to every query head
    log = _AllocationLog()
    with torch.no_grad():
        run(gqa_attention, q, k, v, what="gqa_attention(a decoding step)", refuse=_OWN_ATTENTION, inside=(log,))
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


# ---------------------------------------------------------------- 06.3
_POOL_CASES = [  # (d_model, n_heads, n_kv_heads)
    (32, 8, 2),
    (24, 6, 3),
    (16, 4, 1),  # multi-query: every head pooled into one
    (48, 12, 4),
    (16, 4, 4),  # one head per group: nothing to pool
]


def _random_mha(d_model: int, n_heads: int, g: torch.Generator) -> MultiHeadAttention:
    """A multi-head layer with random weights and biases (each head different), drawn from ``g``."""
    mha = MultiHeadAttention(d_model, n_heads, attn_fn="eager")
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(d_model))
    return mha


def _pool_rows(t: torch.Tensor, n_kv: int, group: int, how: str = "mean") -> torch.Tensor:
    """Pool the head rows of ``t`` (``n_heads * head_dim`` rows, grouped by neighbouring heads)."""
    heads = t.reshape(n_kv, group, -1, *t.shape[1:])  # (n_kv, group, head_dim, ...)
    pooled = {"mean": heads.mean(1), "sum": heads.sum(1), "first": heads[:, 0]}[how]
    return pooled.reshape(-1, *t.shape[1:])  # (n_kv * head_dim, ...)


def _pooled_weights(mha: MultiHeadAttention, n_kv: int, how: str = "mean", order: str = "grouped"):
    """The fused [W_q; W_k; W_v] weight and bias of the pooled layer, built here independently."""
    d, h = mha.d_model, mha.n_heads
    group, head_dim = h // n_kv, d // h
    w, b = mha.qkv.weight.detach(), mha.qkv.bias.detach()
    parts_w, parts_b = [w[:d]], [b[:d]]
    for lo in (d, 2 * d):  # the key rows, then the value rows
        wk, bk = w[lo : lo + d], b[lo : lo + d]
        if order == "tiled":  # kv head j pools query heads j, j + n_kv, ...: the i % n_kv reading
            wk = wk.reshape(group, n_kv, head_dim, d).transpose(0, 1).reshape(d, d)
            bk = bk.reshape(group, n_kv, head_dim).transpose(0, 1).reshape(d)
        elif order == "rows":  # neighbouring rows averaged: features of one head mixed
            parts_w.append(wk.reshape(n_kv * head_dim, group, d).mean(1))
            parts_b.append(bk.reshape(n_kv * head_dim, group).mean(1))
            continue
        parts_w.append(_pool_rows(wk, n_kv, group, how))
        parts_b.append(_pool_rows(bk, n_kv, group, how))
    return torch.cat(parts_w), torch.cat(parts_b)


def _gqa_forward(x, w, b, out_w, out_b, n_heads, n_kv):
    """Causal GQA written out: fused projection, kv heads repeated to their groups, softmax, W_O."""
    B, T, d = x.shape
    head_dim = d // n_heads
    q, k, v = (x @ w.T + b).split([d, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q = q.view(B, T, n_heads, head_dim).transpose(1, 2)  # (B, n_heads, T, hd)
    k, v = (t.view(B, T, n_kv, head_dim).transpose(1, 2) for t in (k, v))  # (B, n_kv, T, hd)
    k, v = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))  # head i reads i // g
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    y = scores.masked_fill(future, float("-inf")).softmax(-1) @ v  # (B, n_heads, T, hd)
    return y.transpose(1, 2).reshape(B, T, d) @ out_w.T + out_b


@exercise("06.3")
def check_pool_kv_heads(pool_kv_heads) -> None:
    """Check ``pool_kv_heads(mha, n_kv_heads)``: weights, biases and outputs of the pooled layer."""
    g = case_rng()
    cases = list(_POOL_CASES)
    for _ in range(2):  # fresh sizes each run
        n_kv, group, head_dim = randint(g, 1, 4), randint(g, 2, 4), randint(g, 2, 6)
        cases.append((n_kv * group * head_dim, n_kv * group, n_kv))
    for d_model, n_heads, n_kv in cases:
        mha = _random_mha(d_model, n_heads, g)
        case = f"(d_model={d_model}, n_heads={n_heads}, n_kv_heads={n_kv})"
        with torch.no_grad():
            got = run(pool_kv_heads, mha, n_kv, what=f"pool_kv_heads{case}")
        if got is None:
            raise NotSolved("return the grouped-query layer, not None")
        expect(
            type(got) is MultiHeadAttention,
            f"{case}: return an attnlib MultiHeadAttention; got {type(got).__name__}",
        )
        expect(
            (got.d_model, got.n_heads, got.n_kv_heads) == (d_model, n_heads, n_kv),
            f"{case}: your layer has d_model={got.d_model}, n_heads={got.n_heads}, "
            f"n_kv_heads={got.n_kv_heads}; keep d_model and n_heads, with n_kv_heads={n_kv}",
        )
        expect(
            got.qkv.bias is not None and got.out_proj.bias is not None,
            f"{case}: your layer has no biases; the multi-head layer has them, so build yours "
            "with bias=True and pool the key/value biases like the weights",
        )
        w, b = got.qkv.weight.detach(), got.qkv.bias.detach()
        w_ref, b_ref = _pooled_weights(mha, n_kv)
        if n_kv < n_heads and not torch.allclose(w, w_ref, atol=1e-6):
            wrong_ways = [
                ("first", "grouped", "you kept one head of each group (the first); average the "
                 "group's heads instead: mean-pooling keeps what every head contributes"),
                ("sum", "grouped", "you summed the heads of each group; average them (divide "
                 "by the group size n_heads // n_kv_heads)"),
                ("mean", "tiled", "your kv head j averages query heads j, j + n_kv_heads, ... "
                 "(the i % n_kv_heads reading); a group is neighbouring heads: kv head j serves "
                 "query heads j*g ... j*g + g - 1, so view the rows as (n_kv_heads, g, head_dim, "
                 "d_model)"),
                ("mean", "rows", "you averaged neighbouring rows, which mixes the features "
                 "of one head; average whole heads: view the rows as (n_kv_heads, g, head_dim, "
                 "d_model) and take the mean over g"),
            ]
            for how, order, hint in wrong_ways:
                w_alt, _ = _pooled_weights(mha, n_kv, how, order)
                expect(not torch.allclose(w, w_alt, atol=1e-6), f"{case}: {hint}")
            expect(
                torch.allclose(w[d_model:], w_ref[d_model:], atol=1e-6),
                f"{case}: the key/value rows of qkv.weight are not the group means of the "
                "multi-head layer's key/value heads",
            )
        expect(
            torch.allclose(w[:d_model], w_ref[:d_model], atol=1e-6)
            and torch.allclose(b[:d_model], b_ref[:d_model], atol=1e-6),
            f"{case}: the query rows of qkv changed; every query head stays as it was "
            "(only keys and values are shared)",
        )
        expect_close(w, w_ref, f"{case}: qkv.weight", atol=1e-6)
        expect(
            torch.allclose(b, b_ref, atol=1e-6),
            f"{case}: the weights are right but the key/value biases are not their group "
            "means; a bias belongs to a head like its rows: pool it the same way",
        )
        expect(
            torch.allclose(got.out_proj.weight, mha.out_proj.weight)
            and torch.allclose(got.out_proj.bias, mha.out_proj.bias),
            f"{case}: copy out_proj unchanged: the output projection reads the n_heads query "
            "heads' outputs, which GQA keeps",
        )
        x = torch.randn(2, 7, d_model, generator=g)
        expected = _gqa_forward(x, w_ref, b_ref, mha.out_proj.weight, mha.out_proj.bias, n_heads, n_kv)
        with torch.no_grad():
            expect_close(got.eval()(x), expected, f"{case}: your layer's output")
