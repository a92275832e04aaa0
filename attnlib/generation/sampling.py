"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Chapter 12. Nucleus sampling: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration".
The settings are checked by :func:`check_sampling`, which the decoding loops (:mod:`attnlib.generation`) call once
before decoding starts.
"""
from __future__ import annotations

import torch

from attnlib._checks import finite_number, positive_int

__all__ = ["check_logits", "check_sampling", "sample_next_token", "top_k_filter", "top_p_filter"]


def _check_top_p(p: object) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"top_p must be a number in (0, 1]; got {p!r} ({type(p).__name__})")
    if not 0.0 < p <= 1.0:  # nan fails this too
        raise ValueError(f"top_p={p!r} must be a number in (0, 1]")


def check_sampling(temperature: object = 1.0, top_k: object = None, top_p: object = None) -> None:
    """Raise unless the sampling settings are valid (nothing is computed).

    Raises:
        TypeError: a setting of the wrong type (a bool, a str, a float ``top_k``, ...).
        ValueError: ``temperature`` negative or not finite, ``top_k < 1``, ``top_p`` outside (0, 1].
    """
    finite_number("temperature", temperature, minimum=0.0)
    if top_k is not None:
        positive_int("top_k", top_k)
    if top_p is not None:
        _check_top_p(top_p)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row, set the rest to ``-inf``.

    Args:
        logits: ``(..., vocab_size)`` float.
        k: how many to keep; values above ``vocab_size`` keep everything.

    Returns:
        A tensor of the same shape (ties with the k-th value are kept).

    Raises:
        TypeError / ValueError: if ``k`` is not a positive int.
    """
    positive_int("top_k", k)
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1): the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probabilities add up to at least ``p``; the rest get ``-inf``.

    ``p = 1`` keeps every token exactly (the cumulative sum is not consulted: in float32 over a
    50,257-token vocabulary it can reach 1 before the last tokens and would drop them). For
    ``p < 1`` the cumulative sum is taken in float64.

    Args:
        logits: ``(..., vocab_size)`` float.
        p: cumulative probability in (0, 1].

    Returns:
        A tensor of the same shape; the most likely token is always kept.

    Raises:
        TypeError / ValueError: if ``p`` is not a number in (0, 1].
    """
    _check_top_p(p)
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.double().softmax(dim=-1)
    # Drop a token when the tokens before it already reach p (so the first one always stays).
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def check_logits(logits: object) -> None:
    """Raise unless ``logits`` is a float ``(B, vocab_size)`` tensor from which every row can pick a token.

    A row holding NaN, or with no finite logit (all ``-inf``, or ``+inf``), has no distribution to
    sample from (``softmax`` gives NaN) and no meaningful argmax: it is refused, naming the row.
    Reads the values (one host sync, as sampling itself).

    Raises:
        TypeError: ``logits`` not a floating point tensor.
        ValueError: not 2-D, an empty vocabulary, or a row as above.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = f"dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"logits must be a floating point tensor (B, vocab_size); got {got}")
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (B, vocab_size) with vocab_size >= 1; got {tuple(logits.shape)}")
    if logits.device.type == "meta":
        return
    bad = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"logits row {row} holds NaN or +inf, or no finite value ({logits[row].tolist()[:8]}...): "
                         "no token can be chosen from it")


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token id per row from next-token logits.

    Args:
        logits: ``(B, vocab_size)`` float, the logits at the last position.
        temperature: divides the logits; ``0`` means greedy (argmax; ``top_k`` / ``top_p`` change nothing then).
        top_k: keep only the ``top_k`` most likely tokens before sampling.
        top_p: keep only the nucleus of cumulative probability ``top_p``.
        generator: a ``torch.Generator`` for reproducible sampling.

    Returns:
        ``(B, 1)`` int64 token ids.

    Raises:
        TypeError / ValueError: as :func:`check_sampling` and :func:`check_logits` (a row with NaN, ``+inf``
            or no finite logit).
    """
    check_sampling(temperature, top_k, top_p)
    check_logits(logits)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    scaled = logits / temperature
    # A tiny temperature overflows finite logits to inf (softmax: inf - inf = nan). Such rows are shifted by
    # their maximum first, which sends the others to -inf instead; other rows keep the plain division. A
    # temperature below the dtype's smallest number (1e-300 for float32) is 0 there: 0 / 0 is nan, so a finite
    # logit that gives nan counts as overflowing too, and the row's maxima (shifted to 0) stay 0. Float64 logits
    # overflow where the float32 softmax below sees +-inf (+-1 / 1e-300): a row of them only would be all -inf.
    lost = ~torch.isfinite(scaled) | ~torch.isfinite(scaled.float())
    overflow = (lost & torch.isfinite(logits)).any(-1, keepdim=True)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    logits = torch.where(overflow, torch.where(shifted == 0, shifted, shifted / temperature), scaled)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
