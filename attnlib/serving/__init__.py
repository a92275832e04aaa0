"""Serving: batched generation with padding, a paged KV cache, continuous batching. Chapter 19.

Speculative decoding is :func:`attnlib.generate.speculative_generate` (:mod:`attnlib.speculative`).
"""
from attnlib.serving.batching import cache_memory, request_lengths, serve
from attnlib.serving.padding import check_attention_mask, left_pad, mask_positions
from attnlib.serving.paged import OutOfPages, PageAllocator, PagedKVCache, PagedLayerCache

__all__ = [
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
    "PagedLayerCache",
    "cache_memory",
    "check_attention_mask",
    "left_pad",
    "mask_positions",
    "request_lengths",
    "serve",
]
