"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Chapter 12. Nucleus sampling: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration".
"""
from __future__ import annotations

import torch

from attnlib._checks import positive_int

__all__ = ["beam_search", "sample_next_token", "top_k_filter", "top_p_filter"]


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

    Args:
        logits: ``(..., vocab_size)`` float.
        p: cumulative probability in (0, 1]; 1 keeps everything.

    Returns:
        A tensor of the same shape; the most likely token is always kept.

    Raises:
        ValueError: if ``p`` is not in (0, 1].
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"top_p={p!r} must be a number in (0, 1]")
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens before it already reach p (so the first one always stays).
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


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
        temperature: divides the logits; ``0`` means greedy (argmax).
        top_k: keep only the ``top_k`` most likely tokens before sampling.
        top_p: keep only the nucleus of cumulative probability ``top_p``.
        generator: a ``torch.Generator`` for reproducible sampling.

    Returns:
        ``(B, 1)`` int64 token ids.

    Raises:
        ValueError: negative temperature, or a bad ``top_k`` / ``top_p``.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0 = greedy)")
    if top_k is not None:
        positive_int("top_k", top_k)
    if top_p is not None:
        top_p_filter(logits[..., :1], top_p)  # validates p before any work
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.no_grad()
def beam_search(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    beam_width: int = 4,
    stop_tokens: list[int] | tuple[int, ...] | None = None,
    length_penalty: float = 0.0,
    use_cache: bool = True,
) -> tuple[torch.Tensor, float]:
    """The most likely continuation found by keeping the ``beam_width`` best partial ones at each step.

    Chapter 08. At every step each beam is extended by every token; the ``beam_width``
    extensions with the highest total log-probability survive (their KV caches follow
    them). A beam that produces a stop token is finished: it keeps its score and only
    ever extends by that token again at no cost. With ``beam_width=1`` this is greedy
    decoding.

    Args:
        model: an :class:`attnlib.GPT`, or any decoder with ``next_token_logits(tokens, cache, n_new)
            -> (logits (n_beams, vocab), cache)`` and ``new_cache()`` (a cache with ``reorder(index)``,
            or ``None`` to decode without one), e.g. the decoder of :class:`attnlib.transformer.Transformer`.
        idx: ``(1, T)`` integer prompt.
        max_new_tokens: tokens to add (>= 0).
        beam_width: beams kept (>= 1).
        stop_tokens: ids that finish a beam.
        length_penalty: ``alpha``; the final choice maximises ``score / n_new ** alpha``
            (0 = plain sum of log-probabilities).
        use_cache: decode with KV caches (same result, faster).

    Returns:
        ``(tokens (1, T + max_new_tokens), score)``: the best beam (finished beams padded
        with their stop token) and its total log-probability (nats).

    Raises:
        ValueError: ``idx`` not a single prompt, or a bad width/length.
    """
    positive_int("beam_width", beam_width)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != 1:
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"beam_search takes one prompt of shape (1, T); got {shape}")
    stops = torch.tensor(list(stop_tokens or []), dtype=torch.long, device=idx.device)
    was_training = model.training
    model.eval()
    try:
        beams, scores = idx, torch.zeros(1, device=idx.device)  # (n_beams, T), (n_beams,)
        done = torch.zeros(1, dtype=torch.bool, device=idx.device)
        cache = model.new_cache() if use_cache else None
        n_new = idx.shape[1]
        for _ in range(max_new_tokens):
            logits, cache = model.next_token_logits(beams, cache, n_new)
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # (n_beams, vocab_size)
            # A finished beam may only repeat its last (stop) token, at no cost.
            frozen = torch.full_like(logprobs, float("-inf"))
            frozen.scatter_(1, beams[:, -1:], 0.0)
            logprobs = torch.where(done[:, None], frozen, logprobs)
            candidates = (scores[:, None] + logprobs).flatten()  # (n_beams * vocab_size,)
            scores, flat = candidates.topk(min(beam_width, candidates.numel()))
            parent, token = flat // logprobs.shape[1], flat % logprobs.shape[1]
            beams = torch.cat([beams[parent], token[:, None]], dim=1)
            done = done[parent] | torch.isin(token, stops)
            if cache is not None:
                cache.reorder(parent)
            n_new = 1
            if done.all():
                break
        n_added = beams.shape[1] - idx.shape[1]
        if n_added < max_new_tokens:  # every beam finished early: pad with its stop token
            beams = torch.cat([beams, beams[:, -1:].expand(-1, max_new_tokens - n_added)], dim=1)
        final = scores / max(n_added, 1) ** length_penalty
        best = int(final.argmax())
    finally:
        model.train(was_training)
    return beams[best : best + 1], float(scores[best])
