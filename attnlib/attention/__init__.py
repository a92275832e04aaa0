"""Attention modules and the registry that lets a :class:`attnlib.GPTConfig` choose one.

``ATTENTION_REGISTRY`` maps a name to a class built as ``cls(config)`` that maps
``(B, T, d_model)`` → ``(B, T, d_model)`` causally; each class also has a
``kv_cache_size(config)``: the numbers a KV cache keeps per token and layer.
"""
from attnlib.attention.cross import CrossAttention
from attnlib.attention.grouped_query import KV_SHARING, GroupedQueryAttention, MultiQueryAttention
from attnlib.attention.latent import MultiHeadLatentAttention
from attnlib.attention.multi_head import BACKENDS, AttentionBase, CausalSelfAttention, MultiHeadAttention
from attnlib.attention.talking_heads import BiasedTalkingHeadsAttention, TalkingHeadsAttention
from attnlib.attention.target import TargetAttention
from attnlib.attention.teaching import CausalAttention, MultiHeadAttentionWrapper, SelfAttentionV1, SelfAttentionV2
from attnlib.attention.tiled import online_softmax, online_softmax_update, tiled_attention

ATTENTION_REGISTRY: dict[str, type[AttentionBase]] = {
    "mha": CausalSelfAttention,
    "talking_heads": TalkingHeadsAttention,
    "mqa": MultiQueryAttention,
    "gqa": GroupedQueryAttention,
    "mla": MultiHeadLatentAttention,
}

__all__ = [
    "ATTENTION_REGISTRY",
    "BACKENDS",
    "KV_SHARING",
    "AttentionBase",
    "BiasedTalkingHeadsAttention",
    "CausalAttention",
    "CausalSelfAttention",
    "CrossAttention",
    "GroupedQueryAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "MultiQueryAttention",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "TalkingHeadsAttention",
    "TargetAttention",
    "online_softmax",
    "online_softmax_update",
    "tiled_attention",
]
