"""Exercise checks for chapter 19 (serving).

* 19.1 ``check_pack``: ``pack(idx, attention_mask) -> (tokens, position_ids, cu_seqlens)``, a padded
  batch (left- or right-padded) turned into the padding-free layout of varlen attention kernels:
  the real tokens row by row, positions that restart at 0 in each sequence, and the cumulative
  lengths ``[0, n_0, n_0 + n_1, ...]`` (int32). attnlib's ``mask_positions`` and ``left_pad`` are refused.
* 19.2 ``check_acceptance_from_rounds``: ``acceptance_from_rounds(accepted, k) -> float``, the
  per-draft acceptance rate estimated from the number of drafts accepted in each round of ``k``
  (checked drafts only: a round stops at its first rejection), a Python float.
* 19.3 ``check_pages_needed``: ``pages_needed(prompt_lengths, new_tokens, page_size) -> int``, the pages
  a batch of requests holds once every request has its prompt and all its new tokens.
* 19.4 ``check_gather_pages`` and 19.5 ``check_greedy_draft_round``: in :mod:`._ch19_pages_drafts`.

Every call of the learner's code goes through :func:`attnlib.book.exercises._run.run`; the random
cases come from :func:`attnlib.book.exercises._core.case_rng`.
"""
from __future__ import annotations

import torch

