"""Exercise checks for chapter 13 (attention variants compared): reading losses and results honestly.

* 13.1 ``perplexity_and_bits(loss)`` -> ``(perplexity, bits_per_char)`` for a loss in nats per character
* 13.2 ``first_suspicious_step(steps, val_loss, floor_bits=1.0)`` -> the first step whose validation
  loss is below a floor given in bits per character, or ``None``
* 13.3 ``kv_cache_bytes(results, variant, context_length, batch_size=1, dtype=torch.float32)`` -> int,
  the KV-cache size from a results file's per-token figure

The graders use fixed inputs (typed-in loss curves, made-up results dicts) and draw no random
numbers, so checking an answer never changes the notebook's random state.
"""
from __future__ import annotations

import math
import numbers

import torch

from attnlib.book.exercises._core import exercise, expect

__all__ = ["check_perplexity_and_bits", "check_first_suspicious_step", "check_kv_cache_bytes"]

LN2 = math.log(2.0)


def _is_real(x: object) -> bool:
    """A real number: a Python/NumPy int or float (not a bool), or a one-element tensor."""
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and not x.dtype.is_complex and x.dtype != torch.bool
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _close(a: float, b: float, rel: float = 1e-6, abs_: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


# ------------------------------------------------------------------------------------------ 13.1
_LOSSES = (0.11, 0.5, 1.0, 1.8, math.log(65), 0.0)


def _perplexity_bits_hint(loss: float, ppl: float, bits: float) -> str | None:
    """The most likely mistake behind a wrong ``(ppl, bits)`` for ``loss``, or None if it is not recognised."""
    exact_ppl, exact_bits = math.exp(loss), loss / LN2
    if _close(ppl, exact_bits) and _close(bits, exact_ppl):
        return "you returned (bits, perplexity); return (perplexity, bits_per_char) in that order"
    if not _close(ppl, exact_ppl):
        if _close(ppl, 2.0**loss):
            return "the loss is in nats (natural log), so perplexity = e^loss, not 2^loss"
        if _close(ppl, 10.0**loss):
            return "the loss is in nats, so perplexity = e^loss, not 10^loss"
        return f"perplexity of a loss of {loss:.4f} nats is e^{loss:.4f} = {exact_ppl:.4f}; you returned {ppl:.4f}"
    if _close(bits, loss * LN2):
        return "one bit is ln 2 = 0.693 nats, so bits = loss / ln 2 (you multiplied)"
    if loss > 0 and _close(bits, math.log2(loss)):
        return "bits per character = loss / ln 2 (a change of unit), not log2(loss)"
    if _close(bits, loss / math.log(10.0)):
        return "bits use base 2: divide by ln 2, not ln 10"
    return None


@exercise("13.1")
def check_perplexity_and_bits(fn) -> None:
    """Check ``perplexity_and_bits(loss) -> (e^loss, loss / ln 2)`` on several losses."""
    for loss in _LOSSES:
        out = fn(loss)
        expect(isinstance(out, (tuple, list)) and len(out) == 2,
               f"return a pair (perplexity, bits_per_char); got {type(out).__name__} for loss={loss}")
        ppl, bits = out
        expect(_is_real(ppl) and _is_real(bits),
               f"return two numbers; got {type(ppl).__name__} and {type(bits).__name__} for loss={loss}")
        ppl, bits = float(ppl), float(bits)
        if _close(ppl, math.exp(loss)) and _close(bits, loss / LN2):
            continue
        hint = _perplexity_bits_hint(loss, ppl, bits)
        if hint is None:
            hint = (f"for a loss of {loss:.4f} nats expected bits {loss / LN2:.4f}, got {bits:.4f}; "
                    f"bits per character = loss / ln 2")
        expect(False, f"loss={loss}: {hint}")


# ------------------------------------------------------------------------------------------ 13.2
# Validation losses (nats per character) every 100 steps from 0 to 2000, as the source notebook
# prints them for its run labelled `causal` (it collapses) and its MQA run (it does not).
_SOURCE_CAUSAL = [4.4812, 2.6553, 2.3581, 2.2083, 2.0922, 1.9897, 1.8655, 1.6542, 1.2377, 0.9049, 0.6903,
                  0.5265, 0.4287, 0.3660, 0.3150, 0.2758, 0.2597, 0.2444, 0.2260, 0.2049, 0.1971]
_SOURCE_MQA = [4.3242, 2.6457, 2.5095, 2.4069, 2.3733, 2.3052, 2.2665, 2.2288, 2.1994, 2.1528, 2.1300,
               2.1113, 2.0981, 2.0779, 2.0471, 2.0363, 2.0137, 2.0073, 2.0025, 1.9981, 1.9879]
_STEPS_100 = list(range(0, 2001, 100))
_STEPS_250 = list(range(0, 5001, 250))
_CURVE_250 = [4.19, 2.52, 2.31, 2.20, 2.12, 2.05, 1.98, 1.95, 1.61, 1.42, 1.38, 1.36, 1.33, 1.30, 1.27,
              1.25, 1.24, 1.22, 1.21, 1.20, 1.19]

_CASES_13_2 = [
    ("the source's `causal` run, floor 1 bit", _STEPS_100, _SOURCE_CAUSAL, 1.0),
    ("the source's `causal` run, floor 2.5 bits", _STEPS_100, _SOURCE_CAUSAL, 2.5),
    ("the source's MQA run, floor 1 bit", _STEPS_100, _SOURCE_MQA, 1.0),
    ("the source's MQA run, floor 3 bits", _STEPS_100, _SOURCE_MQA, 3.0),
    ("a run evaluated every 250 steps, floor 2 bits", _STEPS_250, _CURVE_250, 2.0),
    ("a run evaluated every 250 steps, floor 1.5 bits", _STEPS_250, _CURVE_250, 1.5),
    ("a run evaluated every 250 steps, floor 0.5 bits", _STEPS_250, _CURVE_250, 0.5),
]


def _first_below(steps: list[int], losses: list[float], floor: float, strict: bool = True):
    for step, loss in zip(steps, losses):
        if loss < floor or (not strict and loss <= floor):
            return step
    return None


@exercise("13.2")
def check_first_suspicious_step(fn) -> None:
    """Check ``first_suspicious_step(steps, val_loss, floor_bits)`` on typed-in loss curves."""
    for what, steps, losses, floor_bits in _CASES_13_2:
        expected = _first_below(steps, losses, floor_bits * LN2)
        got = fn(list(steps), list(losses), floor_bits)
        if expected is None:
            if got is None:
                continue
            expect(got is not False and not (isinstance(got, int) and got < 0),
                   f"{what}: when no loss is below the floor, return None (not {got!r})")
            if got == _first_below(steps, losses, floor_bits):
                expect(False, f"{what}: the losses are in nats and the floor in bits; convert the floor to nats "
                              f"(floor_bits * ln 2) before comparing")
            expect(False, f"{what}: no validation loss is below {floor_bits} bits = {floor_bits * LN2:.4f} nats, "
                          f"so return None; got {got!r}")
        expect(got is not None, f"{what}: the loss falls below {floor_bits} bits = {floor_bits * LN2:.4f} nats "
                                f"at step {expected}, but you returned None")
        expect(_is_real(got) and not isinstance(got, float),
               f"{what}: return the step as an int from `steps`; got {type(got).__name__}")
        got = int(got)
        if got == expected:
            continue
        if got == steps.index(expected):
            expect(False, f"{what}: return the step (an entry of `steps`, here {expected}), not its index {got}")
        if got == _first_below(steps, losses, floor_bits):
            expect(False, f"{what}: the losses are in nats and the floor in bits; convert the floor to nats "
                          f"(floor_bits * ln 2) before comparing")
        if got == _first_below(steps, losses, floor_bits / LN2):
            expect(False, f"{what}: to turn bits into nats multiply by ln 2 (you divided)")
        if expected in steps and steps.index(expected) + 1 < len(steps) and got == steps[steps.index(expected) + 1]:
            expect(False, f"{what}: you returned the step after the first one below the floor ({expected})")
        expect(False, f"{what}: the first validation loss below {floor_bits * LN2:.4f} nats is at step {expected}; "
                      f"you returned {got}")


# ------------------------------------------------------------------------------------------ 13.3
def _fake_results(per_token: dict[str, int], **sizes) -> dict:
    """A results dict shaped like ``compare()``'s output, with only what the exercise may use."""
    model = dict(vocab_size=65, block_size=32, n_layers=4, n_heads=4, d_model=64, n_kv_heads=2,
                 kv_latent_dim=16, dropout=0.0, bias=True, attention="mha")
    model.update(sizes)
    variants = {name: {"kv_cache_bytes_per_token": b, "parameters": 1, "causal": True} for name, b in per_token.items()}
    return {"meta": {}, "model": model, "training": {}, "variants": variants}


# The chapter's model (4 layers, d_model 64), and a GPT-2-small-sized one (12 layers, d_model 768,
# 3 KV heads for GQA, d_c = 128 for MLA); per-token figures = numbers cached x n_layers x 4 bytes.
_RESULTS_A = _fake_results({"mha": 2048, "mqa": 512, "gqa": 1024, "mla": 256})
_RESULTS_B = _fake_results({"mha": 73728, "gqa": 18432, "mla": 6144}, n_layers=12, n_heads=12, d_model=768,
                           n_kv_heads=3, kv_latent_dim=128, block_size=1024, vocab_size=50257)
_CASES_13_3 = [  # the first case tells n_layers (12) from the float32 itemsize (4)
    (_RESULTS_B, "gqa", 1024, 1, torch.float32),
    (_RESULTS_A, "mha", 32, 1, torch.float32),
    (_RESULTS_A, "mla", 32, 1, torch.float32),
    (_RESULTS_A, "mqa", 4096, 1, torch.float32),
    (_RESULTS_A, "gqa", 1000, 8, torch.float32),
    (_RESULTS_A, "mha", 4096, 16, torch.bfloat16),
    (_RESULTS_A, "mla", 333, 3, torch.float16),
    (_RESULTS_B, "mha", 2048, 4, torch.bfloat16),
    (_RESULTS_B, "mla", 100, 2, torch.float64),
]


@exercise("13.3")
def check_kv_cache_bytes(fn) -> None:
    """Check ``kv_cache_bytes(results, variant, context_length, batch_size, dtype) -> int`` on made-up results."""
    for results, variant, T, B, dtype in _CASES_13_3:
        per_token = results["variants"][variant]["kv_cache_bytes_per_token"]
        n_layers = results["model"]["n_layers"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        expected = per_token * T * B * itemsize // 4
        what = f"kv_cache_bytes(results, {variant!r}, context_length={T}, batch_size={B}, dtype={dtype})"
        got = fn(results, variant, T, B, dtype)
        expect(_is_real(got) and not isinstance(got, float) and not (isinstance(got, torch.Tensor)
                                                                   and got.is_floating_point()),
               f"{what}: return a whole number of bytes as an int; got {type(got).__name__}")
        got = int(got)
        if got == expected:
            continue
        if got == expected * n_layers:
            expect(False, f"{what}: the per-token figure already counts all {n_layers} layers; do not multiply "
                          f"by n_layers again")
        if got == per_token * T * B:
            expect(False, f"{what}: the per-token figure is for float32 (4 bytes a number); scale it to {dtype} "
                          f"({itemsize} bytes a number)")
        if got == per_token * T * B * itemsize:
            expect(False, f"{what}: the per-token figure is already in bytes (of float32); scale by "
                          f"itemsize / 4, do not multiply by the itemsize")
        if got == per_token * T * itemsize // 4:
            expect(False, f"{what}: every sequence of the batch has its own cache; multiply by batch_size")
        expect(False, f"{what}: expected {expected:,} bytes ({per_token} B/token in float32 x {T} tokens x {B} "
                      f"sequences x {itemsize}/4); got {got:,}")
