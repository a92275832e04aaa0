"""Greedy decoding and sampling: extend each prompt one token at a time. Chapters 08, 12.

Every decoding loop of the library -- :func:`generate` (greedy and sampling; :meth:`attnlib.Decoder.generate`
and :meth:`attnlib.Transformer.greedy_decode` call it), :func:`attnlib.generation.beam_search`,
:func:`attnlib.generation.speculative_generate` and :func:`attnlib.serving.serve` -- checks its settings
and prompt with :mod:`attnlib.generation.checks` before any forward pass (even for ``max_new_tokens=0``),
drives the one step of :mod:`attnlib.generation.step`, and finishes rows with
:func:`attnlib.generation.checks.stop_mask`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from attnlib._checks import token_id_list
from attnlib.attention.masks import check_attention_mask
from attnlib.generation.checks import check_decoding, check_prompt, decoder_vocab_size, stop_mask
from attnlib.generation.sampling import sample_next_token
from attnlib.generation.step import window_step

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_tokens: int | Iterable[int] | torch.Tensor | None = None,
    pad_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Extend each prompt one token at a time: greedy (``temperature=0``) or sampled.

    The model sees at most the last ``block_size`` tokens: a longer prompt is cropped from the left, and
    once the text outgrows ``block_size`` each step sees the last ``block_size`` tokens (the returned
    tensor keeps everything; :func:`attnlib.generation.step.window_step`). With ``use_cache`` (chapter 08)
    the prompt is encoded once (prefill) and each new token attends to the cache (decode); the tokens
    are the same as without it. The caller puts its model in eval mode (:func:`attnlib._checks.eval_mode`;
    :meth:`attnlib.Decoder.generate` does); every setting and every prompt id is checked here before
    the first forward pass.

    Args:
        model: a decoder (see :mod:`attnlib.generation.step`).
        idx: ``(B, T)`` integer prompt, ``T >= 1`` (any integer dtype; every id is checked, also beyond the window).
        max_new_tokens: how many tokens to add at most (>= 0).
        temperature: ``0`` = greedy; higher = more random (finite, >= 0).
        top_k, top_p, generator: see :func:`attnlib.generation.sampling.sample_next_token`.
        use_cache: ask the model for a cache (``model.new_cache()``); without, each step re-encodes.
        stop_tokens: ids that end a row. A finished row is padded with ``pad_id`` (or, when ``pad_id``
            is ``None``, with its own stop token), and the loop ends once every row has finished.
        pad_id: the id that fills a finished row, or ``None``.
        attention_mask: ``(B, T)`` bool, ``True`` = a real token: prompts of different lengths left-padded
            into one batch (:func:`attnlib.serving.left_pad`; chapter 19). Each row gets the tokens it gets
            alone: pads are never attended to and positions start at each row's first real token. It
            grows by a ``True`` column per new token.

    Returns:
        ``(B, T + n)`` int64, ``n <= max_new_tokens`` (``n < max_new_tokens`` only when every row stopped).
        An empty batch (``B = 0``) is returned as it is.

    Raises:
        TypeError / ValueError: see :func:`~attnlib.generation.checks.check_decoding` and
            :func:`~attnlib.generation.checks.check_prompt`; an ``attention_mask`` refused by
            :func:`attnlib.attention.masks.check_attention_mask` (left padding required).
    """
    vocab_size = decoder_vocab_size(model)
    stops = check_decoding(vocab_size, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           stop_tokens=stop_tokens)
    idx = check_prompt(idx, vocab_size)
    if pad_id is not None:
        token_id_list("pad_id", [pad_id], vocab_size)
    if attention_mask is not None:
        check_attention_mask(attention_mask, tuple(idx.shape), idx.device, left_padded=True)
    if idx.shape[0] == 0:
        return idx
    mask = attention_mask
    # With padding, each row's chunks start at another column: every layer keeps every position then.
    cache = model.new_cache(windows=mask is None) if use_cache else None
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    fill = torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device)  # what a finished row repeats
    n_new = idx.shape[1]
    for _ in range(max_new_tokens):
        logits, cache = window_step(model, idx, cache, n_new, mask)
        next_id = sample_next_token(logits, temperature, top_k, top_p, generator)[:, 0]  # (B,)
        next_id = torch.where(finished, fill, next_id)
        idx = torch.cat([idx, next_id[:, None]], dim=1)  # (B, T) -> (B, T + 1)
        if mask is not None:  # the new token is real in every row
            mask = torch.cat([mask, next_id[:, None] >= 0], dim=1)
        n_new = 1
        if stops.numel():
            newly = ~finished & stop_mask(next_id, stops)
            fill = torch.where(newly, next_id if pad_id is None else torch.full_like(next_id, pad_id), fill)
            finished |= newly
            if finished.all():
                break
    return idx

