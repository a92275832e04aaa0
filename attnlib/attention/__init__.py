"""Attention: the functions (one signature, by name) and the modules built on them.

:data:`ATTENTION_FUNCTIONS` maps ``"eager"``, ``"sdpa"``, ``"tiled"`` to functions
``(q, k, v, mask=None, *, is_causal, scale, dropout_p, score_mod) -> (output, weights)``;
:data:`ATTENTION_REGISTRY` maps a :class:`attnlib.GPTConfig`'s ``attention`` name to a
builder of the layer.
"""
from attnlib.attention.deltanet import GatedDeltaNet, gated_delta_rule
from attnlib.attention.flash import flash_attention
from attnlib.attention.functions import ATTENTION_FUNCTIONS, get_attention_function
from attnlib.attention.latent import MultiHeadLatentAttention
from attnlib.attention.linear import FEATURE_MAPS, LinearAttention, linear_attention
from attnlib.attention.multi_head import KV_SHARING, MultiHeadAttention
from attnlib.attention.registry import ATTENTION_REGISTRY, build_attention
from attnlib.attention.rotary import RotaryAttention
from attnlib.attention.sparse import GatedAttention, LightningIndexer, TopKAttention, topk_attention, topk_mask
from attnlib.attention.talking_heads import BiasedTalkingHeadsAttention, TalkingHeadsAttention
from attnlib.attention.target import TargetAttention
from attnlib.attention.teaching import CausalAttention, MultiHeadAttentionWrapper, SelfAttentionV1, SelfAttentionV2
from attnlib.attention.tiled import online_softmax, online_softmax_update, tiled_attention

__all__ = [
    "ATTENTION_FUNCTIONS",
    "ATTENTION_REGISTRY",
    "KV_SHARING",
    "BiasedTalkingHeadsAttention",
    "CausalAttention",
    "FEATURE_MAPS",
    "GatedAttention",
    "GatedDeltaNet",
    "LightningIndexer",
    "LinearAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "RotaryAttention",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "TalkingHeadsAttention",
    "TargetAttention",
    "TopKAttention",
    "build_attention",
    "flash_attention",
    "gated_delta_rule",
    "get_attention_function",
    "linear_attention",
    "online_softmax",
    "online_softmax_update",
    "tiled_attention",
    "topk_attention",
    "topk_mask",
]
