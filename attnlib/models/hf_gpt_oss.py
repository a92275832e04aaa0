"""gpt-oss's attention layer in attnlib: learned sinks, alternating sliding and full layers, YaRN. Chapter 20.

``transformers``' ``GptOssAttention`` is Llama's attention (separate ``q_proj``, ``k_proj``, ``v_proj``
with biases, grouped-query heads, half-split RoPE) plus one learned logit per query head, ``sinks``
(passed to the attention function as ``s_aux``), that joins each row's softmax denominator and is
dropped: :class:`~attnlib.attention.MultiHeadAttention` with ``sinks=True``. Its layers alternate a
sliding window (128 in the released models) and full attention (``config.layer_types``), and its RoPE
is YaRN (``rope_parameters``), which :class:`~attnlib.positional.RotaryEmbedding` reproduces with
``rope_scaling``. gpt-oss's feed-forward is a mixture of experts, outside this book: parity is per
attention layer. (Learned sinks are not StreamingLLM's sink tokens, :class:`~attnlib.cache.SinkLayerCache`.)

Settings attnlib cannot reproduce are refused with a ``ValueError`` naming them.
"""
from __future__ import annotations

import torch

from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.models.hf_llama import _int_field as _size
from attnlib.models.hf_llama import config_getter, rope_parameters
from attnlib.positional.rotary import RotaryEmbedding
from attnlib.positional.scaling import ROPE_TYPES

__all__ = ["attention_from_hf", "rope_from_hf_gpt_oss"]


def _getter(config):
    if config is None or isinstance(config, (str, bytes, int, float, list, tuple)):
        raise TypeError(f"config must be a transformers GptOssConfig or its dict; got {type(config).__name__}")
    return config_getter(config)


def rope_from_hf_gpt_oss(config) -> RotaryEmbedding:
    """The :class:`~attnlib.positional.RotaryEmbedding` of a gpt-oss config: ``head_dim`` wide, base
    ``rope_parameters["rope_theta"]``, the rest of ``rope_parameters`` (YaRN in the released models) as
    ``rope_scaling``, over ``max_position_embeddings`` positions.

    Raises:
        TypeError: ``config`` neither a config object nor a mapping.
        ValueError: a RoPE type or field attnlib does not reproduce (partial rotary, an unknown type), a size
            that is not an int >= 1, a ``rope_theta`` that is not a number; named.
    """
    get = _getter(config)
    n_heads, d_model = _size(get, "num_attention_heads"), _size(get, "hidden_size")
    head_dim = _size(get, "head_dim", optional=True) or d_model // n_heads
    theta, kind, rope = rope_parameters(get, 150000.0)
    if not isinstance(kind, str) or kind not in ROPE_TYPES or "partial_rotary_factor" in rope \
            or get("partial_rotary_factor", None) not in (None, 1, 1.0):
        raise ValueError(f"cannot reproduce rope_parameters={get('rope_parameters', None)!r}: attnlib reproduces "
                         f"the RoPE types {sorted(ROPE_TYPES)} on whole heads")
    return RotaryEmbedding(head_dim, float(theta), None if kind == "default" else rope,
                           _size(get, "max_position_embeddings"))


