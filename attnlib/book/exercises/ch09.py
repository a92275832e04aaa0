"""Exercise checks for chapter 09 (cross-attention and target attention).

* 09.1 ``cross_attention_weights(q, k, key_padding_mask=None)`` -> ``(B, T_q, T_k)``: one head of cross-attention
  weights, ``q`` ``(B, T_q, d)``, ``k`` ``(B, T_k, d)``, mask ``(B, T_k)`` bool, True = real key
* 09.2 ``din_inputs(e, v)`` -> ``(B, T, 4d)``: the activation unit's input ``[e, v, e*v, e-v]``
* 09.3 ``rank_auc(scores, labels)`` -> float: ROC AUC from ranks, ties counted one half

The graders draw their random inputs from a local ``torch.Generator``; ``grade`` runs them inside
``torch.random.fork_rng``, so checking an answer never changes the notebook's random state.
"""
from __future__ import annotations

import torch

from attnlib.attention.target import TargetAttention
from attnlib.book.exercises._core import exercise, expect, expect_close
from attnlib.functional import attention

__all__ = ["check_cross_attention_weights", "check_din_inputs", "check_rank_auc"]


# ------------------------------------------------------------------------------------------ 09.1
def _reference_cross_weights(q, k, key_padding_mask):
    mask = None if key_padding_mask is None else key_padding_mask[:, None, :]  # (B, T_k) -> (B, 1, T_k)
    v = torch.zeros(*k.shape[:-1], 1)
    return attention(q, k, v, mask)[1]


@exercise("09.1")
def check_cross_attention_weights(fn) -> None:
    """Check one head of cross-attention weights with a key padding mask against ``attnlib.functional.attention``."""
    g = torch.Generator().manual_seed(91)
    cases = [
        ("T_q=3 queries over T_k=5 keys, no mask", torch.randn(2, 3, 4, generator=g), torch.randn(2, 5, 4, generator=g),
         None),
        ("T_q=4 over T_k=6 with lengths (6, 2)", torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 8, generator=g),
         torch.arange(6)[None, :] < torch.tensor([6, 2])[:, None]),
        ("T_q=5 over T_k=3 (more queries than keys) with lengths (3, 1)", torch.randn(2, 5, 4, generator=g),
         torch.randn(2, 3, 4, generator=g), torch.arange(3)[None, :] < torch.tensor([3, 1])[:, None]),
        ("a context with no real position (length 0)", torch.randn(2, 2, 4, generator=g),
         torch.randn(2, 3, 4, generator=g), torch.arange(3)[None, :] < torch.tensor([3, 0])[:, None]),
    ]
    for what, q, k, mask in cases:
        expected = _reference_cross_weights(q, k, mask)
        answer = fn(q.clone(), k.clone(), None if mask is None else mask.clone())
        label = f"cross_attention_weights with {what}"
        expect(isinstance(answer, torch.Tensor), f"{label} should return a torch.Tensor, got {type(answer).__name__}")
        expect(tuple(answer.shape) == tuple(expected.shape),
               f"{label} returned shape {tuple(answer.shape)}, expected (B, T_q, T_k) = {tuple(expected.shape)}")
        answer = answer.detach().double()
        expect(not bool(torch.isnan(answer).any()),
               f"{label} contains NaN: a query whose context has no real position must get zero weights")
        if mask is not None:
            expect(bool((answer.masked_select(~mask[:, None, :].expand_as(answer)) == 0).all()),
                   f"{label}: a padded key (mask False) got a non-zero weight; mask the scores of the keys (last axis), "
                   f"True = real")
        T_q, T_k = q.shape[1], k.shape[1]
        ones = torch.ones(T_q, T_k, dtype=torch.bool)
        for tril in (ones.tril(), ones.tril(T_k - T_q)):
            # the source's bug: a lower triangle over the context's keys (top-left or bottom-right aligned)
            full = tril[None] if mask is None else tril & mask[:, None, :]  # (1 or B, T_q, T_k): the scores' rank
            with_tril = attention(q, k, torch.zeros(*k.shape[:-1], 1), full)[1].double()
            expect(torch.equal(tril, torch.ones_like(tril)) or not torch.allclose(answer, with_tril, atol=1e-6),
                   f"{label}: your weights are zero above a diagonal; cross-attention has no causal mask, "
                   f"every query may see every real key of the context")
        unscaled = _reference_cross_weights(q * q.shape[-1] ** 0.5, k, mask)
        expect(not torch.allclose(answer, unscaled.double(), atol=1e-6),
               f"{label}: scale the scores by 1/sqrt(d) before the softmax")
        expect_close(answer, expected.double(), label, atol=1e-5)


