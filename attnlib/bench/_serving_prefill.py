"""The prefix-cache and chunked-prefill rows of ``python -m attnlib.bench serving`` (see :mod:`attnlib.bench.serving`).

Chapter 19. Prefix caching: SGLang's RadixAttention (Zheng et al. 2024, "SGLang: Efficient Execution of Structured
Language Model Programs", §3). Chunked prefill: Sarathi-Serve (Agrawal et al. 2024, "Taming Throughput-Latency
Tradeoff in LLM Inference with Sarathi-Serve", §4).
"""
from __future__ import annotations

import statistics
import time

import torch

from attnlib.serving import serve

__all__ = ["prefill_rows"]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _compare(target, prompts, budgets, repeats, options: dict, **common) -> tuple[dict, list, list, bool]:
    """Time ``serve`` without (``base``) and with ``options``, in interleaved rounds after one untimed round; returns
    (median seconds of each, the stats of each timed run, same tokens). ``serve`` reads every token back to the host,
    which synchronises an accelerator, so a wall clock times it."""
    runs: dict[str, list] = {"base": [], "method": []}
    seconds: dict[str, list] = {"base": [], "method": []}
    outs: dict[str, list] = {}
    for round_ in range(1 + repeats):
        for key, extra in (("base", {}), ("method", options)):
            start = time.perf_counter()
            outs[key], _, st = serve(target, prompts, budgets, return_stats=True, **common, **extra)
            if round_:
                seconds[key].append(time.perf_counter() - start)
                runs[key].append(st)
    s = {key: statistics.median(ts) for key, ts in seconds.items()}
    return s, runs["base"], runs["method"], _same(outs["base"], outs["method"])


def prefill_rows(target, n_prompts: int, new_tokens: int, page_size: int, repeats: int, seed: int, max_batch: int,
                 prefill_chunk: int) -> list[dict]:
    """The four rows: prefix cache (prefill tokens, time) and chunked prefill (longest stall, time).

    Args: as :func:`attnlib.bench.serving.serving_rows` (``target`` the model, in eval mode).
    """
    config, device = target.config, next(target.parameters()).device
    g = torch.Generator().manual_seed(seed + 1)
    block = config.block_size
    rows = []

    # prefix cache: a shared system prompt of block/2 tokens, each request its own suffix and a few new tokens
    system = torch.randint(config.vocab_size, (block // 2,), generator=g)
    budget = max(1, new_tokens // 2)
    suffixes = torch.randint(1, max(2, min(block // 8, block - block // 2 - budget) + 1), (n_prompts,), generator=g)
    prompts = [torch.cat([system, torch.randint(config.vocab_size, (int(n),), generator=g)]).to(device)
               for n in suffixes]
    s, base, method, same = _compare(target, prompts, [budget] * n_prompts, repeats, dict(prefix_cache=True),
                                     max_batch=max_batch, page_size=page_size)
    b, m = base[-1], method[-1]
    what = (f"{n_prompts} requests: a shared system prompt of {block // 2} tokens + {int(suffixes.min())}-"
            f"{int(suffixes.max())} own, {budget} new each")
    for unit, bv, mv, note in (
            ("prefill tokens", b["prefill_tokens"], m["prefill_tokens"],
             f"{what}; {m['prefill_tokens_saved']} prompt tokens from the cache; same tokens: {same}"),
            ("s", s["base"], s["method"], f"{what}; {page_size}/page; same tokens: {same}")):
        rows.append(dict(comparison="prefix cache", baseline="no prefix cache", method="prefix cache (shared pages)",
                         unit=unit, baseline_value=bv, method_value=mv, ratio=bv / mv, note=note,
                         baseline_stats=b, method_stats=m))

    # chunked prefill: short requests decode long outputs while long prompts join one at a time
    n_short = max(1, max_batch - 1)
    long_len = max(2, 5 * block // 8)
    long_budget = max(1, min(new_tokens // 4, block - long_len))
    short_budget = max(1, min(2 * new_tokens, block - 8))
    prompts = ([torch.randint(config.vocab_size, (8,), generator=g).to(device) for _ in range(n_short)]
               + [torch.randint(config.vocab_size, (long_len,), generator=g).to(device)
                  for _ in range(max(1, n_prompts - n_short))])
    budgets = [short_budget] * n_short + [long_budget] * (len(prompts) - n_short)
    s, base, method, same = _compare(target, prompts, budgets, repeats, dict(prefill_chunk=prefill_chunk),
                                     max_batch=max_batch, page_size=page_size)
    stall_b = statistics.median(st["longest_stall_s"] for st in base)
    stall_m = statistics.median(st["longest_stall_s"] for st in method)
    b, m = base[-1], method[-1]
    what = (f"{n_short} short request(s) ({short_budget} new) decoding while {len(prompts) - n_short} prompts of "
            f"{long_len} join, {max_batch} at once")
    for unit, bv, mv, note in (
            ("longest stall ms", 1e3 * stall_b, 1e3 * stall_m,
             f"{what}; the longest stall in tokens through the model {b['longest_stall_tokens']} vs "
             f"{m['longest_stall_tokens']}, in model calls {b['longest_stall_calls']} vs {m['longest_stall_calls']}; "
             f"same tokens: {same}"),
            ("s", s["base"], s["method"], f"{what}; model calls {b['model_calls']} vs {m['model_calls']}; "
                                          f"same tokens: {same}")):
        rows.append(dict(comparison="chunked prefill", baseline="whole prompts",
                         method=f"chunks of {prefill_chunk} tokens", unit=unit, baseline_value=bv, method_value=mv,
                         ratio=bv / mv, note=note, baseline_stats=b, method_stats=m))
    return rows
