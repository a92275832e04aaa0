"""Generation: one step, and the loops that drive it. Chapters 08, 12, 19.

* :mod:`~attnlib.generation.step`: :func:`step` (new tokens → next-token logits) and :func:`window_step`;
* :func:`generate`: greedy decoding and sampling (chapters 08, 12);
* :func:`beam_search` (chapter 08); :func:`speculative_generate` (chapter 19);
* :mod:`~attnlib.generation.sampling`: temperature, top-k, top-p (chapter 12);
* :mod:`~attnlib.generation.checks`: what every loop checks before it runs.

Continuous batching, the fourth loop, serves many requests: :func:`attnlib.serving.serve`.
"""
from attnlib.generation.beam import beam_search
from attnlib.generation.generate import generate
from attnlib.generation.sampling import sample_next_token, top_k_filter, top_p_filter
from attnlib.generation.speculative import speculative_generate, verify_drafts
from attnlib.generation.step import step, window_step

__all__ = [
    "beam_search",
    "generate",
    "sample_next_token",
    "speculative_generate",
    "step",
    "top_k_filter",
    "top_p_filter",
    "verify_drafts",
    "window_step",
]
