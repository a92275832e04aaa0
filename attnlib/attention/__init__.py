"""Attention modules and the registry that lets a :class:`attnlib.GPTConfig` choose one.

``ATTENTION_REGISTRY`` maps a name to a class built as ``cls(config)`` that maps
``(B, T, d_model)`` → ``(B, T, d_model)`` causally.
"""
from attnlib.attention.multi_head import BACKENDS, CausalSelfAttention, MultiHeadAttention
from attnlib.attention.teaching import CausalAttention, MultiHeadAttentionWrapper, SelfAttentionV1, SelfAttentionV2

ATTENTION_REGISTRY: dict[str, type] = {
    "mha": CausalSelfAttention,
}

__all__ = [
    "ATTENTION_REGISTRY",
    "BACKENDS",
    "CausalAttention",
    "CausalSelfAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttentionV1",
    "SelfAttentionV2",
]