# ------------------------------------------------------------------------------------------ 09.2
@exercise("09.2")
def check_din_inputs(fn) -> None:
    """Check the activation unit's input ``[e, v, e*v, e-v]`` against ``TargetAttention.activation_inputs``."""
    g = torch.Generator().manual_seed(92)
    for B, T, d in [(2, 3, 4), (1, 7, 2), (3, 1, 5)]:
        e, v = torch.randn(B, d, generator=g), torch.randn(B, T, d, generator=g)
        expected = TargetAttention.activation_inputs(e, v)
        answer = fn(e.clone(), v.clone())
        label = f"din_inputs for e {tuple(e.shape)}, v {tuple(v.shape)}"
        expect(isinstance(answer, torch.Tensor), f"{label} should return a torch.Tensor, got {type(answer).__name__}")
        expect(tuple(answer.shape) == (B, T, 4 * d),
               f"{label} returned shape {tuple(answer.shape)}, expected (B, T, 4d) = {(B, T, 4 * d)}: put e on every "
               f"behaviour with e.unsqueeze(1).expand_as(v), then concatenate on the last axis")
        answer = answer.detach()
        for i, name in enumerate(["e", "v", "e * v", "e - v"]):
            block = answer[..., i * d:(i + 1) * d]
            if not torch.allclose(block, expected[..., i * d:(i + 1) * d], atol=1e-6):
                hint = f"{label}: block {i} (features {i * d}..{(i + 1) * d - 1}) should be {name}"
                if name == "e - v" and torch.allclose(block, -expected[..., i * d:(i + 1) * d], atol=1e-6):
                    hint += " (you have v - e)"
                expect(False, hint)


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
    g = torch.Generator().manual_seed(93)
    cases = [
        ("continuous scores (no ties)", torch.randn(200, generator=g), (torch.rand(200, generator=g) < 0.3).long()),
        ("scores with many ties (rounded to 1 decimal)", torch.randn(300, generator=g).round(decimals=1),
         (torch.rand(300, generator=g) < 0.5).long()),
        ("a perfect ranking", torch.arange(10.0), (torch.arange(10) >= 6).long()),
        ("all scores equal", torch.zeros(8), torch.tensor([0, 1, 0, 1, 1, 0, 0, 0])),
        ("float labels 0.0/1.0", torch.randn(50, generator=g), (torch.rand(50, generator=g) < 0.5).float()),
    ]
    for what, scores, labels in cases:
        expected = _pairwise_auc(scores, labels)
        answer = fn(scores.clone(), labels.clone())
        label = f"rank_auc with {what}"
        if isinstance(answer, torch.Tensor):
            expect(answer.numel() == 1, f"{label} should return one number, got a tensor of shape {tuple(answer.shape)}")
            answer = answer.item()
        expect(isinstance(answer, (float, int)), f"{label} should return a float, got {type(answer).__name__}")
        if abs(answer - (1 - expected)) < 1e-6 and abs(expected - 0.5) > 1e-3:
            expect(False, f"{label} gave {answer:.4f}, expected {expected:.4f}: you ranked the scores in the wrong "
                        f"direction (rank 1 = the lowest score)")
        expect(abs(answer - expected) < 1e-6,
               f"{label} gave {answer:.6f}, expected {expected:.6f}"
               + ("; tied scores must share the average of their ranks" if "tie" in what or "equal" in what else ""))
