"""Exercise checks for chapter 10 (the Transformer).

* 10.1 ``check_sinusoidal``: the sinusoidal position table of Vaswani et al. 2017, §3.5.
* 10.2 ``check_rms_norm``: RMSNorm by hand, ``x / sqrt(mean(x²) + eps) · γ`` (Zhang & Sennrich 2019).
* 10.3 ``check_decoder_mask``: the decoder's self-attention mask, causal AND target padding.

Every grader draws its test tensors from a local ``torch.Generator``.
"""
from __future__ import annotations

import torch

from attnlib.book.exercises._core import exercise, expect, expect_close
from attnlib.positional import sinusoidal_encoding

__all__ = ["check_decoder_mask", "check_rms_norm", "check_sinusoidal"]


# ---------------------------------------------------------------- 10.1
@exercise("10.1")
def check_sinusoidal(answer) -> None:
    """Check ``answer(T, d_model)`` against the sinusoidal table for a few sizes."""
    for T, d_model in [(1, 2), (10, 8), (33, 16), (7, 64)]:
        out = answer(T, d_model)
        ref = sinusoidal_encoding(T, d_model)
        expect(isinstance(out, torch.Tensor), f"return a torch.Tensor, got {type(out).__name__}")
        expect(tuple(out.shape) == (T, d_model), f"for T={T}, d_model={d_model} the shape should be "
               f"{(T, d_model)}, got {tuple(out.shape)}")
        out = out.double()
        if T > 1 and torch.allclose(out[:, 0::2], ref[:, 1::2].double(), atol=1e-4):
            expect(False, "sines and cosines are swapped: even columns hold sin, odd columns cos")
        if T > 1 and d_model > 2:
            blocked = torch.cat([ref[:, 0::2], ref[:, 1::2]], dim=1).double()
            expect(not torch.allclose(out, blocked, atol=1e-4),
                   "the sines and cosines must be interleaved (column 2i sin, 2i+1 cos), not in two halves")
        if d_model > 2:
            wrong_exp = torch.arange(T, dtype=torch.float64)[:, None] / 10000 ** (
                torch.arange(d_model // 2, dtype=torch.float64) / d_model)
            expect(not torch.allclose(out[:, 0::2], wrong_exp.sin(), atol=1e-4),
                   "pair i uses the exponent 2i / d_model (the column index of its sine), not i / d_model")
        expect_close(out, ref.double(), f"the table for T={T}, d_model={d_model}", atol=1e-4)


# ---------------------------------------------------------------- 10.2
@exercise("10.2")
def check_rms_norm(answer) -> None:
    """Check ``answer(x, weight, eps)`` against ``torch.nn.functional.rms_norm``."""
    g = torch.Generator().manual_seed(1010)
    for shape, eps in [((4, 8), 1e-6), ((2, 3, 16), 1e-5), ((5, 4), 0.5)]:
        x = torch.randn(*shape, generator=g) * 3 + 0.5
        weight = torch.randn(shape[-1], generator=g)
        ref = torch.nn.functional.rms_norm(x, (shape[-1],), weight, eps)
        out = answer(x, weight, eps)
        expect(isinstance(out, torch.Tensor), f"return a torch.Tensor, got {type(out).__name__}")
        expect(tuple(out.shape) == tuple(x.shape), f"the output should have the input's shape {tuple(x.shape)}")
        twice = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight
        expect(not torch.allclose(out, twice, atol=1e-4),
               "that is x / sqrt(RMS(x) + eps): the square root is taken twice; divide by sqrt(mean(x²) + eps)")
        centred = torch.nn.functional.layer_norm(x, (shape[-1],), weight, None, eps)
        expect(not torch.allclose(out, centred, atol=1e-4), "RMSNorm does not subtract the mean (that is LayerNorm)")
        expect(not torch.allclose(out, ref / weight, atol=1e-4), "multiply by the gain weight γ")
        expect_close(out, ref, f"RMSNorm of a {tuple(shape)} input with eps={eps}", atol=1e-4)


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
        for b in range(B):
            tgt[b, lengths[b]:] = pad_id
        out = answer(tgt, pad_id)
        ref = _reference_mask(tgt, pad_id)
        expect(isinstance(out, torch.Tensor) and out.dtype == torch.bool,
               "return a boolean tensor (True = may attend)")
        expect(tuple(out.shape) == (B, 1, T, T), f"the shape should be (B, 1, T, T) = {(B, 1, T, T)}, "
               f"got {tuple(out.shape)}")
        if T > 1:
            expect(not out[:, :, 0, 1:].any(), "position 0 may only see itself: use the lower triangle (tril)")
        pad_key = ~(tgt != pad_id)[:, None, None, :].expand_as(ref)
        expect(not (out & pad_key).any(), "a padding token must never be attended to: mask the padding KEYS (columns)")
        expect(torch.equal(out, ref), "every real key at or before the query should be allowed: "
               "causal mask & (tgt != pad_id) along the keys")
