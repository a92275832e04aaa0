"""Exercise 21.2: the keys DeepSeek-V3.2's lightning indexer selects, under a causal mask.

``indexer_topk(q_idx, k_idx, w, top_k, start) -> (T_q, T_k) bool``: the indexer's queries ``q_idx (T_q, H_I, d_I)``
(``H_I`` heads) at positions ``start … start + T_q - 1``, its keys ``k_idx (T_k, d_I)`` (one per position, shared by
the heads) and the heads' weights ``w (T_q, H_I)`` give the index scores ``I_{t,s} = Σ_j w_{t,j} ReLU(q_{t,j} · k_s)``
(DeepSeek-AI 2025, DeepSeek-V3.2, §2.1, eq. 1); query ``t`` attends the ``top_k`` keys of highest score among those at
or before its position, all of them when there are fewer. The expected choice is computed in float64; where two
scores tie within float32's rounding, either key is right (:func:`fits`). A wrong choice is explained by the slips
that fit the answer in every case (:func:`_slips`). attnlib's attention code (``topk_mask``, ``LightningIndexer``,
...) and transformers' DeepSeek indexers are refused.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from attnlib.book.exercises._ch21_kda import attention_library
from attnlib.book.exercises._core import NotSolved, Wrong, case_rng, exercise, expect, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run

__all__ = ["check_indexer_topk", "fits", "index_scores"]


def _refused() -> Refuse:
    targets = list(attention_library())
    for name in ("deepseek_v32", "deepseek_v4"):  # the chapter's references; a learner may reach for them
        try:
            module = __import__(f"transformers.models.{name}.modeling_{name}", fromlist=["_"])
        except ImportError:  # pragma: no cover - transformers is a dependency of the book
            continue
        targets += [obj for key, obj in vars(module).items() if "Indexer" in key and isinstance(obj, type)]
    return Refuse("select the keys yourself, without attnlib's attention code (topk_mask, LightningIndexer, ...) or "
                  "transformers' DeepSeek indexers", *targets)


def index_scores(q_idx, k_idx, w, *, relu: str = "each", weights: bool = True) -> torch.Tensor:
    """``I (T_q, T_k)`` in float64; ``relu``: ``"each"`` head's dot product (right), ``"sum"`` (after the weighted
    sum) or ``"none"``; ``weights=False``: the heads summed without ``w``."""
    dots = torch.einsum("thd,sd->ths", q_idx.double(), k_idx.double())  # (T_q, H_I, T_k)
    if relu == "each":
        dots = dots.relu()
    scores = torch.einsum("ths,th->ts", dots, w.double() if weights else torch.ones_like(w, dtype=torch.float64))
    return scores.relu() if relu == "sum" else scores


def _allowed(T_q: int, T_k: int, first: int, strict: bool = False) -> torch.Tensor:
    """Which keys each query may choose: those at or before its position ``first + t`` (``strict``: before)."""
    pos = torch.arange(first, first + T_q)[:, None]
    j = torch.arange(T_k)[None, :]
    return j < pos if strict else j <= pos


def fits(got: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, top_k: int, tol: float,
         clip: torch.Tensor | None = None) -> bool:
    """Whether ``got`` is a top-``top_k`` choice among ``allowed`` keys (all of them when fewer), ties within ``tol``
    either way; with ``clip``: a top-``top_k`` choice among ``allowed`` keys, then the keys outside ``clip`` dropped."""
    kk = allowed.sum(-1).clamp(max=top_k)  # (T_q,)
    s = scores.masked_fill(~allowed, float("-inf"))
    theta = s.sort(-1, descending=True).values.gather(-1, (kk - 1).clamp(min=0)[:, None])  # the kk-th best
    inside = allowed if clip is None else allowed & clip
    if bool((got & ~inside).any()):
        return False
    high = (s > theta + tol) & inside  # certainly chosen
    low = (s < theta - tol) | ~allowed  # certainly not
    if bool((high & ~got).any() or (got & low).any()):
        return False
    count = got.sum(-1)
    return bool((count == kk).all()) if clip is None else bool((count <= kk).all())


_RELU = ("ReLU applies to each head's dot product before the heads are weighted and summed: I = Σ_j w_j "
         "ReLU(q_j · k), not Σ_j w_j q_j · k nor ReLU(Σ_j w_j q_j · k); a head that scores a key negatively abstains, "
         "it does not outvote the others")
_OWN = ("a query may select its own key: query t sits at position start + t and chooses among keys 0 … start + t "
        "(j <= start + t), not only those before it")


def _slips(scores_of, T_q: int, T_k: int, top_k: int, start: int, tol) -> dict[str, tuple[str, Callable]]:
    """name -> (hint, whether a choice fits that slip); a slip that cannot differ here is left out."""
    causal = _allowed(T_q, T_k, start)
    right, plain, outer, unweighted = scores_of(), scores_of(relu="none"), scores_of(relu="sum"), scores_of(weights=False)
    every = torch.ones(T_q, T_k, dtype=torch.bool)

    def padded(got):  # fewer than top_k past keys: topk over -inf scores picks future keys to make up top_k
        few = causal.sum(-1) < top_k
        return fits(got[~few], right[~few], causal[~few], top_k, tol) and bool((got[few] >= causal[few]).all()) \
            and bool((got[few].sum(-1) == min(top_k, T_k)).all())

    slips = {
        "no relu": (_RELU, lambda got: fits(got, plain, causal, top_k, tol)),
        "relu after": (_RELU, lambda got: fits(got, outer, causal, top_k, tol)),
        "no w": ("weight each head's score by its w_{t,j} before summing the heads: I = Σ_j w_{t,j} ReLU(q_{t,j} · k)",
                 lambda got: fits(got, unweighted, causal, top_k, tol)),
        "future": ("a query never selects a key after its own position: choose among keys 0 … start + t only "
                   "(causal)", lambda got: fits(got, right, every, top_k, tol)),
        "masked after": ("choose the top_k among the keys at or before the query, not among every key and then "
                         "drop the future ones: that leaves fewer than top_k keys",
                         lambda got: fits(got, right, every, top_k, tol, clip=causal)),
        "padded": ("a query with fewer than top_k keys at or before its position attends all of them and no more: "
                   "topk over scores with -inf at the future keys still returns top_k indices, future keys among "
                   "them", padded),
        "strict": (_OWN, lambda got: fits(got, right, _allowed(T_q, T_k, start, strict=True), top_k, tol)),
        "from 0": ("query t sits at position start + t, not t: the chunk's queries come after start earlier tokens",
                   lambda got: fits(got, right, _allowed(T_q, T_k, 0), top_k, tol)),
        "plus 1": ("query t sits at position start + t (the first query at start), not start + t + 1",
                   lambda got: fits(got, right, _allowed(T_q, T_k, start + 1), top_k, tol)),
        "minus 1": (_OWN, lambda got: fits(got, right, _allowed(T_q, T_k, start - 1), top_k, tol)),
        "last": (f"query t sits at position start + t; the keys may go on after the last query (here {T_k} keys, the "
                 f"last query at {start + T_q - 1}): do not take the queries for the last T_q positions",
                 lambda got: fits(got, right, _allowed(T_q, T_k, T_k - T_q), top_k, tol)),
    }
    return slips


#: the slips' names, most specific first
_NAMES = ("padded", "masked after", "future", "relu after", "no relu", "no w", "strict", "from 0", "plus 1",
          "minus 1", "last")


def _cases(g: torch.Generator) -> list[tuple[int, int, int, int, int, int]]:
    """(T_q, T_k, H_I, d_I, top_k, start): one key; a prefill whose first queries have fewer than top_k keys; a
    decoding step; a chunk in the middle of longer keys; top_k larger than every key count; top_k = 1; and fresh
    random ones."""
    cases = [(1, 1, 1, 2, 1, 0), (6, 6, 2, 4, 3, 0), (1, 12, 4, 8, 4, 11), (4, 16, 3, 5, 6, 5),
             (5, 10, 2, 3, 20, 2), (8, 8, 4, 4, 1, 0), (3, 20, 2, 6, 5, 7), (6, 24, 4, 4, 4, 2)]
    for _ in range(3):
        T_k = randint(g, 2, 30)
        T_q = randint(g, 1, T_k)
        cases.append((T_q, T_k, randint(g, 1, 4), randint(g, 2, 8), randint(g, 1, 8), randint(g, 0, T_k - T_q)))
    return cases


def _what(T_q, T_k, H, d, top_k, start) -> str:
    return f"indexer_topk(q_idx ({T_q}, {H}, {d}), k_idx ({T_k}, {d}), w ({T_q}, {H}), top_k={top_k}, start={start})"


@exercise("21.2")
def check_indexer_topk(answer) -> None:
    """Check ``answer(q_idx, k_idx, w, top_k, start) -> (T_q, T_k) bool`` against a float64 reference.

    Every case runs first; a wrong choice is then explained by the slips that fit the answer in every case.
    """
    rng, refuse = case_rng(), _refused()
    chosen = []  # (case, inputs, the answer's mask, right)
    for case in _cases(rng):
        T_q, T_k, H, d, top_k, start = case
        q_idx = torch.randn(T_q, H, d, generator=rng)
        k_idx = torch.randn(T_k, d, generator=rng)
        w = torch.randn(T_q, H, generator=rng).abs() * torch.where(torch.rand(T_q, H, generator=rng) < 0.8, 1.0, -1.0)
        what = _what(*case)
        try:
            got = run(answer, q_idx, k_idx, w, top_k, start, what=what, refuse=refuse)
        except Wrong as e:
            if any(not c[-1] for c in chosen):
                break  # an earlier case's wrong choice says more than this one's error
            if "your code raised" in str(e) and top_k > start + 1:
                raise Wrong(f"{e}; the first queries here have fewer than top_k = {top_k} keys at or before them "
                            "(query t has start + t + 1): they attend all of those, so ask topk for no more "
                            "than there are") from None
            raise
        if got is None:
            raise NotSolved("return the (T_q, T_k) bool mask of the keys each query attends, not None")
        expect_tensor(got, what)
        expect(not (got.dtype == torch.int64 and got.dim() == 2 and tuple(got.shape) != (T_q, T_k)),
               f"{what} returned indices of shape {tuple(got.shape)}: return a (T_q, T_k) bool mask, True at the "
               "keys each query attends (scatter the indices into it)")
        expect(not (T_q != T_k and tuple(got.shape) == (T_k, T_q)), f"{what} has shape {tuple(got.shape)}: one row "
                                                                     f"per query, one column per key, ({T_q}, {T_k})")
        expect(tuple(got.shape) == (T_q, T_k), f"{what} has shape {tuple(got.shape)}, expected ({T_q}, {T_k})")
        expect(got.dtype == torch.bool, f"{what} has dtype {got.dtype}: return a bool mask (True = the query attends "
                                        "the key)" + ("; topk gives indices: scatter the indices into it"
                                                      if not got.is_floating_point() else ""))
        # the expected choice, after the answer ran, in float64
        scores = index_scores(q_idx, k_idx, w)
        tol = 1e-5 * max(1.0, scores.abs().max().item())
        right = fits(got, scores, _allowed(T_q, T_k, start), top_k, tol)
        chosen.append((case, (q_idx, k_idx, w), got, tol, right))
    wrong = [c for c in chosen if not c[-1]]
    if not wrong:
        return

    def table(case, inputs, tol):
        def scores_of(**variant):
            return index_scores(*inputs, **variant)
        T_q, T_k, _, _, top_k, start = case
        return _slips(scores_of, T_q, T_k, top_k, start, tol)

    tables = [table(case, inputs, tol) for case, inputs, _, tol, _ in chosen]
    names = [name for name in _NAMES if all(name not in t or t[name][1](c[2]) for t, c in zip(tables, chosen))]
    first = chosen.index(wrong[0])
    case, inputs, got, _, _ = wrong[0]
    hints = list(dict.fromkeys(tables[first][name][0] for name in names if name in tables[first]))
    expect(not hints, f"{_what(*case)}: " + "; or ".join(hints))
    T_q, T_k, _, _, top_k, start = case
    want = _probe(index_scores(*inputs), _allowed(T_q, T_k, start), top_k)
    row = int((got != want).any(-1).nonzero()[0, 0])
    expect(False, f"{_what(*case)}: query {row} (position {start + row}) attends keys "
                  f"{got[row].nonzero()[:, 0].tolist()}, expected {want[row].nonzero()[:, 0].tolist()} (its top "
                  f"{top_k} keys by I = Σ_j w_j ReLU(q_j · k) among keys 0 … {start + row})")


def _probe(scores: torch.Tensor, allowed: torch.Tensor, top_k: int) -> torch.Tensor:
    """The expected mask itself: the top ``top_k`` allowed keys of each row (all when fewer)."""
    kk = allowed.sum(-1).clamp(max=top_k)
    order = scores.masked_fill(~allowed, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    keep = torch.arange(scores.shape[-1])[None, :] < kk[:, None]
    return torch.zeros_like(allowed).scatter(-1, order, keep)
