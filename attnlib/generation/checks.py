"""What every decoding loop checks before it runs, and how it tells a finished row. Chapters 08, 12.

Used by :func:`attnlib.generation.generate` (greedy and sampling), :func:`attnlib.generation.beam_search`,
:func:`attnlib.generation.speculative_generate`, :func:`attnlib.serving.serve` and the
:class:`attnlib.Transformer`'s decoders: the settings are validated up front, even when
``max_new_tokens=0``, and every id of the prompt is checked, not only the window the model sees.
What a *decoder* offers the loops: :mod:`attnlib.generation.step`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from attnlib._checks import finite_number, non_negative_int, positive_int, token_id_list, token_ids
from attnlib.generation.sampling import check_sampling

__all__ = ["check_decoding", "check_prompt", "decoder_vocab_size", "stop_mask"]


def check_decoding(
    vocab_size: int,
    max_new_tokens: object,
    *,
    temperature: object = 1.0,
    top_k: object = None,
    top_p: object = None,
    stop_tokens: object = None,
    beam_width: object = 1,
    length_penalty: object = 0.0,
) -> torch.Tensor:
    """Check every decoding setting at once; return the stop tokens as an int64 tensor.

    Args:
        vocab_size: the model's vocabulary (stop tokens must be ids in it).
        max_new_tokens: an int >= 0.
        temperature, top_k, top_p: see :func:`attnlib.generation.sampling.check_sampling`.
        stop_tokens: ``None``, one id, or a sequence / 1-D integer tensor of ids.
        beam_width: an int >= 1.
        length_penalty: a finite number.

    Returns:
        ``(n_stop,)`` int64 (on the CPU; move it to the tokens' device).

    Raises:
        TypeError: a setting of the wrong type (the message names it and its value).
        ValueError: a setting out of range, not finite, or a stop token outside the vocabulary.
    """
    non_negative_int("max_new_tokens", max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    positive_int("beam_width", beam_width)
    finite_number("length_penalty", length_penalty)
    if stop_tokens is None:
        return torch.empty(0, dtype=torch.long)
    if isinstance(stop_tokens, int) and not isinstance(stop_tokens, bool):
        stop_tokens = [stop_tokens]
    if not isinstance(stop_tokens, (Iterable, torch.Tensor)) or isinstance(stop_tokens, (str, bytes, dict)):
        raise TypeError(f"stop_tokens must be an id or a sequence of ids; got {stop_tokens!r}")
    return torch.tensor(token_id_list("stop_tokens", stop_tokens, vocab_size), dtype=torch.long)


def check_prompt(idx: object, vocab_size: int, *, batch: int | None = None) -> torch.Tensor:
    """Check a prompt: a ``(B, T)`` integer tensor, ``T >= 1``, every id (not only the last window's) in the vocabulary.

    Args:
        batch: the batch size required (beam search takes one prompt), or ``None``.

    Returns:
        ``idx`` as int64.

    Raises:
        TypeError: not a tensor, or not an integer dtype (named).
        ValueError: not 2-D, on the meta device, an empty prompt, the wrong batch size, an id outside the vocabulary.
    """
    idx = token_ids("idx", idx, vocab_size)
    if idx.device.type == "meta":
        raise ValueError("idx is on the meta device (shapes, no values): generating picks each token by the "
                         "values of the logits; run the model's forward on meta for shapes, or move it to a real device")
    if idx.shape[1] == 0:
        raise ValueError(f"idx must hold at least one prompt token per row; got shape {tuple(idx.shape)} (T=0)")
    if batch is not None and idx.shape[0] != batch:
        raise ValueError(f"idx must have shape ({batch}, T) (one prompt); got {tuple(idx.shape)}")
    return idx


def stop_mask(tokens: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """Which of ``tokens`` (any shape) are stop tokens: bool, same shape (all False without stops)."""
    if stops.numel() == 0:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, stops.to(tokens.device))


def decoder_vocab_size(model: object) -> int:
    """The vocabulary size of a decoder: its ``config.vocab_size`` (or its ``vocab_size``).

    Raises:
        TypeError: ``model`` has neither.
    """
    size = getattr(model, "vocab_size", None)
    if size is None:
        size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"model must be a decoder with vocab_size or config.vocab_size; got {type(model).__name__}")
    return size
