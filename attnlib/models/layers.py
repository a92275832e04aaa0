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
from attnlib.attention.differential import DifferentialAttention, lambda_init_schedule
from attnlib.attention.kv_reuse import KVReuseAttention
from attnlib.attention.latent import MultiHeadLatentAttention
from attnlib.attention.linear import LinearAttention
from attnlib.attention.mods import alibi, compose, softcap
from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.attention.sparse import GatedAttention
from attnlib.attention.talking_heads import TalkingHeadsAttention
from attnlib.attention.temperature import AttentionTemperature
from attnlib.layers.feedforward import FeedForward, GeGLU, SwiGLU
from attnlib.layers.norms import RMSNorm
from attnlib.models.config import DecoderConfig

__all__ = ["ATTENTION_LAYERS", "build_attention", "build_feedforward", "build_norm", "deltanet_options"]


def _multi_head(config: DecoderConfig, window: int | None, chunk: int | None, rope, layer: int = 0,
                layer_class: type[MultiHeadAttention] = MultiHeadAttention, **options) -> nn.Module:
    score_mod = compose(alibi(config.n_heads) if config.position == "alibi" else None,
                        softcap(config.attn_softcap) if config.attn_softcap is not None else None)
    if config.attn_output_gate:  # Qwen3-Next, Qwen3.5: out_proj(heads ⊙ σ(x W_g)), W_g without a bias of its own
        layer_class, options = GatedAttention, dict(options, gate="elementwise", gate_bias=config.attention_bias)
    if reuses_kv(config):  # Gemma 4: the layer's own sizes; keys as values on full layers; or another layer's K/V
        source, full = config.kv_source(layer), config.layer_types[layer] == "full_attention"
        layer_class = KVReuseAttention
        options = dict(options, kv_source=source, k_eq_v=config.attention_k_eq_v and full and source is None,
                       value_norm=config.value_norm and source is None)
    return layer_class(
        config.d_model, config.n_heads, config.n_kv_heads_of(layer), block_size=config.block_size,
        dropout=config.dropout, bias=config.attention_bias, attn_fn=config.attn_fn, head_dim=config.head_dim_of(layer),
        sliding_window=window,
        chunk_size=chunk, rope=rope, qk_norm=config.qk_norm and (config.qk_norm_type != "l2" or rope is not None),
        norm_eps=config.norm_eps, score_mod=score_mod, qk_norm_type=config.qk_norm_type,  # Llama 4: L2 on RoPE layers
        temperature=AttentionTemperature(config.floor_scale, config.attn_scale)
        if config.attn_temperature_tuning and rope is None else None,  # Llama 4: on its NoPE layers
        scale=config.attention_scale, sinks=config.attention_sinks, **options,
    )


def reuses_kv(config: DecoderConfig) -> bool:
    """Whether the config asks for Gemma 4's attention (:class:`~attnlib.attention.kv_reuse.KVReuseAttention`:
    per-layer sizes, keys as values, the value norm, or another layer's keys and values)."""
    return bool(config.num_kv_shared_layers or config.attention_k_eq_v or config.value_norm
                or config.global_head_dim is not None or config.global_n_kv_heads is not None)


def _talking_heads(config: DecoderConfig, window: int | None, chunk: int | None, rope, layer: int = 0) -> nn.Module:
    return TalkingHeadsAttention(config.d_model, config.n_heads, block_size=config.block_size, dropout=config.dropout,
                                 bias=config.attention_bias, sliding_window=window, chunk_size=chunk)


def _latent(config: DecoderConfig, window: int | None, chunk: int | None, rope, layer: int = 0) -> nn.Module:
    return MultiHeadLatentAttention(config.d_model, config.n_heads, config.kv_latent_dim, block_size=config.block_size,
                                    dropout=config.dropout, bias=config.attention_bias, attn_fn=config.attn_fn,
                                    sliding_window=window, chunk_size=chunk)


def _differential(config: DecoderConfig, window: int | None, chunk: int | None, rope, layer: int = 0) -> nn.Module:
    """DiffLlama's attention: multi-head attention's settings, ``λ_init`` from the layer's index (chapter 20)."""
    return _multi_head(config, window, chunk, rope, layer, DifferentialAttention, lambda_init=lambda_init_schedule(layer))


#: The softmax layers a config's ``attention`` names, as builders ``(config, window, chunk, rope, layer=0) -> module``
#: (``layer``: the index, which differential attention's λ schedule reads).
#: MHA, GQA and MQA are one class with different ``n_kv_heads`` (``config.n_kv_heads``).
ATTENTION_LAYERS: dict[str, Callable[..., nn.Module]] = {
    "mha": _multi_head,  # n_kv_heads = n_heads
    "talking_heads": _talking_heads,
    "mqa": _multi_head,  # n_kv_heads = 1
    "gqa": _multi_head,  # n_kv_heads from the config
    "mla": _latent,
    "differential": _differential,
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
        options = deltanet_options(config)  # {} for chapter 18's layers
        return LINEAR_LAYER_CLASSES[config.linear_layer](config.d_model, options.pop("n_heads", config.n_heads),
                                                         block_size=config.block_size, dropout=config.dropout,
                                                         bias=config.attention_bias, **options)
    window = config.sliding_window if kind == "sliding_attention" else None
    chunk = config.attention_chunk_size if kind == "chunked_attention" else None
    return ATTENTION_LAYERS[config.attention](config, window, chunk, rope, layer)


def deltanet_options(config: DecoderConfig) -> dict:
    """The gated DeltaNet options a config sets (chapter 21): none for chapter 18's layer; with a
    ``linear_conv_kernel_dim``, Qwen3.5's (its convolution, ``norm_eps`` on the gated norm, fla's L2 norm); the
    ``linear_*`` head counts and widths that are given."""
    options = {name: getattr(config, field) for name, field in (
        ("n_v_heads", "linear_num_value_heads"), ("head_k_dim", "linear_key_head_dim"),
        ("head_v_dim", "linear_value_head_dim")) if getattr(config, field) is not None}
    if config.linear_num_key_heads is not None:
        options["n_heads"] = config.linear_num_key_heads
    if config.linear_conv_kernel_dim is not None:
        options.update(conv_size=config.linear_conv_kernel_dim, norm_eps=config.norm_eps, l2norm="fla")
    return options


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
