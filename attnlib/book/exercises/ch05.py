"""Exercise checks for chapter 05 (talking heads): the mixed weights, where a layer leaks from, convex mixing.

* 05.1 ``talking_heads_weights(q, k, mix_logits, mix_weights, mask=None)`` -> ``(B, n_heads, T_q, T_k)``
* 05.2 ``leaking_positions(module, t, T, d_model)`` -> bool ``(T,)``: the positions after ``t`` that reach output ``t``
* 05.3 ``convex_mix(weights, mix_raw)`` -> ``(B, n_heads, T_q, T_k)``: heads mixed by ``softmax(mix_raw, dim=-1)``

Mixing matrices are indexed ``[output head, input head]``, as ``TalkingHeadsAttention.mix_logits``.
Every learner call goes through :func:`~attnlib.book.exercises._run.run`; each check has fixed edge
cases and fresh random ones from :func:`~attnlib.book.exercises._core.case_rng`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib.attention import attention, causal_mask, padding_mask
from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.attention.talking_heads import BiasedTalkingHeadsAttention, TalkingHeadsAttention
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run

__all__ = ["check_talking_heads_weights", "check_leaking_positions", "check_convex_mix"]


# ------------------------------------------------------------------------------------------ 05.1
def _reference_weights(q, k, mix_logits, mix_weights, mask):
    """attnlib's talking-heads weights for the given queries, keys, mixing and mask (no causal mask added)."""
    B, n_heads, T_k, head_dim = k.shape
    module = TalkingHeadsAttention(n_heads * head_dim, n_heads, block_size=T_k, causal=False).eval()  # mask: all of it
    with torch.no_grad():
        module.mix_logits.copy_(mix_logits)
        module.mix_weights.copy_(mix_weights)
        v = torch.zeros(B, n_heads, T_k, 1)
        _, weights = module.attend(q, k, v, mask, is_causal=False, need_weights=True)
    return weights


def _mask_then_mix(q, k, mix_logits, mix_weights, mask, zero_masked, fill=-1e9):
    """The mistake of masking with a finite number before the pre-softmax mixing."""
    logits = torch.einsum("brie,brje->brij", q, k) / math.sqrt(q.shape[-1])
    logits = torch.einsum("brij,sr->bsij", logits.masked_fill(~mask, fill), mix_logits)
    weights = torch.softmax(logits, dim=-1)
    if zero_masked:
        weights = weights.masked_fill(~mask, 0.0)
    return torch.einsum("bsij,us->buij", weights, mix_weights)


def _cases_05_1(g: torch.Generator):
    """(description, q, k, mix_logits, mix_weights, mask); each mask has the scores' rank, 4."""
    cases = []

    def mixing(n_heads):
        return torch.randn(n_heads, n_heads, generator=g), torch.randn(n_heads, n_heads, generator=g)

    q, k = torch.randn(2, 2, 4, 5, 3, generator=g).unbind(0)  # B=2, n_heads=4, T=5, head_dim=3
    cases.append(("a causal mask", q, k, *mixing(4), causal_mask(5)[None, None]))  # (1, 1, T, T)
    q, k = torch.randn(2, 1, 2, 4, 8, generator=g).unbind(0)
    cases.append(("mask=None", q, k, *mixing(2), None))
    q, k = torch.randn(2, 2, 3, 6, 4, generator=g).unbind(0)
    real = padding_mask(torch.tensor([6, 2]), 6).flip(-1)  # (B, T), True = real token, padded on the left
    left_padded = causal_mask(6) & real[:, None, :]  # (B, T, T); rows 0..3 of sequence 1 are empty
    cases.append(("a left-padded causal mask (some rows have no key at all)", q, k, *mixing(3),
                  left_padded.unsqueeze(1)))
    q = torch.randn(1, 4, 2, 4, generator=g)
    k = torch.randn(1, 4, 6, 4, generator=g)
    cases.append(("2 queries over 6 keys (bottom-right causal mask)", q, k, *mixing(4), causal_mask(2, 6)[None, None]))
    for _ in range(2):  # fresh sizes and a fresh left padding each run
        B, h, T, d = randint(g, 1, 3), randint(g, 2, 5), randint(g, 3, 8), randint(g, 2, 6)
        q, k = torch.randn(2, B, h, T, d, generator=g).unbind(0)
        lengths = torch.randint(0, T + 1, (B,), generator=g)
        real = (torch.arange(T)[None, :] >= T - lengths[:, None])  # (B, T), padded on the left
        mask = (causal_mask(T) & real[:, None, :]).unsqueeze(1)  # (B, 1, T, T)
        cases.append((f"a left-padded causal mask, lengths {lengths.tolist()}", q, k, *mixing(h), mask))
    return cases


