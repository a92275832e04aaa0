"""Exercise checks for chapter 07 (multi-head latent attention).

* 07.1 ``check_gqa_as_latent``: grouped-query attention written as MLA. From GQA's key and value
  projections, build ``kv_down``, ``k_up``, ``v_up`` with a latent of ``2 * n_kv_heads * head_dim``
  such that every query head decodes exactly the key and value GQA gives it; checked on the
  products ``W^UK_h W^DKV`` and ``W^UV_h W^DKV`` (every input at once), at float64.
* 07.2 ``check_fold_query``: ``W^UK`` folded into the query projection, bias included: ``A_h = W^UK_h^T W^q_h``,
  ``c_h = W^UK_h^T b_h``, so ``(A_h x + c_h) . c_t = (W^q_h x + b_h) . (W^UK_h c_t)``; checked by scores, at float64.
* 07.3 ``check_absorbed_decode_step`` (in :mod:`_ch07_decoupled`): one decoding step of MLA with a
  decoupled rotary key (DeepSeek-V2 §2.1.3), checked at every position against the naive computation,
  and its FLOPs against decoding the keys.

Every learner call goes through :func:`run`; the cases are fixed edges plus fresh ones from
:func:`case_rng`.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._ch07_decoupled import check_absorbed_decode_step, rope
from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    case_rng,
    exercise,
    expect,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import run

__all__ = ["check_gqa_as_latent", "check_fold_query", "check_absorbed_decode_step", "rope"]


def _close64(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b.double(), atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------- 07.1
def _gqa_cases(g: torch.Generator) -> list[tuple[int, int, int, int]]:
    """(d_model, n_heads, n_kv_heads, head_dim): MQA, MHA, groups that tell h // group from h % n_kv."""
    cases = [(16, 4, 1, 4), (12, 3, 3, 4), (24, 6, 3, 4), (10, 8, 2, 3)]
    for _ in range(2):  # fresh sizes each run
        n_kv, group = randint(g, 2, 3), randint(g, 2, 3)
        cases.append((randint(g, 4, 20), n_kv * group, n_kv, randint(g, 2, 5)))
    return cases


