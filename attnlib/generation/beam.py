"""Beam search: keep the ``beam_width`` most likely partial continuations at each step. Chapter 08.

Length normalisation as in Wu et al. 2016 (GNMT, §7) in its simple form: the final choice
maximises ``score / length ** alpha``, each hypothesis divided by its own length.
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn

from attnlib._checks import eval_mode
from attnlib.generation.checks import check_decoding, check_prompt, decoder_vocab_size, stop_mask
from attnlib.generation.step import window_step

__all__ = ["beam_search"]


@torch.no_grad()
def beam_search(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    beam_width: int = 4,
    stop_tokens: int | Iterable[int] | torch.Tensor | None = None,
    length_penalty: float = 0.0,
    use_cache: bool = True,
) -> tuple[torch.Tensor, float]:
    """The most likely continuation found by keeping the ``beam_width`` best partial ones at each step.

    At every step each beam is extended by every token; the ``beam_width`` extensions with the
    highest total log-probability survive (their KV caches follow them). A beam that produces a
    stop token is finished: its length stops growing, and it only ever extends by that token
    again at no cost. With ``beam_width=1`` this is greedy decoding.

    Args:
        model: an :class:`attnlib.Decoder`, or any decoder (see :mod:`attnlib.generation.step`); an
            ``nn.Module`` runs in eval mode and gets its modes back.
        idx: ``(1, T)`` integer prompt (any integer dtype; every id is checked).
        max_new_tokens: tokens to add (>= 0).
        beam_width: beams kept (>= 1).
        stop_tokens: an id or ids that finish a beam.
        length_penalty: ``alpha`` (finite); the final choice maximises ``score / length ** alpha``,
            ``length`` being the number of tokens the beam generated (its stop token included;
            shorter for a beam that finished early). ``0`` = plain sum of log-probabilities;
            ``alpha > 0`` favours longer beams.
        use_cache: decode with the model's cache (same result, faster).

    Returns:
        ``(tokens (1, T + max_new_tokens), score)``: the best beam (a finished beam padded with
        its stop token) and its total log-probability in nats (not divided by the length).

    Raises:
        TypeError / ValueError: a bad prompt (not one ``(1, T)`` prompt, an id outside the
            vocabulary) or setting, checked by :func:`attnlib.generation.checks.check_decoding` before any
            forward pass.
    """
    vocab_size = decoder_vocab_size(model)
    stops = check_decoding(vocab_size, max_new_tokens, stop_tokens=stop_tokens, beam_width=beam_width,
                           length_penalty=length_penalty)
    idx = check_prompt(idx, vocab_size, batch=1)
    with eval_mode(model) if isinstance(model, nn.Module) else nullcontext():
        beams, scores = idx, torch.zeros(1, device=idx.device)  # (n_beams, T), (n_beams,)
        done = torch.zeros(1, dtype=torch.bool, device=idx.device)
        lengths = torch.zeros(1, dtype=torch.long, device=idx.device)  # tokens generated, stop included
        cache = model.new_cache() if use_cache else None
        n_new = idx.shape[1]
        for _ in range(max_new_tokens):
            logits, cache = window_step(model, beams, cache, n_new)
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # (n_beams, vocab_size)
            # A finished beam may only repeat its last (stop) token, at no cost.
            frozen = torch.full_like(logprobs, float("-inf"))
            frozen.scatter_(1, beams[:, -1:], 0.0)
            logprobs = torch.where(done[:, None], frozen, logprobs)
            candidates = (scores[:, None] + logprobs).flatten()  # (n_beams * vocab_size,)
            scores, flat = candidates.topk(min(beam_width, candidates.numel()))
            parent, token = flat // logprobs.shape[1], flat % logprobs.shape[1]
            beams = torch.cat([beams[parent], token[:, None]], dim=1)  # (n_beams, T) -> (n_beams, T + 1)
            lengths = lengths[parent] + (~done[parent]).long()
            done = done[parent] | stop_mask(token, stops)
            if cache is not None:
                cache.reorder(parent)
            n_new = 1
            if done.all():
                break
        n_added = beams.shape[1] - idx.shape[1]
        if n_added < max_new_tokens:  # every beam finished early: pad with its stop token
            beams = torch.cat([beams, beams[:, -1:].expand(-1, max_new_tokens - n_added)], dim=1)
        final = scores / lengths.clamp(min=1).float() ** length_penalty  # each beam by its own length
        best = int(final.argmax())
    return beams[best : best + 1], float(scores[best])