#: 05.1 asks for the weights by hand: attnlib's talking-heads layers are refused wherever they are reached from.
_BY_HAND = Refuse("write the talking-heads weights yourself, not with attnlib's TalkingHeadsAttention",
                  TalkingHeadsAttention, BiasedTalkingHeadsAttention)


@exercise("05.1")
def check_talking_heads_weights(fn) -> None:
    """Check hand-written talking-heads weights against ``TalkingHeadsAttention.attend``."""
    g = case_rng()
    for what, q, k, P_l, P_w, mask in _cases_05_1(g):
        label = f"talking_heads_weights with {what}"
        answer = run(fn, q, k, P_l, P_w, mask, what=label, refuse=_BY_HAND)
        expected = _reference_weights(q, k, P_l, P_w, mask)
        answer = expect_tensor(answer, label, shape=tuple(expected.shape)).detach().float()
        expect(not bool(torch.isnan(answer).any()),
               f"{label} contains NaN: mask the logits after mixing them (-inf * 0 is NaN), and give rows with "
               f"nothing to attend to zero weights")
        if torch.allclose(answer, expected, atol=1e-5, rtol=1e-4):
            continue
        alternatives = [
            ("you mixed with mix[h, g] instead of mix[g, h]: the matrices are [output head, input head], "
             "einsum('bhij,gh->bgij', logits, mix)", (q, k, P_l.T, P_w.T, mask)),
            ("mix_logits was not applied to the logits before the softmax", (q, k, torch.eye(len(P_l)), P_w, mask)),
            ("mix_weights was not applied to the weights after the softmax", (q, k, P_l, torch.eye(len(P_w)), mask)),
            ("the logits are not scaled: divide q k^T by sqrt(head_dim)", (q * math.sqrt(q.shape[-1]), k, P_l, P_w, mask)),
        ]
        for hint, args in alternatives:
            if torch.allclose(answer, _reference_weights(*args), atol=1e-5, rtol=1e-4):
                expect(False, f"{label}: {hint}")
        if mask is not None:
            for zero_masked in (True, False):
                masked_first = _mask_then_mix(q, k, P_l, P_w, mask, zero_masked)
                if torch.allclose(answer, masked_first, atol=1e-5, rtol=1e-4):
                    expect(False, f"{label}: you masked the logits (with a finite number) before mixing them; "
                                  f"a negative entry of mix_logits turns -1e9 into +1e9 and a masked key wins. "
                                  f"Mix first, then mask with -inf")
        if mask is not None:
            hidden = ~mask.expand_as(expected)
            expect(bool((answer[hidden] == 0).all()),
                   f"{label}: a masked key got a non-zero weight; after the softmax set masked cells to 0, and "
                   f"mix the weights without any bias")
        diff = (answer.double() - expected.double()).abs().max().item()
        expect(False, f"{label} differs from attnlib's weights (max abs difference {diff:.3g}); the order is: "
                      f"scaled logits, mix with mix_logits, mask with -inf, softmax, zero masked cells, "
                      f"mix with mix_weights")


