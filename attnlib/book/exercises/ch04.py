"""Exercise checks for chapter 04 (multi-head attention).

* 04.1 ``check_split_into_heads``: cut a :class:`attnlib.MultiHeadAttention` into a
  :class:`attnlib.MultiHeadAttentionWrapper` of single heads.
* 04.2 ``check_mha_einsum``: the whole multi-head forward pass written with ``torch.einsum``, the
  heads split in the weights, never in the activations.
* 04.3 ``check_mha_without_heads``: the output of a :class:`attnlib.MultiHeadAttention` with some
  heads switched off (head masking, Michel et al. 2019).

Every learner call goes through :func:`~attnlib.book.exercises._run.run`; each check has fixed
edge cases and fresh random ones from :func:`~attnlib.book.exercises._core.case_rng`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from attnlib.attention import MultiHeadAttention, MultiHeadAttentionWrapper, attention
from attnlib.attention.functions import sdpa_attention
from attnlib.attention.teaching import CausalAttention
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
from attnlib.book.exercises._run import Refuse, run

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


def _sizes(g: torch.Generator, fixed: list[tuple], n: int = 3) -> list[tuple[int, int, bool]]:
    """The fixed ``(n_heads, head_dim, bias)`` cases plus ``n`` fresh ones (up to 6 heads)."""
    return fixed + [(randint(g, 2, 6), randint(g, 2, 5), bool(randint(g, 0, 1))) for _ in range(n)]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.detach(), b.detach(), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- 04.1


@exercise("04.1")
def check_split_into_heads(split_into_heads) -> None:
    """Check ``split_into_heads(mha) -> MultiHeadAttentionWrapper`` with ``mha.out_proj(wrapper(x)) == mha(x)``."""
    g = case_rng()
    for n_heads, head_dim, bias in _sizes(g, [(3, 4, False), (3, 4, True), (4, 4, True), (1, 8, False)]):
        d_model, block_size = n_heads * head_dim, randint(g, 4, 9)
        mha = _random_mha(d_model, n_heads, block_size, bias, g)
        x = torch.randn(2, block_size, d_model, generator=g)
        case = f"(d_model={d_model}, n_heads={n_heads}, bias={bias})"
        wrapper = run(split_into_heads, mha, what=f"split_into_heads(mha {case})")
        if wrapper is None:
            raise NotSolved("return a MultiHeadAttentionWrapper, not None")
        expect(type(wrapper) is MultiHeadAttentionWrapper,
               f"return an attnlib.MultiHeadAttentionWrapper; got {type(wrapper).__name__}")
        expect(len(wrapper.heads) == n_heads,
               f"{case}: the wrapper has {len(wrapper.heads)} heads, expected n_heads={n_heads}")
        for i, head in enumerate(wrapper.heads):
            expect(type(head) is CausalAttention, f"{case}: head {i} is a {type(head).__name__}; build the heads "
                                                  "with MultiHeadAttentionWrapper(d_model, head_dim, ...)")
            expect(head.W_query.out_features == head_dim and head.W_query.in_features == d_model,
                   f"{case}: head {i} maps {head.W_query.in_features} -> {head.W_query.out_features} features; "
                   f"each head should map d_model={d_model} -> head_dim={head_dim}")
            expect((head.W_query.bias is not None) == bias,
                   f"{case}: mha {'has' if bias else 'has no'} q/k/v biases, so the heads need bias={bias}")
        wrapper.eval()
        with torch.no_grad():
            mine = expect_tensor(wrapper(x), f"{case}: wrapper(x)", shape=(2, block_size, d_model))
            reference = _head_outputs(mha, x)  # (B, n_heads, T, head_dim)
            for i in range(n_heads):
                got = mine[..., i * head_dim : (i + 1) * head_dim]
                if _close(got, reference[:, i]):
                    continue
                for j in range(n_heads):
                    expect(not _close(got, reference[:, j]),
                           f"{case}: your head {i} computes mha's head {j}; keep the heads in order")
                raise Wrong(
                    f"{case}: head {i} gives the wrong output. It must use rows {i * head_dim}:{(i + 1) * head_dim} "
                    "(i*head_dim:(i+1)*head_dim) of each block of mha.qkv.weight: the q block is rows 0:d_model, "
                    "the k block d_model:2*d_model, the v block 2*d_model:3*d_model (and the same slices of "
                    "mha.qkv.bias)")
            expect_close(mha.out_proj(mine), mha(x), f"{case}: mha.out_proj(wrapper(x)) compared with mha(x)")


# ---------------------------------------------------------------- 04.2

#: 04.2 asks for einsum only: every other product and attention function is refused wherever reached from.
_EINSUM_ONLY = Refuse(
    "write every product with torch.einsum, not with @, torch.matmul, F.linear / nn.Linear or an attention "
    "function (the exercise asks for einsum only)",
    torch.matmul, torch.bmm, torch.mm, torch.Tensor.matmul, torch.Tensor.bmm, torch.Tensor.mm,
    torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, F.linear, F.scaled_dot_product_attention,
    attention, sdpa_attention, MultiHeadAttention, aten="scaled_dot_product")

#: reshaping operations: applied to the activations ``(B, T, ...)`` they split heads out of ``x``.
_RESHAPES = {"view", "reshape", "transpose", "permute", "split", "chunk", "unflatten", "movedim", "swapaxes",
             "swapdims", "view_as", "reshape_as", "tensor_split", "unsafe_split", "flatten", "as_strided"}


class _EinsumOnly(TorchFunctionMode):
    """Counts ``torch.einsum`` calls and refuses a reshape of the activations (a 3-D tensor ``(B, T, *)``)."""

    def __init__(self, B: int, T: int) -> None:
        super().__init__()
        self.B, self.T, self.einsums = B, T, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "einsum":
            self.einsums += 1
        elif name in _RESHAPES and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3 \
                and tuple(args[0].shape[:2]) == (self.B, self.T):
            raise Wrong(f"your code calls {name} on activations of shape {tuple(args[0].shape)}: reshape the "
                        "weights, not the activations (view w_qkv as (3, n_heads, head_dim, d_model) and w_out "
                        "as (d_model, n_heads, head_dim))")
        return func(*args, **(kwargs or {}))


def _mha_weights(mha: MultiHeadAttention):
    bias = mha.qkv.bias is not None
    return (mha.qkv.weight.detach(), mha.qkv.bias.detach() if bias else None,
            mha.out_proj.weight.detach(), mha.out_proj.bias.detach() if bias else None)


def _scaled_reference(mha: MultiHeadAttention, x: torch.Tensor, scale: float) -> torch.Tensor:
    B, T, d_model = x.shape
    q, k, v = (mha.split_heads(t, mha.n_heads) for t in mha.qkv(x).split(d_model, dim=-1))
    y = attention(q, k, v, is_causal=True, scale=scale)[0]
    return mha.out_proj(y.transpose(1, 2).reshape(B, T, d_model))  # (B, n_heads, T, head_dim) -> (B, T, d_model)


@exercise("04.2")
def check_mha_einsum(mha_einsum) -> None:
    """Check ``mha_einsum(x, w_qkv, b_qkv, w_out, b_out, n_heads)`` against a causal MultiHeadAttention."""
    g = case_rng()
    for n_heads, head_dim, bias in _sizes(g, [(3, 4, True), (4, 4, False), (2, 4, True), (1, 6, True)]):
        d_model, B, T = n_heads * head_dim, randint(g, 1, 3), randint(g, 2, 7)
        mha = _random_mha(d_model, n_heads, 8, bias, g)
        weights = _mha_weights(mha)
        x = torch.randn(B, T, d_model, generator=g)
        case = f"(d_model={d_model}, n_heads={n_heads}, T={T}, bias={bias})"
        what = f"mha_einsum{case}"
        with torch.no_grad():
            counter = _EinsumOnly(B, T)
            got = run(mha_einsum, x, *weights, n_heads, what=what, refuse=_EINSUM_ONLY, inside=(counter,))
            if got is None:
                raise NotSolved("return the output tensor of shape (B, T, d_model), not None")
            expect_tensor(got, f"{case}: the output", shape=(B, T, d_model))
            expect(counter.einsums >= 4,
                   f"{case}: torch.einsum ran {counter.einsums} time(s); write the projections, the scores, "
                   "the weighted sum and the output projection with torch.einsum (at least 4 calls)")
            expected = mha(x)
            if _close(got, expected):
                continue
            x2 = x.clone()
            x2[:, -1] = torch.randn(B, d_model, generator=g)
            moved_out = run(mha_einsum, x2, *weights, n_heads, what=what, refuse=_EINSUM_ONLY,
                            inside=(_EinsumOnly(B, T),))
            moved = (expect_tensor(moved_out, what)[:, :-1] - got[:, :-1]).abs().max().item()
            expect(moved < 1e-6, f"{case}: changing the last token moved the outputs at earlier positions (by "
                                 f"up to {moved:.3g}): mask the scores so query t only sees keys <= t")
            expect(not _close(got, _scaled_reference(mha, x, 1.0 / math.sqrt(d_model))),
                   f"{case}: you scale the scores by 1/sqrt(d_model); each head's dot products have head_dim="
                   f"{head_dim} terms, so scale by 1/sqrt(head_dim)")
            if bias:
                no_bias = _scaled_reference(mha, x, 1.0 / math.sqrt(head_dim)) - weights[3]
                expect(not _close(got, no_bias), f"{case}: b_out is missing: add the output projection's bias")
            if n_heads > 1:
                w_t = MultiHeadAttention(d_model, n_heads, block_size=8, bias=bias, attn_fn="eager").eval()
                w_t.load_state_dict(mha.state_dict())
                w_t.out_proj.weight.copy_(mha.out_proj.weight.T)
                expect(not _close(got, w_t(x)),
                       f"{case}: w_out is in nn.Linear's layout (out features, in features): view it as "
                       "(d_model, n_heads, head_dim), the input features (the concatenated heads) last")
            expect_close(got, expected, f"{case}: your output (split w_qkv's rows into q, k, v blocks of d_model "
                                        "rows; head h takes rows h*head_dim:(h+1)*head_dim of each block)")


# ---------------------------------------------------------------- 04.3


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
    y = attention(q * keep[None, :, None, None], k, v, is_causal=True)[0]
    B, _, T, _ = y.shape
    return mha.out_proj(y.transpose(1, 2).reshape(B, T, mha.d_model))


@exercise("04.3")
def check_mha_without_heads(mha_without_heads) -> None:
    """Check ``mha_without_heads(mha, x, keep)``: ``mha(x)`` with the heads where ``keep`` is False silenced."""
    g = case_rng()
    cases = [(3, (True, False, True), True), (4, (False, True, True, False), True),
             (4, (True, True, False, True), False), (3, (True, True, True), True), (3, (False, False, False), True)]
    for _ in range(3):
        n = randint(g, 2, 6)
        cases.append((n, tuple(bool(b) for b in torch.randint(0, 2, (n,), generator=g)), bool(randint(g, 0, 1))))
    for n_heads, keep_list, bias in cases:
        head_dim, T = randint(g, 2, 4), randint(g, 2, 6)
        d_model = n_heads * head_dim
        mha = _random_mha(d_model, n_heads, 8, bias, g)
        x = torch.randn(2, T, d_model, generator=g)
        keep = torch.tensor(keep_list)
        case = f"(n_heads={n_heads}, keep={keep.tolist()}, bias={bias})"
        with torch.no_grad():
            got = run(mha_without_heads, mha, x, keep, what=f"mha_without_heads{case}")
            if got is None:
                raise NotSolved("return the output tensor of shape (B, T, d_model), not None")
            expected = _without_heads(mha, x, keep)
            got = expect_tensor(got, f"{case}: the output", shape=tuple(expected.shape)).detach()
            if _close(got, expected):
                continue
            mistakes = [
                (_without_heads(mha, x, ~keep), "you switched off the heads where keep is True; True means keep "
                                                "the head"),
                (_without_heads(mha, x, keep, zero="output"), "you zeroed features of the output; a head's output "
                 "is an input of out_proj: zero its slice of the concatenation (before out_proj), so W^O never "
                 "sees it"),
                (_queries_zeroed(mha, x, keep), "a head with zero queries still attends (uniformly over its past) "
                                                "and still adds its values; zero the head's output, not its queries"),
                (_without_heads(mha, x, keep, keep_bias=False), "out_proj's bias belongs to no head: keep it"),
                (_without_heads(mha, x, keep, rescale=True), "do not rescale the heads that are kept (this is not "
                                                            "dropout)"),
                (mha(x), "this is mha(x) with every head on; switch off the heads where keep is False"),
            ]
            for other, hint in mistakes:
                expect(not _close(got, other), f"{case}: {hint}")
            expect_close(got, expected, f"{case}: your output")