def attention_from_hf(module: torch.nn.Module, config=None, *, attn_fn: str = "eager",
                      rope: RotaryEmbedding | None = None) -> MultiHeadAttention:
    """An attnlib :class:`~attnlib.attention.MultiHeadAttention` equal to one ``transformers`` ``GptOssAttention``.

    ``q_proj``, ``k_proj``, ``v_proj`` are stacked into ``qkv`` (rows ``[W_q; W_k; W_v]``, biases likewise),
    ``o_proj`` becomes ``out_proj``, ``sinks`` is copied; the layer's type (``config.layer_types[layer_idx]``)
    gives it ``config.sliding_window`` or full attention, and its RoPE is :func:`rope_from_hf_gpt_oss`'s.
    Its ``forward(x)`` equals the module's ``forward(x, position_embeddings, mask)`` (the causal or
    sliding-window mask of the layer's type; positions ``0, 1, …``), 1e-5 in float32, with gradients.

    Args:
        module: a ``GptOssAttention`` (its ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``sinks``, ``layer_idx``).
        config: its ``GptOssConfig`` (or dict); default ``module.config``.
        attn_fn: ``"eager"``, ``"tiled"`` or ``"flash"`` (``"sdpa"`` cannot add the sinks).
        rope: a :class:`~attnlib.positional.RotaryEmbedding` to share between layers; default a new one.

    Returns:
        the layer, causal, in the module's dtype and on its device.

    Raises:
        TypeError: ``module`` not a ``torch.nn.Module``; ``config`` neither a config nor a mapping.
        ValueError: what attnlib cannot reproduce, named: ``attention_dropout`` > 0 (attnlib's layer would drop
            its output too), a layer type other than ``"full_attention"`` / ``"sliding_attention"``, a sliding
            layer without a ``sliding_window``, a RoPE setting (:func:`rope_from_hf_gpt_oss`), ``attn_fn='sdpa'``;
            a module without sinks or whose weights do not have the config's shapes.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a transformers GptOssAttention; got {type(module).__name__}")
    config = getattr(module, "config", None) if config is None else config
    get = _getter(config)
    n_heads, d_model = _size(get, "num_attention_heads"), _size(get, "hidden_size")
    n_kv_heads = _size(get, "num_key_value_heads", optional=True) or n_heads
    head_dim = _size(get, "head_dim", optional=True) or d_model // n_heads
    if get("attention_dropout", 0.0):
        raise ValueError(f"cannot reproduce attention_dropout={get('attention_dropout')!r}: attnlib's layer drops "
                         "its output as well as its weights; use 0.0")
    layer = getattr(module, "layer_idx", None)
    types = get("layer_types", None)
    kind = types[layer] if types is not None and isinstance(layer, int) and 0 <= layer < len(types) else "full_attention"
    if kind not in ("full_attention", "sliding_attention"):
        raise ValueError(f"cannot reproduce layer_types[{layer}]={kind!r}: expected 'full_attention' or 'sliding_attention'")
    window = _size(get, "sliding_window") if kind == "sliding_attention" else None
    rope = rope_from_hf_gpt_oss(config) if rope is None else rope
    if attn_fn == "sdpa":
        raise ValueError("attn_fn='sdpa' cannot add gpt-oss's sinks to its softmax; use 'eager', 'tiled' or 'flash'")
    parts = {name: getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "sinks")}
    if any(p is None for p in parts.values()):
        raise ValueError(f"module lacks {[n for n, p in parts.items() if p is None]}: not a GptOssAttention")
    bias = parts["q_proj"].bias is not None
    ours = MultiHeadAttention(d_model, n_heads, n_kv_heads, block_size=_size(get, "max_position_embeddings"),
                              bias=bias, attn_fn=attn_fn, head_dim=head_dim, sliding_window=window, rope=rope, sinks=True)
    own = ours.state_dict()
    with torch.no_grad():
        theirs = {"qkv.weight": torch.cat([parts[x].weight for x in ("q_proj", "k_proj", "v_proj")]),
                  "out_proj.weight": parts["o_proj"].weight, "sinks": parts["sinks"]}
        if bias:
            theirs["qkv.bias"] = torch.cat([parts[x].bias for x in ("q_proj", "k_proj", "v_proj")])
            theirs["out_proj.bias"] = parts["o_proj"].bias
    for name, value in theirs.items():
        if value is None or tuple(value.shape) != tuple(own[name].shape):
            raise ValueError(f"{name} from the module has shape {None if value is None else tuple(value.shape)}; "
                             f"the config expects {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, value in theirs.items():
            own[name].copy_(value)
    return ours.to(device=parts["sinks"].device, dtype=parts["o_proj"].weight.dtype)
