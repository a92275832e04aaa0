"""Exercise checks for chapter 20 (decoders that mix layer types).

* 20.1 ``check_sink_backward``: ``sink_backward(scores, v, sink, d_out) -> (out, d_scores, d_sink)``,
  attention with gpt-oss's learned sink (one logit per head joins the softmax's denominator and is
  dropped) and its gradients by hand; autograd refused (its entry points, and any graph recorded),
  compared with float64 autograd of the check's own formula; rows whose keys are all masked, scores
  large enough to overflow ``exp`` and a sink that takes nearly all the weight among the edges.
* 20.2 ``check_layer_types_for_budget``: ``layer_types_for_budget(config, budget_bytes, dtype)``, the
  ``layer_types`` list with the most full-attention layers whose KV cache fits, spread by the
  statement's rule; the answer's list is measured by a filled :class:`attnlib.Decoder` cache
  (:mod:`._ch20_budget`).
* 20.3 ``check_chunked_mask``: ``chunked_mask(T_q, T_k, chunk_size)``, which keys the last ``T_q``
  queries of ``T_k`` positions see under Llama 4's chunked attention, built by hand (attnlib's and
  transformers' mask helpers refused); queries at position 0, at a chunk's first and last token.

Every learner call goes through :func:`~attnlib.book.exercises._run.run`; besides fixed edge cases, the
random cases come from :func:`~attnlib.book.exercises._core.case_rng` (fresh each run).
"""
from __future__ import annotations

import math

import torch
import transformers.masking_utils as hf_masks

from attnlib.attention import masks as attnlib_masks
from attnlib.attention import mods
from attnlib.book.exercises._autograd import AUTOGRAD, GraphWatch
from attnlib.book.exercises._ch20_budget import budget_cases, grade_budget
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run

__all__ = ["check_chunked_mask", "check_layer_types_for_budget", "check_sink_backward"]


# ---------------------------------------------------------------- 20.1
_BY_HAND = Refuse("compute the gradients by hand, without autograd", *AUTOGRAD)


def _sink_reference(scores, v, sink, d_out):
    """(out, d_scores, d_sink) by float64 autograd of softmax([scores, sink])[..., :-1] @ v."""
    s, k = scores.double().requires_grad_(), sink.double().requires_grad_()
    with torch.enable_grad():
        column = k[None, :, None, None].expand(*s.shape[:-1], 1)  # (B, H, T_q, 1): the sink of each head
        p = torch.cat([s, column], dim=-1).softmax(dim=-1)[..., :-1]  # the sink's weight dropped
        out = p @ v.double()
        d_s, d_k = torch.autograd.grad((out * d_out.double()).sum(), (s, k))
    return out.detach(), d_s, d_k