@exercise("07.1")
def check_gqa_as_latent(gqa_as_latent) -> None:
    """Check ``gqa_as_latent(w_k, w_v, n_heads, n_kv_heads) -> (kv_down, k_up, v_up)``."""
    g = case_rng()
    for d, h, n_kv, hd in _gqa_cases(g):
        group, d_c = h // n_kv, 2 * n_kv * hd
        w_k = torch.randn(n_kv * hd, d, generator=g, dtype=torch.float64)
        w_v = torch.randn(n_kv * hd, d, generator=g, dtype=torch.float64)
        what = (f"gqa_as_latent(w_k {tuple(w_k.shape)}, w_v {tuple(w_v.shape)}, n_heads={h}, "
                f"n_kv_heads={n_kv}) (head_dim={hd}, d_model={d})")
        out = run(gqa_as_latent, w_k, w_v, h, n_kv, what=what)
        if out is None:
            raise NotSolved("return the three weights (kv_down, k_up, v_up), not None")
        expect(type(out) in (tuple, list) and len(out) == 3,
               f"{what}: return a tuple of three tensors (kv_down, k_up, v_up); got {type(out).__name__}")
        for t, name in zip(out, ("kv_down", "k_up", "v_up")):
            expect_tensor(t, f"{what}: {name}")
        kv_down, k_up, v_up = out
        shapes = [tuple(t.shape) for t in out]
        want = [(d_c, d), (h * hd, d_c), (h * hd, d_c)]
        if shapes != want and sorted(shapes) == sorted(want):
            raise Wrong(f"{what}: the shapes {shapes} are a reordering of {want}: return (kv_down, k_up, "
                        "v_up) in that order")
        expect(shapes[0] != (d, d_c) or d == d_c,
               f"{what}: kv_down is transposed: like nn.Linear's weight it maps x (d_model) to the latent, "
               f"shape (d_c, d_model) = {(d_c, d)}")
        expect(shapes[0] != (n_kv * hd, d),
               f"{what}: kv_down has {n_kv * hd} rows, room for the keys only; the latent must hold every "
               f"key/value head's key AND value: d_c = 2 * n_kv_heads * head_dim = {d_c}")
        expect(n_kv == h or (shapes[1] != (n_kv * hd, d_c) and shapes[2] != (n_kv * hd, d_c)),
               f"{what}: k_up/v_up have one block of rows per key/value head; MLA decodes a key and a value "
               f"for every QUERY head: shape (n_heads * head_dim, d_c) = {(h * hd, d_c)}")
        for s, w, name in zip(shapes, want, ("kv_down", "k_up", "v_up")):
            expect(s == w, f"{what}: {name} has shape {s}, expected {w} (d_c = 2 * n_kv_heads * head_dim)")
        expect(all(t.dtype == torch.float64 for t in out),
               f"{what}: the weights are float64 and yours {[str(t.dtype) for t in out]}: keep the dtype given")
        # every query head's decoded key and value, as maps of x: (n_heads, head_dim, d_model)
        keys = k_up.detach().view(h, hd, d_c) @ kv_down.detach()
        values = v_up.detach().view(h, hd, d_c) @ kv_down.detach()
        owner = torch.arange(h) // group  # the key/value head GQA gives query head i
        want_k, want_v = w_k.view(n_kv, hd, d)[owner], w_v.view(n_kv, hd, d)[owner]
        if _close64(keys, want_k) and _close64(values, want_v):
            continue
        tiled = torch.arange(h) % n_kv
        expect(not (_close64(keys, w_k.view(n_kv, hd, d)[tiled]) and group > 1 and n_kv > 1),
               f"{what}: query head i reads key/value head i % n_kv_heads (the cache tiled, repeat); GQA "
               "gives consecutive query heads one key/value head: i // (n_heads // n_kv_heads) "
               "(repeat_interleave)")
        expect(not (_close64(keys, want_v) and _close64(values, want_k)),
               f"{what}: k_up decodes the values and v_up the keys: the two are swapped")
        expect(not _close64(keys, want_v), f"{what}: k_up decodes GQA's values, not its keys")
        expect(_close64(keys, want_k),
               f"{what}: query head i's decoded key, W^UK_i W^DKV x, must be GQA's key of head "
               "i // (n_heads // n_kv_heads), W^K_(i // group) x, for every x; it is not")
        raise Wrong(f"{what}: the keys are right but not the values: W^UV_i W^DKV must equal "
                    "W^V_(i // (n_heads // n_kv_heads))")


# ---------------------------------------------------------------- 07.2
def _fold_query_ref(wq, bq, w_uk, h, q_split="heads", k_split="heads", k_read="right"):
    """``A_h = W^UK_h^T W^q_h`` (h, d_c, d), ``c_h = W^UK_h^T b_h`` (h, d_c), or a mistake: split ``"inter"`` reads row
    ``d*h + i`` as head ``i``; ``k_read`` ``"view"``/``"t_view"`` reshapes ``w_uk``/``w_uk.T`` instead of transposing."""
    def per_head(w, split):  # rows (h*hd, ...) -> (h, hd, ...)
        return w.reshape(h, -1, *w.shape[1:]) if split == "heads" else w.reshape(-1, h, *w.shape[1:]).transpose(0, 1)
    uk_t = {"right": lambda: per_head(w_uk, k_split).transpose(1, 2), "view": lambda: w_uk.reshape(h, w_uk.shape[1], -1),
            "t_view": lambda: w_uk.T.reshape(h, w_uk.shape[1], -1)}[k_read]()  # (h, d_c, hd)
    return uk_t @ per_head(wq, q_split), (uk_t @ per_head(bq, q_split).unsqueeze(-1)).squeeze(-1)


