"""Exercise checks 15.5 (one tile of FlashAttention's backward) and 15.6 (Flex mods after a cache).

:mod:`ch15` imports them, which registers them.

* 15.5 ``flash_backward_tile(q, k, v, d_out, lse, D, visible) -> (dq, dk, dv)``: the shares of one
  tile of queries ``(B_q, d)`` and keys/values ``(B_k, d)`` in the gradients, rebuilt from the saved
  log-sum-exp ``lse`` ``(B_q,)`` and ``D = rowsum(dO * O)`` ``(B_q,)`` (Dao 2023, Algorithm 2); the
  shares of every tile are summed and compared with autograd through plain attention.
* 15.6 ``flex_mods(T_q, T_k, window, n_heads) -> (mask_mod, score_mod)``: a causal sliding window and
  ALiBi for ``torch.nn.attention.flex_attention``, whose ``q_idx`` counts the ``T_q`` newest queries
  from 0; checked on the index grid and through ``flex_attention`` against attention written out.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from attnlib.attention.flash import FlashAttentionFunction, _backward, flash_attention
from attnlib.attention.mods import alibi_slopes
from attnlib.book.exercises._autograd import AUTOGRAD
from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    _raised_by_learner,
    case_rng,
    exercise,
    expect,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import Refuse, run

_BY_HAND = Refuse("write the gradients from the formulas, not with autograd or a library backward",
                  *AUTOGRAD, _backward, FlashAttentionFunction, flash_attention,
                  F.scaled_dot_product_attention, aten="scaled_dot_product")


def _tile_cases(g: torch.Generator):
    """(what, T_q, T_k, d, B_q, B_k, causal, score scale): fixed edges, then fresh sizes."""
    cases = [("one tile holding everything, 4 queries, 6 keys", 4, 6, 4, 4, 6, False, 1.0),
             ("causal, 8 queries over 8 keys, tiles of 3 x 5", 8, 8, 4, 3, 5, True, 1.0),
             ("causal, the last 6 of 14 positions, tiles of 4 x 3", 6, 14, 8, 4, 3, True, 1.0),
             ("scores in the thousands (exp(S) overflows)", 4, 9, 4, 2, 4, False, 40.0)]
    T_k = randint(g, 3, 16)
    cases.append(("fresh random sizes", randint(g, 1, T_k), T_k, randint(g, 2, 8), randint(g, 1, 5),
                  randint(g, 1, 5), bool(randint(g, 0, 1)), 1.0))
    return cases


def _expected_shares(P, dO, D, q, k, v, scale):
    """One tile's shares from its block of the whole softmax ``P``: dq, dk, dv (and dS without D)."""
    dv = P.T @ dO  # (B_k, B_q) @ (B_q, d)
    dP = dO @ v.T  # (B_q, B_k)
    dS = P * (dP - D[:, None])
    return scale * dS @ k, scale * dS.T @ q, dv


@exercise("15.5")
def check_flash_backward_tile(flash_backward_tile) -> None:
    """Check ``flash_backward_tile`` tile by tile; the summed shares against autograd of plain attention."""
    g = case_rng()
    for what, T_q, T_k, d, bq, bk, causal, size in _tile_cases(g):
        q, k, v = (torch.randn(T, d, generator=g, dtype=torch.float64) * w
                   for T, w in ((T_q, size), (T_k, size), (T_k, 1.0)))
        dO = torch.randn(T_q, d, generator=g, dtype=torch.float64)
        scale = 1 / math.sqrt(d)
        pos = torch.arange(T_k - T_q, T_k)[:, None]
        visible = (torch.arange(T_k)[None, :] <= pos) if causal else torch.ones(T_q, T_k, dtype=torch.bool)
        S = (q @ k.T * scale).masked_fill(~visible, -math.inf)  # (T_q, T_k)
        lse = torch.logsumexp(S, dim=-1)
        P = torch.exp(S - lse[:, None])
        D = (dO * (P @ v)).sum(-1)  # rowsum(dO o O)
        shares = [torch.zeros(T_q, d, dtype=torch.float64), torch.zeros(T_k, d, dtype=torch.float64),
                  torch.zeros(T_k, d, dtype=torch.float64)]
        for q0 in range(0, T_q, bq):
            rows = slice(q0, min(q0 + bq, T_q))
            for k0 in range(0, T_k, bk):
                cols = slice(k0, min(k0 + bk, T_k))
                tile = f"{what}: the tile of queries {rows.start}:{rows.stop} and keys {cols.start}:{cols.stop}"
                got = run(flash_backward_tile, q[rows], k[cols], v[cols], dO[rows], lse[rows], D[rows],
                          visible[rows, cols], what=f"flash_backward_tile(...) on {tile}", refuse=_BY_HAND)
                if got is None:
                    raise NotSolved("return the tile's shares (dq, dk, dv), not None")
                expect(type(got) in (tuple, list) and len(got) == 3, f"return three tensors (dq, dk, dv); got "
                                                                      f"{type(got).__name__}")
                n_q, n_k = rows.stop - rows.start, cols.stop - cols.start
                for name, t, shape in zip(("dq", "dk", "dv"), got, ((n_q, d), (n_k, d), (n_k, d))):
                    expect_tensor(t, f"{tile}: {name}", shape=shape)
                got = [t.double() for t in got]
                want = _expected_shares(P[rows, cols], dO[rows], D[rows], q[rows], k[cols], v[cols], scale)
                if not all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(got, want[:3])):
                    raw = q[rows] @ k[cols].T * scale  # the tile's scores, unmasked
                    _tile_mistake(tile, got, want, raw, visible[rows, cols], dO[rows], lse[rows], d)
                for total, share, part in zip(shares, got, ((rows,), (cols,), (cols,))):
                    total[part] += share
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]  # autograd through plain attention, after
        scores = (leaves[0] @ leaves[1].T * scale).masked_fill(~visible, -math.inf)
        ref = torch.autograd.grad(torch.softmax(scores, dim=-1) @ leaves[2], leaves, dO)
        for name, mine, theirs in zip(("dQ", "dK", "dV"), shares, ref):
            expect(torch.allclose(mine, theirs, rtol=1e-6, atol=1e-8),
                   f"{what}: the summed shares of {name} differ from autograd's by "
                   f"{(mine - theirs).abs().max().item():.2e}")