def _sink_slips(scores, v, sink, d_out) -> dict[str, tuple[str, torch.Tensor]]:
    """What the usual slips give: (which output, value), keyed by the hint; float64."""
    s, v, k, d_o = scores.double(), v.double(), sink.double(), d_out.double()
    logits = torch.cat([s, k[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    lse = logits.logsumexp(-1, keepdim=True)  # (B, H, T_q, 1)
    p, p_sink = (s - lse).exp(), (k[None, :, None] - lse[..., 0]).exp()  # (B, H, T_q, T_k), (B, H, T_q)
    out = p @ v
    d_p = d_o @ v.transpose(-2, -1)  # (B, H, T_q, T_k)
    D = (d_o * out).sum(-1)  # (B, H, T_q) = sum_j p_j dP_j
    B, T_q = s.shape[0], s.shape[2]
    return {
        "the sink's logit only enlarges the denominator, so d_sink = -sum p_sink * D with "
        "D = rowsum(dO * O): the sign is flipped": ("d_sink", (p_sink * D).sum((0, 2))),
        "d_sink is a sum over the batch and the queries, not a mean": ("d_sink", -(p_sink * D).sum((0, 2)) / (B * T_q)),
        "that is p_sink's own derivative, p_sink * (1 - p_sink), summed: the loss reaches the sink only "
        "through the keys' weights it shrinks, d_sink = -sum p_sink * D with D = rowsum(dO * O)":
            ("d_sink", (p_sink * (1 - p_sink)).sum((0, 2))),
        "the softmax's Jacobian is diag(p) - p p^T: you kept only its diagonal, p * dP; subtract "
        "D = rowsum(dO * O) first": ("d_scores", p * d_p),
        "D in the softmax's backward is sum_j p_j dP_j over the keys only; with the sink's weight in the "
        "row, sum_j p_j is 1 - p_sink, so do not divide D by it (or renormalise the weights)":
            ("d_scores", p * (d_p - (D / (1 - p_sink).clamp_min(1e-300))[..., None])),
    }


def _sink_cases(g: torch.Generator) -> list[dict]:
    """(B, H, T_q, T_k, head_dim) and what to do to the scores: causal masks, masked rows, large values."""
    cases = [dict(size=(1, 1, 1, 1, 2)), dict(size=(2, 3, 4, 4, 5), causal=True),
             dict(size=(1, 2, 3, 5, 4), empty_row=True),  # a query that sees no key: the sink takes it all
             dict(size=(2, 2, 3, 6, 3), scale=60.0, sink=100.0),  # exp of the scores (and sink) overflows float32
             dict(size=(1, 4, 5, 5, 4), causal=True, sink=4.0)]  # a sink that takes most of the weight
    for _ in range(3):
        T_q = randint(g, 1, 6)
        cases.append(dict(size=(randint(g, 1, 3), randint(g, 1, 4), T_q, randint(g, T_q, 8), randint(g, 1, 8)),
                          causal=bool(randint(g, 0, 1))))
    return cases


@exercise("20.1")
def check_sink_backward(answer) -> None:
    """Check ``answer(scores, v, sink, d_out) -> (out, d_scores, d_sink)`` against float64 autograd."""
    g = case_rng()
    for case in _sink_cases(g):
        B, H, T_q, T_k, d = case["size"]
        scores = torch.randn(B, H, T_q, T_k, generator=g) * case.get("scale", 2.0)
        if case.get("causal"):  # the queries are the last T_q positions
            future = torch.ones(T_q, T_k, dtype=torch.bool).triu(T_k - T_q + 1)
            scores = scores.masked_fill(future, -math.inf)
        if case.get("empty_row"):
            scores[:, :, 1] = -math.inf
        sink = torch.randn(H, generator=g) + case.get("sink", 0.0)
        v, d_out = torch.randn(B, H, T_k, d, generator=g), torch.randn(B, H, T_q, d, generator=g)
        what = (f"sink_backward(scores {tuple(scores.shape)}, v {tuple(v.shape)}, sink ({H},), d_out "
                f"{tuple(d_out.shape)})" + (", a row of scores all -inf" if case.get("empty_row") else "")
                + (f", scores up to {scores.max().item():.0f}" if case.get("scale") else ""))
        watch = GraphWatch()
        got = run(answer, scores, v, sink, d_out, what=what, refuse=_BY_HAND, inside=(watch,))
        expect(not watch.recorded, f"{what}: {_BY_HAND.why}: your code recorded an autograd graph (requires_grad "
                                   "on a tensor); write the chain rule out with tensor operations")
        expect(type(got) in (tuple, list) and len(got) == 3,
               f"{what} should return the tuple (out, d_scores, d_sink), got {type(got).__name__}"
               + (f" of length {len(got)}" if type(got) in (tuple, list) else ""))
        out, d_scores, d_sink = got
        expect(not (isinstance(out, torch.Tensor) and isinstance(d_sink, torch.Tensor) and out.shape == (H,)
                    and d_sink.shape == (B, H, T_q, d)), f"{what}: return (out, d_scores, d_sink) in this order")
        expect_tensor(out, f"out of {what}", dtype=v.dtype)
        expect_tensor(d_scores, f"d_scores of {what}", dtype=scores.dtype)
        expect(tuple(d_scores.shape) != (B, H, T_q, T_k + 1), f"d_scores of {what} has the sink's column: "
               "the sink's weight is dropped after the softmax; return the gradient of the T_k scores only")
        expect_tensor(d_sink, f"d_sink of {what}", dtype=sink.dtype)
        expect(tuple(d_sink.shape) == (H,), f"d_sink of {what} has shape {tuple(d_sink.shape)}: one number per "
               f"head, ({H},); the sink of a head is shared by every batch row and query, so sum over both")
        # the expected values, computed after the answer ran, by float64 autograd of the definition
        want_out, want_ds, want_sink = _sink_reference(scores, v, sink, d_out)
        nans = [name for name, t in (("out", out), ("d_scores", d_scores), ("d_sink", d_sink)) if t.isnan().any()]
        expect(not nans, f"{nans[0] if nans else ''} of {what} has NaN: "
               + ("a query that sees no key still has the sink; take the max (or log-sum-exp) over the scores "
                  "AND the sink together, so that no row computes -inf - (-inf)" if case.get("empty_row") else
                  "exp of large scores overflows: subtract each row's max over the scores AND the sink together first"
                  if case.get("scale") else "compute each weight as exp(s - m) / sum with m the row's max"))
        # float32 rounds a score of size M by about M * 6e-8, and exp turns that into a relative error of the
        # weights: the tolerance grows with the largest logit (1e-5 up to logits of 10)
        finite = scores[scores.isfinite()]
        tol = 1e-5 * max(1.0, (finite.abs().max().item() if finite.numel() else 0.0) / 10, sink.abs().max().item() / 10)
        plain = scores.double().softmax(-1) @ v.double()
        expect(case.get("empty_row") or torch.allclose(plain, want_out, atol=tol, rtol=1e-4)
               or not torch.allclose(out.double(), plain, atol=tol, rtol=1e-4),
               f"out of {what} is plain softmax attention: the sink joins the softmax's denominator, so the "
               "keys' weights sum to 1 - p_sink, not 1 (softmax over [scores, sink], then drop the sink's column)")
        expect_close(out, want_out, f"out of {what}", atol=tol)
        slips = _sink_slips(scores, v, sink, d_out)
        for name, got_value, want in (("d_scores", d_scores, want_ds), ("d_sink", d_sink, want_sink)):
            if torch.allclose(got_value.double(), want, atol=tol, rtol=1e-4):
                continue
            for hint, (which, value) in slips.items():
                if which == name and not torch.allclose(value, want, atol=tol, rtol=1e-4):
                    expect(not torch.allclose(got_value.double(), value, atol=tol, rtol=1e-4),
                           f"{name} of {what}: {hint}")
            expect_close(got_value, want, f"{name} of {what} (compared with autograd)", atol=tol)


# ---------------------------------------------------------------- 20.2
@exercise("20.2")
def check_layer_types_for_budget(answer) -> None:
    """Check ``answer(config, budget_bytes, dtype) -> list[str]``: the most full layers that fit, spread."""
    grade_budget(answer, budget_cases(case_rng()))


# ---------------------------------------------------------------- 20.3
_BY_HAND_MASK = Refuse(
    "build the mask yourself from the positions, without a library's mask helper",
    mods.chunked, mods.sliding_window, attnlib_masks.mask_from_mod, hf_masks.chunked_overlay,
    hf_masks.chunked_causal_mask_function, hf_masks.create_chunked_causal_mask, hf_masks.sdpa_mask,
    hf_masks.eager_mask)


def _mask_slips(T_q: int, T_k: int, C: int) -> dict[str, torch.Tensor]:
    """Masks the usual slips give, keyed by the hint, most specific first."""
    q = torch.arange(T_k - T_q, T_k)[:, None]  # (T_q, 1): absolute positions of the queries
    j = torch.arange(T_k)[None, :]  # (1, T_k)
    i = torch.arange(T_q)[:, None]  # the queries numbered from 0, as if they began the sequence
    causal = j <= q
    slips = {
        "that is a sliding window of chunk_size keys; chunked attention cuts the sequence into fixed chunks "
        "from position 0, so the first query of a chunk sees only itself": causal & (q - j < C),
        "chunks are counted from position 0: the chunk of position p is p // chunk_size, not (p + 1) // "
        "chunk_size": causal & ((q + 1) // C == (j + 1) // C),
        "the chunks are fixed by absolute positions, from position 0, not counted from the first query":
            causal & ((q - (T_k - T_q)) // C == (j - (T_k - T_q)) // C),
        "the queries are the last T_q positions: query i sits at position T_k - T_q + i":
            (j <= i) & (i // C == j // C),
        "a query sees no later key, even in its own chunk (causal inside the chunk)": q // C == j // C,
        "a query sees itself: j <= i, not j < i": (j < q) & (q // C == j // C),
        "a query sees the keys of its own chunk, not only those of the chunk before": causal & (j // C < q // C),
    }
    if T_q == T_k:
        slips["one row per query, one column per key: your mask is transposed"] = (causal & (q // C == j // C)).T
    return slips


def _mask_cases(g: torch.Generator) -> list[tuple[int, int, int]]:
    """(T_q, T_k, chunk_size): position 0; a chunk's first and last token decoding; prefills; C = 1 and C > T."""
    cases = [(8, 8, 4), (1, 1, 4), (1, 9, 4), (1, 8, 4), (5, 13, 4), (6, 6, 1), (7, 7, 10), (3, 10, 3), (4, 11, 6)]
    for _ in range(3):
        T_k = randint(g, 2, 30)
        cases.append((randint(g, 1, T_k), T_k, randint(g, 2, 8)))
    return cases


@exercise("20.3")
def check_chunked_mask(answer) -> None:
    """Check ``answer(T_q, T_k, chunk_size) -> (T_q, T_k) bool``: Llama 4's chunked attention of the last T_q queries."""
    for T_q, T_k, C in _mask_cases(case_rng()):
        what = f"chunked_mask({T_q}, {T_k}, {C})"
        got = run(answer, T_q, T_k, C, what=what, refuse=_BY_HAND_MASK)
        expect_tensor(got, what)
        expect(tuple(got.shape) == (T_q, T_k), f"{what} has shape {tuple(got.shape)}, expected ({T_q}, {T_k}): "
               "one row per query, one column per key")
        expect(got.dtype == torch.bool, f"{what} has dtype {got.dtype}: return a bool mask (True = the query "
                                        "sees the key)")
        # the expected mask, computed after the answer ran, position by position
        want = torch.zeros(T_q, T_k, dtype=torch.bool)
        for row in range(T_q):
            p = T_k - T_q + row
            start = p - p % C  # the first position of p's chunk
            want[row, start:p + 1] = True
        if not torch.equal(got, want):
            for hint, wrong in _mask_slips(T_q, T_k, C).items():
                expect(torch.equal(wrong, want) or not torch.equal(got, wrong), f"{what}: {hint}")
            rows = (got != want).any(-1).nonzero()[:, 0].tolist()
            p = T_k - T_q + rows[0]
            expect(False, f"{what} differs from the expected mask first at query {rows[0]} (position {p}), "
                          f"which sees keys {want[rows[0]].nonzero()[:, 0].tolist()}: those of its chunk "
                          f"[{p - p % C}, {p - p % C + C}) up to itself")
