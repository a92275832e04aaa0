"""Exercise checks for chapter 10 (the Transformer).

* 10.1 ``check_shift_matrix``: the linear map ``M_k`` with ``PE[pos + k] = PE[pos] @ M_k`` for the
  sinusoidal table of Vaswani et al. 2017, §3.5 ("PE_{pos+k} can be represented as a linear
  function of PE_pos").
* 10.2 ``check_smoothed_loss``: cross-entropy with label smoothing (Vaswani et al. 2017, §5.4),
  PyTorch's convention (``eps / |V|`` on every token), padding ignored, without
  ``F.cross_entropy``.
* 10.3 ``check_decoder_mask``: the decoder's self-attention mask, causal AND target padding.

Every grader draws its test tensors from a local ``torch.Generator``.
"""
from __future__ import annotations

import math
from unittest import mock

import torch
import torch.nn.functional as F

from attnlib.book.exercises._core import NotSolved, exercise, expect, expect_close
from attnlib.positional import sinusoidal_encoding

__all__ = ["check_decoder_mask", "check_shift_matrix", "check_smoothed_loss"]


# ---------------------------------------------------------------- 10.1
def _shift_matrix(k: float, d_model: int, exponent: float = 2.0, sign: float = 1.0) -> torch.Tensor:
    """Block-diagonal rotations: row vector (sin a, cos a) times the block gives (sin, cos) of a + k w."""
    m = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        angle = sign * k * 10000 ** (-exponent * i / d_model)
        c, s = math.cos(angle), math.sin(angle)
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = c, -s
        m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = s, c
    return m


@exercise("10.1")
def check_shift_matrix(answer) -> None:
    """Check ``answer(k, d_model)``: ``PE[pos + k] == PE[pos] @ M`` for every position."""
    g = torch.Generator().manual_seed(1001)
    offsets = [1, 3] + torch.randint(2, 40, (3,), generator=g).tolist()
    sizes = [2, 8, 16, 32, 6]
    for k, d_model in zip(offsets, sizes):
        out = answer(k, d_model)
        if out is None:
            raise NotSolved("return the (d_model, d_model) matrix M_k")
        expect(isinstance(out, torch.Tensor), f"return a torch.Tensor, got {type(out).__name__}")
        expect(tuple(out.shape) == (d_model, d_model),
               f"for d_model={d_model} the shape should be {(d_model, d_model)}, got {tuple(out.shape)}")
        out = out.detach().double()
        ref = _shift_matrix(k, d_model)
        if torch.allclose(out, ref, atol=1e-5):
            continue
        what = f"shift_matrix({k}, {d_model})"
        expect(not torch.allclose(out, torch.eye(d_model, dtype=torch.float64), atol=1e-5),
               f"{what} is the identity: it must move the table by {k} positions")
        expect(not torch.allclose(out, ref.T, atol=1e-5),
               f"{what} shifts by -{k} (PE[pos - {k}]): the rows are positions, so the row vector is "
               f"multiplied on the left, PE[pos] @ M; transpose each 2x2 block")
        if d_model > 2:
            expect(not torch.allclose(out, _shift_matrix(k, d_model, exponent=1.0), atol=1e-5),
                   f"{what}: pair i turns at 10000^(-2i/d_model), the exponent of its column 2i, "
                   f"not 10000^(-i/d_model)")
        pe = sinusoidal_encoding(k + 20, d_model).double()
        moved = pe[:20] @ out
        expect_close(moved, pe[k:], f"PE[pos] @ {what} against PE[pos + {k}] for pos < 20", atol=1e-4)


# ---------------------------------------------------------------- 10.2
def _smoothed_reference(logits: torch.Tensor, targets: torch.Tensor, eps: float, pad_id: int) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_id, label_smoothing=eps)


def _no_cross_entropy(*args, **kwargs):
    raise AssertionError("smoothed_loss called F.cross_entropy: write the loss from log_softmax")