from attnlib.attention.masks import mask_positions
from attnlib.book.exercises._ch19_pages_drafts import check_gather_pages, check_greedy_draft_round  # 19.4, 19.5
from attnlib.book.exercises._core import (
    NotSolved,
    case_rng,
    exercise,
    expect,
    expect_int,
    expect_number,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import Refuse, run
from attnlib.serving import left_pad

__all__ = ["check_acceptance_from_rounds", "check_gather_pages", "check_greedy_draft_round", "check_pack",
           "check_pages_needed"]


# ---------------------------------------------------------------- 19.1
_OWN_POSITIONS = Refuse("count the positions yourself, not with attnlib's mask helpers", mask_positions, left_pad)


def _padded_batch(g: torch.Generator, lengths: list[int], T: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.zeros(len(lengths), T, dtype=torch.long)  # pad id 0
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        cols = slice(T - n, T) if left else slice(0, n)
        idx[b, cols] = torch.randint(1, 50, (n,), generator=g)
        mask[b, cols] = True
    return idx, mask


@exercise("19.1")
def check_pack(pack) -> None:
    """Check ``pack(idx (B, T), attention_mask (B, T) bool) -> (tokens (N,), position_ids (N,), cu_seqlens (B + 1,))``."""
    g = case_rng()
    cases = [([3, 7, 1], 7, True), ([3, 7, 1], 7, False), ([5], 5, True), ([4, 0, 2], 6, True), ([2, 6, 6], 6, False)]
    for _ in range(3):
        T = randint(g, 2, 16)
        cases.append((torch.randint(1, T + 1, (randint(g, 1, 6),), generator=g).tolist(), T, randint(g, 0, 1) == 1))
    for lengths, T, left in cases:
        idx, mask = _padded_batch(g, lengths, T, left)
        what = f"pack(idx, attention_mask) for a {'left' if left else 'right'}-padded batch with lengths {lengths}, T={T}"
        got = run(pack, idx, mask, what=what, refuse=_OWN_POSITIONS)
        if got is None:
            raise NotSolved("return the triple (tokens, position_ids, cu_seqlens), not None")
        expect(type(got) in (tuple, list) and len(got) == 3,
               f"{what}: return a triple (tokens, position_ids, cu_seqlens); got {type(got).__name__}")
        N, B = sum(lengths), len(lengths)
        want_tokens = torch.cat([idx[b][mask[b]] for b in range(B)])  # row by row
        want_pos = torch.cat([torch.arange(n) for n in lengths])
        want_cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        tokens, pos, cu = got
        if all(isinstance(t, torch.Tensor) for t in got) and N != B + 1:
            expect(not (tuple(pos.shape) == (B + 1,) and tuple(cu.shape) == (N,)),
                   f"{what}: return (tokens, position_ids, cu_seqlens) in this order")
        expect(not (isinstance(tokens, torch.Tensor) and tokens.numel() == idx.numel() != N),
               f"{what}: tokens holds the pads too: drop the pads, keep the {N} real tokens")
        expect_tensor(tokens, f"{what}: tokens", shape=(N,))
        if not torch.equal(tokens.long(), want_tokens):
            expect(not torch.equal(tokens.long(), idx.T[mask.T]),
                   f"{what}: tokens go sequence by sequence (row by row), not column by column")
            expect(False, f"{what}: tokens should be each row's real tokens in order, rows one after another")
        expect_tensor(tokens, f"{what}: tokens", dtype=idx.dtype)
        expect_tensor(pos, f"{what}: position_ids", shape=(N,), dtype=torch.int64)
        if not torch.equal(pos, want_pos):
            expect(not torch.equal(pos, torch.arange(T).expand(B, T)[mask]),
                   f"{what}: your positions are the columns: a sequence's positions restart at 0 at its first real "
                   "token, as it would be alone")
            expect(not torch.equal(pos, torch.arange(N)),
                   f"{what}: your positions run on across sequences: they restart at 0 in each one")
            expect(not (not left and torch.equal(pos, (torch.arange(T) - (~mask).sum(-1, keepdim=True))[mask])),
                   f"{what}: you subtracted the number of pads, which is right for left padding only; in a right-"
                   "padded row the pads come after the tokens: count the real tokens before each one")
            expect(False, f"{what}: position_ids should be 0, 1, ... within each sequence: {want_pos.tolist()}")
        expect_tensor(cu, f"{what}: cu_seqlens", shape=(B + 1,))
        expect(cu.dtype == torch.int32, f"{what}: cu_seqlens has dtype {cu.dtype}; varlen kernels take int32")
        expect(torch.equal(cu, want_cu), f"{what}: cu_seqlens should be [0, n_0, n_0 + n_1, ...] = "
                                         f"{want_cu.tolist()}, where sequence b is tokens[cu[b]:cu[b + 1]]; "
                                         f"got {cu.tolist()}")


# ---------------------------------------------------------------- 19.2
def _rounds(g: torch.Generator, alpha: float, k: int, n: int) -> torch.Tensor:
    ok = torch.rand(n, k, generator=g, dtype=torch.float64) < alpha
    return ok.long().cumprod(-1).sum(-1)  # drafts accepted before the first rejection


@exercise("19.2")
def check_acceptance_from_rounds(acceptance_from_rounds) -> None:
    """Check ``acceptance_from_rounds(accepted (n,) int64, k) -> float`` (a Python float)."""
    g = case_rng()
    cases = [(torch.tensor([2, 0, 4, 1, 4, 3]), 4), (torch.tensor([1, 0, 1, 1]), 1), (torch.tensor([3, 3, 3]), 3),
             (torch.tensor([0, 0]), 5)]
    for _ in range(4):
        k = randint(g, 2, 8)
        cases.append((_rounds(g, 0.3 + 0.65 * float(torch.rand((), generator=g)), k, randint(g, 20, 300)), k))
    for accepted, k in cases:
        what = f"acceptance_from_rounds(accepted={accepted.tolist()[:8]}{' ...' if len(accepted) > 8 else ''}, k={k})"
        got = expect_number(run(acceptance_from_rounds, accepted, k, what=what), what)
        a = [int(x) for x in accepted]
        successes, failures = sum(a), sum(1 for x in a if x < k)  # every round that stopped had one rejection
        want = successes / (successes + failures)
        if abs(got - want) <= 1e-6 * want:  # float32 division rounds at 1e-7
            continue
        case = f"{what} = {got:.4g}, expected {want:.4g}"
        rounds = len(a)
        expect(abs(got - successes / (k * rounds)) > 1e-6 or k == 1,
               f"{case}: accepted / drafted counts the drafts after a round's first rejection, which the target "
               "never checked; divide by the checked drafts only (the accepted ones and one rejection per round "
               "that stopped early)")
        expect(abs(got - successes / (successes + rounds)) > 1e-6,
               f"{case}: a round that accepted all k drafts had no rejection: count one rejection only for the "
               "rounds with fewer than k accepted")
        expect(abs(got - sum(1 for x in a if x > 0) / rounds) > 1e-6,
               f"{case}: you used the first draft of each round only; every checked draft is a trial")
        expect(False, f"{case}: the acceptance rate is accepted / (accepted + rejected) over the drafts the target "
                      "checked")


# ---------------------------------------------------------------- 19.3
def _up(n: int, ps: int) -> int:
    return -(-n // ps)


_PAGE_MISTAKES = [  # (what a mistaken answer gives on a case, the hint): named when it fits every case
    (lambda ps_, ns, s: _up(sum(p + n for p, n in zip(ps_, ns)), s),
     "a page belongs to one sequence: round up per request, then add (you rounded the total)"),
    (lambda ps_, ns, s: sum((p + n) // s for p, n in zip(ps_, ns)),
     "a sequence whose last page is partly filled still holds that page: round up (ceil), not down"),
    (lambda ps_, ns, s: sum((p + n) // s + 1 for p, n in zip(ps_, ns)),
     "a sequence of exactly m * page_size positions fills m pages, not m + 1 (use ceil(n / page_size))"),
    (lambda ps_, ns, s: sum(_up(p, s) + _up(n, s) for p, n in zip(ps_, ns)),
     "the new tokens continue the prompt's last page: round up prompt + new tokens together, not each on its own"),
    (lambda ps_, ns, s: sum(_up(p, s) for p in ps_), "count the new tokens too: the pages are held until the "
                                                     "request ends"),
    (lambda ps_, ns, s: sum(_up(n, s) for n in ns), "count the prompt too: its keys and values sit in the first "
                                                    "pages"),
    (lambda ps_, ns, s: sum(_up(p + n - 1, s) for p, n in zip(ps_, ns)),
     "you counted prompt + new - 1 positions (true of the cache itself: the last token is never fed back); the "
     "exercise asks for room for all prompt + new positions, what serve reserves"),
]


@exercise("19.3")
def check_pages_needed(pages_needed) -> None:
    """Check ``pages_needed(prompt_lengths, new_tokens, page_size) -> int`` on fixed and random batches."""
    g = case_rng()
    cases = [([5, 3, 12], [4, 4, 4], 4), ([16, 1], [16, 15], 16), ([7], [1], 8), ([8, 8], [8, 8], 8),
             ([4, 4, 4], [1, 1, 1], 4)]  # the last: each request one position past a page
    for _ in range(4):
        n = randint(g, 2, 8)
        cases.append((torch.randint(1, 60, (n,), generator=g).tolist(), torch.randint(1, 40, (n,), generator=g).tolist(),
                      randint(g, 2, 16)))
    answers = []
    for prompts, new, ps in cases:
        what = f"pages_needed({prompts}, {new}, page_size={ps})"
        answers.append(expect_int(run(pages_needed, list(prompts), list(new), ps, what=what), what))
    expected = [sum(_up(p + n, ps) for p, n in zip(prompts, new)) for prompts, new, ps in cases]
    if answers == expected:
        return
    i = next(j for j, (a, e) in enumerate(zip(answers, expected)) if a != e)
    prompts, new, ps = cases[i]
    case = f"pages_needed({prompts}, {new}, page_size={ps})"
    for mistake, hint in _PAGE_MISTAKES:
        expect(answers != [mistake(*c) for c in cases], f"{case}: {hint}")
    expect(False, f"{case}: expected {expected[i]} pages, got {answers[i]}")
