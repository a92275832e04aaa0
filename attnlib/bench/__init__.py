"""Benchmarks of chapter 15: ``python -m attnlib.bench <name>`` prints a table measured in one run.

* ``mha`` (:func:`mha_rows`): every implementation of causal multi-head attention at GPT-2
  small's size, forward and forward + backward, against a fair SDPA reference.
* ``kv-cache`` (:func:`kv_cache_rows`): tokens/s of generation with and without the KV cache
  for MHA, GQA, MQA and MLA, and the cache's bytes per token (measured and by formula).
* ``memory`` (:func:`memory_rows`): peak memory and time of naive, SDPA and tiled attention
  as the sequence grows.

Each function returns plain dicts (one per table row) so that a notebook can run a
small version; ``--json FILE`` writes settings, environment and rows;
:func:`load_results` reads such a file back. Speed is measured here, never asserted in
tests. Full-size runs::

    python -m attnlib.bench mha --json results/bench_mha.json
    python -m attnlib.bench kv-cache --json results/bench_kv_cache.json
    python -m attnlib.bench memory --json results/bench_memory.json
"""
from attnlib.bench._common import environment, format_table, load_results, time_calls
from attnlib.bench.kv_cache import GPT2_SMALL, format_kv_cache, kv_cache_rows
from attnlib.bench.memory import format_memory, memory_rows
from attnlib.bench.mha import MHA_DEFAULTS, format_mha, mha_rows, mha_summary

__all__ = [
    "GPT2_SMALL",
    "MHA_DEFAULTS",
    "environment",
    "format_kv_cache",
    "format_memory",
    "format_mha",
    "format_table",
    "kv_cache_rows",
    "load_results",
    "memory_rows",
    "mha_rows",
    "mha_summary",
    "time_calls",
]
