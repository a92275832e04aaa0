"""Serving: batched generation with padding and continuous batching. Chapter 19.

:func:`left_pad` makes one batch of prompts of different lengths (the model takes its
``attention_mask``); :func:`serve` runs continuous batching on a paged KV cache
(:class:`attnlib.cache.PagedKVCache`). Speculative decoding is :func:`attnlib.generation.speculative_generate`.
"""
from attnlib.serving.batching import cache_memory, request_lengths, serve
from attnlib.serving.padding import left_pad

__all__ = ["cache_memory", "left_pad", "request_lengths", "serve"]
