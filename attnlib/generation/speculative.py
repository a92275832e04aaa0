"""Speculative decoding: a small draft model guesses, the large target model checks. Chapter 19.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding" (Algorithm 1);
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling" (Algorithm 2).

A decode step of a large model is slow because it reads all its weights for one token. Here the draft
proposes ``k`` tokens one by one (cheap), and the target scores all of them in *one* forward pass of
``k + 1`` tokens. Draft token ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``
(``p`` the target's distribution, ``q`` the draft's); at the first rejection the replacement is drawn
from ``max(0, p_j - q_j)`` renormalised, and if all ``k`` pass, one more token comes from ``p_{k+1}``.
Every emitted token is then distributed exactly as the target's own sample (Leviathan et al.,
Appendix A.1), and greedily (``temperature=0``: accept iff ``d_j`` is the target's argmax) the output is
the target's own greedy output. Each round costs one target pass and yields 1 to ``k + 1`` tokens.
"""
from __future__ import annotations

import torch

from attnlib._checks import eval_mode, generator_or_none, positive_int
from attnlib.generation.checks import check_decoding, check_prompt, decoder_vocab_size
from attnlib.generation.step import step

__all__ = ["speculative_generate", "verify_drafts"]


def verify_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, greedy: bool = False,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance step of speculative sampling, for ``N`` independent rows at once.

    Args:
        p: ``(N, k + 1, V)`` the target's next-token probabilities after the prefix and after each draft.
        q: ``(N, k, V)`` the draft's probabilities from which ``drafts`` were drawn.
        drafts: ``(N, k)`` int64 draft tokens.
        greedy: accept ``d_j`` iff it is ``p_j``'s argmax; the replacement is the argmax (no randomness).
        generator: for the uniforms and the replacement sample.

    Returns:
        ``(n_accepted (N,), next_token (N,))``: the first ``n_accepted`` drafts are kept, then ``next_token``
        (from the residual ``max(0, p[:, n] - q[:, n])`` after a rejection at draft ``n``, counted from 0; from
        ``p[:, k]``, the distribution after all ``k`` drafts (chapter 19's ``p_{k+1}``), after ``k`` acceptances).

    Raises:
        TypeError: ``p`` or ``q`` not a floating tensor, ``drafts`` not an integer tensor, ``greedy`` not a
            bool, ``generator`` not a ``torch.Generator``.
        ValueError: shapes that do not fit ``(N, k + 1, V)``, ``(N, k, V)``, ``(N, k)``; a draft outside
            ``[0, V)``; a probability that is negative or not finite, a row of ``p`` with no mass. All before
            any sampling.
    """
    _check_verify(p, q, drafts, greedy, generator)
    N, k = drafts.shape
    rows = torch.arange(N, device=p.device)
    if greedy:
        ok = drafts == p[:, :k].argmax(dim=-1)
    else:
        p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # (N, k): target's probability of each draft
        q_d = q.gather(-1, drafts[..., None])[..., 0]
        r = torch.rand(N, k, generator=generator, dtype=p.dtype, device=p.device)
        ok = r * q_d < p_d  # accepted with probability min(1, p / q)
    n = ok.long().cumprod(dim=-1).sum(dim=-1)  # (N,): length of the accepted prefix
    p_n = p[rows, n]  # (N, V): the target's distribution where the drafts stop
    if greedy:
        return n, p_n.argmax(dim=-1)
    q_n = torch.cat([q, p.new_zeros(N, 1, p.shape[-1])], dim=1)[rows, n]  # q after k acceptances is 0: residual = p
    residual = (p_n - q_n).clamp(min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p_n)
    return n, torch.multinomial(residual, 1, generator=generator)[:, 0]


def _check_verify(p: object, q: object, drafts: object, greedy: object, generator: object) -> None:
    """The argument checks of :func:`verify_drafts` (see its Raises)."""
    for name, t in (("p", p), ("q", q)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor of probabilities; got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if not isinstance(drafts, torch.Tensor) or drafts.dtype == torch.bool or drafts.is_floating_point() \
            or drafts.is_complex():
        raise TypeError(f"drafts must be an integer tensor (N, k); got {getattr(drafts, 'dtype', type(drafts).__name__)}")
    if not isinstance(greedy, bool):
        raise TypeError(f"greedy must be a bool; got {greedy!r}")
    generator_or_none(generator)
    if drafts.dim() != 2 or p.dim() != 3:
        raise ValueError(f"drafts must be (N, k) and p (N, k + 1, V); got {tuple(drafts.shape)} and {tuple(p.shape)}")
    (N, k), V = drafts.shape, p.shape[-1]
    if tuple(p.shape) != (N, k + 1, V) or tuple(q.shape) != (N, k, V):
        raise ValueError(f"with drafts (N, k) = {(N, k)}, p must be (N, k + 1, V) and q (N, k, V); got p "
                         f"{tuple(p.shape)}, q {tuple(q.shape)}")
    if drafts.numel() and not bool(((drafts >= 0) & (drafts < V)).all()):
        raise ValueError(f"drafts must be token ids in [0, V={V}); got {drafts.min().item()}..{drafts.max().item()}")
    for name, t in (("p", p), ("q", q)):
        if t.numel() and not bool((torch.isfinite(t) & (t >= 0)).all()):
            raise ValueError(f"{name} must hold probabilities (finite, >= 0); got a value "
                             f"{t[~(torch.isfinite(t) & (t >= 0))][0].item()}")
    if p.numel() and not bool((p.sum(dim=-1) > 0).all()):
        raise ValueError("every row of p must have some probability mass (a target distribution sums to 1); "
                         "got a row of zeros")


def _feed(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Run ``tokens[:, cache.length:]`` through ``model`` (:func:`~attnlib.generation.step.step`); their
    next-token logits ``(n_new, V)``."""
    return step(model, tokens[:, cache.length:], cache, all_logits=True)[0]


@torch.no_grad()
def speculative_generate(target, draft, idx: torch.Tensor, max_new_tokens: int, n_draft: int = 4,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         return_stats: bool = False) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Extend one prompt by ``max_new_tokens`` tokens with speculative decoding.

    Batch of one: rows of a batch accept different numbers of drafts, so their lengths would part
    (a paged cache with per-row lengths could take that; left out here).

    Args:
        target: the model whose distribution is sampled (an :class:`attnlib.Decoder`).
        draft: a smaller model with the same vocabulary.
        idx: ``(1, T)`` integer prompt; ``T + max_new_tokens`` must fit both models' ``block_size``.
        max_new_tokens: tokens to add (>= 0); exactly this many are returned.
        n_draft: draft tokens per round, ``k`` (>= 1; the last round may draft fewer).
        temperature: ``0`` = greedy (the target's own greedy tokens); else both models sample at it.
        generator: a ``torch.Generator`` for the draft's samples, the acceptance tests and the replacements.
        return_stats: also return ``{"rounds", "drafted", "accepted", "acceptance_rate", "target_calls",
            "draft_calls", "tokens_per_target_call"}`` (``acceptance_rate`` = accepted / drafted).

    Returns:
        ``(1, T + max_new_tokens)`` int64, with the statistics when ``return_stats``.

    Raises:
        TypeError / ValueError: different vocabularies (both named), ``n_draft`` not an int >= 1, a bad
            prompt (not one row) or temperature, a ``generator`` that is not a ``torch.Generator``, a text
            longer than a ``block_size``; all before any pass.
    """
    vocab, draft_vocab = decoder_vocab_size(target), decoder_vocab_size(draft)
    if vocab != draft_vocab:
        raise ValueError(f"draft and target must share a vocabulary; draft vocab_size={draft_vocab}, "
                         f"target vocab_size={vocab}")
    positive_int("n_draft", n_draft)
    generator_or_none(generator)
    check_decoding(vocab, max_new_tokens, temperature=temperature)
    idx = check_prompt(idx, vocab, batch=1)
    longest = idx.shape[1] + max_new_tokens
    for name, model in (("target", target), ("draft", draft)):
        if longest > model.config.block_size:
            raise ValueError(f"T + max_new_tokens = {idx.shape[1]} + {max_new_tokens} exceeds the {name}'s "
                             f"block_size={model.config.block_size} (speculative decoding does not slide the window)")
    caches = {"target": target.new_cache(windows=False), "draft": draft.new_cache(windows=False)}
    stats = {"rounds": 0, "drafted": 0, "accepted": 0, "target_calls": 0, "draft_calls": 0}
    greedy = temperature == 0

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return logits.double().softmax(dim=-1) if greedy else (logits.double() / temperature).softmax(dim=-1)

    tokens = idx
    with eval_mode(target), eval_mode(draft):
        while tokens.shape[1] < longest:
            k = min(n_draft, longest - tokens.shape[1] - 1)  # the round's last token comes from the target
            start = tokens.shape[1]
            seq, q = tokens, []
            for _ in range(k):  # the draft proposes k tokens, one at a time
                q.append(probs(_feed(draft, caches["draft"], seq)[-1]))
                stats["draft_calls"] += 1
                nxt = q[-1].argmax() if greedy else torch.multinomial(q[-1], 1, generator=generator)[0]
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            p = probs(_feed(target, caches["target"], seq)[-(k + 1):])  # (k + 1, V): one pass scores every draft
            stats["target_calls"] += 1
            q = torch.stack(q) if q else p.new_zeros(0, vocab)
            n, nxt = verify_drafts(p[None], q[None], seq[:, start:], greedy, generator)
            n = int(n[0])
            tokens = torch.cat([seq[:, : start + n], nxt.view(1, 1)], dim=1)
            for cache in caches.values():  # keep only what the accepted tokens put there
                cache.crop(tokens.shape[1] - 1)
            stats["rounds"] += 1
            stats["drafted"] += k
            stats["accepted"] += n
    if not return_stats:
        return tokens
    stats["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else float("nan")
    stats["tokens_per_target_call"] = max_new_tokens / stats["target_calls"] if stats["target_calls"] else float("nan")
    return tokens, stats