# ------------------------------------------------------------------------------------------ 05.2
class _MaskedAttention(nn.Module):
    """Multi-head attention whose mask also lets query i see the key ``offset`` positions ahead."""

    def __init__(self, d_model: int, n_heads: int, offset: int) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(d_model, n_heads, causal=False, attn_fn="eager")
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        mask = ((j <= i) | (j == i + self.offset))[None, None]  # (1, 1, T, T): every sequence, every head
        return self.attn(x, mask=mask)  # (B, T, d_model)


def _talking_heads(
    d_model: int,
    n_heads: int,
    g: torch.Generator,
    cls=TalkingHeadsAttention,
    bias: float | None = None,
    dropout: float = 0.0,
):
    module = cls(d_model, n_heads, block_size=16, dropout=dropout)
    with torch.no_grad():
        module.mix_logits.copy_(torch.randn(n_heads, n_heads, generator=g))
        module.mix_weights.copy_(torch.randn(n_heads, n_heads, generator=g))
        if bias is not None:
            module.mix_weights_bias.fill_(bias)
    return module


@exercise("05.2")
def check_leaking_positions(fn) -> None:
    """Check a per-position leak finder on causal, biased and partly unmasked layers."""
    g = case_rng()
    T, d_model, n_heads = randint(g, 6, 9), 16, 4
    torch.manual_seed(randint(g, 0, 2**31))  # the modules' own projections
    after = torch.arange(T)
    ahead = randint(g, 2, 3)  # the mask that opens one key ahead: which one, fresh each run
    modules = [
        ("TalkingHeadsAttention with random mixing", _talking_heads(d_model, n_heads, g), lambda t: after < 0,
         "a causal layer was reported as leaking"),
        ("TalkingHeadsAttention with dropout 0.2, in training mode",
         _talking_heads(d_model, n_heads, g, dropout=0.2).train(),
         lambda t: after < 0, "dropout makes two runs differ by chance: call module.eval() before comparing"),
        ("BiasedTalkingHeadsAttention (bias 0.01)", _talking_heads(d_model, n_heads, g, BiasedTalkingHeadsAttention, 0.01),
         lambda t: after > t, "a bias after the softmax puts weight on every key after t"),
        ("BiasedTalkingHeadsAttention with bias 1e-4", _talking_heads(d_model, n_heads, g, BiasedTalkingHeadsAttention, 1e-4),
         lambda t: after > t, "a leak of about 1e-4 went unnoticed: use a tight tolerance (1e-6)"),
        (f"attention whose mask also opens the key {ahead} ahead", _MaskedAttention(d_model, n_heads, ahead),
         lambda t: after == t + ahead,
         f"only position t + {ahead} reaches output t here: redraw one position s at a time, not everything "
         "from s on"),
        ("attention whose mask also opens the key 1 ahead", _MaskedAttention(d_model, n_heads, 1),
         lambda t: after == t + 1, "only position t + 1 reaches output t here"),
    ]
    torch.manual_seed(randint(g, 0, 2**31))  # a learner's probe may draw from the global generator
    for name, module, expected_of, hint in modules:
        for t in (0, randint(g, 1, T - 3), T - 1):
            expected = expected_of(t)
            what = f"leaking_positions(<{name}>, t={t}, T={T})"
            answer = run(fn, module, t, T, d_model, what=what)
            expect_tensor(answer, what, shape=(T,))
            expect(answer.dtype == torch.bool, f"{what} returned dtype {answer.dtype}; return a boolean tensor")
            expect(not bool(answer[: t + 1].any()),
                   f"{what} marked positions <= t: those are the past, which output t may read; only positions "
                   f"after t can leak")
            if not torch.equal(answer, expected):
                got, want = answer.nonzero().flatten().tolist(), expected.nonzero().flatten().tolist()
                expect(False, f"{what} returned positions {got}, expected {want}: {hint}")


