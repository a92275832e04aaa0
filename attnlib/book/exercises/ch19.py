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

Random inputs come from a local ``torch.Generator``.
"""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._core import NotSolved, exercise, expect

__all__ = ["check_expected_tokens", "check_pages_needed", "check_positions_from_mask", "check_residual"]


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
            expect(False, f"{case}: real tokens must be at 0, 1, 2, ... counted from each row's first "
                          "real token")
        pads = got[~mask]
        expect(pads.numel() == 0 or bool(((pads >= 0) & (pads < T)).all()),
               f"{case}: a pad got position {pads.min().item() if pads.numel() else 0}: no row of a position table has that "
               "index (clamp the pads' positions at 0)")


# ---------------------------------------------------------------- 19.2
@exercise("19.2")
def check_expected_tokens(expected_tokens) -> None:
    """Check ``expected_tokens(alpha, k) -> float`` against the closed form and a simulation."""
    cases = [(0.5, 1), (0.8, 4), (0.3, 6), (0.95, 2), (0.0, 3), (0.71, 5), (1.0, 4), (1.0, 1)]
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
    for prompts, new, ps in cases:
        case = f"prompts {prompts}, new tokens {new}, page_size {ps}"
        got = pages_needed(list(prompts), list(new), ps)
        if got is None:
            raise NotSolved("return the number of pages, not None")
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"{case}: return a Python int (a count of pages); got {type(got).__name__}")
        lengths = [p + n for p, n in zip(prompts, new)]
        expected = sum(-(-n // ps) for n in lengths)
        if got == expected:
            continue
        expect(got != -(-sum(lengths) // ps),
               f"{case}: a page belongs to one sequence: round up per request, then add (you rounded the "
               "total)")
        expect(got != sum(n // ps for n in lengths),
               f"{case}: a sequence whose last page is partly filled still holds that page: round up "
               "(ceil), not down")
        expect(got != sum(n // ps + 1 for n in lengths),
               f"{case}: a sequence of exactly m * page_size positions fills m pages, not m + 1 (use "
               "ceil(n / page_size))")
        expect(got != sum(-(-p // ps) + -(-n // ps) for p, n in zip(prompts, new)),
               f"{case}: the new tokens continue the prompt's last page: round up prompt + new tokens "
               "together, not each on its own")
        expect(got != sum(-(-p // ps) for p in prompts),
               f"{case}: count the new tokens too: the pages are held until the request ends")
        expect(False, f"{case}: expected {expected} pages, got {got}")


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
    if torch.allclose(got[rows], expected[rows], atol=1e-10):
        expect(not torch.isnan(got[2]).any(),
               "when q = p (a perfect draft) max(0, p - q) is all zero and cannot be normalised: "
               "a rejection never happens then, return p for such rows (not nan)")
        expect(torch.allclose(got[2], p[2], atol=1e-10),
               "when q = p the residual is all zero; return p for such rows")
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
