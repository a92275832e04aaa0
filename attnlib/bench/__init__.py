"""Benchmarks of chapter 15: ``python -m attnlib.bench <name>`` prints a table measured in one run.

* ``mha`` (:func:`mha_rows`): every implementation of causal multi-head attention at GPT-2
  small's size, forward and forward + backward, against a fair SDPA reference.
* ``kv-cache`` (:func:`kv_cache_rows`): tokens/s of generation with and without the KV cache
  for MHA, GQA, MQA and MLA, and the cache's bytes per token (measured and by formula).
* ``memory`` (:func:`memory_rows`): peak memory and time of naive, SDPA and tiled attention
  as the sequence grows.
* ``train`` (:func:`train_rows`): one AdamW step of attnlib's GPT against a GPT built from
  ``nn.TransformerEncoderLayer``, at the book's small model and at 10M parameters (``--modern``:
  and the Llama-style :class:`attnlib.Decoder` of the same sizes).
* ``flash``, ``long-context``, ``serving``: chapters 15, 17 and 19 (:mod:`attnlib.bench.flash`, ...).
* ``hf-llama`` (:func:`hf_llama_rows`): the Llama-style decoder against ``transformers``'
  ``LlamaForCausalLM`` with the same weights: a training step and greedy decoding (needs ``transformers``).
* ``layer-types`` (:func:`layer_types_rows`): decode tokens/s and KV-cache bytes of layer patterns
  (full, sliding, Gemma 3, gpt-oss, Llama 4, Qwen3-Next) at one context.
* ``kv-quant`` (:mod:`attnlib.bench.kv_quant`): bytes per token and the logits' and loss's error of the
  float, bfloat16, int8 and KIVI 4- and 2-bit caches (:meth:`attnlib.cache.KVCache.quantized`).
* ``serving`` also compares prefix caching and chunked prefill on and off (prefill tokens, longest stall).

Each function returns plain dicts (one per table row) so that a notebook can run a
small version. The command line checks every flag first (``error:``, exit 2), prints the
table and writes settings, environment (load average included) and rows to ``--out FILE``
(default ``bench_<name>.json`` in the current directory); :func:`load_results` reads such a
file back. ``--small`` runs a tiny configuration in seconds. Speed is measured here, never
asserted in tests. Full-size runs::

    python -m attnlib.bench mha --out bench_mha.json
    python -m attnlib.bench kv-cache --out bench_kv_cache.json
    python -m attnlib.bench memory --out bench_memory.json
    python -m attnlib.bench train --out bench_train.json
    python -m attnlib.bench hf-llama --out bench_hf_llama.json
    python -m attnlib.bench layer-types --out bench_layer_types.json
"""
from attnlib.bench._common import environment, format_table, load_results, time_after_setup, time_calls
from attnlib.bench.hf_llama import format_hf_llama, hf_llama_rows
from attnlib.bench.kv_cache import GPT2_SMALL, format_kv_cache, kv_cache_rows
from attnlib.bench.layer_types import format_layer_types, layer_types_rows
from attnlib.bench.memory import format_memory, memory_rows
from attnlib.bench.mha import MHA_DEFAULTS, format_mha, mha_rows, mha_summary
from attnlib.bench.train import TRAIN_SIZES, TorchGPT, format_train, train_rows

__all__ = [
    "GPT2_SMALL",
    "MHA_DEFAULTS",
    "TRAIN_SIZES",
    "TorchGPT",
    "environment",
    "format_hf_llama",
    "format_kv_cache",
    "format_layer_types",
    "format_memory",
    "format_mha",
    "format_table",
    "format_train",
    "hf_llama_rows",
    "kv_cache_rows",
    "layer_types_rows",
    "load_results",
    "memory_rows",
    "mha_rows",
    "mha_summary",
    "time_after_setup",
    "time_calls",
    "train_rows",
]
