"""Continuous batching on the paged cache, and what paging saves. Chapter 19.

*Static* batching (``Decoder.generate`` with ``attention_mask``) runs a batch until its longest request is
done: a finished row keeps its slot, and a new request waits for the whole batch. *Continuous*
batching (Yu et al. 2022, "Orca", iteration-level scheduling; vLLM) decides again at every step:
finished requests leave, waiting ones join. :func:`serve` does this on a
:class:`~attnlib.cache.paged.PagedKVCache`: a joining request is prefilled alone (its prompt
through the model, its pages taken), then decodes one token per step in the running batch, whose
rows have different lengths (the cache returns them right-aligned with a mask). A leaving request
gives its pages back at once. Without pages, a joining request would need a contiguous slab of
``block_size`` positions free, or the running batch's caches copied into a new layout.

Admission is conservative: a request joins only if the free pages cover the most it can still need
(prompt + ``max_new_tokens``) on top of what the running requests may still take, so no running request
is ever preempted (vLLM instead admits greedily and preempts: swapping or recomputing a victim's pages).
Two options of :func:`serve`, both in :mod:`attnlib.serving.scheduler`: ``prefix_cache`` shares the pages of
equal prompt prefixes between requests (SGLang's RadixAttention; only unheld *cached* pages are evicted), and
``prefill_chunk`` lets a long prompt in a chunk per step (Sarathi-Serve), so it stalls the running requests less.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attnlib._checks import generator_or_none, positive_int, token_ids
from attnlib.cache.paged import PageAllocator, PagedKVCache
from attnlib.generation.checks import check_decoding, decoder_vocab_size
from attnlib.generation.sampling import sample_next_token
from attnlib.serving.padding import _as_ids
from attnlib.serving.scheduler import run_schedule

__all__ = ["cache_memory", "request_lengths", "serve"]


def request_lengths(n: int, block_size: int, seed: int = 0) -> list[int]:
    """A mix of ``n`` request lengths (prompt + output) in ``[1, block_size]``, log-uniform (many short
    requests, a few long ones, as in chat traffic), from ``seed``."""
    positive_int("n", n)
    positive_int("block_size", block_size)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int; got {seed!r} ({type(seed).__name__})")
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return [max(1, min(block_size, int(round(math.exp(x * math.log(block_size)))))) for x in u.tolist()]


def cache_memory(lengths: Sequence[int], block_size: int, page_size: int, bytes_per_token: int = 1) -> dict:
    """KV-cache positions a set of requests occupies three ways, the paged one measured on a :class:`PageAllocator`.

    * ``contiguous``: every request preallocates ``block_size`` positions (a :class:`~attnlib.cache.KVCache`);
    * ``padded``: one static batch, every row as long as the longest request;
    * ``paged``: pages of ``page_size`` taken as needed (at most ``page_size - 1`` positions wasted per request).

    Args:
        lengths: positions each request ends with (prompt + output), each in ``[1, block_size]``.
        block_size: the model's context (``block_size``).
        page_size: positions per page, an int >= 1.
        bytes_per_token: bytes one position takes in all layers (``model.kv_cache_bytes_per_token()``).

    Returns:
        ``{"requests", "tokens", "<scheme>_positions", "<scheme>_bytes", "<scheme>_waste"}`` for each scheme
        (waste = the fraction of the reserved positions that hold no token), and ``"paged_pages"``.

    Raises:
        TypeError / ValueError: ``page_size`` (named), ``block_size`` or ``bytes_per_token`` not an int >= 1;
            ``lengths`` not a list, empty, or holding a length outside ``[1, block_size]``.
    """
    positive_int("page_size", page_size)
    positive_int("block_size", block_size)
    positive_int("bytes_per_token", bytes_per_token)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"lengths must be a list of ints (positions per request); got {type(lengths).__name__}")
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= block_size for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of ints in [1, block_size={block_size}]; got {lengths[:8]}")
    alloc = PageAllocator(sum(math.ceil(n / page_size) for n in lengths), page_size)
    for n in lengths:
        alloc.ensure(alloc.new_sequence(), n)  # what each sequence takes by the time it has n positions
    tokens = sum(lengths)
    result = {"requests": len(lengths), "tokens": tokens, "paged_pages": alloc.pages_used}
    for scheme, positions in (("contiguous", len(lengths) * block_size), ("padded", len(lengths) * max(lengths)),
                              ("paged", alloc.pages_used * page_size)):
        result[f"{scheme}_positions"] = positions
        result[f"{scheme}_bytes"] = positions * bytes_per_token
        result[f"{scheme}_waste"] = 1.0 - tokens / positions
    return result


@torch.no_grad()
def serve(model, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int | Sequence[int], *,
          max_batch: int = 4, page_size: int = 16, n_pages: int | None = None, temperature: float = 0.0,
          generator: torch.Generator | None = None, stop_tokens=None, prefix_cache: bool = False,
          prefill_chunk: int | None = None, return_stats: bool = False) -> tuple:
    """Generate for every prompt with continuous batching on a paged cache.

    Args:
        model: an :class:`attnlib.Decoder` (run in eval mode, left so).
        prompts: the requests, in arrival order: non-empty lists or 1-D tensors of ids.
        max_new_tokens: tokens to generate per request (one int for all, or one per request), >= 1;
            prompt + ``max_new_tokens`` must fit in ``block_size``.
        max_batch: most requests decoding together.
        page_size, n_pages: the pool (default: enough pages for ``max_batch`` requests of ``block_size``).
        temperature, generator: as :meth:`attnlib.GPT.generate` (``0`` = greedy).
        stop_tokens: ids that end a request early (the stop token is kept).
        prefix_cache: share the cached pages of equal prompt prefixes between requests (RadixAttention: Zheng
            et al. 2024, SGLang, §3; :mod:`attnlib.cache.prefix`): a request prefills only what follows its
            longest cached prefix of full pages. Cached pages no request holds are evicted, least recently used
            first, when the pool runs out.
        prefill_chunk: ``None``: each prompt goes through the model whole when its request is admitted;
            an int >= 1: at most this many prompt *tokens* per scheduler step, one chunk per step, between
            the running requests' decode steps (Sarathi-Serve: Agrawal et al. 2024, §4;
            :mod:`attnlib.serving.scheduler` says how this differs from it).
        return_stats: also return the stats dict.

    Returns:
        ``(outputs, trace)``, or ``(outputs, trace, stats)`` with ``return_stats``: ``outputs[i]`` 1-D int64,
        prompt ``i`` and its new tokens (greedily, exactly what ``model.generate`` gives it alone, with or
        without ``prefix_cache`` and ``prefill_chunk``); ``trace``: one dict per decode step with ``"running"``
        (the request indices in the batch), ``"joined"``, ``"left"``, ``"pages_used"`` (pages off the free
        list, evictable cached pages included) and ``"prefilled"`` (prompt tokens through the model in that
        step); ``stats``: ``prompt_tokens``, ``prefill_tokens`` (prompt tokens through the model),
        ``prefill_tokens_saved`` (taken from the prefix cache; the two add up to ``prompt_tokens``),
        ``model_calls``, ``model_tokens`` (every token through the model, decode included),
        ``longest_stall_s`` / ``longest_stall_calls`` / ``longest_stall_tokens`` (the longest wait of a running
        request between two of its tokens: in seconds, in model calls and in tokens through the model
        meanwhile), and at the end ``pages_held`` (pages sequences still hold: 0), ``pages_cached``,
        ``evictions``, ``copies`` (copy-on-write).

    Raises:
        TypeError / ValueError: not a decoder; no prompts; a bad prompt (named by index: empty, not 1-D, not
            integer ids, outside the vocabulary, not on the model's device); ``max_new_tokens`` not an int >= 1
            or a list of them, one per prompt; a bad pool size, temperature, stop token or generator; a request
            longer than ``block_size`` or than the whole pool; ``prefix_cache`` or ``return_stats`` not a bool,
            ``prefill_chunk`` neither ``None`` nor an int >= 1. All before any forward pass.
    """
    vocab = decoder_vocab_size(model)
    block = model.config.block_size
    stops = check_decoding(vocab, 1, temperature=temperature, stop_tokens=stop_tokens)
    positive_int("max_batch", max_batch)
    positive_int("page_size", page_size)
    generator_or_none(generator)
    for name, flag in (("prefix_cache", prefix_cache), ("return_stats", return_stats)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool; got {flag!r} ({type(flag).__name__})")
    if prefill_chunk is not None:
        positive_int("prefill_chunk", prefill_chunk)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, torch.Tensor)) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of prompts; got {type(prompts).__name__}")
    device = next(model.parameters()).device
    checked = []
    for i, p in enumerate(prompts):
        t = _as_ids(f"prompts[{i}]", p)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D sequence of ids; got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"prompts[{i}] is on {t.device} but the model is on {device}")
        checked.append(token_ids(f"prompts[{i}]", t[None], vocab)[0])
    prompts = checked
    if isinstance(max_new_tokens, (str, bytes)) or not isinstance(max_new_tokens, (int, Sequence)):
        raise TypeError(f"max_new_tokens must be an int or a list of ints, one per prompt; got {max_new_tokens!r}")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise ValueError(f"max_new_tokens gives {len(budgets)} budgets for {len(prompts)} prompts")
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        positive_int(f"max_new_tokens[{i}]", n)
        if p.numel() == 0 or p.numel() + n > block:
            raise ValueError(f"request {i}: prompt of {p.numel()} tokens + {n} new must be in [1, block_size={block}]")
    n_pages = max_batch * math.ceil(block / page_size) if n_pages is None else n_pages
    cache = PagedKVCache.for_model(model, n_pages, page_size, prefix_cache=prefix_cache)
    alloc = cache.allocator
    worst = [alloc.pages_for(p.numel() + n) for p, n in zip(prompts, budgets)]  # the most each may take
    if max(worst) > n_pages:
        i = worst.index(max(worst))
        raise ValueError(f"request {i} may need {worst[i]} pages of {page_size}; the pool has n_pages={n_pages}")
    model.eval()
    outputs, trace, stats = run_schedule(model, cache, prompts, budgets, max_batch=max_batch, prefill_chunk=prefill_chunk,
                                         prefix_cache=prefix_cache, stops=stops,
                                         sample=lambda logits: sample_next_token(logits, temperature, generator=generator))
    return (outputs, trace, stats) if return_stats else (outputs, trace)
