"""The scheduler of :func:`attnlib.serving.serve`: admission, prefill (whole, or in chunks), decode steps. Chapter 19.

Each *scheduler step* admits waiting requests, runs prefill, then one decode step of every running
request (one new token each, one model call for the batch). Two ways to prefill:

* **whole** (``prefill_chunk=None``): every request that is admitted in a step goes through the model
  at once, its whole prompt in one call, before that step's decode. The running requests wait for all of
  it: a long prompt *stalls* every running request for as long as it takes;
* **chunked** (Sarathi-Serve: Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM Inference
  with Sarathi-Serve", §4.1-4.2): a prompt enters ``prefill_chunk`` tokens per step, at most one chunk
  per step, so a running request waits at most one chunk between two of its tokens. One request is in
  prefill at a time (the next is admitted when its prompt is in). Sarathi-Serve puts the chunk and the
  decodes in *one* batch (one model call, "stall-free batching"), which needs rows of different numbers
  of new tokens in one call; here they are two calls in the same step (the chunk, then the decode
  batch): the stall is bounded the same way, the fused call's better use of the hardware is left out.

With prefix caching (:class:`attnlib.cache.prefix.PrefixPageAllocator`) a request first takes the cached
pages of its prompt's longest prefix and prefills only the rest; its full pages are indexed after each
chunk and, with the generated tokens, when it leaves.

A request is admitted only if the pool can give it the most pages it may still need on top of what the
running requests may still take (cached pages no one holds count as available: they are evicted on demand),
so a running request never runs out of pages.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from attnlib.generation.checks import stop_mask
from attnlib.generation.step import step

__all__ = ["run_schedule"]

STALLS = ("longest_stall_s", "longest_stall_calls", "longest_stall_tokens")


def run_schedule(model, cache, prompts: list[torch.Tensor], budgets: list[int], *, max_batch: int,
                 prefill_chunk: int | None, prefix_cache: bool, sample, stops) -> tuple[list, list, dict]:
    """Serve ``prompts`` (checked 1-D id tensors) on the empty paged ``cache``; see :func:`attnlib.serving.serve`.

    ``sample(logits (B, vocab)) -> (B, 1)`` picks the next tokens; ``stops`` as :func:`~attnlib.generation.checks.stop_mask`.
    Returns ``(outputs, trace, stats)`` as ``serve(..., return_stats=True)``.
    """
    alloc = cache.allocator
    worst = [alloc.pages_for(p.numel() + n) for p, n in zip(prompts, budgets)]  # the most each may hold
    outputs: list[torch.Tensor] = list(prompts)
    waiting, running, trace = deque(range(len(prompts))), {}, []  # running: request -> sequence id
    prefilling = None  # [request, sequence, positions cached so far] while a prompt enters in chunks
    chunk = prefill_chunk or max(p.numel() for p in prompts)
    stats = dict(prompt_tokens=sum(p.numel() for p in prompts), prefill_tokens=0, prefill_tokens_saved=0,
                 model_calls=0, model_tokens=0, longest_stall_s=0.0, longest_stall_calls=0, longest_stall_tokens=0)
    last: dict[int, tuple] = {}  # request -> (seconds, model calls, model tokens) when its latest token came

    def forward(tokens: torch.Tensor, seqs: list[int], masked: bool) -> torch.Tensor:
        stats["model_calls"] += 1
        stats["model_tokens"] += tokens.numel()
        cache.select(seqs)
        return step(model, tokens, cache, attention_mask=cache.attention_mask(tokens.shape[1]) if masked else None)

    def emit(requests: list[int], logits: torch.Tensor) -> list[int]:
        """Append the next token of each request, measure its wait since its last; return those that are done."""
        nxt = sample(logits)[:, 0]
        now, done = (time.perf_counter(), stats["model_calls"], stats["model_tokens"]), []
        for r, t in zip(requests, nxt.tolist()):
            if r in last:  # a running request: the gap since its previous token
                for key, a, b in zip(STALLS, now, last[r]):
                    stats[key] = max(stats[key], a - b)
            last[r] = now
            outputs[r] = torch.cat([outputs[r], torch.tensor([t], device=outputs[r].device)])
            if outputs[r].numel() - prompts[r].numel() == budgets[r] or stop_mask(torch.tensor(t), stops):
                done.append(r)
        return done

    def admit(r: int) -> list | None:
        """Request ``r``'s sequence, with its cached prefix, if the pool can hold the most it may need; else None."""
        tokens = prompts[r].tolist()
        hit = alloc.lookup(tokens) if prefix_cache else []
        revived = sum(alloc.refs[page] == 0 for page in hit)  # cached pages it takes off the evictable list
        # a fully cached prompt copies its last page before writing its last token; the old page stays held
        # (a pool page lost) unless only this request held it (then it goes back to the evictable list)
        copy = len(hit) * alloc.page_size == len(tokens) and alloc.refs[hit[-1]] > 0
        owed = sum(worst[q] - len(alloc.table(s)) for q, s in running.items())  # what the running may still take
        if alloc.available - owed < worst[r] - len(hit) + revived + copy:
            return None
        seq = cache.add_sequence()
        cached = cache.take_prefix(seq, tokens) if prefix_cache else 0
        stats["prefill_tokens_saved"] += cached
        return [r, seq, cached]

    def release(r: int) -> None:
        seq = running.pop(r)
        if prefix_cache:  # its full pages, generated tokens too, stay for later requests
            cache.cache_prefix(seq, outputs[r][: cache.sequence_length(seq)])
        cache.release(seq)
        last.pop(r, None)

    while waiting or running or prefilling:
        joined, left, prefilled = [], [], 0
        while True:  # admit and prefill: whole prompts while requests fit, or one chunk
            if prefilling is None:
                if not waiting or len(running) >= max_batch or (prefilling := admit(waiting[0])) is None:
                    break
                waiting.popleft()
            r, seq, start = prefilling
            end = min(start + chunk, prompts[r].numel())
            logits = forward(prompts[r][None, start:end], [seq], masked=False)
            prefilled += end - start
            if prefix_cache:
                cache.cache_prefix(seq, prompts[r][:end])
            prefilling[2] = end
            if end == prompts[r].numel():  # the prompt is in: its first token, then it decodes with the others
                prefilling, running[r] = None, seq
                joined.append(r)
                left += emit([r], logits)
            if prefill_chunk is not None:
                break
        stats["prefill_tokens"] += prefilled
        for r in left:
            release(r)
        if running:
            requests = list(running)
            last_tokens = torch.stack([outputs[r][-1] for r in requests])[:, None]  # (B, 1): each row's newest
            done = emit(requests, forward(last_tokens, [running[r] for r in requests], masked=True))
            trace.append({"running": requests, "joined": joined, "left": left + done, "pages_used": alloc.pages_used,
                          "prefilled": prefilled})
            for r in done:
                release(r)
    stats.update(pages_held=alloc.n_pages - alloc.available, pages_cached=getattr(alloc, "pages_cached", 0),
                 evictions=getattr(alloc, "evictions", 0), copies=getattr(alloc, "copies", 0))
    return outputs, trace, stats
