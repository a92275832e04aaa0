"""The attention functions by name (Hugging Face's ``AttentionInterface`` pattern). Chapters 02, 15.

Every entry has one signature::

    fn(q, k, v, mask=None, *, is_causal=False, scale=None, dropout_p=0.0, score_mod=None, sinks=None)
        -> (output, weights or None)

and refuses the same bad inputs (:func:`attnlib.attention.functions.check_attention_inputs`) before
any kernel runs. A layer stores the name (``attn_fn="sdpa"``) and looks the function up when it
attends. A function that cannot do what it is asked (SDPA and flash cannot modify scores; SDPA cannot
add learned ``sinks`` to its softmax, chapter 20; tiled and flash have no dropout) raises a ``ValueError``
naming the argument.
"""
from __future__ import annotations

from collections.abc import Callable

from attnlib.attention.flash import flash_attention
from attnlib.attention.functions import attention, sdpa_attention
from attnlib.attention.tiled import tiled_attention

__all__ = ["ATTENTION_FUNCTIONS", "get_attention_function"]

ATTENTION_FUNCTIONS: dict[str, Callable] = {
    "eager": attention,  # readable, returns the weights (chapters 02-04)
    "sdpa": sdpa_attention,  # torch.nn.functional.scaled_dot_product_attention (fused kernels)
    "tiled": tiled_attention,  # the online softmax, tile by tile (chapter 15)
    "flash": flash_attention,  # tiled, with FlashAttention's backward from the log-sum-exp (chapter 15)
}


def get_attention_function(name: str) -> Callable:
    """The attention function registered as ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not isinstance(name, str) or name not in ATTENTION_FUNCTIONS:
        raise ValueError(f"attn_fn={name!r} is not one of {sorted(ATTENTION_FUNCTIONS)}")
    return ATTENTION_FUNCTIONS[name]
