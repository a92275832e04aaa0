"""Llama 4's attention, layer by layer, from ``transformers``' ``Llama4TextAttention``. Chapter 20.

Llama 4 mixes two kinds of softmax layer (Meta's Llama 4 release, 2025; ``transformers``' ``modeling_llama4``):

* RoPE layers (``no_rope_layers[i] == 1``): **chunked attention** (a query sees only the keys of its own chunk
  of ``attention_chunk_size`` positions, ``"chunked_attention"``) and, with ``use_qk_norm``, an L2 QK-norm
  without weight (:class:`~attnlib.attention.temperature.L2Norm`);
* NoPE layers (every ``no_rope_layer_interval``-th): full attention, no RoPE, and with
  ``attn_temperature_tuning`` queries scaled by ``log(floor((p + 1) / floor_scale) + 1) · attn_scale + 1``
  (:class:`~attnlib.attention.temperature.AttentionTemperature`).

Its feed-forward is a mixture of experts, outside this book: :func:`config_from_hf_llama4` gives a *dense*
:class:`~attnlib.DecoderConfig` with Llama 4's attention pattern (SwiGLU of ``intermediate_size_mlp``), and
:func:`attention_from_hf` loads one attention layer, equal to ``transformers``' (1e-5 in float32).

Llama 4 rotates *interleaved* pairs (a complex view); the rows of ``W_q`` and ``W_k`` of its RoPE layers are
reordered once (:func:`~attnlib.positional.rotary.interleaved_to_half_split`), so that attnlib's half-split
RoPE gives the same scores. Differences by design: attnlib's L2 QK-norm comes before RoPE (a rotation keeps
the norm: equal to rounding), and its temperature uses the ``positions`` a caller gives (a left-padded row
counts from its first real token, as its RoPE and chunks do), where ``transformers`` uses the index in the
padded sequence; without padding they agree.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib.models.config import DecoderConfig
from attnlib.models.hf_llama import config_getter
from attnlib.models.layers import build_attention
from attnlib.positional.rotary import RotaryEmbedding, interleaved_to_half_split
from attnlib.positional.scaling import ROPE_TYPES

__all__ = ["attention_from_hf", "config_from_hf_llama4"]


def _int(get, name: str) -> int:
    value = get(name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1 (the config's {name})")
    return value


def _bool(get, name: str, default: bool) -> bool:
    value = get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a bool (true/false)")
    return value


def _rope_flags(get, n_layers: int) -> list[int]:
    """``no_rope_layers`` as ``transformers`` builds it (1: the layer uses RoPE; empty or None: every
    ``no_rope_layer_interval``-th layer without)."""
    flags = get("no_rope_layers", None)
    if not flags:
        interval = _int(get, "no_rope_layer_interval")
        return [int((i + 1) % interval != 0) for i in range(n_layers)]
    if isinstance(flags, (str, bytes)) or not hasattr(flags, "__iter__"):
        raise ValueError(f"no_rope_layers={flags!r} must be a list of 0/1, one per layer (1: the layer uses RoPE)")
    flags = list(flags)
    if len(flags) < n_layers or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise ValueError(f"no_rope_layers={flags!r} must give 0 or 1 for each of the {n_layers} layers")
    return flags


def config_from_hf_llama4(hf_config) -> DecoderConfig:
    """A dense :class:`~attnlib.DecoderConfig` with the attention of a ``transformers`` ``Llama4TextConfig``.

    Layer types, chunk size, NoPE layers (``no_rope_layers``: 0 = no RoPE), L2 QK-norm on the RoPE layers
    (``use_qk_norm`` → ``qk_norm=True, qk_norm_type="l2"``), temperature tuning on the NoPE layers; the
    feed-forward is a SwiGLU of ``intermediate_size_mlp`` on every layer (Llama 4's dense layers; its experts are
    not built). A ``use_qk_norm`` without RoPE layers, or a temperature tuning without NoPE layers, does nothing in
    ``transformers`` and is left off.

    Args:
        hf_config: a ``Llama4TextConfig`` or its dict (the text part: ``Llama4Config.text_config``).

    Raises:
        TypeError: neither a mapping nor a config object.
        ValueError: a setting attnlib cannot reproduce (another activation, a RoPE type it does not know, a layer
            type other than chunked or full), a size that is not an int >= 1, a flag that is not a bool; named.
    """
    if hf_config is None or isinstance(hf_config, (str, bytes, int, float, list, tuple)):
        raise TypeError(f"hf_config must be a transformers Llama4TextConfig or its dict; got {type(hf_config).__name__}")
    get = config_getter(hf_config)
    if get("model_type") not in (None, "llama4_text"):
        raise ValueError(f"this is a {get('model_type')!r} config; config_from_hf_llama4 reads 'llama4_text' "
                         "(a Llama4Config's text_config)")
    n_layers = _int(get, "num_hidden_layers")
    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"cannot reproduce hidden_act={get('hidden_act')!r}: only SiLU (SwiGLU) is reproduced")
    flags = _rope_flags(get, n_layers)
    types = get("layer_types", None) or ["chunked_attention" if f else "full_attention" for f in flags]
    if isinstance(types, (str, bytes)) or len(list(types)) != n_layers \
            or not set(types) <= {"chunked_attention", "full_attention"}:
        raise ValueError(f"cannot reproduce layer_types={types!r}: expected {n_layers} of 'chunked_attention' / "
                         "'full_attention'")
    types = tuple(types)
    chunk = _int(get, "attention_chunk_size") if "chunked_attention" in types else None
    rope = dict(get("rope_parameters", None) or {"rope_type": "default"})
    theta = rope.pop("rope_theta", get("rope_theta", 500000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES or "partial_rotary_factor" in rope:
        raise ValueError(f"cannot reproduce rope_parameters={get('rope_parameters')!r}: attnlib reproduces "
                         f"{sorted(ROPE_TYPES)}")
    nope = tuple(i for i in range(n_layers) if not flags[i])
    eps = get("rms_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
        raise ValueError(f"rms_norm_eps={eps!r} must be a finite number > 0")
    tuning = _bool(get, "attn_temperature_tuning", True) and bool(nope)
    n_heads = _int(get, "num_attention_heads")
    return DecoderConfig.llama(
        vocab_size=_int(get, "vocab_size"), block_size=_int(get, "max_position_embeddings"), n_layers=n_layers,
        n_heads=n_heads, d_model=_int(get, "hidden_size"), n_kv_heads=get("num_key_value_heads", None) or n_heads,
        head_dim=_int(get, "head_dim"), d_ff=_int(get, "intermediate_size_mlp"), norm_eps=float(eps),
        rope_base=float(theta), rope_scaling=None if kind == "default" else rope, layer_types=types,
        attention_chunk_size=chunk, nope_layers=nope, attention_bias=_bool(get, "attention_bias", False),
        tie_embeddings=_bool(get, "tie_word_embeddings", False),
        qk_norm=_bool(get, "use_qk_norm", True) and len(nope) < n_layers, qk_norm_type="l2",
        attn_temperature_tuning=tuning, floor_scale=get("floor_scale", 8192) if tuning else 8192.0,
        attn_scale=get("attn_scale", 0.1) if tuning else 0.1,
    )


def attention_from_hf(module: nn.Module, config=None) -> nn.Module:
    """An attnlib :class:`~attnlib.attention.MultiHeadAttention` equal to one ``transformers`` ``Llama4TextAttention``.

    The layer is built as :class:`~attnlib.Decoder` builds layer ``module.layer_idx`` of
    :func:`config_from_hf_llama4`'s config (its chunk, RoPE, L2 QK-norm or temperature), in the weights' dtype.

    Args:
        module: a ``Llama4TextAttention`` (its ``layer_idx`` picks the layer's kind).
        config: its ``Llama4TextConfig`` (or dict); default ``module.config``.

    Returns:
        a layer whose ``forward(x)`` ``(B, T, d_model)`` equals ``module(x, freqs_cis, mask)[0]`` at positions
        ``0, …, T - 1`` (1e-5 in float32), with a cache (``layer.new_cache(block_size)``) as without.

    Raises:
        TypeError: ``module`` not an ``nn.Module`` with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and ``layer_idx``.
        ValueError: as :func:`config_from_hf_llama4`; a weight of another shape (named).
    """
    parts = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not isinstance(module, nn.Module) or not all(hasattr(module, p) for p in parts) \
            or not isinstance(getattr(module, "layer_idx", None), int):
        raise TypeError(f"module must be a transformers Llama4TextAttention; got {type(module).__name__}")
    c = config_from_hf_llama4(module.config if config is None else config)
    if not 0 <= module.layer_idx < c.n_layers:
        raise ValueError(f"module.layer_idx={module.layer_idx} is not a layer of the config's {c.n_layers}")
    layer = module.layer_idx
    rope = RotaryEmbedding(c.head_dim, c.rope_base, c.rope_scaling, c.block_size) if c.uses_rope(layer) else None
    ours = build_attention(c, layer, rope)
    q, k, v, o = (getattr(module, p) for p in parts)

    def rows(linear: nn.Linear, n_heads: int, name: str) -> list[torch.Tensor | None]:
        want = n_heads * c.head_dim
        if linear.weight.shape != (want, c.d_model):
            raise ValueError(f"{name}.weight has shape {tuple(linear.weight.shape)}; expected {(want, c.d_model)}")
        ws = [linear.weight, linear.bias]
        return [interleaved_to_half_split(w, n_heads) if rope is not None and name != "v_proj" and w is not None
                else w for w in ws]

    (wq, bq), (wk, bk), (wv, bv) = rows(q, c.n_heads, "q_proj"), rows(k, c.n_kv_heads, "k_proj"), rows(v, c.n_kv_heads, "v_proj")
    if o.weight.shape != ours.out_proj.weight.shape:
        raise ValueError(f"o_proj.weight has shape {tuple(o.weight.shape)}; expected {tuple(ours.out_proj.weight.shape)}")
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([wq, wk, wv]))  # rows [W_q; W_k; W_v]
        ours.out_proj.weight.copy_(o.weight)
        if ours.qkv.bias is not None:
            ours.qkv.bias.copy_(torch.cat([bq, bk, bv]))
            ours.out_proj.bias.copy_(o.bias)
    return ours.to(q.weight.dtype)