def _tile_mistake(what, got, want, raw, visible, dO, lse, d) -> None:
    """Raise :class:`Wrong` naming the mistake in one tile's shares (``raw``: its unmasked scores)."""
    dq, dk, dv = got
    want_dq, want_dk, want_dv = want
    close = lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-8)  # noqa: E731
    if any(not torch.isfinite(t).all() for t in got):
        raise Wrong(f"{what}: your gradients hold NaN or inf. For scores in the hundreds exp(S) and exp(L) "
                    "overflow, and a masked score is -inf: rebuild P in one exponent, exp(S - L)")
    if not close(dv, want_dv):
        tile_softmax = torch.softmax(raw.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
        if close(dv, tile_softmax.T @ dO) and not close(tile_softmax.T @ dO, want_dv):
            raise Wrong(f"{what}: dV is P^T dO with P normalised over this tile's keys only. The tile sees part "
                        "of each row; L is the log-sum-exp of the whole row: P = exp(S - L), no softmax")
        if not visible.all() and close(dv, torch.exp(raw - lse[:, None]).T @ dO):
            raise Wrong(f"{what}: dV counts the keys this tile masks (visible False): their P is 0, as if "
                        "their score were -inf")
        raise Wrong(f"{what}: dV should be P^T dO, with P = exp(S - L), S = q k^T / sqrt(d) and P = 0 where "
                    "visible is False")
    for name, a, b in (("dQ", dq, want_dq), ("dK", dk, want_dk)):
        if close(a, b):
            continue
        for factor in (math.sqrt(d), 1 / math.sqrt(d)):
            if close(a, b * factor):
                raise Wrong(f"{what}: {name} is off by a factor {factor:.3g}. The scores are S = q k^T / sqrt(d): "
                            "dQ = dS k / sqrt(d) and dK = dS^T q / sqrt(d), the scale once each")
        raise Wrong(f"{what}: {name} is wrong. dS = P o (dP - D), dP = dO V^T: subtract D_i from every entry of "
                    "row i (D = rowsum(dO o O) is the softmax Jacobian's sum); then dQ = dS K / sqrt(d), "
                    "dK = dS^T Q / sqrt(d)")


# ---------------------------------------------------------------- 15.6
def _flex(q, k, v, mask_mod, score_mod):
    """``flex_attention`` (uncompiled: the reference that materialises the scores) with the answer's mods."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without")
        block_mask = create_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2], device="cpu")
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _flex_cases(g: torch.Generator) -> list[tuple[int, int, int, int]]:
    """(T_q, T_k, window, n_heads): one decoding step, a square mask, a chunk after a cache, fresh ones."""
    cases = [(1, 9, 4, 2), (7, 7, 3, 3), (5, 17, 4, 4), (6, 20, 40, 1)]
    for _ in range(2):
        T_k = randint(g, 2, 40)
        cases.append((randint(g, 1, T_k), T_k, randint(g, 1, T_k + 2), randint(g, 1, 8)))
    return cases


def _mask_hint(case, got, T_q, T_k, window) -> str:
    i, j = torch.arange(T_q)[:, None], torch.arange(T_k)[None, :]
    for q_pos, hint in ((i, "FlexAttention numbers the new queries from 0: query q_idx sits at position "
                           "q_idx + T_k - T_q (add the offset inside the mask_mod)"),
                        (i - (T_k - T_q), "the offset goes the other way: query q_idx sits at q_idx + T_k - T_q")):
        if torch.equal(got, (j <= q_pos) & (q_pos - j < window)):
            return f"{case}: {hint}"
    pos = i + T_k - T_q
    if torch.equal(got, (j <= pos) & (pos - j <= window)):
        return f"{case}: the window holds {window} keys, the query's own included: pos - kv_idx < window"
    if torch.equal(got, (pos - j).abs() < window):
        return f"{case}: keys after the query (kv_idx > its position) must stay hidden: keep the mask causal"
    return f"{case}: query q_idx (position q_idx + T_k - T_q) sees key kv_idx iff pos - window < kv_idx <= pos"


def _bias_hint(case, got, want, visible, T_q, T_k, slopes) -> str:
    i, j = torch.arange(T_q)[:, None], torch.arange(T_k)[None, :]
    on = lambda t: torch.allclose(got[visible], t.expand_as(got)[visible], atol=1e-5)  # noqa: E731
    if on(-slopes[:, None, None] * (i - j)):
        return (f"{case}: ALiBi's distance uses the query's position, q_idx + T_k - T_q, not q_idx: the penalty "
                "must count the keys back from the query's real place in the sequence")
    if on(-want):
        return f"{case}: the sign: ALiBi subtracts slope * (position - kv_idx), a penalty that grows with distance"
    if on(want[:1].expand_as(want)):
        return f"{case}: every head uses head 0's slope; index the slopes with h"
    return f"{case}: score_mod should return score - slope[h] * (q_idx + T_k - T_q - kv_idx)"


@exercise("15.6")
def check_flex_offset_mods(flex_mods) -> None:
    """Check ``flex_mods(T_q, T_k, window, n_heads)`` on the index grid, then through ``flex_attention``."""
    g = case_rng()
    for T_q, T_k, window, n_heads in _flex_cases(g):
        case = f"flex_mods(T_q={T_q}, T_k={T_k}, window={window}, n_heads={n_heads})"
        got = run(flex_mods, T_q, T_k, window, n_heads, what=case)
        if got is None:
            raise NotSolved("return the pair (mask_mod, score_mod), not None")
        expect(type(got) in (tuple, list) and len(got) == 2 and all(callable(f) for f in got),
               f"{case}: return a pair of functions (mask_mod, score_mod)")
        mask_mod, score_mod = got
        B = 2
        b, h = torch.arange(B)[:, None, None, None], torch.arange(n_heads)[None, :, None, None]
        q_idx, kv_idx = torch.arange(T_q)[:, None], torch.arange(T_k)[None, :]
        mask = run(mask_mod, b, h, q_idx, kv_idx, what=f"{case}'s mask_mod")
        expect_tensor(mask, f"{case}: mask_mod(...)", dtype=torch.bool)
        mask = mask.expand(B, n_heads, T_q, T_k)[0, 0]
        pos = q_idx + T_k - T_q  # the check's own positions, after the answer ran
        visible = (kv_idx <= pos) & (pos - kv_idx < window)
        if not torch.equal(mask, visible):
            raise Wrong(_mask_hint(case, mask, T_q, T_k, window))
        zeros = torch.zeros(B, n_heads, T_q, T_k)
        bias = run(score_mod, zeros, b, h, q_idx, kv_idx, what=f"{case}'s score_mod")
        expect_tensor(bias, f"{case}: score_mod(...)")
        slopes = alibi_slopes(n_heads).double()
        want = -slopes[:, None, None] * (pos - kv_idx)  # (n_heads, T_q, T_k)
        bias = bias.double().expand(B, n_heads, T_q, T_k)[0]
        grid = visible.expand(n_heads, T_q, T_k)
        if not torch.allclose(bias[grid], want[grid], atol=1e-5):
            raise Wrong(_bias_hint(case, bias, want, grid, T_q, T_k, slopes))
        q = torch.randn(B, n_heads, T_q, 8, generator=g)
        k, v = (torch.randn(B, n_heads, T_k, 8, generator=g) for _ in range(2))
        try:  # called here, not through run(): run would count _flex's own frame as the answer's
            out = _flex(q, k, v, mask_mod, score_mod)
        except Exception as e:  # the answer's mods run inside flex_attention, under vmap
            if not _raised_by_learner(e, flex_mods):
                raise
            raise Wrong(f"{case}: under flex_attention your mods raised {type(e).__name__}: {e}. Flex calls them "
                        "with one scalar tensor per index (under vmap): no Python if or .item() on them") from None
        scores = (q @ k.transpose(-2, -1) / math.sqrt(8) + want.float()).masked_fill(~visible, -math.inf)
        expected = torch.softmax(scores, dim=-1) @ v
        expect(torch.allclose(out, expected, atol=1e-5),
               f"{case}: flex_attention with your mods differs from attention written out by "
               f"{(out - expected).abs().max().item():.1e}")
