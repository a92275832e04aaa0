"""Serving: batched generation with padding, a paged KV cache, continuous batching. Chapter 19.

Speculative decoding is :func:`attnlib.generate.speculative_generate` (:mod:`attnlib.speculative`).
"""
from attnlib.serving.padding import check_attention_mask, left_pad, mask_positions

__all__ = ["check_attention_mask", "left_pad", "mask_positions"]
