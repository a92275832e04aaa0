"""The parts of a decoder block, built from a :class:`~attnlib.models.config.DecoderConfig` for one layer.

:data:`ATTENTION_LAYERS` maps a config's ``attention`` (chapter 13's variants) to a builder of the
softmax layer; :func:`build_attention` picks by the layer's type (``config.layer_types[layer]``):
full, sliding-window or chunked softmax attention with that layer's RoPE, or a linear layer.
:func:`build_norm` and :func:`build_feedforward` make the block's other parts.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from attnlib.attention.deltanet import GatedDeltaNet
from attnlib.attention.latent import MultiHeadLatentAttention
from attnlib.attention.linear import LinearAttention
from attnlib.attention.mods import alibi, compose, softcap
from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.attention.talking_heads import TalkingHeadsAttention
from attnlib.layers.feedforward import FeedForward, GeGLU, SwiGLU
from attnlib.layers.norms import RMSNorm
from attnlib.models.config import DecoderConfig

__all__ = ["ATTENTION_LAYERS", "build_attention", "build_feedforward", "build_norm"]


def _multi_head(config: DecoderConfig, window: int | None, chunk: int | None, rope) -> nn.Module:
    score_mod = compose(alibi(config.n_heads) if config.position == "alibi" else None,
                        softcap(config.attn_softcap) if config.attn_softcap is not None else None)
    return MultiHeadAttention(
        config.d_model, config.n_heads, config.n_kv_heads, block_size=config.block_size, dropout=config.dropout,
        bias=config.attention_bias, attn_fn=config.attn_fn, head_dim=config.head_dim, sliding_window=window,
        chunk_size=chunk, rope=rope, qk_norm=config.qk_norm, norm_eps=config.norm_eps, score_mod=score_mod,
        scale=config.attention_scale, sinks=config.attention_sinks,
    )


def _talking_heads(config: DecoderConfig, window: int | None, chunk: int | None, rope) -> nn.Module:
    return TalkingHeadsAttention(config.d_model, config.n_heads, block_size=config.block_size, dropout=config.dropout,
                                 bias=config.attention_bias, sliding_window=window, chunk_size=chunk)


def _latent(config: DecoderConfig, window: int | None, chunk: int | None, rope) -> nn.Module:
    return MultiHeadLatentAttention(config.d_model, config.n_heads, config.kv_latent_dim, block_size=config.block_size,
                                    dropout=config.dropout, bias=config.attention_bias, attn_fn=config.attn_fn,
                                    sliding_window=window, chunk_size=chunk)


#: The softmax layers a config's ``attention`` names, as builders ``(config, window, chunk, rope) -> layer``.
#: MHA, GQA and MQA are one class with different ``n_kv_heads`` (``config.n_kv_heads``).
ATTENTION_LAYERS: dict[str, Callable[..., nn.Module]] = {
    "mha": _multi_head,  # n_kv_heads = n_heads
    "talking_heads": _talking_heads,
    "mqa": _multi_head,  # n_kv_heads = 1
    "gqa": _multi_head,  # n_kv_heads from the config
    "mla": _latent,
}
LINEAR_LAYER_CLASSES = {"gated_deltanet": GatedDeltaNet, "linear": LinearAttention}


def build_attention(config: DecoderConfig, layer: int, rope=None) -> nn.Module:
    """Layer ``layer``'s attention: its type's (``config.layer_types[layer]``) with ``rope`` (None: no RoPE).

    Raises:
        TypeError: ``config`` not a :class:`~attnlib.models.config.DecoderConfig`.
    """
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be an attnlib.DecoderConfig; got {type(config).__name__}")
    kind = config.layer_types[layer]
    if kind == "linear_attention":
        return LINEAR_LAYER_CLASSES[config.linear_layer](config.d_model, config.n_heads, block_size=config.block_size,
                                                         dropout=config.dropout, bias=config.attention_bias)
    window = config.sliding_window if kind == "sliding_attention" else None
    chunk = config.attention_chunk_size if kind == "chunked_attention" else None
    return ATTENTION_LAYERS[config.attention](config, window, chunk, rope)


def build_norm(config: DecoderConfig) -> nn.Module:
    """The config's norm over ``d_model``: ``nn.LayerNorm`` (one fused kernel) or attnlib's RMSNorm (equal to
    ``transformers``' Llama/Qwen3 RMSNorm bit for bit)."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
    return RMSNorm(config.d_model, config.norm_eps)


def build_feedforward(config: DecoderConfig) -> nn.Module:
    """The config's feed-forward block: GELU MLP (``fc``, ``proj``), SwiGLU or GeGLU (``gate``, ``up``, ``down``)."""
    if config.feedforward == "gelu":
        return FeedForward(config.d_model, config.d_ff, config.dropout, config.gelu_approximate, config.mlp_bias)
    block = SwiGLU if config.feedforward == "swiglu" else GeGLU
    return block(config.d_model, config.d_ff, bias=config.mlp_bias, dropout=config.dropout)
