"""Exercise checks for chapter 07 (multi-head latent attention).

* 07.1 ``check_absorbed_scores``: attention scores against the latents, with ``W^UK`` folded into the
  queries (DeepSeek-V2 §2.1.2), never decoding the keys.
* 07.2 ``check_fold_query``: ``W^UK`` folded into the query projection, bias included: ``A_h = W^UK_h^T W^q_h``,
  ``c_h = W^UK_h^T b_h``, so ``(A_h x + c_h) . c_t = (W^q_h x + b_h) . (W^UK_h c_t)``; checked by scores, at float64.
* 07.3 ``check_absorbed_decode_step``: one decoding step of MLA with a decoupled rotary key
  (DeepSeek-V2 §2.1.3): the cache holds the latent ``c`` and the shared rotated key ``k^R``; the
  score is the absorbed content part plus ``q^R . k^R``. Checked at every position against the
  naive computation written out here, and its cost against decoding the keys.

Every grader draws its test tensors from a local ``torch.Generator``; ``grade`` runs it inside
``torch.random.fork_rng``, so checking an answer never moves the notebook's global random state.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlib.book.exercises._ch07_decoupled import (
    _DECODE_CASES,
    _decode_cost,
    _DecoupledLayer,
    _naive_decoupled,
    rope,  # the chapter's rotation; the solutions use ch07.rope
)
from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect, expect_close

__all__ = ["check_absorbed_scores", "check_fold_query", "check_absorbed_decode_step", "rope"]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- 07.1
_SCORE_CASES = [  # (B, n_heads, head_dim, d_c, T_q, T_k)
    (2, 4, 8, 6, 5, 5),
    (1, 2, 4, 12, 3, 7),
    (2, 3, 5, 5, 1, 9),
    (1, 1, 6, 10, 4, 4),
]
_FLOP_CASE = (1, 4, 8, 6, 1, 64)  # one query against many latents: decoding the keys would dominate


def _decoded_scores(q: torch.Tensor, c: torch.Tensor, w_uk: torch.Tensor, n_heads: int, scale: float) -> torch.Tensor:
    """The naive scores: decode k = W^UK c, split into heads, q . k * scale."""
    B, T_k, _ = c.shape
    k = (c @ w_uk.T).view(B, T_k, n_heads, -1).transpose(1, 2)  # (B, T_k, n_heads*hd) -> (B, n_heads, T_k, hd)
    return q @ k.transpose(-2, -1) * scale  # (B, n_heads, T_q, T_k)


def _score_inputs(B, n_heads, head_dim, d_c, T_q, T_k, g):
    q = torch.randn(B, n_heads, T_q, head_dim, generator=g)
    c = torch.randn(B, T_k, d_c, generator=g)
    w_uk = torch.randn(n_heads * head_dim, d_c, generator=g) / math.sqrt(d_c)
    return q, c, w_uk


@exercise("07.1")
def check_absorbed_scores(absorbed_scores) -> None:
    """Check ``absorbed_scores(q, c, w_uk, n_heads)`` against scores of decoded keys, and that no key is decoded."""
    g = torch.Generator().manual_seed(707)
    for B, n_heads, head_dim, d_c, T_q, T_k in _SCORE_CASES:
        q, c, w_uk = _score_inputs(B, n_heads, head_dim, d_c, T_q, T_k, g)
        case = f"(n_heads={n_heads}, head_dim={head_dim}, d_c={d_c}, T_q={T_q}, T_k={T_k})"
        with torch.no_grad():
            got = absorbed_scores(q.clone(), c.clone(), w_uk.clone(), n_heads)
        if got is None:
            raise NotSolved("return the scores of shape (B, n_heads, T_q, T_k), not None")
        expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
        expect(
            tuple(got.shape) == (B, n_heads, T_q, T_k),
            f"{case}: scores have shape {tuple(got.shape)}, expected (B, n_heads, T_q, T_k) = {(B, n_heads, T_q, T_k)}",
        )
        expected = _decoded_scores(q, c, w_uk, n_heads, 1.0 / math.sqrt(head_dim))
        if _close(got, expected):
            continue
        expect(
            not _close(got, _decoded_scores(q, c, w_uk, n_heads, 1.0 / math.sqrt(d_c))),
            f"{case}: you scale by 1/sqrt(d_c); the absorbed score is the same number as q_h . k_h, a dot product "
            f"of head_dim={head_dim} terms, so the scale stays 1/sqrt(head_dim)",
        )
        expect(
            not _close(got, _decoded_scores(q, c, w_uk, n_heads, 1.0)),
            f"{case}: the scores are not scaled; divide by sqrt(head_dim)",
        )
        raise Wrong(
            f"{case}: the scores differ from q_h . (W^UK_h c) / sqrt(head_dim). Head h's block of W^UK is rows "
            "h*head_dim:(h+1)*head_dim of w_uk, i.e. w_uk.view(n_heads, head_dim, d_c)[h]; fold it as "
            "W^UK_h^T q_h (shape (..., d_c)) and take its dot product with every latent"
        )

    B, n_heads, head_dim, d_c, T_q, T_k = _FLOP_CASE
    q, c, w_uk = _score_inputs(B, n_heads, head_dim, d_c, T_q, T_k, g)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        absorbed_scores(q, c, w_uk, n_heads)
    flops = counter.get_total_flops()
    decoding = 2 * B * T_k * d_c * n_heads * head_dim  # c @ W^UK^T for every latent
    absorbed = 2 * B * n_heads * T_q * (head_dim * d_c + T_k * d_c)
    expect(
        flops < decoding,
        f"the scores are right, but for one query against {T_k} latents your function did {flops:,} FLOPs of matrix "
        f"products; decoding the keys alone costs {decoding:,}, the absorbed form {absorbed:,}. Do not compute "
        "c @ w_uk.T (the keys): fold w_uk into q instead",
    )


# ---------------------------------------------------------------- 07.2
_QUERY_CASES = [(12, 3, 4, 7), (16, 4, 4, 10), (10, 1, 6, 3), (20, 5, 2, 9)]  # (d, n_heads, head_dim, d_c)


def _fold_query_ref(wq, bq, w_uk, h, q_split="heads", k_split="heads", k_read="right"):
    """``A_h = W^UK_h^T W^q_h`` (h, d_c, d), ``c_h = W^UK_h^T b_h`` (h, d_c), or a mistake: split ``"inter"`` reads row
    ``d*h + i`` as head ``i``; ``k_read`` ``"view"``/``"t_view"`` reshapes ``w_uk``/``w_uk.T`` instead of transposing."""
    def per_head(w, split):  # rows (h*hd, ...) -> (h, hd, ...)
        return w.reshape(h, -1, *w.shape[1:]) if split == "heads" else w.reshape(-1, h, *w.shape[1:]).transpose(0, 1)
    uk_t = {"right": lambda: per_head(w_uk, k_split).transpose(1, 2), "view": lambda: w_uk.reshape(h, w_uk.shape[1], -1),
            "t_view": lambda: w_uk.T.reshape(h, w_uk.shape[1], -1)}[k_read]()  # (h, d_c, hd)
    return uk_t @ per_head(wq, q_split), (uk_t @ per_head(bq, q_split).unsqueeze(-1)).squeeze(-1)


def _close64(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a, b, atol=1e-9, rtol=1e-9)


@exercise("07.2")
def check_fold_query(fold_query) -> None:
    """Check ``fold_query(q_weight, q_bias, w_uk, n_heads) -> (A, c)`` by the scores it gives, at float64."""
    g = torch.Generator().manual_seed(7072)
    for d, h, hd, d_c in _QUERY_CASES:
        f64 = dict(generator=g, dtype=torch.float64)
        wq, bq = torch.randn(h * hd, d, **f64) / math.sqrt(d), torch.randn(h * hd, **f64)
        w_uk = torch.randn(h * hd, d_c, **f64) / math.sqrt(d_c)
        x, lat = torch.randn(d + 3, d, **f64), torch.randn(d_c + 3, d_c, **f64)  # enough to pin A and c down
        before = (wq.clone(), bq.clone(), w_uk.clone())
        case = f"(d_model={d}, n_heads={h}, head_dim={hd}, d_c={d_c})"
        with torch.no_grad():
            result = fold_query(wq, bq, w_uk, h)
        if result is None:
            raise NotSolved("return the pair (A, c): A of shape (n_heads, d_c, d_model), c of shape (n_heads, d_c)")
        expect(all(torch.equal(t, t0) for t, t0 in zip((wq, bq, w_uk), before)),
               "your function changed the weights it was given (an in-place operation such as mul_, add_ or "
               "transpose_); build new tensors and leave the layer's weights alone")
        expect(isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result),
               f"return a pair of tensors (A, c); got {type(result).__name__}")
        a, c = result
        expect(a.dtype == c.dtype == torch.float64,
               f"the weights are float64 and your results {a.dtype}, {c.dtype}; keep the dtype you were given")
        shape_hints = [
            (a.shape == (h, d, d_c), f"A has shape {(h, d, d_c)}, (n_heads, d_model, d_c): W^UK is transposed. "
             f"A_h = W^UK_h^T W^q_h maps x (d_model) into latent space (d_c): shape {(h, d_c, d)}"),
            (a.shape == (d_c, d), f"A has shape {(d_c, d)}: one matrix, the heads summed; every head keeps its own A_h"),
            (a.shape != (h, d_c, d), f"A has shape {tuple(a.shape)}, expected (n_heads, d_c, d_model) = {(h, d_c, d)}"),
            (c.shape == (h, hd), f"c has shape {(h, hd)}: the query bias split into heads but not folded; it meets "
             f"W^UK_h like the rest of the query: c_h = W^UK_h^T b_h, shape {(h, d_c)}"),
            (c.shape != (h, d_c), f"c has shape {tuple(c.shape)}, expected (n_heads, d_c) = {(h, d_c)}"),
        ]
        for bad, hint in shape_hints:
            expect(not bad, f"{case}: {hint}")
        got = (torch.einsum("hcd,nd->hnc", a, x) + c.unsqueeze(1)) @ lat.T  # (A_h x + c_h) . c_t: (h, N, M)
        q = (x @ wq.T + bq).view(-1, h, hd).transpose(0, 1)  # (h, N, hd), bias included
        expected = q @ (lat @ w_uk.T).view(-1, h, hd).permute(1, 2, 0)  # q . (W^UK_h c_t), keys decoded
        if _close64(got, expected):
            continue
        ref_a, ref_c = _fold_query_ref(wq, bq, w_uk, h)
        a_ok, c_ok = _close64(a, ref_a), _close64(c, ref_c)
        expect(not (a_ok and _close64(c, torch.zeros_like(c))),
               f"{case}: A is right but c is zero: the query bias is dropped. (W^q_h x + b_h) . k adds "
               "b_h . (W^UK_h c_t), different for every latent, to the score: c_h = W^UK_h^T b_h")
        for name, width in (("head_dim", hd), ("d_c", d_c)):
            expect(not (_close64(a, ref_a / math.sqrt(width)) and (c_ok or _close64(c, ref_c / math.sqrt(width)))),
                   f"{case}: A (and c) are divided by sqrt({name}); the exercise asks for the raw score "
                   "(W^q_h x + b_h) . (W^UK_h c_t), with no scale: the attention applies 1/sqrt(head_dim) later")
        for read in ("view", "t_view"):
            expect(not _close64(a, _fold_query_ref(wq, bq, w_uk, h, k_read=read)[0]),
                   f"{case}: W^UK_h is read with its axes swapped (reshaped to (d_c, head_dim), not transposed). "
                   "Head h's block is w_uk.view(n_heads, head_dim, d_c)[h]; A_h = W^UK_h^T W^q_h uses its transpose")
        for splits in (("inter", "inter"), ("inter", "heads"), ("heads", "inter")):
            expect(not _close64(a, _fold_query_ref(wq, bq, w_uk, h, *splits)[0]),
                   f"{case}: the heads are interleaved: you took rows h, h + n_heads, h + 2 n_heads, ... as head h. "
                   "split_heads gives head h the contiguous rows h*head_dim:(h+1)*head_dim of W^q, b and W^UK")
        expect(not a_ok, f"{case}: A is right but c is not: c_h = W^UK_h^T b_h, the head's bias through W^UK_h")
        raise Wrong(f"{case}: the scores (A_h x + c_h) . c_t differ from (W^q_h x + b_h) . (W^UK_h c_t) (max abs "
                    f"difference {(got - expected).abs().max().item():.3g}); A_h = W^UK_h^T W^q_h with "
                    "W^q_h = q_weight.view(n_heads, head_dim, d_model)[h], W^UK_h = w_uk.view(n_heads, head_dim, d_c)[h]")


# ---------------------------------------------------------------- 07.3
@exercise("07.3")
def check_absorbed_decode_step(absorbed_decode_step) -> None:
    """Check ``absorbed_decode_step(layer, x_new, cache, rope) -> (out, (c, k_r))`` at every position."""
    g = torch.Generator().manual_seed(7073)
    for B, d_model, n_heads, d_c, rope_dim, T in _DECODE_CASES:
        layer = _DecoupledLayer(d_model, n_heads, d_c, rope_dim, g)
        x = torch.randn(B, T, d_model, generator=g)
        with torch.no_grad():
            full = _naive_decoupled(layer, x)  # (B, T, d_model)
            c_all = layer.kv_down(x)  # (B, T, d_c)
            kr_all = rope(layer.k_rope(x), torch.arange(T))  # (B, T, rope_dim)
            wrong = {v: _naive_decoupled(layer, x, v) for v in (
                "scale_head_dim", "scale_d_c", "no_rope", "query_shift_-1", "query_shift_1", "query_at_0",
                "no_self")}
        sizes = f"(B={B}, d_model={d_model}, n_heads={n_heads}, d_c={d_c}, rope_dim={rope_dim})"
        for t in range(T):
            case = f"{sizes}, position {t} ({t} tokens cached)"
            cache = (c_all[:, :t].clone(), kr_all[:, :t].clone())
            with torch.no_grad():
                result = absorbed_decode_step(layer, x[:, t : t + 1], cache, rope)
            if result is None:
                raise NotSolved("return (output, (latents, rotary keys)), not None")
            expect(
                isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], tuple)
                and len(result[1]) == 2,
                f"return a pair (output, (latents, rotary keys)); got {type(result).__name__}",
            )
            out, (c_new, kr_new) = result
            expect_close(c_new, c_all[:, : t + 1], f"{case}: the returned latent cache (B, T+1, d_c)")
            expect(
                isinstance(kr_new, torch.Tensor) and tuple(kr_new.shape) == (B, t + 1, rope_dim),
                f"{case}: the returned rotary-key cache should have shape {(B, t + 1, rope_dim)}",
            )
            if not torch.allclose(kr_new, kr_all[:, : t + 1], atol=1e-5, rtol=1e-4):
                raw = layer.k_rope(x[:, t : t + 1])
                expect(
                    t == 0 or not torch.allclose(kr_new[:, t:], raw, atol=1e-5, rtol=1e-4),
                    f"{case}: the new rotary key is cached unrotated; rotate W^KR x at its "
                    f"own position ({t}) once, and cache it rotated",
                )
                raise Wrong(
                    f"{case}: the new rotary key is not R_t W^KR x_t at position t = {t} (the "
                    "number of cached tokens), or the cached ones changed"
                )
            expect(
                isinstance(out, torch.Tensor) and tuple(out.shape) == (B, 1, d_model),
                f"{case}: the output should be a tensor of shape {(B, 1, d_model)}",
            )
            expected = full[:, t : t + 1]
            if torch.allclose(out, expected, atol=1e-5, rtol=1e-4):
                continue
            hints = {
                "scale_head_dim": "you scale by 1/sqrt(head_dim); the score is the dot product of "
                "[q^C; q^R] with [k^C; k^R], head_dim + rope_dim terms: 1/sqrt(head_dim + rope_dim)",
                "scale_d_c": "you scale by 1/sqrt(d_c + rope_dim), the width of the absorbed "
                "vectors; the number is still the naive score: 1/sqrt(head_dim + rope_dim)",
                "no_rope": "the rotary part is missing from the scores: add q^R_h . k^R_s to "
                "the absorbed content score of every head",
                "query_shift_-1": f"the new query is rotated at position {t - 1}; it sits at "
                f"position {t}, the number of tokens already cached",
                "query_shift_1": f"the new query is rotated at position {t + 1}; positions "
                f"count from 0, so with {t} tokens cached it sits at {t}",
                "query_at_0": f"the new query is rotated at position 0; it sits at position {t}, "
                "the number of tokens already cached",
                "no_self": "the new token does not attend to itself: append its latent and rotary "
                "key to the cache first, then score the query against all t + 1 of them",
            }
            for variant, hint in hints.items():
                if not torch.allclose(wrong[variant][:, t : t + 1], expected, atol=1e-5, rtol=1e-4):
                    expect(
                        not torch.allclose(out, wrong[variant][:, t : t + 1], atol=1e-5, rtol=1e-4),
                        f"{case}: {hint}",
                    )
            expect_close(out, expected, f"{case}: your output")

    # Cost: one new token over a long cache. Decoding the keys costs 2 B T d_c n_h d_h FLOPs.
    B, d_model, n_heads, d_c, rope_dim, T = 1, 32, 4, 24, 4, 256
    layer = _DecoupledLayer(d_model, n_heads, d_c, rope_dim, g)
    cache = (torch.randn(B, T, d_c, generator=g), torch.randn(B, T, rope_dim, generator=g))
    x_new = torch.randn(B, 1, d_model, generator=g)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        absorbed_decode_step(layer, x_new, cache, rope)
    flops, decoding = counter.get_total_flops(), _decode_cost(B, T, layer)
    expect(
        flops < decoding,
        f"the values are right, but one step over {T} cached tokens did {flops:,} FLOPs of matrix "
        f"products; decoding the cached latents into keys alone costs {decoding:,}. Fold W^UK_h "
        "into the new query and score it against the latents; never compute k_up(cache)",
    )