@exercise("10.2")
def check_smoothed_loss(answer) -> None:
    """Check ``answer(logits, targets, eps, pad_id)`` against ``F.cross_entropy(..., label_smoothing=eps)``."""
    g = torch.Generator().manual_seed(1002)
    for B, T, V, pad_id in [(2, 5, 7, 0), (3, 4, 11, 3), (1, 6, 5, 2)]:
        eps = float(torch.empty(()).uniform_(0.05, 0.3, generator=g))
        logits = torch.randn(B, T, V, generator=g) * 2
        targets = torch.randint(0, V, (B, T), generator=g)
        targets[targets == pad_id] = (pad_id + 1) % V
        targets[0, -2:] = pad_id  # some padding
        ref = _smoothed_reference(logits, targets, eps, pad_id)
        original = logits.clone()
        with mock.patch.object(F, "cross_entropy", _no_cross_entropy), \
                mock.patch.object(torch.nn.CrossEntropyLoss, "forward", _no_cross_entropy):
            try:
                out = answer(logits, targets.clone(), eps, pad_id)
            except AssertionError as e:
                if "F.cross_entropy" in str(e):
                    expect(False, "do not call F.cross_entropy (or nn.CrossEntropyLoss): build the loss "
                                  "from log_softmax")
                raise
        if out is None:
            raise NotSolved("return the loss, a scalar tensor")
        expect(torch.equal(logits, original), "smoothed_loss changed the logits in place")
        expect(isinstance(out, torch.Tensor) and out.numel() == 1,
               f"return a scalar tensor (the mean loss), got {getattr(out, 'shape', type(out).__name__)}")
        out = out.reshape(()).double()
        what = f"logits {(B, T, V)}, eps={eps:.3f}, pad_id={pad_id}"
        if torch.allclose(out, ref.double(), atol=1e-5):
            continue
        flat_l, flat_t = logits.flatten(0, 1), targets.flatten()
        keep = flat_t != pad_id
        logp = flat_l.log_softmax(-1)
        nll = -logp.gather(-1, flat_t[:, None])[:, 0]
        plain = nll[keep].mean()
        expect(not torch.allclose(out, plain.double(), atol=1e-5),
               f"{what}: that is the plain cross-entropy: mix in eps times the mean of -log p over the vocabulary")
        every = F.cross_entropy(flat_l, flat_t, label_smoothing=eps)
        expect(not torch.allclose(out, every.double(), atol=1e-5),
               f"{what}: padding positions were averaged in: keep only targets != pad_id")
        others = ((1 - eps) * nll + eps * (-(logp.sum(-1) - logp.gather(-1, flat_t[:, None])[:, 0]) / (V - 1)))
        expect(not torch.allclose(out, others[keep].mean().double(), atol=1e-5),
               f"{what}: eps is spread over the V - 1 other tokens; PyTorch's convention spreads it over all "
               f"|V| tokens, the right one included (eps/|V| each)")
        smoothed = (1 - eps) * nll + eps * (-logp.mean(-1))
        expect(not torch.allclose(out, smoothed[keep].sum().double(), atol=1e-5),
               f"{what}: that is the sum over positions; take the mean over the non-padding ones")
        expect(not torch.allclose(out, (smoothed * keep).sum().double() / keep.numel(), atol=1e-5),
               f"{what}: the padding positions were zeroed but still counted: divide by the number "
               f"of non-padding positions, not by B * T")
        summed_vocab = (1 - eps) * nll + eps * (-logp.sum(-1))
        expect(not torch.allclose(out, summed_vocab[keep].mean().double(), atol=1e-5),
               f"{what}: eps was put on every token (the sum of -log p over the vocabulary); "
               f"it is spread evenly, eps/|V| each: take the mean over the vocabulary")
        q = torch.full_like(logp, eps / V)
        q.scatter_add_(-1, flat_t[:, None], torch.full_like(logp[:, :1], 1 - eps))
        entropy = -(q * q.log()).sum(-1)  # (N,): H(q), what KL(q || p) leaves out
        expect(not torch.allclose(out, (smoothed - entropy)[keep].mean().double(), atol=1e-5),
               f"{what}: that is the KL divergence KL(q || p) (nn.KLDivLoss, as in the Annotated "
               f"Transformer), the cross-entropy minus the entropy of q; the loss asked for is "
               f"the cross-entropy -sum q log p")
        expect_close(out, ref.double(), f"the smoothed loss for {what}", atol=1e-5)


# ---------------------------------------------------------------- 10.3
def _reference_mask(tgt: torch.Tensor, pad_id: int) -> torch.Tensor:
    T = tgt.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T), key j <= query i
    real = (tgt != pad_id)[:, None, None, :]  # (B, T) -> (B, 1, 1, T): keys that are tokens
    return causal & real  # (B, 1, T, T)


@exercise("10.3")
def check_decoder_mask(answer) -> None:
    """Check ``answer(tgt, pad_id)`` returns the boolean causal & key-padding mask of shape ``(B, 1, T, T)``."""
    g = torch.Generator().manual_seed(103)
    for B, T, pad_id in [(2, 5, 0), (3, 7, 4), (1, 1, 0)]:
        tgt = torch.randint(0, 9, (B, T), generator=g)
        tgt[tgt == pad_id] = pad_id + 1
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = max(1, T - 2)  # some padding in row 0
        for b in range(B):
            tgt[b, lengths[b]:] = pad_id
        out = answer(tgt, pad_id)
        if out is None:
            raise NotSolved("return the (B, 1, T, T) boolean mask")
        ref = _reference_mask(tgt, pad_id)
        expect(isinstance(out, torch.Tensor) and out.dtype == torch.bool,
               "return a boolean tensor (True = may attend)")
        expect(tuple(out.shape) == (B, 1, T, T), f"the shape should be (B, 1, T, T) = {(B, 1, T, T)}, "
               f"got {tuple(out.shape)}")
        expect(not torch.equal(out, ~ref), "True must mean 'may attend': that mask is inverted (True = "
               "masked, the convention of nn.MultiheadAttention's key_padding_mask); return its negation")
        if T > 1:
            expect(not out[:, :, 0, 1:].any(), "position 0 may only see itself: use the lower triangle (tril)")
        real_query = (tgt != pad_id)[:, None, :, None]  # (B, 1, T, 1)
        expect(not torch.equal(out, ref & real_query) or torch.equal(ref & real_query, ref),
               "padding QUERIES (rows) were masked too: a padding row then has no key at all "
               "(softmax over all -inf is NaN); mask only the padding keys, (B, 1, 1, T)")
        no_diagonal = ref & ~torch.eye(T, dtype=torch.bool)
        expect(not torch.equal(out, no_diagonal),
               "the diagonal is masked: query i may attend key j for j <= i, itself included "
               "(tril with diagonal=0)")
        pad_key = ~(tgt != pad_id)[:, None, None, :].expand_as(ref)
        expect(not (out & pad_key).any(), "a padding token must never be attended to: mask the padding KEYS (columns)")
        rows = torch.ones(T, T, dtype=torch.bool).tril() & (tgt != pad_id)[:, None, :, None]
        expect(not torch.equal(out, rows) or torch.equal(rows, ref),
               "that masks the padding QUERIES (rows); mask the padding KEYS (columns): (B, 1, 1, T)")
        expect(torch.equal(out, ref), "every real key at or before the query should be allowed: "
               "causal mask & (tgt != pad_id) along the keys")