def _query_cases(g: torch.Generator) -> list[tuple[int, int, int, int]]:
    cases = [(12, 3, 4, 7), (16, 4, 4, 10), (10, 1, 6, 3), (20, 5, 2, 9)]  # (d, n_heads, head_dim, d_c)
    for _ in range(2):
        hd = randint(g, 2, 6)
        cases.append((randint(g, 4, 16), randint(g, 2, 5), hd, hd + randint(g, 1, 6)))
    return cases


@exercise("07.2")
def check_fold_query(fold_query) -> None:
    """Check ``fold_query(q_weight, q_bias, w_uk, n_heads) -> (A, c)`` by the scores it gives, at float64."""
    g = case_rng()
    for d, h, hd, d_c in _query_cases(g):
        f64 = dict(generator=g, dtype=torch.float64)
        wq, bq = torch.randn(h * hd, d, **f64) / math.sqrt(d), torch.randn(h * hd, **f64)
        w_uk = torch.randn(h * hd, d_c, **f64) / math.sqrt(d_c)
        x, lat = torch.randn(d + 3, d, **f64), torch.randn(d_c + 3, d_c, **f64)  # enough to pin A and c down
        case = f"(d_model={d}, n_heads={h}, head_dim={hd}, d_c={d_c})"
        result = run(fold_query, wq, bq, w_uk, h, what=f"fold_query{case}")
        if result is None:
            raise NotSolved("return the pair (A, c): A of shape (n_heads, d_c, d_model), c of shape (n_heads, d_c)")
        expect(type(result) is tuple and len(result) == 2,
               f"return a pair of tensors (A, c); got {type(result).__name__}")
        a, c = (expect_tensor(t, f"{case}: {name}") for t, name in zip(result, "Ac"))
        expect(a.dtype == c.dtype == torch.float64,
               f"the weights are float64 and your results {a.dtype}, {c.dtype}; keep the dtype you were given")
        shape_hints = [
            (a.shape == (h, d, d_c) and d != d_c, f"A has shape {(h, d, d_c)}, (n_heads, d_model, d_c): W^UK is transposed. "
             f"A_h = W^UK_h^T W^q_h maps x (d_model) into latent space (d_c): shape {(h, d_c, d)}"),
            (a.shape == (d_c, d), f"A has shape {(d_c, d)}: one matrix, the heads summed; every head keeps its own A_h"),
            (a.shape != (h, d_c, d), f"A has shape {tuple(a.shape)}, expected (n_heads, d_c, d_model) = {(h, d_c, d)}"),
            (c.shape == (h, hd) and hd != d_c, f"c has shape {(h, hd)}: the query bias split into heads but not "
             f"folded; it meets W^UK_h like the rest of the query: c_h = W^UK_h^T b_h, shape {(h, d_c)}"),
            (c.shape != (h, d_c), f"c has shape {tuple(c.shape)}, expected (n_heads, d_c) = {(h, d_c)}"),
        ]
        for bad, hint in shape_hints:
            expect(not bad, f"{case}: {hint}")
        a, c = a.detach(), c.detach()
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
            expect(h == 1 or not _close64(a, _fold_query_ref(wq, bq, w_uk, h, *splits)[0]),
                   f"{case}: the heads are interleaved: you took rows h, h + n_heads, h + 2 n_heads, ... as head h. "
                   "split_heads gives head h the contiguous rows h*head_dim:(h+1)*head_dim of W^q, b and W^UK")
        expect(not a_ok, f"{case}: A is right but c is not: c_h = W^UK_h^T b_h, the head's bias through W^UK_h")
        raise Wrong(f"{case}: the scores (A_h x + c_h) . c_t differ from (W^q_h x + b_h) . (W^UK_h c_t) (max abs "
                    f"difference {(got - expected).abs().max().item():.3g}); A_h = W^UK_h^T W^q_h with "
                    "W^q_h = q_weight.view(n_heads, head_dim, d_model)[h], W^UK_h = w_uk.view(n_heads, head_dim, d_c)[h]")
