"""Loading ``transformers``' DeepSeek-V4 attention modules into :class:`~attnlib.attention.CompressedAttention`. Chapter 21.

Only the attention: a V4 decoder layer also has manifold-constrained hyper-connections (``hc_mult``
residual streams) and a hash / top-k routed mixture of experts, which attnlib does not build. The
parameter names are ``transformers``' (the indexer sits beside the compressor here, not inside it), so
the state dict loads as it is, strictly. Settings this layer cannot reproduce are refused with a
``ValueError`` naming them.
"""
from __future__ import annotations

import torch

from attnlib.attention.compressed import LAYER_TYPES, CompressedAttention

__all__ = ["compressed_attention_kwargs", "from_hf_deepseek_v4_attention"]


def compressed_attention_kwargs(config, layer_type: str) -> dict:
    """:class:`CompressedAttention`'s arguments from a ``DeepseekV4Config`` for a layer of ``layer_type``.

    Raises:
        ValueError: ``layer_type`` not one of V4's; a RoPE other than the default (``rope_parameters``; YaRN
            allowed on the compressed layers, as V4 ships it); ``num_key_value_heads != 1``.
    """
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type={layer_type!r} is not one of {LAYER_TYPES}")
    rope = config.rope_parameters
    for label, allowed in (("main", ("default",)), ("compress", ("default", "yarn"))):
        kind = rope[label].get("rope_type", "default")
        if kind not in allowed:
            raise ValueError(f"rope_parameters[{label!r}] rope_type={kind!r}: only {allowed} are reproduced")
    scaling = None
    if rope["compress"].get("rope_type") == "yarn":  # attnlib's RoPE takes the scaling alone (its angles only)
        scaling = {k: v for k, v in rope["compress"].items() if k not in ("rope_theta", "partial_rotary_factor")}
    if config.num_key_value_heads != 1:
        raise ValueError(f"num_key_value_heads={config.num_key_value_heads}: V4 shares one key/value head")
    return dict(layer_type=layer_type, q_lora_rank=config.q_lora_rank, rope_head_dim=config.qk_rope_head_dim,
                o_groups=config.o_groups, o_lora_rank=config.o_lora_rank, sliding_window=config.sliding_window,
                compress_rate=config.compress_rates.get(layer_type), index_n_heads=config.index_n_heads,
                index_head_dim=config.index_head_dim, index_topk=config.index_topk,
                rope_theta=float(rope["main"]["rope_theta"]), compress_rope_theta=float(rope["compress"]["rope_theta"]),
                compress_rope_scaling=scaling, eps=config.rms_norm_eps)


def from_hf_deepseek_v4_attention(module: torch.nn.Module) -> CompressedAttention:
    """A :class:`CompressedAttention` equal to ``module``, a ``transformers`` ``DeepseekV4Attention``, its weights copied.

    Raises:
        ValueError: see :func:`compressed_attention_kwargs`; a module without ``config`` and ``layer_type``.
    """
    config, layer_type = getattr(module, "config", None), getattr(module, "layer_type", None)
    if config is None or layer_type is None:
        raise ValueError(f"module must be a transformers DeepseekV4Attention; got {type(module).__name__}")
    layer = CompressedAttention(config.hidden_size, config.num_attention_heads, config.head_dim,
                                **compressed_attention_kwargs(config, layer_type))
    state = {key.replace("compressor.indexer.scorer.", "indexer.").replace("compressor.indexer.", "indexer."): value
             for key, value in module.state_dict().items()}
    layer.load_state_dict(state, strict=True)
    weight = module.q_a_proj.weight
    return layer.to(device=weight.device, dtype=weight.dtype)
