"""The one step every decoding loop drives: new tokens in, next-token logits out. Chapters 08, 12, 19.

:func:`step` feeds the tokens after those a cache holds (all of them without a cache) through the
model and returns the logits of the last position (or of every new position, for speculative
decoding's verification). :func:`window_step` is the step of a loop that extends a text: when the
text outgrows the model's ``block_size``, it re-encodes the last ``block_size`` tokens (learned
absolute positions cannot be shifted inside a cache), exactly what the uncached model sees.
``generate``, beam search, speculative decoding and continuous batching all call these. Both run
without gradients (a decoding step builds no autograd graph), as every loop does.

A *decoder* here is any object with ``config.vocab_size``, ``config.block_size``,
``__call__(tokens, cache=None, attention_mask=None, positions=None, last_only=False) -> (logits, loss)``
and ``new_cache(windows=True)`` (a cache, or ``None`` for a model that keeps none).
"""
from __future__ import annotations

import torch

__all__ = ["step", "window_step"]


@torch.no_grad()
def step(model, tokens: torch.Tensor, cache=None, *, attention_mask: torch.Tensor | None = None,
         positions: torch.Tensor | None = None, all_logits: bool = False) -> torch.Tensor:
    """Feed ``tokens`` ``(B, T_new)``, the tokens after the ``cache.length`` cached ones, through ``model``.

    Args:
        model: a decoder (see the module's docstring).
        tokens: ``(B, T_new)`` integer ids.
        cache: the model's cache, extended in place; ``None``: ``tokens`` is the whole text.
        attention_mask: ``(B, cached + T_new)`` bool, ``True`` = a real token (left padding, chapter 19).
        positions: ``(B, T_new)`` positions of the new tokens (default: from the mask, or the cache's length).
        all_logits: return every new position's logits, ``(B, T_new, vocab_size)``, not only the last's.

    Returns:
        ``(B, vocab_size)`` logits of the token after ``tokens`` (or ``(B, T_new, vocab_size)``).

    Raises:
        TypeError / ValueError: as the model's forward pass (bad tokens, masks, a full cache, ...).
    """
    logits, _ = model(tokens, cache=cache, attention_mask=attention_mask, positions=positions,
                      last_only=not all_logits)
    return logits if all_logits else logits[:, -1, :]


@torch.no_grad()
def window_step(model, tokens: torch.Tensor, cache, n_new: int,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
    """The logits for the token after ``tokens`` ``(B, T)``, of which the last ``n_new`` are not cached yet.

    Without a cache, the last ``block_size`` tokens are encoded from scratch. With one, the new tokens
    are appended; when they would not fit, the window slides: the cache is emptied and refilled with
    the last ``block_size`` tokens, exactly what the uncached path sees. ``attention_mask`` ``(B, T)``
    is cropped with the tokens: each row's last ``block_size`` real tokens are always inside the window.

    Returns:
        ``(logits (B, vocab_size), cache)``.
    """
    block_size = model.config.block_size
    if cache is None:
        mask = None if attention_mask is None else attention_mask[:, -block_size:]
        return step(model, tokens[:, -block_size:], attention_mask=mask), None
    if cache.length + n_new > block_size or cache.length == 0:
        cache.reset()  # the window slides: re-encode it from position 0, reusing the buffers
        n_new = min(tokens.shape[1], block_size)
    mask = None if attention_mask is None else attention_mask[:, -(cache.length + n_new):]  # cached + new
    return step(model, tokens[:, -n_new:], cache, attention_mask=mask), cache
