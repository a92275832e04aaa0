"""Loading Hugging Face Llama, Qwen3 and Mistral weights into :class:`attnlib.ModernDecoder`. Chapter 16.

``transformers``' ``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` keep separate ``q_proj``,
``k_proj``, ``v_proj`` (stacked here into attnlib's fused ``qkv``, rows ``[W_q; W_k; W_v]``) and
rotate query/key pairs **half-split** (``rotate_half``), as :class:`attnlib.RotaryEmbedding`
does: their weights load without a permutation. (Meta's original Llama checkpoints rotate
interleaved pairs; ``transformers``' conversion script permutes the rows of ``W_q`` and ``W_k``
once, so the two conventions give the same model. Chapter 16 shows that permutation.)

Settings attnlib cannot reproduce are refused with a ``ValueError`` naming them, never
loaded into a model that would give other logits.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from attnlib.modern import ModernConfig, ModernDecoder
from attnlib.rope import ROPE_TYPES

__all__ = ["config_from_hf_decoder", "from_hf_llama", "from_hf_mistral", "from_hf_qwen3"]

_BLOCK_KEYS = {  # attnlib name -> transformers name (per layer); qkv is stacked from three
    "ln_1.weight": "input_layernorm.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "attn.out_proj.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_FAMILIES = ("llama", "qwen3", "mistral")


def config_from_hf_decoder(hf_config, family: str) -> ModernConfig:
    """The :class:`ModernConfig` of a ``transformers`` Llama / Qwen3 / Mistral config.

    Raises:
        ValueError: a setting attnlib cannot reproduce (another activation, MLP biases, a RoPE
            type or field :func:`~attnlib.positional.rope_frequencies` does not know, partial rotary,
            tensor-parallel pretraining, sliding windows on only some layers), named.
    """
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {_FAMILIES}; got {family!r}")
    get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
    model_type = get("model_type")
    if model_type is not None and model_type != family:
        raise ValueError(f"this is a {model_type!r} config; from_hf_{family} loads {family!r} models")
    refused = {
        "hidden_act": (get("hidden_act", "silu") != "silu", "only SiLU (SwiGLU) is reproduced"),
        "mlp_bias": (bool(get("mlp_bias", False)), "MLP biases are not reproduced"),
        "pretraining_tp": ((get("pretraining_tp", 1) or 1) != 1, "tensor-parallel slicing is not reproduced"),
    }
    rope = dict(get("rope_parameters", None) or get("rope_scaling", None) or {})
    theta = rope.pop("rope_theta", get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    refused["rope_parameters"] = (kind not in ROPE_TYPES or "partial_rotary_factor" in rope,
                                  f"RoPE type {kind!r} / fields {sorted(rope)} (attnlib reproduces {sorted(ROPE_TYPES)})")
    window = get("sliding_window", None)
    layer_types = set(get("layer_types", None) or [])
    if family == "qwen3":
        window = window if get("use_sliding_window", False) else None
        refused["layer_types"] = ("sliding_attention" in layer_types and "full_attention" in layer_types,
                                  "sliding windows on only some layers are not reproduced")
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"cannot reproduce {name}={get(name)!r}: {why}")
    return ModernConfig(
        vocab_size=get("vocab_size"), block_size=get("max_position_embeddings"), n_layers=get("num_hidden_layers"),
        n_heads=get("num_attention_heads"), d_model=get("hidden_size"),
        n_kv_heads=get("num_key_value_heads", None) or get("num_attention_heads"),
        head_dim=get("head_dim", None) or get("hidden_size") // get("num_attention_heads"),
        d_ff=get("intermediate_size"), rope_base=float(theta), rope_scaling=None if kind == "default" else rope,
        norm_eps=float(get("rms_norm_eps")), qk_norm=family == "qwen3", tie_embeddings=bool(get("tie_word_embeddings")),
        bias=bool(get("attention_bias", False)), sliding_window=window,
    )


def _load(model_or_state_dict, config, family: str) -> ModernDecoder:
    if isinstance(model_or_state_dict, torch.nn.Module):
        config = model_or_state_dict.config if config is None else config
        state = model_or_state_dict.state_dict()
    elif isinstance(model_or_state_dict, Mapping):
        if config is None:
            raise ValueError("a state dict needs its transformers config: from_hf_...(state_dict, config=...)")
        state = dict(model_or_state_dict)
    else:
        raise TypeError(f"expected a transformers model or a state dict; got {type(model_or_state_dict).__name__}")
    ours = ModernDecoder(config_from_hf_decoder(config, family))
    c = ours.config
    wanted = {"tok_emb.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}
    if not c.tie_embeddings:
        wanted["lm_head.weight"] = "lm_head.weight"
    for i in range(c.n_layers):
        for mine, theirs in _BLOCK_KEYS.items():
            wanted[f"blocks.{i}.{mine}"] = f"model.layers.{i}.{theirs}"
        p = f"model.layers.{i}.self_attn."
        for suffix in ("weight", "bias"):
            parts = [f"{p}{x}_proj.{suffix}" for x in "qkv"]
            if all(k in state for k in parts):
                state[f"{p}qkv.{suffix}"] = torch.cat([state.pop(k) for k in parts])  # rows [W_q; W_k; W_v]
            wanted[f"blocks.{i}.attn.qkv.{suffix}"] = f"{p}qkv.{suffix}"
    own = ours.state_dict()
    wanted = {mine: theirs for mine, theirs in wanted.items() if mine in own}
    missing = sorted(theirs for theirs in wanted.values() if theirs not in state)
    ignored = {"lm_head.weight"} if c.tie_embeddings else set()
    unused = sorted(set(state) - set(wanted.values()) - ignored - {k for k in state if k.endswith("rotary_emb.inv_freq")})
    if missing or unused:
        raise ValueError(f"the weights do not match a {family} model of this config: missing {missing[:5]}, "
                         f"unexpected {unused[:5]}")
    with torch.no_grad():
        for mine, theirs in wanted.items():
            if own[mine].shape != state[theirs].shape:
                raise ValueError(f"{theirs} has shape {tuple(state[theirs].shape)}; expected {tuple(own[mine].shape)}")
            own[mine].copy_(state[theirs])
    return ours.to(next(iter(state.values())).dtype)


def from_hf_llama(model_or_state_dict, config=None) -> ModernDecoder:
    """An attnlib :class:`ModernDecoder` equal to a ``transformers`` ``LlamaForCausalLM``.

    Args:
        model_or_state_dict: a ``LlamaForCausalLM``, or its ``state_dict()`` (then ``config`` is needed).
        config: the ``LlamaConfig`` (or its dict); default: the model's.

    Returns:
        a model in the weights' dtype whose ``forward(idx)`` gives the same logits (1e-5 in float32).

    Raises:
        TypeError: neither a model nor a mapping. ValueError: a setting attnlib cannot reproduce
            (:func:`config_from_hf_decoder`), missing or unexpected weights, a shape mismatch.
    """
    return _load(model_or_state_dict, config, "llama")


def from_hf_qwen3(model_or_state_dict, config=None) -> ModernDecoder:
    """As :func:`from_hf_llama`, for ``Qwen3ForCausalLM`` (QK-norm, its own ``head_dim``)."""
    return _load(model_or_state_dict, config, "qwen3")


def from_hf_mistral(model_or_state_dict, config=None) -> ModernDecoder:
    """As :func:`from_hf_llama`, for ``MistralForCausalLM`` (a sliding window on every layer)."""
    return _load(model_or_state_dict, config, "mistral")
