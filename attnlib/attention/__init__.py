"""Attention: the functions (one signature, by name), their masks, and the layers built on them.

* functions, one signature ``(q, k, v, mask=None, *, is_causal, scale, dropout_p, score_mod) -> (output,
  weights)``, by name in :data:`ATTENTION_FUNCTIONS`: :func:`attention` (eager, chapters 02–04),
  :func:`sdpa_attention`, :func:`tiled_attention` and :func:`flash_attention` (chapter 15);
* masks and mask/score modifications: :mod:`~attnlib.attention.masks` (chapter 03),
  :mod:`~attnlib.attention.mods` (windows, chunks, ALiBi, soft-capping; chapter 17);
* layers: :class:`MultiHeadAttention` (MHA, GQA, MQA, cross-attention, RoPE, QK-norm, windows;
  chapters 04, 06, 09, 16, 17), :class:`TalkingHeadsAttention` (05), :class:`MultiHeadLatentAttention`
  (07), the single heads of chapters 02–04 (:mod:`~attnlib.attention.teaching`), and chapter 18's
  :class:`LinearAttention`, :class:`GatedDeltaNet`, :class:`GatedAttention`, :class:`TopKAttention`; chapter 20's
  :class:`DifferentialAttention`; chapter 21's :class:`KimiDeltaAttention` (:func:`kimi_delta_rule`),
  :class:`CompressedAttention` (DeepSeek-V4's CSA / HCA).
"""
from attnlib.attention.compressed import CompressedAttention
from attnlib.attention.deltanet import GatedDeltaNet, gated_delta_rule
from attnlib.attention.differential import DifferentialAttention, lambda_init_schedule
from attnlib.attention.flash import flash_attention
from attnlib.attention.functions import attention, check_attention_inputs, sdpa_attention
from attnlib.attention.kda import KimiDeltaAttention, kimi_delta_rule
from attnlib.attention.latent import MultiHeadLatentAttention
from attnlib.attention.linear import FEATURE_MAPS, LinearAttention, linear_attention
from attnlib.attention.masks import (
    causal_mask,
    check_attention_mask,
    combined_mask,
    mask_from_mod,
    mask_positions,
    masked_softmax,
    padding_mask,
)
from attnlib.attention.multi_head import KV_SHARING, MultiHeadAttention
from attnlib.attention.registry import ATTENTION_FUNCTIONS, get_attention_function
from attnlib.attention.sparse import GatedAttention, LightningIndexer, TopKAttention, topk_attention, topk_mask
from attnlib.attention.talking_heads import BiasedTalkingHeadsAttention, TalkingHeadsAttention
from attnlib.attention.teaching import CausalAttention, MultiHeadAttentionWrapper, SelfAttentionV1, SelfAttentionV2
from attnlib.attention.tiled import online_softmax, online_softmax_update, tiled_attention

__all__ = [
    "ATTENTION_FUNCTIONS",
    "FEATURE_MAPS",
    "KV_SHARING",
    "BiasedTalkingHeadsAttention",
    "CausalAttention",
    "CompressedAttention",
    "DifferentialAttention",
    "GatedAttention",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "LightningIndexer",
    "LinearAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "TalkingHeadsAttention",
    "TopKAttention",
    "attention",
    "causal_mask",
    "check_attention_inputs",
    "check_attention_mask",
    "combined_mask",
    "flash_attention",
    "gated_delta_rule",
    "kimi_delta_rule",
    "get_attention_function",
    "lambda_init_schedule",
    "linear_attention",
    "mask_from_mod",
    "mask_positions",
    "masked_softmax",
    "online_softmax",
    "online_softmax_update",
    "padding_mask",
    "sdpa_attention",
    "tiled_attention",
    "topk_attention",
    "topk_mask",
]
