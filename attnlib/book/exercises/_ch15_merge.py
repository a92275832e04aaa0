"""Exercise check 15.4 (merging the partial attentions of two parts of the keys); :mod:`ch15` registers it."""
from __future__ import annotations

import math

import torch

from attnlib.attention.masks import causal_mask
from attnlib.book.exercises._core import NotSolved, Wrong, case_rng, exercise, expect, expect_tensor, randint
from attnlib.book.exercises._run import run


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """Attention of ``q`` over one part of the keys, in float64: (out, lse); a row that sees nothing
    gets out 0 and lse -inf."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with nothing visible
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return p @ v, lse


def _merge_cases(g: torch.Generator):
    cases = []
    for what, T_q, T_k, split, scale, causal in [
        ("random scores, keys split 5 | 7", 4, 12, 5, 1.0, False),
        ("random scores, keys split 1 | 9", 3, 10, 1, 1.0, False),
        ("scores in the hundreds", 4, 10, 6, 60.0, False),
        ("causal, 6 queries over 6 keys split 3 | 3 (early queries see no key of the second part)",
         6, 6, 3, 1.0, True),
        ("causal, the first part masked for some rows, one query sees no key", 5, 9, 4, 1.0, True),
    ]:
        q = torch.randn(2, 3, T_q, 8, generator=g, dtype=torch.float64) * scale
        k = torch.randn(2, 3, T_k, 8, generator=g, dtype=torch.float64) * scale
        v = torch.randn(2, 3, T_k, 8, generator=g, dtype=torch.float64)
        visible = causal_mask(T_q, T_k) if causal else torch.ones(T_q, T_k, dtype=torch.bool)
        if what.startswith("causal, the first part"):
            visible = visible.clone()
            visible[:2, :split] = False  # these rows see only the second part
            visible[2] = False  # a padded query: it sees no key at all
        cases.append((what, q, k, v, visible, split))
    T_k = randint(g, 2, 24)  # fresh sizes each run
    T_q, split = randint(g, 1, 6), randint(g, 1, T_k - 1)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64) * 3 for T in (T_q, T_k, T_k))
    cases.append((f"fresh random scores, {T_q} queries, keys split {split} | {T_k - split}", q, k, v,
                  torch.ones(T_q, T_k, dtype=torch.bool), split))
    return cases


@exercise("15.4")
def check_merge_partials(merge_partials) -> None:
    """Check ``merge_partials(out_a, lse_a, out_b, lse_b) -> (out, lse)`` against attention over all keys."""
    g = case_rng()
    for what, q, k, v, visible, split in _merge_cases(g):
        out_a, lse_a = _partial(q, k[..., :split, :], v[..., :split, :], visible[:, :split])
        out_b, lse_b = _partial(q, k[..., split:, :], v[..., split:, :], visible[:, split:])
        got = run(merge_partials, out_a, lse_a, out_b, lse_b, what=f"merge_partials(...) on {what}")
        if got is None:
            raise NotSolved("return the pair (out, lse), not None")
        want_out, want_lse = _partial(q, k, v, visible)  # computed after the answer ran
        expect(type(got) in (tuple, list) and len(got) == 2,
               f"return a pair (out, lse); got {type(got).__name__}")
        out, lse = got
        expect_tensor(out, f"{what}: out")
        expect_tensor(lse, f"{what}: lse")
        expect(tuple(out.shape) == tuple(want_out.shape) and tuple(lse.shape) == tuple(want_lse.shape),
               f"{what}: out has shape {tuple(out.shape)} and lse {tuple(lse.shape)}; expected "
               f"{tuple(want_out.shape)} and {tuple(want_lse.shape)}")
        if torch.isnan(out).any() or torch.isnan(lse).any():
            bad = torch.isnan(out).any(dim=-1) | torch.isnan(lse)  # (B, h, T_q)
            both = torch.isinf(lse_a) & torch.isinf(lse_b)
            if (bad & both).any():
                raise Wrong(f"{what}: NaN for a query that sees no key in either part (a padded "
                            "query): both lse are -inf, and exp(-inf - (-inf)) is NaN. Shift by 0 "
                            "when both are -inf, and return out 0 and lse -inf for that query")
            if (bad & (torch.isinf(lse_a) | torch.isinf(lse_b))).any():
                raise Wrong(f"{what}: NaN where one part has lse = -inf (the query sees none of its "
                            "keys): its weight exp(-inf - m) should be 0")
            raise Wrong(f"{what}: your out or lse holds NaN. With lse in the hundreds, exp(lse) "
                        "overflows: weigh each part by exp(lse_part - max(lse_a, lse_b))")
        if not torch.allclose(out.double(), want_out, rtol=1e-5, atol=1e-6):
            mean = (out_a + out_b) / 2
            if torch.allclose(out.double(), mean, rtol=1e-5, atol=1e-6):
                raise Wrong(f"{what}: out is the plain mean of the two parts. Each part's output is "
                            "normalised over its own keys: weigh it by its share of the whole "
                            "denominator, exp(lse_part - lse)")
            raise Wrong(f"{what}: out differs from attention over all keys by up to "
                        f"{(out.double() - want_out).abs().max().item():.2e}. out = "
                        "(exp(lse_a - lse) out_a + exp(lse_b - lse) out_b)")
        finite = torch.isfinite(want_lse)
        expect(torch.equal(torch.isinf(lse), ~finite),
               f"{what}: lse must be -inf exactly where a query sees no key at all, finite elsewhere")
        if not torch.allclose(lse.double()[finite], want_lse[finite], rtol=1e-6, atol=1e-6):
            if torch.allclose(lse.double()[finite], torch.maximum(lse_a, lse_b)[finite]):
                raise Wrong(f"{what}: lse is max(lse_a, lse_b); the log-sum-exp of the union is "
                            "log(exp(lse_a) + exp(lse_b)), computed as m + log(exp(lse_a - m) + "
                            "exp(lse_b - m))")
            raise Wrong(f"{what}: lse should be the log-sum-exp over all keys, log(exp(lse_a) + "
                        "exp(lse_b))")
