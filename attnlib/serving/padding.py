"""Batches of prompts of different lengths: left padding, the attention mask, per-row positions. Chapter 19.

A batch is a rectangle, prompts are not. Batched generation pads every prompt on the *left* to the
longest one and passes an ``attention_mask`` (``(B, T)`` bool, ``True`` = a real token, as in
Hugging Face ``transformers``): left, so that every row's last column is a real token whose logits
give the next one, and the new tokens of all rows are appended in the same column. The mask does
two things in the model:

* pads are never attended to (it is the attention's ``key_padding_mask``, cached positions included);
* each row's positions start at its first real token (:func:`mask_positions`), so RoPE and learned
  position tables see exactly the positions the prompt would have alone.

With both, every prompt gets, greedily, the tokens it gets alone (tests/test_batched_generation.py).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from attnlib._checks import positive_int, token_ids

__all__ = ["check_attention_mask", "left_pad", "mask_positions"]


def check_attention_mask(attention_mask: object, shape: tuple[int, int], device: torch.device | None = None,
                         *, left_padded: bool = False) -> torch.Tensor:
    """Check a padding mask and return it.

    Args:
        attention_mask: ``(B, T)`` bool, ``True`` = a real token.
        shape: the ``(B, T)`` it must have (the tokens it describes, cached ones included).
        device: the device it must be on (the tokens'), or ``None``.
        left_padded: also require left padding: no padding after a real token in any row.

    Returns:
        ``attention_mask`` unchanged.

    Raises:
        TypeError: not a bool tensor (``transformers`` uses 0/1 integers: convert with ``.bool()``).
        ValueError: another shape or device; a row with no real token (named: it would have nothing to
            attend to and no last token to continue); with ``left_padded``, padding after a real token.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise TypeError("attention_mask must be a bool tensor (B, T), True = a real token; got "
                        f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)} (use mask.bool())")
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have shape (B, T) = {tuple(shape)}; got {tuple(attention_mask.shape)}")
    if device is not None and attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device} but the tokens are on {device}")
    empty = (~attention_mask.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask row {empty[0]} is all padding (rows {empty} hold no real token); "
                         "every prompt needs at least one real token")
    if left_padded:
        late = (attention_mask[:, 1:] < attention_mask[:, :-1]).any(dim=-1).nonzero().flatten().tolist()
        if late:
            raise ValueError(f"attention_mask row {late[0]} has padding after a real token; prompts must be "
                             "left-padded (the last column of every row a real token)")
    return attention_mask


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token: ``(B, T)`` bool → ``(B, T)`` int64.

    Real tokens get ``0, 1, …`` in order; a pad gets the position of the last real token before it
    (0 before the first): it is never attended to, so any position in range does.

    Raises:
        TypeError: not a bool tensor. ValueError: not 2-D ``(B, T)``.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise TypeError("attention_mask must be a bool tensor (B, T), True = a real token; got "
                        f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)} (use mask.bool())")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape (B, T); got {tuple(attention_mask.shape)}")
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _as_ids(name: str, prompt: object) -> torch.Tensor:
    """One prompt (a tensor, or a list of ints) as a tensor, without rounding floats into ids."""
    if isinstance(prompt, torch.Tensor):
        return prompt
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"{name} must be a list or 1-D tensor of token ids; got {type(prompt).__name__} "
                        f"{prompt!r:.40} (prompts is a list of prompts, each a list of ids)")
    if len(prompt) == 0:
        return torch.zeros(0, dtype=torch.long)
    try:
        return torch.tensor(list(prompt))  # floats stay floats: token_ids refuses them, not rounds them
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} must hold integer token ids; got {list(prompt)[:8]!r}") from e


def left_pad(prompts: Sequence[Sequence[int] | torch.Tensor], pad_id: int = 0, vocab_size: int | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts of different lengths into one left-padded batch.

    Args:
        prompts: ``B >= 1`` prompts, each a non-empty list or 1-D integer tensor of token ids.
        pad_id: the id written into the padding (never attended to; any valid id).
        vocab_size: when given, every id (``pad_id`` too) must lie in ``[0, vocab_size)``.

    Returns:
        ``(idx (B, T_max) int64, attention_mask (B, T_max) bool)``.

    Raises:
        TypeError / ValueError: no prompts (or a string, or one prompt instead of a list of prompts), an
            empty prompt (named by its index), ids that are not integers (floats are refused, not rounded) or
            lie outside the vocabulary, prompts on different devices, ``vocab_size`` not an int >= 1.
    """
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of prompts; got {type(prompts).__name__}")
    if vocab_size is not None:
        positive_int("vocab_size", vocab_size)
    vocab = 2**62 if vocab_size is None else vocab_size  # without a vocabulary: ids must be integers >= 0
    rows = []
    for i, p in enumerate(prompts):
        t = _as_ids(f"prompts[{i}]", p)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D sequence of ids; got shape {tuple(t.shape)}")
        if t.device != (rows[0].device if rows else t.device):
            raise ValueError(f"prompts[{i}] is on {t.device} but prompts[0] is on {rows[0].device}")
        rows.append(token_ids(f"prompts[{i}]", t[None], vocab)[0])
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"pad_id must be an int; got {pad_id!r}")
    token_ids("pad_id", torch.tensor([[pad_id]]), vocab)
    width = max(len(r) for r in rows)
    idx = torch.full((len(rows), width), pad_id, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        idx[i, width - len(r):] = r
        mask[i, width - len(r):] = True
    return idx, mask
