"""Exercise checks for chapter 04 (multi-head attention).

* 04.1 ``check_split_into_heads``: cut a :class:`attnlib.MultiHeadAttention` into a
  :class:`attnlib.MultiHeadAttentionWrapper` of single heads.
* 04.2 ``check_mha_einsum``: the whole multi-head forward pass written with ``torch.einsum``.
* 04.3 ``check_mha_without_heads``: the output of a :class:`attnlib.MultiHeadAttention` with some
  heads switched off (head masking, Michel et al. 2019).

Every grader draws its test weights from a local ``torch.Generator``; ``grade`` runs it
inside ``torch.random.fork_rng``, so checking an answer never moves the notebook's global
random state.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from attnlib.attention import MultiHeadAttention, MultiHeadAttentionWrapper, attention
from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect, expect_close

__all__ = ["check_split_into_heads", "check_mha_einsum", "check_mha_without_heads"]


def _random_mha(d_model: int, n_heads: int, block_size: int, bias: bool, g: torch.Generator) -> MultiHeadAttention:
    """A causal eager MultiHeadAttention whose weights come from ``g`` (not from the global RNG)."""
    mha = MultiHeadAttention(d_model, n_heads, block_size=block_size, bias=bias, attn_fn="eager").eval()
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(d_model))
    return mha


def _head_outputs(mha: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Each head's output before the output projection: ``(B, n_heads, T, head_dim)``."""
    q, k, v = (mha.split_heads(t, mha.n_heads) for t in mha.qkv(x).split(mha.d_model, dim=-1))
    return attention(q, k, v, is_causal=True)[0]


# ---------------------------------------------------------------- 04.1
_SPLIT_CASES = [  # (d_model, n_heads, block_size, bias)
    (12, 3, 6, False),
    (12, 3, 6, True),
    (16, 4, 8, True),
    (8, 1, 5, False),
]


@exercise("04.1")
def check_split_into_heads(split_into_heads) -> None:
    """Check ``split_into_heads(mha) -> MultiHeadAttentionWrapper`` with ``mha.out_proj(wrapper(x)) == mha(x)``."""
    g = torch.Generator().manual_seed(404)
    for d_model, n_heads, block_size, bias in _SPLIT_CASES:
        mha = _random_mha(d_model, n_heads, block_size, bias, g)
        before = {name: t.clone() for name, t in mha.state_dict().items()}
        x = torch.randn(2, block_size, d_model, generator=g)
        case = f"(d_model={d_model}, n_heads={n_heads}, bias={bias})"

        wrapper = split_into_heads(mha)
        if wrapper is None:
            raise NotSolved("return a MultiHeadAttentionWrapper, not None")
        expect(
            isinstance(wrapper, MultiHeadAttentionWrapper),
            f"return an attnlib.MultiHeadAttentionWrapper; got {type(wrapper).__name__}",
        )
        expect(
            all(torch.equal(t, before[name]) for name, t in mha.state_dict().items()),
            "your function changed mha's weights: copy them into the heads, leave mha as it was",
        )
        expect(
            len(wrapper.heads) == n_heads,
            f"{case}: the wrapper has {len(wrapper.heads)} heads, expected n_heads={n_heads}",
        )
        head_dim = d_model // n_heads
        for i, head in enumerate(wrapper.heads):
            expect(
                head.W_query.out_features == head_dim and head.W_query.in_features == d_model,
                f"{case}: head {i} maps {head.W_query.in_features} -> {head.W_query.out_features} features; "
                f"each head should map d_model={d_model} -> head_dim={head_dim}",
            )
            expect(
                (head.W_query.bias is not None) == bias,
                f"{case}: mha {'has' if bias else 'has no'} q/k/v biases, so the heads need bias={bias}",
            )
        wrapper.eval()
        with torch.no_grad():
            mine = wrapper(x)
            expect(
                isinstance(mine, torch.Tensor) and tuple(mine.shape) == (2, block_size, d_model),
                f"{case}: wrapper(x) should have shape (B, T, n_heads*head_dim) = {(2, block_size, d_model)}; "
                f"got {tuple(getattr(mine, 'shape', ()))}",
            )
            reference = _head_outputs(mha, x)  # (B, n_heads, T, head_dim)
            for i in range(n_heads):
                got = mine[..., i * head_dim : (i + 1) * head_dim]
                if torch.allclose(got, reference[:, i], atol=1e-5, rtol=1e-4):
                    continue
                for j in range(n_heads):
                    expect(
                        not torch.allclose(got, reference[:, j], atol=1e-5, rtol=1e-4),
                        f"{case}: your head {i} computes mha's head {j}; keep the heads in order",
                    )
                raise Wrong(
                    f"{case}: head {i} gives the wrong output. It must use rows {i * head_dim}:{(i + 1) * head_dim} (i*head_dim:(i+1)*head_dim) of "
                    "each block of mha.qkv.weight: the q block is rows 0:d_model, the k block d_model:2*d_model, "
                    "the v block 2*d_model:3*d_model (and the same slices of mha.qkv.bias)"
                )
            expect_close(mha.out_proj(mine), mha(x), f"{case}: mha.out_proj(wrapper(x)) compared with mha(x)")


