"""Exercise checks for chapter 04 (multi-head attention).

* 04.1 ``check_split_into_heads``: cut a :class:`attnlib.MultiHeadAttention` into a
  :class:`attnlib.MultiHeadAttentionWrapper` of single heads.
* 04.2 ``check_mha_einsum``: the whole multi-head forward pass written with ``torch.einsum``.
* 04.3 ``check_mha_param_count``: the parameter count of a :class:`attnlib.MultiHeadAttention`.

Every grader draws its test weights from a local ``torch.Generator``; ``grade`` runs it
inside ``torch.random.fork_rng``, so checking an answer never moves the notebook's global
random state.
"""
from __future__ import annotations

import inspect
import math

import torch

from attnlib.attention import MultiHeadAttention, MultiHeadAttentionWrapper
from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect, expect_close
from attnlib.functional import attention

__all__ = ["check_split_into_heads", "check_mha_einsum", "check_mha_param_count"]


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
            got = mha_einsum(x, *weights, n_heads)
            if got is None:
                raise NotSolved("return the output tensor of shape (B, T, d_model), not None")
            expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
            expect(
                tuple(got.shape) == (3, T, d_model),
                f"{case}: output has shape {tuple(got.shape)}, expected (B, T, d_model) = {(3, T, d_model)}",
            )
            expected = mha(x)
            if torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                continue
            # Diagnose the usual mistakes.
            if T > 1:
                x2 = x.clone()
                x2[:, -1] = torch.randn(3, d_model, generator=g)
                moved = (mha_einsum(x2, *weights, n_heads)[:, :-1] - got[:, :-1]).abs().max().item()
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
    try:
        source = inspect.getsource(mha_einsum)
    except (OSError, TypeError):
        source = None
    expect(source is None or "einsum" in source, "the output is right, but write the products with torch.einsum")


def _scaled_reference(mha: MultiHeadAttention, x: torch.Tensor, scale: float) -> torch.Tensor:
    B, T, d_model = x.shape
    q, k, v = (mha.split_heads(t, mha.n_heads) for t in mha.qkv(x).split(d_model, dim=-1))
    y = attention(q, k, v, is_causal=True, scale=scale)[0]
    return mha.out_proj(y.transpose(1, 2).reshape(B, T, d_model))  # (B, n_heads, T, head_dim) -> (B, T, d_model)


# ---------------------------------------------------------------- 04.3
_COUNT_CASES = [  # (d_model, n_heads, bias)
    (12, 3, True),
    (12, 3, False),
    (12, 4, True),
    (64, 8, False),
    (768, 12, True),
    (768, 12, False),
    (1024, 16, True),
    (10, 1, True),
]


def _count(d_model: int, n_heads: int, bias: bool) -> int:
    with torch.device("meta"):  # shapes only: no memory, no random numbers
        mha = MultiHeadAttention(d_model, n_heads, bias=bias)
    return sum(p.numel() for p in mha.parameters())


@exercise("04.3")
def check_mha_param_count(mha_param_count) -> None:
    """Check ``mha_param_count(d_model, n_heads, bias) -> int`` against ``sum(p.numel())`` of the module."""
    for d_model, n_heads, bias in _COUNT_CASES:
        got = mha_param_count(d_model, n_heads, bias)
        if got is None:
            raise NotSolved("return the number of parameters as an int, not None")
        expect(
            isinstance(got, int) and not isinstance(got, bool),
            f"return a Python int; got {type(got).__name__} (use int(...) if you computed a tensor or a float)",
        )
        expected = _count(d_model, n_heads, bias)
        case = f"mha_param_count({d_model}, {n_heads}, bias={bias}) = {got:,}"
        if got == expected:
            continue
        d = d_model
        expect(
            not (bias and got == 4 * d * d + d),
            f"{case}: that is the source's count, which leaves out qkv's 3*d_model biases; expected {expected:,}",
        )
        expect(not (bias and got == 4 * d * d), f"{case}: you left out the biases (bias=True); expected {expected:,}")
        expect(not (not bias and got > expected), f"{case}: with bias=False there are no biases at all")
        one_head = mha_param_count(d_model, 1, bias)
        expect(
            one_head == got or one_head != expected,
            f"{case} but {one_head:,} with n_heads=1: the count does not depend on n_heads; expected {expected:,}",
        )
        raise Wrong(
            f"{case}, expected {expected:,}: qkv is Linear(d_model, 3*d_model), out_proj is Linear(d_model, d_model)"
        )
