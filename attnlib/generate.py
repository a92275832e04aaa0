"""The decode loop: greedy decoding and sampling; beam search and the filters re-exported. Chapters 08, 12.

Every decoder of the library -- :meth:`attnlib.GPT.generate` (which calls :func:`decode`),
:func:`attnlib.beam.beam_search`, :meth:`attnlib.Transformer.greedy_decode` and
:meth:`attnlib.Transformer.beam_decode` -- checks its settings and prompt with
:mod:`attnlib.decoding` before any forward pass (even for ``max_new_tokens=0``) and finishes rows
with :func:`attnlib.decoding.stop_mask`. Speculative decoding (chapter 19),
:func:`speculative_generate`, lives in :mod:`attnlib.speculative`. Greedy decoding and sampling are one loop, :func:`decode`;
beam search keeps several hypotheses per prompt, so it has its own loop in :mod:`attnlib.beam`,
over the same checks.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from attnlib._checks import token_id_list
from attnlib.beam import beam_search
from attnlib.decoding import check_decoding, check_prompt, stop_mask
from attnlib.sampling import sample_next_token, top_k_filter, top_p_filter
from attnlib.serving.padding import check_attention_mask
from attnlib.speculative import speculative_generate

__all__ = ["beam_search", "decode", "sample_next_token", "speculative_generate", "top_k_filter", "top_p_filter"]


@torch.no_grad()
def decode(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    vocab_size: int,
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

    The caller puts its model in eval mode (:func:`attnlib._checks.eval_mode`); every setting and
    every prompt id is checked here before the first forward pass.

    Args:
        model: a decoder (see the module's docstring).
        idx: ``(B, T)`` integer prompt, ``T >= 1``.
        max_new_tokens: how many tokens to add at most (>= 0).
        vocab_size: the model's vocabulary, for the checks.
        temperature, top_k, top_p, generator: see :func:`attnlib.sampling.sample_next_token`.
        use_cache: ask the model for a cache (``model.new_cache()``); without, each step re-encodes.
        stop_tokens: ids that end a row. A finished row is padded with ``pad_id`` (or, when ``pad_id``
            is ``None``, with its own stop token), and the loop ends once every row has finished.
        pad_id: the id that fills a finished row, or ``None``.
        attention_mask: ``(B, T)`` bool, ``True`` = a real token: left-padded prompts of different
            lengths (chapter 19). It grows by a ``True`` column per new token and goes to
            ``model.next_token_logits(..., attention_mask=...)``; the cache is
            ``model.new_cache(windows=False)`` (a ring buffer takes no padding mask). A GPT.

    Returns:
        ``(B, T + n)`` int64, ``n <= max_new_tokens`` (``n < max_new_tokens`` only when every row stopped).
        An empty batch (``B = 0``) is returned as it is.

    Raises:
        TypeError / ValueError: see :func:`check_decoding` and :func:`check_prompt`; an ``attention_mask``
            refused by :func:`attnlib.serving.check_attention_mask` (left padding required).
    """
    stops = check_decoding(vocab_size, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           stop_tokens=stop_tokens)
    idx = check_prompt(idx, vocab_size)
    if pad_id is not None:
        token_id_list("pad_id", [pad_id], vocab_size)
    if attention_mask is not None:
        check_attention_mask(attention_mask, tuple(idx.shape), idx.device, left_padded=True)
    if idx.shape[0] == 0:
        return idx
    padded = {} if attention_mask is None else {"attention_mask": attention_mask}
    cache = (model.new_cache(windows=False) if padded else model.new_cache()) if use_cache else None
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    fill = torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device)  # what a finished row repeats
    n_new = idx.shape[1]
    for _ in range(max_new_tokens):
        logits, cache = model.next_token_logits(idx, cache, n_new, **padded)
        next_id = sample_next_token(logits, temperature, top_k, top_p, generator)[:, 0]  # (B,)
        next_id = torch.where(finished, fill, next_id)
        idx = torch.cat([idx, next_id[:, None]], dim=1)  # (B, T) -> (B, T + 1)
        if padded:  # the new token is real in every row
            padded["attention_mask"] = torch.cat([padded["attention_mask"], next_id[:, None] >= 0], dim=1)
        n_new = 1
        if stops.numel():
            newly = ~finished & stop_mask(next_id, stops)
            fill = torch.where(newly, next_id if pad_id is None else torch.full_like(next_id, pad_id), fill)
            finished |= newly
            if finished.all():
                break
    return idx