# ---------------------------------------------------------------- 04.2
_EINSUM_CASES = [  # (d_model, n_heads, T, bias)
    (12, 3, 5, True),
    (16, 4, 7, False),
    (8, 2, 1, True),
    (6, 1, 4, True),
]


def _mha_weights(mha: MultiHeadAttention):
    bias = mha.qkv.bias is not None
    return (
        mha.qkv.weight.detach(),
        mha.qkv.bias.detach() if bias else None,
        mha.out_proj.weight.detach(),
        mha.out_proj.bias.detach() if bias else None,
    )


_NOT_EINSUM = "write this product with torch.einsum, not with {name} (the exercise asks for einsum only)"


@contextlib.contextmanager
def _einsum_only():
    """Count ``torch.einsum`` calls; matmul, linear layers and attention functions raise a hint."""
    calls = {"einsum": 0}
    einsum = torch.einsum

    def counting_einsum(*args, **kwargs):
        calls["einsum"] += 1
        return einsum(*args, **kwargs)

    def refuse(name):
        def refused(*args, **kwargs):
            raise Wrong(_NOT_EINSUM.format(name=name))

        return refused

    patches = [
        (torch, "einsum", counting_einsum),
        (torch, "matmul", refuse("torch.matmul")),
        (torch, "bmm", refuse("torch.bmm")),
        (torch, "mm", refuse("torch.mm")),
        (torch.Tensor, "__matmul__", refuse("@")),
        (torch.Tensor, "matmul", refuse("Tensor.matmul")),
        (torch.Tensor, "bmm", refuse("Tensor.bmm")),
        (F, "linear", refuse("F.linear or an nn.Linear")),
        (F, "scaled_dot_product_attention", refuse("F.scaled_dot_product_attention")),
        (MultiHeadAttention, "forward", refuse("attnlib.MultiHeadAttention")),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield calls
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


@exercise("04.2")
def check_mha_einsum(mha_einsum) -> None:
    """Check ``mha_einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads)`` against a causal MultiHeadAttention."""
    g = torch.Generator().manual_seed(4042)
    for d_model, n_heads, T, bias in _EINSUM_CASES:
        mha = _random_mha(d_model, n_heads, 8, bias, g)
        weights = _mha_weights(mha)
        x = torch.randn(3, T, d_model, generator=g)
        case = f"(d_model={d_model}, n_heads={n_heads}, T={T}, bias={bias})"
        with torch.no_grad():
            expected = mha(x)
            with _einsum_only() as calls:
                got = mha_einsum(x, *weights, n_heads)
            if got is None:
                raise NotSolved("return the output tensor of shape (B, T, d_model), not None")
            expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
            expect(
                tuple(got.shape) == (3, T, d_model),
                f"{case}: output has shape {tuple(got.shape)}, expected (B, T, d_model) = {(3, T, d_model)}",
            )
            expect(
                calls["einsum"] >= 4,
                f"{case}: torch.einsum ran {calls['einsum']} time(s); write the projections, the scores, "
                "the weighted sum and the output projection with torch.einsum (at least 4 calls)",
            )
            if torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                continue
            # Diagnose the usual mistakes.
            if T > 1:
                x2 = x.clone()
                x2[:, -1] = torch.randn(3, d_model, generator=g)
                with _einsum_only():
                    moved_out = mha_einsum(x2, *weights, n_heads)
                moved = (moved_out[:, :-1] - got[:, :-1]).abs().max().item()
                expect(
                    moved < 1e-6,
                    f"{case}: changing the last token moved the outputs at earlier positions (by up to "
                    f"{moved:.3g}): mask the scores so query t only sees keys <= t",
                )
            head_dim = d_model // n_heads
            scaled_by_d_model = _scaled_reference(mha, x, scale=1.0 / math.sqrt(d_model))
            expect(
                not torch.allclose(got, scaled_by_d_model, atol=1e-5, rtol=1e-4),
                f"{case}: you scale the scores by 1/sqrt(d_model); each head's dot products have head_dim="
                f"{head_dim} terms, so scale by 1/sqrt(head_dim)",
            )
            expect_close(
                got,
                expected,
                f"{case}: your output (split w_qkv's rows into q, k, v blocks of d_model rows; head h takes "
                "rows h*head_dim:(h+1)*head_dim of each block)",
            )


def _scaled_reference(mha: MultiHeadAttention, x: torch.Tensor, scale: float) -> torch.Tensor:
    B, T, d_model = x.shape
    q, k, v = (mha.split_heads(t, mha.n_heads) for t in mha.qkv(x).split(d_model, dim=-1))
    y = attention(q, k, v, is_causal=True, scale=scale)[0]
    return mha.out_proj(y.transpose(1, 2).reshape(B, T, d_model))  # (B, n_heads, T, head_dim) -> (B, T, d_model)


# ---------------------------------------------------------------- 04.3
_PRUNE_CASES = [  # (d_model, n_heads, T, bias, keep)
    (12, 3, 5, True, (True, False, True)),
    (16, 4, 6, True, (False, True, True, False)),
    (16, 4, 6, False, (True, True, False, True)),
    (12, 3, 4, True, (True, True, True)),
    (12, 3, 4, True, (False, False, False)),
    (8, 2, 3, True, (False, True)),
]


def _without_heads(mha, x, keep, *, zero="input", rescale=False, keep_bias=True):
    """The reference (``zero="input"``) and the mistakes the check names."""
    keep = torch.as_tensor(keep, dtype=torch.bool)
    heads = _head_outputs(mha, x)  # (B, n_heads, T, head_dim)
    B, n_heads, T, head_dim = heads.shape
    w, b = mha.out_proj.weight, mha.out_proj.bias
    if zero == "input":
        heads = heads * keep[None, :, None, None]
        if rescale:
            heads = heads * (n_heads / max(int(keep.sum()), 1))
    concat = heads.transpose(1, 2).reshape(B, T, n_heads * head_dim)  # (B, T, d_model)
    out = concat @ w.T + (b if (b is not None and keep_bias) else 0.0)
    if zero == "output":  # zeroing the head's slice of the output features instead
        out = out * keep.repeat_interleave(head_dim)
    return out


def _queries_zeroed(mha, x, keep):
    """Switching a head off by zeroing its queries: it then attends uniformly, it does not go silent."""
    keep = torch.as_tensor(keep, dtype=torch.bool)
    q, k, v = (mha.split_heads(t, mha.n_heads) for t in mha.qkv(x).split(mha.d_model, dim=-1))
    q = q * keep[None, :, None, None]
    y = attention(q, k, v, is_causal=True)[0]
    B, _, T, _ = y.shape
    return mha.out_proj(y.transpose(1, 2).reshape(B, T, mha.d_model))


@exercise("04.3")
def check_mha_without_heads(mha_without_heads) -> None:
    """Check ``mha_without_heads(mha, x, keep)``: ``mha(x)`` with the heads where ``keep`` is False silenced."""
    g = torch.Generator().manual_seed(4043)
    for d_model, n_heads, T, bias, keep_list in _PRUNE_CASES:
        mha = _random_mha(d_model, n_heads, 8, bias, g)
        before = {name: t.clone() for name, t in mha.state_dict().items()}
        x = torch.randn(2, T, d_model, generator=g)
        keep = torch.tensor(keep_list)
        case = f"(n_heads={n_heads}, keep={keep.tolist()}, bias={bias})"
        with torch.no_grad():
            expected = _without_heads(mha, x, keep)
            got = mha_without_heads(mha, x.clone(), keep.clone())
            if got is None:
                raise NotSolved("return the output tensor of shape (B, T, d_model), not None")
            expect(
                all(torch.equal(t, before[name]) for name, t in mha.state_dict().items()),
                "your function changed mha's weights: compute the output without writing into mha",
            )
            expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
            expect(
                tuple(got.shape) == tuple(expected.shape),
                f"{case}: output has shape {tuple(got.shape)}, expected (B, T, d_model) = {tuple(expected.shape)}",
            )
            got = got.detach()

            def same(other, got=got):
                return torch.allclose(got, other, atol=1e-5, rtol=1e-4)

            if same(expected):
                continue
            expect(not same(_without_heads(mha, x, ~keep)),
                   f"{case}: you switched off the heads where keep is True; True means keep the head")
            expect(not same(_without_heads(mha, x, keep, zero="output")),
                   f"{case}: you zeroed features of the output; a head's output is an input of out_proj: "
                   "zero its slice of the concatenation (before out_proj), so W^O never sees it")
            expect(not same(_queries_zeroed(mha, x, keep)),
                   f"{case}: a head with zero queries still attends (uniformly over its past) and still "
                   "adds its values; zero the head's output, not its queries")
            expect(not same(_without_heads(mha, x, keep, keep_bias=False)),
                   f"{case}: out_proj's bias belongs to no head: keep it")
            expect(not same(_without_heads(mha, x, keep, rescale=True)),
                   f"{case}: do not rescale the heads that are kept (this is not dropout)")
            expect(not same(mha(x)), f"{case}: this is mha(x) with every head on; switch off the heads where "
                                     "keep is False")
            expect_close(got, expected, f"{case}: your output")
