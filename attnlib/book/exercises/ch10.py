"""Exercise checks for chapter 10 (the Transformer).

* 10.1 ``check_shift_matrix``: the linear map ``M_k`` with ``PE[pos + k] = PE[pos] @ M_k`` for the
  sinusoidal table of Vaswani et al. 2017, §3.5 ("PE_{pos+k} can be represented as a linear
  function of PE_pos").
* 10.2 ``check_smoothed_loss``: cross-entropy with label smoothing (Vaswani et al. 2017, §5.4),
  PyTorch's convention (``eps / |V|`` on every token), padding ignored, without
  ``F.cross_entropy`` (refused under any name, ``torch.ops.aten`` included).
* 10.3 ``check_decoder_mask``: the decoder's self-attention mask, causal AND target padding.

Every check calls the answer through :func:`run` and draws fresh random cases from
:func:`case_rng` besides its fixed edge cases.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlib.book.exercises._ch10_doors import RefuseOps
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.positional import sinusoidal_encoding

__all__ = ["check_decoder_mask", "check_shift_matrix", "check_smoothed_loss"]


# ---------------------------------------------------------------- 10.1
def _blocks(k: float, d_model: int, exponent: float = 2.0) -> torch.Tensor:
    """Block-diagonal rotations: row vector (sin a, cos a) times the block gives (sin, cos) of a + k w."""
    m = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        angle = k * 10000 ** (-exponent * i / d_model)
        c, s = math.cos(angle), math.sin(angle)
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = c, -s
        m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = s, c
    return m


@exercise("10.1")
def check_shift_matrix(answer) -> None:
    """Check ``answer(k, d_model)``: ``PE[pos + k] == PE[pos] @ M`` for every position."""
    g = case_rng()
    cases = [(1, 2), (3, 8), (0, 6), (57, 32), (200, 64)]  # fixed edges: one pair, k = 0, a large k
    cases += [(randint(g, 1, 90), 2 * randint(g, 2, 24)) for _ in range(3)]  # fresh each run
    for k, d_model in cases:
        what = f"shift_matrix({k}, {d_model})"
        out = expect_tensor(run(answer, k, d_model, what=what), what, shape=(d_model, d_model))
        expect(out.is_floating_point(), f"{what} has dtype {out.dtype}; return a float matrix")
        out = out.detach().double()
        pe = sinusoidal_encoding(k + 40, d_model).double()  # (k + 40, d_model)
        if torch.allclose(pe[:40] @ out, pe[k:], atol=1e-4, rtol=0):
            continue
        if k:
            expect(not torch.allclose(out, torch.eye(d_model, dtype=torch.float64), atol=1e-5),
                   f"{what} is the identity: it must move the table by {k} positions")
            expect(not torch.allclose(out, _blocks(k, d_model).T, atol=1e-5),
                   f"{what} shifts by -{k} (PE[pos - {k}]): the rows are positions, so the row vector "
                   f"is multiplied on the left, PE[pos] @ M; transpose each 2x2 block")
        if d_model > 2:
            expect(not torch.allclose(out, _blocks(k, d_model, exponent=1.0), atol=1e-5),
                   f"{what}: pair i turns at 10000^(-2i/d_model), the exponent of its column 2i, "
                   f"not 10000^(-i/d_model)")
        expect_close(pe[:40] @ out, pe[k:], f"PE[pos] @ {what} against PE[pos + {k}] for pos < 40",
                     atol=1e-4, rtol=0)


# ---------------------------------------------------------------- 10.2
#: "without calling F.cross_entropy": refused under any name (the module, its C function, the loss class)
_NO_CROSS_ENTROPY = Refuse("build the loss from log_softmax, without F.cross_entropy or nn.CrossEntropyLoss",
                           F.cross_entropy, torch.nn.CrossEntropyLoss, torch._C._nn.cross_entropy_loss,
                           aten="cross_entropy")


def _loss_cases(g: torch.Generator) -> list[tuple[int, int, int, int, float]]:
    cases = [(2, 5, 7, 0, 0.1), (3, 4, 11, 3, 0.25), (1, 6, 5, 2, 0.0), (2, 3, 2, 1, 1.0)]  # eps 0 and 1
    for _ in range(2):
        V = randint(g, 3, 40)
        cases.append((randint(g, 1, 4), randint(g, 3, 9), V, randint(g, 0, V - 1),
                      float(torch.empty(()).uniform_(0.05, 0.4, generator=g))))
    return cases


@exercise("10.2")
def check_smoothed_loss(answer) -> None:
    """Check ``answer(logits, targets, eps, pad_id)`` against ``F.cross_entropy(..., label_smoothing=eps)``."""
    g = case_rng()
    for B, T, V, pad_id, eps in _loss_cases(g):
        logits = torch.randn(B, T, V, generator=g) * 2
        targets = torch.randint(0, V, (B, T), generator=g)
        targets[targets == pad_id] = (pad_id + 1) % V
        targets[0, -2:] = pad_id  # some padding; every case keeps real targets in its other positions
        what = f"smoothed_loss(logits {(B, T, V)}, targets, eps={eps:.3f}, pad_id={pad_id})"
        ops = RefuseOps(_NO_CROSS_ENTROPY.why, "cross_entropy")  # torch.ops.aten.cross_entropy_loss
        out = run(answer, logits, targets, eps, pad_id, what=what, refuse=_NO_CROSS_ENTROPY, inside=(ops,))
        ops.verdict()
        expect_tensor(out, what)
        expect(out.shape == (), f"{what} has shape {tuple(out.shape)}; return the mean loss, a scalar "
                                "tensor of shape ()")
        out = out.detach().double()
        # the expected values, computed after the answer ran, from the definition -sum_j q_j log p_j
        flat_l, flat_t = logits.double().flatten(0, 1), targets.flatten()
        keep = flat_t != pad_id
        logp = flat_l.log_softmax(-1)  # (N, V)
        nll = -logp.gather(-1, flat_t[:, None])[:, 0]  # (N,)
        q = torch.full_like(logp, eps / V).scatter_add_(-1, flat_t[:, None], torch.full_like(nll[:, None], 1 - eps))
        per_position = -(q * logp).sum(-1)  # (N,)
        if torch.allclose(out, per_position[keep].mean(), atol=1e-5, rtol=1e-5):
            continue

        def near(value: torch.Tensor, out: torch.Tensor = out) -> bool:
            return bool(torch.allclose(out, value, atol=1e-5, rtol=1e-5))

        expect(eps == 0 or not near(nll[keep].mean()),
               f"{what}: that is the plain cross-entropy: mix in eps times the mean of -log p over the vocabulary")
        expect(not near(per_position.mean()), f"{what}: padding positions were averaged in: keep only "
                                              "targets != pad_id")
        others = (1 - eps) * nll + eps * (-(logp.sum(-1) + nll) / (V - 1))
        expect(eps == 0 or not near(others[keep].mean()),
               f"{what}: eps is spread over the V - 1 other tokens; PyTorch's convention spreads it over all "
               f"|V| tokens, the right one included (eps/|V| each)")
        expect(not near(per_position[keep].sum()),
               f"{what}: that is the sum over positions; take the mean over the non-padding ones")
        expect(not near((per_position * keep).sum() / keep.numel()),
               f"{what}: the padding positions were zeroed but still counted: divide by the number "
               f"of non-padding positions, not by B * T")
        expect(eps == 0 or not near(((1 - eps) * nll - eps * logp.sum(-1))[keep].mean()),
               f"{what}: eps was put on every token (the sum of -log p over the vocabulary); "
               f"it is spread evenly, eps/|V| each: take the mean over the vocabulary")
        entropy = -(q * q.clamp_min(1e-300).log()).sum(-1)  # (N,): H(q), what KL(q || p) leaves out
        expect(not near((per_position - entropy)[keep].mean()),
               f"{what}: that is the KL divergence KL(q || p) (nn.KLDivLoss, as in the Annotated "
               f"Transformer), the cross-entropy minus the entropy of q; the loss asked for is "
               f"the cross-entropy -sum q log p")
        expect_close(out, per_position[keep].mean(), f"the smoothed loss for {what}", atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- 10.3
def _targets(g: torch.Generator, B: int, T: int, pad_id: int) -> torch.Tensor:
    tgt = torch.randint(0, 9, (B, T), generator=g)
    tgt[tgt == pad_id] = pad_id + 1
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = max(1, T - 2)  # some padding in row 0
    for b in range(B):
        tgt[b, int(lengths[b]):] = pad_id
    return tgt


@exercise("10.3")
def check_decoder_mask(answer) -> None:
    """Check ``answer(tgt, pad_id)`` returns the boolean causal & key-padding mask of shape ``(B, 1, T, T)``."""
    g = case_rng()
    cases = [(2, 5, 0), (3, 7, 4), (1, 1, 0), (1, 4, 2)]
    cases += [(randint(g, 1, 4), randint(g, 2, 12), randint(g, 0, 8)) for _ in range(3)]
    for B, T, pad_id in cases:
        tgt = _targets(g, B, T, pad_id)
        what = f"decoder_mask(tgt={tgt.tolist()}, pad_id={pad_id})"
        out = expect_tensor(run(answer, tgt, pad_id, what=what), what)
        expect(out.dtype == torch.bool, f"{what} has dtype {out.dtype}; return a boolean tensor "
                                        "(True = may attend)")
        expect(tuple(out.shape) == (B, 1, T, T), f"{what}: the shape should be (B, 1, T, T) = {(B, 1, T, T)}, "
                                                 f"got {tuple(out.shape)}")
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        real = tgt != pad_id  # (B, T)
        ref = (j <= i) & real[:, None, None, :]  # (B, 1, T, T): key j real and not after query i
        if torch.equal(out, ref):
            continue
        expect(not torch.equal(out, ~ref), "True must mean 'may attend': that mask is inverted (True = "
               "masked, the convention of nn.MultiheadAttention's key_padding_mask); return its negation")
        expect(T == 1 or not out[:, :, 0, 1:].any(), "position 0 may only see itself: use the lower triangle "
                                                     "(tril)")
        expect(not torch.equal(out, ref & real[:, None, :, None]),
               "padding QUERIES (rows) were masked too: a padding row then has no key at all "
               "(softmax over all -inf is NaN); mask only the padding keys, (B, 1, 1, T)")
        expect(not torch.equal(out, ref & (j != i)),
               "the diagonal is masked: query i may attend key j for j <= i, itself included "
               "(tril with diagonal=0)")
        expect(not (out & ~real[:, None, None, :]).any(),
               "a padding token must never be attended to: mask the padding KEYS (columns)")
        expect(False, "every real key at or before the query should be allowed: "
                      "causal mask & (tgt != pad_id) along the keys")
