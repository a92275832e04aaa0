"""The attention variants a :class:`attnlib.GPTConfig` can name, each built with explicit sizes.

``ATTENTION_REGISTRY[name](config)`` returns a causal attention layer mapping
``(B, T, d_model)`` → ``(B, T, d_model)``; :func:`build_attention` looks the name up.
MHA, GQA and MQA are one class with different ``n_kv_heads`` (``config.kv_heads``).
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from attnlib.attention.latent import MultiHeadLatentAttention
from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.attention.talking_heads import TalkingHeadsAttention
from attnlib.config import GPTConfig

__all__ = ["ATTENTION_REGISTRY", "build_attention"]


def _multi_head(config: GPTConfig) -> MultiHeadAttention:
    return MultiHeadAttention(
        config.d_model, config.n_heads, config.kv_heads, block_size=config.block_size, dropout=config.dropout, bias=config.bias,
        sliding_window=config.sliding_window,
    )


def _talking_heads(config: GPTConfig) -> TalkingHeadsAttention:
    return TalkingHeadsAttention(
        config.d_model, config.n_heads, block_size=config.block_size, dropout=config.dropout, bias=config.bias,
        sliding_window=config.sliding_window,
    )


def _latent(config: GPTConfig) -> MultiHeadLatentAttention:
    return MultiHeadLatentAttention(
        config.d_model, config.n_heads, config.latent_dim, block_size=config.block_size, dropout=config.dropout, bias=config.bias,
        sliding_window=config.sliding_window,
    )


ATTENTION_REGISTRY: dict[str, Callable[[GPTConfig], nn.Module]] = {
    "mha": _multi_head,  # n_kv_heads = n_heads
    "talking_heads": _talking_heads,
    "mqa": _multi_head,  # n_kv_heads = 1
    "gqa": _multi_head,  # n_kv_heads from the config
    "mla": _latent,
}


def build_attention(config: GPTConfig) -> nn.Module:
    """The attention layer ``config.attention`` names, built from ``config``'s sizes.

    Raises:
        TypeError: ``config`` not a :class:`attnlib.GPTConfig`.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be an attnlib.GPTConfig; got {type(config).__name__}")
    return ATTENTION_REGISTRY[config.attention](config)
