"""Exercise checks for chapter 09 (cross-attention and target attention).

* 09.1 ``cross_attention_weights(q, k, attention_mask=None)`` -> ``(B, T_q, T_k)``: one head of cross-attention
  weights, ``q`` ``(B, T_q, d)``, ``k`` ``(B, T_k, d)``, mask ``(B, T_k)`` bool, True = real key
* 09.2 ``additive_attention(s, m, W_s, W_m, w, mask=None)`` -> ``(context, weights)``: the additive
  cross-attention of Bahdanau et al. (2015), ``e_ij = w . tanh(W_s s_i + W_m m_j)``, encoder states ``m``
  (memory; Bahdanau et al. write ``h_j``)
* 09.3 ``rank_auc(scores, labels)`` -> float: ROC AUC from ranks, ties counted one half

Every learner call goes through :func:`run`; each check has fixed edge cases and fresh ones drawn
from :func:`case_rng`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlib.attention import attention
from attnlib.attention.masks import masked_softmax
from attnlib.book.exercises._core import (
    NotSolved,
    case_rng,
    exercise,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import HF_ATTENTION, Refuse, run

__all__ = ["check_additive_attention", "check_cross_attention_weights", "check_rank_auc"]


# ------------------------------------------------------------------------------------------ 09.1
def _reference_cross_weights(q, k, attention_mask):
    mask = None if attention_mask is None else attention_mask[:, None, :]  # (B, T_k) -> (B, 1, T_k)
    v = torch.zeros(*k.shape[:-1], 1)
    return attention(q, k, v, mask)[1]


#: 09.1 asks for the weights written out: attnlib's attention (which returns them) and SDPA are refused.
_BY_HAND = Refuse("write the weights with tensor operations, not with attnlib's attention, its masked "
                  "softmax, SDPA or transformers' attention",
                  attention, F.scaled_dot_product_attention, masked_softmax, named=HF_ATTENTION,
                  # torch.ops.aten.scaled_dot_product_attention decomposes before a dispatch mode sees it;
                  # its math path is the only user of aten._safe_softmax (torch.softmax is aten._softmax)
                  aten=("scaled_dot_product", "_safe_softmax"))


def _lengths_mask(lengths: list[int], T_k: int) -> torch.Tensor:
    return torch.arange(T_k)[None, :] < torch.tensor(lengths)[:, None]  # (B, T_k), True = real


@exercise("09.1")
def check_cross_attention_weights(fn) -> None:
    """Check one head of cross-attention weights with a key padding mask against ``attnlib.attention.attention``."""
    g = case_rng()
    sizes = [  # (what, B, T_q, T_k, d, lengths or None)
        ("T_q=3 queries over T_k=5 keys, no mask", 2, 3, 5, 4, None),
        ("T_q=4 over T_k=6 with lengths (6, 2)", 2, 4, 6, 8, [6, 2]),
        ("T_q=5 over T_k=3 (more queries than keys) with lengths (3, 1)", 2, 5, 3, 4, [3, 1]),
        ("a context with no real position (length 0)", 2, 2, 3, 4, [3, 0]),
    ]
    B, T_q, T_k = randint(g, 1, 4), randint(g, 1, 7), randint(g, 2, 9)
    lengths = torch.randint(0, T_k + 1, (B,), generator=g).tolist()
    sizes.append((f"T_q={T_q} over T_k={T_k} with lengths {tuple(lengths)}", B, T_q, T_k, randint(g, 2, 9), lengths))
    for what, B, T_q, T_k, d, lengths in sizes:
        q, k = torch.randn(B, T_q, d, generator=g), torch.randn(B, T_k, d, generator=g)
        mask = None if lengths is None else _lengths_mask(lengths, T_k)
        label = f"cross_attention_weights with {what}"
        answer = run(fn, q, k, mask, what=label, refuse=_BY_HAND)
        if answer is None:
            raise NotSolved("return the weights of shape (B, T_q, T_k), not None")
        expected = _reference_cross_weights(q, k, mask)
        expect_tensor(answer, label, shape=tuple(expected.shape), dtype=q.dtype)
        answer = answer.detach().double()
        expect(not bool(torch.isnan(answer).any()),
               f"{label} contains NaN: a query whose context has no real position must get zero weights")
        if mask is not None:
            empty = ~mask.any(-1)  # (B,): contexts with no real position
            if bool(empty.any()) and torch.allclose(answer[empty], torch.full_like(answer[empty], 1 / T_k)):
                expect(False, f"{label}: a query whose context has no real position gets the uniform weights "
                              f"1/T_k = {1 / T_k:.3g}: a finite fill (such as -1e9) makes every score of that row "
                              "equal; zero the weights of rows with no real key")
            expect(bool((answer.masked_select(~mask[:, None, :].expand_as(answer)) == 0).all()),
                   f"{label}: a padded key (mask False) got a non-zero weight; mask the scores of the keys (last axis), "
                   f"True = real")
        ones = torch.ones(T_q, T_k, dtype=torch.bool)
        for tril in (ones.tril(), ones.tril(T_k - T_q)):
            # the source's bug: a lower triangle over the context's keys (top-left or bottom-right aligned)
            full = tril[None] if mask is None else tril & mask[:, None, :]  # (1 or B, T_q, T_k): the scores' rank
            with_tril = attention(q, k, torch.zeros(*k.shape[:-1], 1), full)[1].double()
            same = torch.allclose(with_tril.nan_to_num(), expected.double().nan_to_num(), atol=1e-6)
            expect(same or not torch.allclose(answer, with_tril.nan_to_num(), atol=1e-6),
                   f"{label}: your weights are zero above a diagonal; cross-attention has no causal mask, "
                   f"every query may see every real key of the context")
        unscaled = _reference_cross_weights(q * q.shape[-1] ** 0.5, k, mask)
        expect(torch.allclose(unscaled, expected, atol=1e-6) or not torch.allclose(answer, unscaled.double(), atol=1e-6),
               f"{label}: scale the scores by 1/sqrt(d) before the softmax")
        expect_close(answer, expected.double(), label, atol=1e-5)


# ------------------------------------------------------------------------------------------ 09.2
def _additive(s, m, W_s, W_m, w, mask=None, *, tanh=True, scale=False):
    """Bahdanau et al. (2015) attention: e_ij = w . tanh(W_s s_i + W_m m_j), softmax over j."""
    features = (s @ W_s.T)[:, :, None, :] + (m @ W_m.T)[:, None, :, :]  # (B, T_q, T_k, d_a)
    scores = (torch.tanh(features) if tanh else features) @ w  # (B, T_q, T_k)
    if scale:
        scores = scores / W_s.shape[0] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ m, weights  # (B, T_q, d_m), (B, T_q, T_k)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b.double(), atol=1e-5)


@exercise("09.2")
def check_additive_attention(fn) -> None:
    """Check Bahdanau-style additive cross-attention against a reference (weights and context)."""
    g = case_rng()
    cases = [  # (B, T_q, T_k, d_s, d_m, d_a, lengths)
        (2, 3, 5, 4, 6, 7, None),
        (2, 4, 6, 5, 3, 8, (6, 2)),
        (3, 5, 3, 4, 4, 4, (3, 1, 2)),  # more queries than keys
        (1, 1, 7, 2, 5, 3, (4,)),
    ]
    B, T_k = randint(g, 1, 3), randint(g, 2, 8)
    cases.append((B, randint(g, 1, 6), T_k, randint(g, 2, 6), randint(g, 2, 6), randint(g, 2, 9),
                  tuple(torch.randint(1, T_k + 1, (B,), generator=g).tolist())))
    for B, T_q, T_k, d_s, d_m, d_a, lengths in cases:
        s = torch.randn(B, T_q, d_s, generator=g)
        m = torch.randn(B, T_k, d_m, generator=g)
        W_s = torch.randn(d_a, d_s, generator=g) / d_s**0.5
        W_m = torch.randn(d_a, d_m, generator=g) / d_m**0.5
        w = torch.randn(d_a, generator=g)
        mask = None if lengths is None else torch.arange(T_k)[None, :] < torch.tensor(lengths)[:, None]
        label = (f"additive_attention with B={B}, T_q={T_q}, T_k={T_k}, d_s={d_s}, d_m={d_m}, "
                 f"d_a={d_a}, " + ("no mask" if mask is None else f"lengths {lengths}"))
        out = run(fn, s, m, W_s, W_m, w, mask, what=label)
        if out is None:
            raise NotSolved("return (context, weights), not None")
        expect(type(out) is tuple and len(out) == 2,
               f"{label}: return a pair (context, weights); got {type(out).__name__}")
        context, weights = out
        expect_tensor(weights, f"{label}: the weights")
        expect_tensor(context, f"{label}: the context")
        if weights.dim() == 3 and tuple(context.shape) == (B, T_q, T_k) != (B, T_q, d_m) \
                and tuple(weights.shape) == (B, T_q, d_m):
            expect(False, f"{label}: return (context, weights) in this order; yours are the other way round")
        expected_c, expected_w = _additive(s, m, W_s, W_m, w, mask)
        expect(isinstance(weights, torch.Tensor) and tuple(weights.shape) == tuple(expected_w.shape),
               f"{label}: weights should have shape (B, T_q, T_k) = {tuple(expected_w.shape)}; got "
               f"{tuple(getattr(weights, 'shape', ()))}")
        weights = weights.detach().double()
        expect(not bool(torch.isnan(weights).any()), f"{label}: the weights contain NaN")
        if mask is not None:
            padded = ~mask[:, None, :].expand_as(weights)
            expect(bool((weights[padded] == 0).all()),
                   f"{label}: a padded key (mask False) got a non-zero weight; set its score to -inf "
                   "before the softmax")
        sums = weights.sum(dim=-1)
        if not torch.allclose(sums, torch.ones_like(sums), atol=1e-5):
            if torch.allclose(weights.sum(dim=-2), torch.ones_like(weights.sum(dim=-2)), atol=1e-5):
                expect(False, f"{label}: your weights sum to 1 over the queries; the softmax runs over "
                              "the keys (the last axis): each query distributes its attention over the "
                              "source positions")
            expect(False, f"{label}: each query's weights should sum to 1 over the real keys; mask the "
                          "scores with -inf before the softmax (zeroing weights after it leaves rows "
                          "that no longer sum to 1)")
        if not _close(weights, expected_w):
            expect(not _close(weights, _additive(s, m, W_s, W_m, w, mask, tanh=False)[1]),
                   f"{label}: the score is w . tanh(W_s s_i + W_m m_j); you left out the tanh")
            expect(not _close(weights, _additive(s, m, W_s, W_m, w, mask, scale=True)[1]),
                   f"{label}: additive attention has no 1/sqrt(d) scale; that belongs to dot-product "
                   "attention")
            expect_close(weights, expected_w.double(), f"{label}: the weights")
        expect(isinstance(context, torch.Tensor) and tuple(context.shape) == tuple(expected_c.shape),
               f"{label}: the context should be the weighted sum of the encoder states m, shape "
               f"(B, T_q, d_m) = {tuple(expected_c.shape)}; got {tuple(getattr(context, 'shape', ()))}")
        expect_close(context, expected_c, f"{label}: the context vectors (weights @ m)")


# ------------------------------------------------------------------------------------------ 09.3
def _pairwise_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a random positive > score of a random negative) + 1/2 P(equal), by counting pairs."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    greater = (pos[:, None] > neg[None, :]).double().sum()
    equal = (pos[:, None] == neg[None, :]).double().sum()
    return ((greater + 0.5 * equal) / (len(pos) * len(neg))).item()


@exercise("09.3")
def check_rank_auc(fn) -> None:
    """Check a rank-based AUC against counting pairs, with and without ties."""
    g = case_rng()
    n = randint(g, 50, 400)
    cases = [
        ("continuous scores (no ties)", torch.randn(n, generator=g), (torch.rand(n, generator=g) < 0.3).long()),
        ("scores with many ties (rounded to 1 decimal)", torch.randn(300, generator=g).round(decimals=1),
         (torch.rand(300, generator=g) < 0.5).long()),
        ("a perfect ranking", torch.arange(10.0), (torch.arange(10) >= 6).long()),
        ("all scores equal", torch.zeros(8), torch.tensor([0, 1, 0, 1, 1, 0, 0, 0])),
        ("float labels 0.0/1.0", torch.randn(50, generator=g), (torch.rand(50, generator=g) < 0.5).float()),
        ("integer scores (a tie in almost every pair)", torch.randint(0, 4, (n,), generator=g),
         (torch.rand(n, generator=g) < 0.4).long()),
    ]
    for what, scores, labels in cases:
        if not 0 < int((labels == 1).sum()) < len(labels):  # a fresh draw with one class only: give it both
            labels[0], labels[1] = 1, 0
        label = f"rank_auc with {what}"
        answer = run(fn, scores, labels, what=label)
        if answer is None:
            raise NotSolved("return the AUC as a float, not None")
        answer = expect_number(answer, label)
        expected = _pairwise_auc(scores.double(), labels)
        if abs(answer - (1 - expected)) < 1e-6 and abs(expected - 0.5) > 1e-3:
            expect(False, f"{label} gave {answer:.4f}, expected {expected:.4f}: you ranked the scores in the wrong "
                          f"direction (rank 1 = the lowest score)")
        n_pos = int((labels == 1).sum())
        from_zero = expected - n_pos / (n_pos * (len(labels) - n_pos))
        expect(abs(answer - from_zero) > 1e-9 or abs(answer - expected) < 1e-6,
               f"{label} gave {answer:.6f}, expected {expected:.6f}: the ranks start at 1 for the "
               "lowest score, not at 0")
        expect(abs(answer - expected) < 1e-6,
               f"{label} gave {answer:.6f}, expected {expected:.6f}"
               + ("; tied scores must share the average of their ranks" if "tie" in what or "equal" in what else ""))