# ------------------------------------------------------------------------------------------ 05.3
def _reference_convex_mix(weights: torch.Tensor, mix_raw: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bgij,fg->bfij", weights, torch.softmax(mix_raw, dim=-1))  # (B, n_heads, T_q, T_k)


def _cases_05_3(g: torch.Generator):
    """(description, weights, mask, mix_raw)."""
    cases = []
    q, k, v = torch.randn(3, 2, 4, 5, 3, generator=g).unbind(0)
    _, w = attention(q, k, v, mask=causal_mask(5)[None, None])  # mask (1, 1, T, T) for scores (B, n_heads, T, T)
    cases.append(("causal weights", w, causal_mask(5).expand_as(w), 2.0 * torch.randn(4, 4, generator=g)))
    q, k, v = torch.randn(3, 2, 3, 6, 4, generator=g).unbind(0)
    real = padding_mask(torch.tensor([6, 3]), 6).flip(-1)  # (B, T), True = real token, padded on the left
    mask = causal_mask(6) & real[:, None, None, :]  # (T, T) & (B, 1, 1, T) -> (B, 1, T, T)
    _, w = attention(q, k, v, mask=mask)
    cases.append(("left-padded weights (some rows empty)", w, mask.expand_as(w), torch.randn(3, 3, generator=g)))
    q, k, v = torch.randn(3, 1, 4, 4, 2, generator=g).unbind(0)
    _, w = attention(q, k, v, mask=causal_mask(4)[None, None])
    cases.append(("mix_raw = 0 (every head becomes the average of all heads)", w, causal_mask(4).expand_as(w),
                  torch.zeros(4, 4)))
    cases.append(("mix_raw with entries near +-100", w, causal_mask(4).expand_as(w),
                  100.0 * torch.randn(4, 4, generator=g).sign()))
    for _ in range(2):  # fresh sizes each run
        B, h, T = randint(g, 1, 3), randint(g, 2, 5), randint(g, 2, 7)
        q, k, v = torch.randn(3, B, h, T, 3, generator=g).unbind(0)
        _, w = attention(q, k, v, mask=causal_mask(T)[None, None])
        cases.append((f"{h} heads, T={T}", w, causal_mask(T).expand_as(w), 3.0 * torch.randn(h, h, generator=g)))
    return cases


@exercise("05.3")
def check_convex_mix(fn) -> None:
    """Check a head mixing whose coefficients are a softmax over the input heads."""
    g = case_rng()
    for what, weights, mask, mix_raw in _cases_05_3(g):
        label = f"convex_mix with {what}"
        answer = run(fn, weights, mix_raw, what=label)
        expected = _reference_convex_mix(weights, mix_raw)
        answer = expect_tensor(answer, label, shape=tuple(expected.shape)).detach().float()
        expect(bool(torch.isfinite(answer).all()),
               f"{label} is not finite: exp of large scores overflows; use torch.softmax (it subtracts the maximum)")
        expect(bool((answer[~mask] == 0).all()), f"{label}: a masked weight became non-zero; mix without a bias")
        expect(bool((answer >= -1e-6).all()),
               f"{label} has negative weights: every mixing coefficient must be >= 0 (a softmax of mix_raw)")
        row_sums = answer.sum(-1)
        want_sums = mask.any(-1).to(answer.dtype)  # 1 for rows with a key, 0 for empty rows
        if torch.allclose(answer, expected, atol=1e-5, rtol=1e-4):
            continue
        if torch.allclose(answer, _reference_convex_mix(weights, mix_raw.T), atol=1e-5, rtol=1e-4):
            expect(False, f"{label}: you used mix_raw[h, g]; mix_raw is [output head, input head], so output head f "
                          f"uses row f of softmax(mix_raw, dim=-1)")
        expect(torch.allclose(row_sums, want_sums, atol=1e-5),
               f"{label}: rows should sum to 1 (or 0 where the query saw no key), got sums from "
               f"{row_sums.min().item():.3f} to {row_sums.max().item():.3f}; each output head's coefficients must "
               f"sum to 1: softmax over the input heads, the last dimension of mix_raw")
        expect_close(answer, expected, label)
