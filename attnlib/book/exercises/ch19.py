"""Exercise checks for chapter 19 (serving).

* 19.1 ``check_positions_from_mask``: ``positions_from_mask(attention_mask)``, each token's position
  counted from its row's first real token, for a left-padded ``(B, T)`` bool mask; pads get any
  position a position table can look up (``0 <= pos < T``).
* 19.2 ``check_expected_tokens``: ``expected_tokens(alpha, k)``, the expected tokens one target pass
  of speculative decoding yields when each draft is accepted independently with probability
  ``alpha`` (Leviathan et al. 2023, eq. 1): ``(1 - alpha**(k + 1)) / (1 - alpha)``, ``k + 1`` at 1.
* 19.3 ``check_pages_needed``: ``pages_needed(prompt_lengths, new_tokens, page_size)``, the pages a
  batch of requests holds once every request has its prompt and all its new tokens.
* 19.4 ``check_residual``: ``residual(p, q)``, the distribution a rejected draft is replaced from:
  ``max(0, p - q)`` normalised, ``p`` where ``p == q``.
* 19.5 ``check_greedy_draft_round``: ``greedy_draft_round(p, drafts, generator)``, one round of
  speculative sampling when the draft proposes its argmax (its ``q`` is a point mass): the emitted
  tokens must follow the target's law (measured over many rounds), end at the first rejection and
  carry the bonus token after ``k`` acceptances.

Random inputs come from a local ``torch.Generator``.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._core import NotSolved, exercise, expect

__all__ = ["check_expected_tokens", "check_greedy_draft_round", "check_pages_needed", "check_positions_from_mask",
           "check_residual"]


# ---------------------------------------------------------------- 19.1
def _left_padded_masks(g: torch.Generator) -> list[torch.Tensor]:
    masks = []
    for B, T in [(3, 6), (4, 9), (1, 5), (5, 12)]:
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = T  # one row without padding
        masks.append(torch.arange(T)[None, :] >= (T - lengths)[:, None])
    return masks


@exercise("19.1")
def check_positions_from_mask(positions_from_mask) -> None:
    """Check ``positions_from_mask(mask (B, T) bool) -> (B, T) int64`` on random left-padded masks."""
    g = torch.Generator().manual_seed(191)
    for mask in _left_padded_masks(g):
        before = mask.clone()
        got = positions_from_mask(mask)
        if got is None:
            raise NotSolved("return the positions (B, T), not None")
        B, T = mask.shape
        case = f"a mask of shape {(B, T)} with {(~mask).sum(-1).tolist()} pads per row"
        expect(torch.equal(before, mask), f"{case}: your code changed the mask in place")
        expect(isinstance(got, torch.Tensor) and tuple(got.shape) == (B, T),
               f"{case}: return a tensor of shape (B, T) = {(B, T)}; got {getattr(got, 'shape', got)}")
        expect(not got.is_floating_point() and got.dtype != torch.bool,
               f"{case}: positions index a table: return an integer tensor, not {got.dtype}")
        n_pad = (~mask).sum(-1, keepdim=True)
        expected = torch.arange(T)[None, :] - n_pad  # real tokens: 0, 1, ... from the first real one
        if not torch.equal(got[mask], expected[mask]):
            expect(not torch.equal(got[mask], torch.arange(T).expand(B, T)[mask]),
                   f"{case}: your positions count the pads: a prompt with p pads would be read as if it "
                   "started at position p, not 0 as it does alone")
            expect(not torch.equal(got[mask], expected[mask] + 1),
                   f"{case}: the first real token must be at position 0, yours start at 1 (subtract 1 from "
                   "the cumulative sum)")
            expect(not torch.equal(got[mask], (T - 1 - torch.arange(T)).expand(B, T)[mask]),
                   f"{case}: positions grow from left to right (count from the first real token, not "
                   "back from the last)")
            b = next(r for r in range(B) if not torch.equal(got[r][mask[r]], expected[r][mask[r]]))
            expect(False, f"{case}: real tokens must be at 0, 1, 2, ... counted from each row's first "
                          f"real token; row {b}'s real tokens: expected {expected[b][mask[b]].tolist()}, got "
                          f"{got[b][mask[b]].tolist()}")
        pads = got[~mask]
        expect(pads.numel() == 0 or bool(((pads >= 0) & (pads < T)).all()),
               f"{case}: a pad got position {pads.min().item() if pads.numel() else 0}: no row of a position table has that "
               "index (clamp the pads' positions at 0)")


# ---------------------------------------------------------------- 19.2
@exercise("19.2")
def check_expected_tokens(expected_tokens) -> None:
    """Check ``expected_tokens(alpha, k) -> float`` against the closed form and a simulation."""
    cases = [(0.5, 1), (0.8, 4), (0.3, 6), (0.95, 2), (0.0, 3), (0.71, 5), (1.0, 4), (1.0, 1)]
    g = torch.Generator().manual_seed(1920)
    cases += [(round(float(torch.rand(1, generator=g)), 3), int(torch.randint(1, 9, (1,), generator=g)))
              for _ in range(4)]
    for alpha, k in cases:
        case = f"alpha={alpha}, k={k}"
        try:
            got = expected_tokens(alpha, k)
        except ZeroDivisionError:
            expect(False, f"{case}: with alpha = 1 every draft is accepted: k + 1 tokens (the sum "
                          "1 + alpha + ... + alpha**k, without dividing by 1 - alpha = 0)")
        if got is None:
            raise NotSolved("return the expected number of tokens, not None")
        got = float(got)
        expected = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
            continue
        expect(not math.isnan(got), f"{case}: you returned nan: with alpha = 1 every draft is accepted "
                                    "and the pass yields k + 1 tokens")
        expect(not (alpha < 1 and math.isclose(got, (1 - alpha**k) / (1 - alpha), rel_tol=1e-9)),
               f"{case}: you forgot the target's own token: every pass adds one token after the accepted "
               "drafts (the replacement or the bonus token), so 1 + alpha + ... + alpha**k")
        expect(not (alpha < 1 and math.isclose(got, alpha * (1 - alpha**k) / (1 - alpha), rel_tol=1e-9)),
               f"{case}: that is the expected number of accepted drafts only; the pass also emits one "
               "token of the target's own (the replacement or the bonus token): add 1")
        expect(not (alpha < 1 and math.isclose(got, (1 - alpha ** (k + 2)) / (1 - alpha), rel_tol=1e-9)),
               f"{case}: one term too many (off by one in k): k drafts give the terms alpha**0 ... "
               "alpha**k, k + 1 of them, so (1 - alpha**(k + 1)) / (1 - alpha)")
        expect(not math.isclose(got, 1 + alpha * k, rel_tol=1e-9),
               f"{case}: drafts are not accepted independently of each other: draft j counts only if "
               "drafts 1..j-1 were all accepted (probability alpha**j), not alpha for each")
        expect(not (alpha < 1 and math.isclose(got, 1 / (1 - alpha), rel_tol=1e-9)),
               f"{case}: 1 / (1 - alpha) is the limit of infinitely many drafts; with k drafts the sum "
               "stops at alpha**k")
        expect(False, f"{case}: expected {expected:.6g} tokens per target pass, got {got:.6g}")
    # a simulation with the same assumption, as a second witness
    g = torch.Generator().manual_seed(192)
    alpha, k = 0.6, 3
    accepted = (torch.rand(200_000, k, generator=g) < alpha).long().cumprod(-1).sum(-1)
    simulated = (accepted + 1).double().mean().item()
    expect(abs(float(expected_tokens(alpha, k)) - simulated) < 0.02,
           f"alpha={alpha}, k={k}: a simulation gives {simulated:.3f} tokens per pass")


# ---------------------------------------------------------------- 19.3
@exercise("19.3")
def check_pages_needed(pages_needed) -> None:
    """Check ``pages_needed(prompt_lengths, new_tokens, page_size) -> int`` on random batches."""
    g = torch.Generator().manual_seed(193)
    cases = [([5, 3, 12], [4, 4, 4], 4), ([16, 1], [16, 15], 16), ([7], [1], 8), ([8, 8], [8, 8], 8)]
    for _ in range(4):
        n = int(torch.randint(2, 9, (1,), generator=g))
        cases.append((torch.randint(1, 60, (n,), generator=g).tolist(),
                      torch.randint(1, 40, (n,), generator=g).tolist(), int(torch.randint(2, 17, (1,), generator=g))))
    answers = []
    for prompts, new, ps in cases:
        got = pages_needed(list(prompts), list(new), ps)
        if got is None:
            raise NotSolved("return the number of pages, not None")
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"prompts {prompts}, new tokens {new}, page_size {ps}: return a Python int (a count of pages); "
               f"got {type(got).__name__}")
        answers.append(got)

    def up(n: int, ps: int) -> int:
        return -(-n // ps)

    mistakes = [  # (what a mistaken answer gives on a case, the hint): named when it fits every case
        (lambda ps_, ns, s: up(sum(p + n for p, n in zip(ps_, ns)), s),
         "a page belongs to one sequence: round up per request, then add (you rounded the total)"),
        (lambda ps_, ns, s: sum((p + n) // s for p, n in zip(ps_, ns)),
         "a sequence whose last page is partly filled still holds that page: round up (ceil), not down"),
        (lambda ps_, ns, s: sum((p + n) // s + 1 for p, n in zip(ps_, ns)),
         "a sequence of exactly m * page_size positions fills m pages, not m + 1 (use ceil(n / page_size))"),
        (lambda ps_, ns, s: sum(up(p, s) + up(n, s) for p, n in zip(ps_, ns)),
         "the new tokens continue the prompt's last page: round up prompt + new tokens together, not each "
         "on its own"),
        (lambda ps_, ns, s: sum(up(p, s) for p in ps_),
         "count the new tokens too: the pages are held until the request ends"),
        (lambda ps_, ns, s: sum(up(n, s) for n in ns),
         "count the prompt too: its keys and values sit in the first pages"),
        (lambda ps_, ns, s: sum(up(p + n - 1, s) for p, n in zip(ps_, ns)),
         "you counted prompt + new - 1 positions (true of the cache itself: the last token is never fed "
         "back); the exercise asks for room for all prompt + new positions, what serve reserves"),
    ]
    expected = [sum(up(p + n, ps) for p, n in zip(prompts, new)) for prompts, new, ps in cases]
    if answers == expected:
        return
    i = next(j for j, (a, e) in enumerate(zip(answers, expected)) if a != e)
    prompts, new, ps = cases[i]
    case = f"prompts {prompts}, new tokens {new}, page_size {ps}"
    for mistake, hint in mistakes:
        expect(answers != [mistake(*c) for c in cases], f"{case}: {hint}")
    expect(False, f"{case}: expected {expected[i]} pages, got {answers[i]}")


# ---------------------------------------------------------------- 19.4
@exercise("19.4")
def check_residual(residual) -> None:
    """Check ``residual(p (..., V), q (..., V)) -> (..., V)`` on random distributions."""
    g = torch.Generator().manual_seed(194)
    p = torch.rand(6, 7, generator=g, dtype=torch.float64).pow(3).softmax(-1)
    q = torch.rand(6, 7, generator=g, dtype=torch.float64).mul(3).softmax(-1)
    q[2] = p[2]  # the draft is exact in row 2: nothing to correct
    p[4, :3] = 0.0
    p[4] /= p[4].sum()
    inputs = (p.clone(), q.clone())
    got = residual(p, q)
    if got is None:
        raise NotSolved("return the residual distribution (..., V), not None")
    expect(torch.equal(inputs[0], p) and torch.equal(inputs[1], q), "your code changed p or q in place")
    expect(isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(p.shape),
           f"return a tensor of the shape of p, {tuple(p.shape)}; got {getattr(got, 'shape', got)}")
    got = got.double()
    diff = (p - q).clamp(min=0)
    expected = diff / diff.sum(-1, keepdim=True)
    expected[2] = p[2]
    rows = [r for r in range(6) if r != 2]
    sums = got[rows].sum(-1)
    if not torch.allclose(got[rows], expected[rows], atol=1e-10) and torch.isfinite(got[rows]).all() \
            and (got[rows] >= 0).all() and not torch.allclose(sums, torch.ones_like(sums), atol=1e-8) \
            and not torch.allclose(got[rows], diff[rows], atol=1e-10):
        expect(False, "each row of the residual must sum to 1 over the vocabulary (the last dimension); "
                      f"your rows sum to {[round(x, 3) for x in sums.tolist()]}: normalise over dim=-1")
    if torch.allclose(got[rows], expected[rows], atol=1e-10):
        expect(not torch.isnan(got[2]).any(),
               "when q = p (a perfect draft) max(0, p - q) is all zero and cannot be normalised: "
               "a rejection never happens then, return p for such rows (not nan)")
        expect(torch.allclose(got[2], p[2], atol=1e-10),
               "when q = p the residual is all zero; return p for such rows")
        p3, q3 = p.reshape(2, 3, 7), q.reshape(2, 3, 7)  # (..., V): a batch of rows of rows
        got3 = residual(p3.clone(), q3.clone())
        expect(isinstance(got3, torch.Tensor) and tuple(got3.shape) == (2, 3, 7)
               and torch.allclose(got3.double(), expected.reshape(2, 3, 7), atol=1e-10),
               "p and q of shape (2, 3, V) (any leading dimensions): normalise over the last dimension "
               "only; your answer works for (N, V) only")
        return
    back = (q - p).clamp(min=0)
    expect(not torch.allclose(got[rows], (back / back.sum(-1, keepdim=True))[rows], atol=1e-10),
           "the residual is max(0, p - q): where the TARGET has more mass than the draft, not q - p")
    expect(not torch.allclose(got[rows], diff[rows], atol=1e-10),
           "max(0, p - q) is not a distribution yet: divide by its sum over the vocabulary")
    raw = p - q
    expect(not torch.allclose(got[rows], (raw / raw.sum(-1, keepdim=True).clamp(min=1e-300))[rows], atol=1e-6)
           and not torch.allclose(got[rows], raw.softmax(-1)[rows], atol=1e-10),
           "clip p - q at zero before normalising (a probability cannot be negative; softmax is not "
           "the same either)")
    expect(False, "expected max(0, p - q) / sum(max(0, p - q)) in every row")


# ---------------------------------------------------------------- 19.5
def _rounds(fn, p: torch.Tensor, drafts: torch.Tensor, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    k, out = drafts.numel(), []
    for _ in range(n):
        before = p.clone()
        got = fn(p, drafts.clone(), g)
        if got is None:
            raise NotSolved("return the emitted tokens (a 1-D tensor), not None")
        expect(torch.equal(before, p), "your code changed p in place (e.g. zeroing the draft's token to "
                                       "build the residual): work on a copy")
        expect(isinstance(got, torch.Tensor) and got.dim() == 1 and not got.is_floating_point(),
               f"return a 1-D integer tensor of the emitted tokens; got {getattr(got, 'shape', got)}")
        toks = got.tolist()
        expect(1 <= len(toks) <= k + 1, f"a round with k = {k} drafts emits 1 to k + 1 tokens; got {len(toks)}")
        expect(toks[:-1] == drafts[: len(toks) - 1].tolist(),
               f"emitted {toks} for drafts {drafts.tolist()}: all but the last token must be accepted drafts, "
               "in order; the round ends at the first rejection (with its replacement)")
        out.append(toks)
    return out


def _tv(tokens: list[int], law: torch.Tensor) -> tuple[float, list[float]]:
    freq = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=law.numel()).double() / len(tokens)
    return 0.5 * float((freq - law).abs().sum()), [round(x, 2) for x in freq.tolist()]


@exercise("19.5")
def check_greedy_draft_round(greedy_draft_round) -> None:
    """Check ``greedy_draft_round(p (k + 1, V), drafts (k,), generator) -> (n,) int64`` by its law."""
    V, drafts = 5, torch.tensor([0, 1])
    sure = torch.zeros(3, V, dtype=torch.float64)
    sure[0, 0] = sure[1, 1] = 1.0  # the target is certain of both drafts
    sure[2] = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3], dtype=torch.float64)
    for toks in _rounds(greedy_draft_round, sure, drafts, 50, 195):
        expect(len(toks) == 3, f"the target gives each draft probability 1, so both are accepted; you emitted "
                               f"{toks}: after k acceptances add the bonus token, drawn from p[k]")
    never = sure.clone()
    never[0] = torch.tensor([0.0, 0.4, 0.3, 0.2, 0.1], dtype=torch.float64)  # the target never says 0 first
    for toks in _rounds(greedy_draft_round, never, drafts, 50, 196):
        expect(toks[0] != 0, "p[0] gives the draft's token 0 probability 0, yet you emitted it: accept d with "
                             "probability min(1, p(d) / q(d)) = p(d), since q is a point mass on d (not q / p)")
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.2, 0.6]],
                     dtype=torch.float64)
    runs = _rounds(greedy_draft_round, p, drafts, 3000, 197)
    tv, freq = _tv([r[0] for r in runs], p[0])
    if tv > 0.06:
        f0, p0 = freq[0], float(p[0, 0])
        expect(f0 < 0.95, f"the draft's token 0 came first in {f0:.0%} of the rounds, p[0] gives it {p0:.0%}: "
                          "you accept it always; accept with probability min(1, p(d) / q(d)) = p(d) (q is a "
                          "point mass on d), not min(1, q / p)")
        expect(abs(f0 - (p0 + (1 - p0) * p0)) > 0.04,
               f"token 0 came first in {f0:.0%} of the rounds, p[0] gives it {p0:.0%}: after a rejection you "
               "drew from p, which can say d again; draw from max(0, p - q) normalised, that is p without d")
        expect(False, f"the first emitted token must follow p[0] = {p[0].tolist()}; yours came out with "
                      f"frequencies {freq}")
    second = [r[1] for r in runs if len(r) >= 2]
    tv, freq = _tv(second, p[1])
    expect(tv < 0.08, f"after the first draft is accepted, the next token must follow p[1] = {p[1].tolist()}; "
                      f"yours came out with frequencies {freq}")
    bonus = [r[2] for r in runs if len(r) == 3]
    tv, freq = _tv(bonus, p[2])
    expect(tv < 0.08, f"after k acceptances the bonus token must follow p[k] = {p[2].tolist()} (the target's "
                      f"distribution after the last draft); yours came out with frequencies {freq}")
