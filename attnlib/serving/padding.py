"""Batches of prompts of different lengths: left padding, the attention mask, per-row positions. Chapter 19.

A batch is a rectangle, prompts are not. Batched generation pads every prompt on the *left* to the
longest one and passes an ``attention_mask`` (``(B, T)`` bool, ``True`` = a real token, as in
Hugging Face ``transformers``): left, so that every row's last column is a real token whose logits
give the next one, and the new tokens of all rows are appended in the same column. The mask does
two things in the model:

* pads are never attended to (every layer hides them, cached positions included);
* each row's positions start at its first real token (:func:`attnlib.attention.masks.mask_positions`),
  so RoPE and learned position tables see exactly the positions the prompt would have alone.

With both, every prompt gets, greedily, the tokens it gets alone (tests/test_batched_generation.py).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from attnlib._checks import positive_int, token_ids

__all__ = ["left_pad"]


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
