"""Loading Hugging Face Gemma 3 (text) weights into an :class:`attnlib.Decoder`. Chapter 20.

``transformers``' ``Gemma3ForCausalLM`` is a Llama-style decoder (grouped-query attention, RoPE rotated
half-split, RMSNorm, no biases) with Gemma's changes, each a field of :class:`~attnlib.DecoderConfig`:

* five sliding-window layers to one global layer (``layer_types``, ``sliding_window``), the sliding layers
  with their own unscaled RoPE base (``rope_parameters["sliding_attention"]`` → ``rope_local_base``) and
  the global layers with theirs, linear scaling included (``rope_parameters["full_attention"]`` →
  ``rope_base``, ``rope_scaling``);
* four norms per layer, "sandwich": ``input_layernorm`` → ``ln_1``, ``post_attention_layernorm`` →
  ``post_attn_norm`` (on the attention's output, before the residual sum), ``pre_feedforward_layernorm`` →
  ``ln_2``, ``post_feedforward_layernorm`` → ``post_mlp_norm``; QK-norm (``q_norm``, ``k_norm``);
* GeGLU with GELU's tanh form (``gelu_pytorch_tanh``); the embedding scaled by √d_model; the factor
  ``query_pre_attn_scalar ** -0.5`` on ``q · k`` (``attention_scale``); the soft cap on the logits when the
  config sets one (``final_logit_softcapping`` → ``logit_softcap``); a tied output head.

Gemma's RMSNorm multiplies by ``1 + weight`` (its weights are stored centred on 0); attnlib's by ``weight``.
The loader stores ``weight + 1``, computed in float32: in float32 this is the same number Gemma forms in its
forward pass, so the norms agree bit for bit (the tests check it). In bfloat16 the sum is rounded to the
weights' dtype, as every other attnlib weight is.

Settings attnlib cannot reproduce are refused with a ``ValueError`` naming them, never loaded into a model
that would give other logits. ``attention_dropout`` and ``pad_token_id`` (the embedding's ``padding_idx``)
change training only and are not carried over.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from attnlib.models.config import DecoderConfig
from attnlib.models.decoder import Decoder
from attnlib.models.hf_llama import (
    _flag,
    _int_field,
    check_tied_head,
    check_weight_names,
    config_getter,
    hf_state_and_config,
)
from attnlib.models.hf_vision_language import language_model_weights, text_config_of
from attnlib.positional.scaling import ROPE_TYPES

__all__ = ["config_from_hf_gemma3", "from_hf_gemma3"]

_TYPES = ("sliding_attention", "full_attention")
_NORMS = {  # attnlib name -> transformers name (per layer): Gemma's (1 + weight) norms, loaded as weight + 1
    "ln_1.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "ln_2.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
_LINEAR = {  # loaded as they are; qkv is stacked from q_proj, k_proj, v_proj
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "attn.out_proj.bias": "self_attn.o_proj.bias",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def _number(get, name: str, default=None, *, positive: bool = True) -> float | None:
    """A finite number (> 0 when ``positive``), or None where the config has none and ``default`` is None."""
    value = get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            float("-inf") < value < float("inf")) or (positive and value <= 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0 (the config's {name})")
    return float(value)


def _layer_types(get, n_layers: int) -> tuple[str, ...]:
    """``layer_types`` as given, or from the older ``sliding_window_pattern`` (every ``n``-th layer global)."""
    types = get("layer_types", None)
    if types is None:
        pattern = get("sliding_window_pattern", get("_sliding_window_pattern", 6))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern={pattern!r} must be an int >= 1")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if isinstance(types, (str, bytes)) or not hasattr(types, "__iter__"):
        raise ValueError(f"layer_types={types!r} must be a list of 'sliding_attention' / 'full_attention'")
    types = tuple(types)
    if len(types) != n_layers or not set(types) <= set(_TYPES):
        raise ValueError(f"cannot reproduce layer_types={list(types)!r}: expected {n_layers} of {list(_TYPES)}")
    return types


def _rope(get) -> dict[str, dict]:
    """Each layer type's RoPE settings, as ``Gemma3TextConfig`` builds them: ``rope_parameters`` per layer type
    (transformers 5), or the older ``rope_theta`` + ``rope_scaling`` (the global layers') + ``rope_local_base_freq``."""
    given = get("rope_parameters", None)
    if given is not None and (not isinstance(given, Mapping) or not set(given) <= set(_TYPES)):
        raise ValueError(f"rope_parameters={given!r} must map 'full_attention' / 'sliding_attention' to their "
                         "RoPE settings (Gemma 3's per-layer-type form)")
    params = {kind: dict((given or {}).get(kind) or {"rope_type": "default"}) for kind in _TYPES}
    scaling = get("rope_scaling", None)
    if scaling is not None and given is not None and scaling is given:  # transformers 5's alias of rope_parameters
        scaling = None
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise ValueError(f"rope_scaling={scaling!r} must be a dict or None")
        params["full_attention"].update(scaling)
    params["full_attention"].setdefault("rope_theta", get("rope_theta", 1_000_000.0))
    params["sliding_attention"].setdefault("rope_theta", get("rope_local_base_freq", 10_000.0))
    for kind, rope in params.items():
        _number(rope.get, "rope_theta")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES or "partial_rotary_factor" in rope:
            raise ValueError(f"cannot reproduce rope_parameters[{kind!r}]={rope!r}: attnlib reproduces the RoPE types "
                             f"{sorted(ROPE_TYPES)}, without partial_rotary_factor")
        if kind == "sliding_attention" and rope_type != "default":
            raise ValueError(f"cannot reproduce rope_parameters['sliding_attention']={rope!r}: the sliding layers' "
                             "RoPE is unscaled in attnlib (rope_local_base); only 'default' is reproduced")
    return params


def config_from_hf_gemma3(hf_config) -> DecoderConfig:
    """The :class:`~attnlib.DecoderConfig` of a ``transformers`` ``Gemma3TextConfig`` (chapter 20).

    Args:
        hf_config: a ``Gemma3TextConfig`` or its dict (``config.json``; the ``rope_parameters`` per layer type of
            transformers 5, or the older ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` and
            ``sliding_window_pattern``), or a vision-language ``Gemma3Config`` (its ``text_config``,
            :mod:`~attnlib.models.hf_vision_language`).

    Returns:
        :meth:`DecoderConfig.gemma3 <attnlib.DecoderConfig.gemma3>` with the config's sizes and settings.

    Raises:
        TypeError: ``hf_config`` neither a mapping nor a config object.
        ValueError: another ``model_type``,
            a setting attnlib cannot reproduce (``use_bidirectional_attention``, ``attn_logit_softcapping`` (which
            ``transformers``' Gemma 3 keeps but never applies), a ``hidden_activation`` other than
            ``gelu_pytorch_tanh``, a RoPE type it does not know or a scaled RoPE on the sliding layers, a layer
            type other than sliding or full), a size missing or not an int >= 1, a flag that is not a bool, a
            number that is not finite and > 0; each named.
    """
    hf_config = text_config_of(hf_config, "gemma3")  # a vision-language config: its text decoder's
    if hf_config is None or isinstance(hf_config, (str, bytes, int, float, list, tuple)):
        raise TypeError(f"hf_config must be a transformers config or its dict; got {type(hf_config).__name__}")
    get = config_getter(hf_config)
    model_type = get("model_type")
    if model_type is not None and model_type != "gemma3_text":
        raise ValueError(f"this is a {model_type!r} config; from_hf_gemma3 loads 'gemma3_text' models")
    sizes = {name: _int_field(get, name) for name in ("vocab_size", "max_position_embeddings", "num_hidden_layers",
                                                      "num_attention_heads", "hidden_size", "intermediate_size")}
    n_kv_heads, head_dim = _int_field(get, "num_key_value_heads", optional=True), _int_field(get, "head_dim", optional=True)
    head_dim = head_dim or sizes["hidden_size"] // sizes["num_attention_heads"]
    activation = get("hidden_activation", None) or get("hidden_act", None) or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"cannot reproduce hidden_activation={activation!r}: only 'gelu_pytorch_tanh' (GeGLU with "
                         "GELU's tanh form, nn.functional.gelu(approximate='tanh')) is reproduced")
    if _number(get, "attn_logit_softcapping") is not None:  # Gemma3Attention keeps it but never passes it on
        raise ValueError(f"cannot reproduce attn_logit_softcapping={get('attn_logit_softcapping')!r}: transformers' "
                         "Gemma3ForCausalLM ignores it (no attention function of Gemma 3 receives it; Gemma 3's "
                         "released configs set it to null), so there is no reference to be equal to")
    if _flag(get, "use_bidirectional_attention"):
        raise ValueError("cannot reproduce use_bidirectional_attention=True: attnlib's decoder is causal")
    types = _layer_types(get, sizes["num_hidden_layers"])
    sliding = "sliding_attention" in types
    window = _int_field(get, "sliding_window") if sliding else None
    rope = _rope(get)
    full = dict(rope["full_attention"])
    theta, kind = float(full.pop("rope_theta")), full.get("rope_type", full.get("type", "default"))
    scalar = _number(get, "query_pre_attn_scalar", 256)
    tied = get("tie_word_embeddings", None) is None or _flag(get, "tie_word_embeddings")  # Gemma's default: tied
    return DecoderConfig.gemma3(
        vocab_size=sizes["vocab_size"], block_size=sizes["max_position_embeddings"],
        n_layers=sizes["num_hidden_layers"], n_heads=sizes["num_attention_heads"], d_model=sizes["hidden_size"],
        n_kv_heads=n_kv_heads or sizes["num_attention_heads"], head_dim=head_dim, d_ff=sizes["intermediate_size"],
        layer_types=types, sliding_window=window, rope_base=theta, rope_scaling=None if kind == "default" else full,
        rope_local_base=float(rope["sliding_attention"]["rope_theta"]) if sliding else None,
        norm_eps=_number(get, "rms_norm_eps", 1e-6), tie_embeddings=tied,
        attention_bias=_flag(get, "attention_bias"), attention_scale=scalar ** -0.5,
        logit_softcap=_number(get, "final_logit_softcapping"),
    )


def from_hf_gemma3(model_or_state_dict, config=None) -> Decoder:
    """An attnlib :class:`~attnlib.Decoder` equal to a ``transformers`` ``Gemma3ForCausalLM`` (chapter 20).

    Args:
        model_or_state_dict: a ``Gemma3ForCausalLM`` or a ``Gemma3ForConditionalGeneration`` (its text decoder,
            :mod:`~attnlib.models.hf_vision_language`), or its ``state_dict()`` (then ``config`` is needed).
        config: the ``Gemma3TextConfig`` or ``Gemma3Config`` (or its dict); default: the model's. Given with a model, it must describe
            the same model (a contradiction is refused, never loaded).

    Returns:
        a model in the weights' dtype whose ``forward(idx)`` gives the same logits (1e-5 in float32), the norms'
        weights stored as ``weight + 1`` (see the module docstring).

    Raises:
        TypeError: neither a model nor a mapping; a state dict value that is not a floating point tensor (named).
        ValueError: a setting attnlib cannot reproduce (:func:`config_from_hf_gemma3`), missing or unexpected
            weights (named), a shape mismatch, an ``lm_head.weight`` that differs from the embedding it is tied
            to, weights on the meta device, a ``config`` that contradicts the model's own.
    """
    state, config = hf_state_and_config(model_or_state_dict, config, config_from_hf_gemma3)
    state, family = language_model_weights(state, "Gemma 3")  # a vision-language checkpoint's decoder
    ours = Decoder(config_from_hf_gemma3(config))
    c, own = ours.config, ours.state_dict()
    ignored = check_tied_head(state, c.tie_embeddings)
    wanted = {"tok_emb.weight": "model.embed_tokens.weight"}
    if not c.tie_embeddings:
        wanted["lm_head.weight"] = "lm_head.weight"
    norms = {"ln_f.weight": "model.norm.weight"}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        wanted |= {f"blocks.{i}.{mine}": p + theirs for mine, theirs in _LINEAR.items()}
        norms |= {f"blocks.{i}.{mine}": p + theirs for mine, theirs in _NORMS.items()}
        for suffix in ("weight", "bias"):  # rows [W_q; W_k; W_v]
            wanted[f"blocks.{i}.attn.qkv.{suffix}"] = tuple(f"{p}self_attn.{x}_proj.{suffix}" for x in "qkv")
    wanted = {mine: theirs for mine, theirs in (wanted | norms).items() if mine in own}
    needed = {k for theirs in wanted.values() for k in ((theirs,) if isinstance(theirs, str) else theirs)}
    missing = sorted(needed - set(state))
    unused = sorted(k for k in set(state) - needed - ignored if not k.endswith("rotary_emb.inv_freq"))
    check_weight_names(family, missing, unused)
    with torch.no_grad():
        for mine, theirs in wanted.items():
            if isinstance(theirs, tuple):  # q, k, v: each part's shape checked before stacking
                rows = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim)
                for key, n in zip(theirs, rows):
                    if state[key].shape != (n, *own[mine].shape[1:]):
                        raise ValueError(f"{key} has shape {tuple(state[key].shape)}; expected {(n, *own[mine].shape[1:])}")
                value = torch.cat([state[key] for key in theirs])
            else:
                value = state[theirs]
            if own[mine].shape != value.shape:
                raise ValueError(f"{theirs} has shape {tuple(value.shape)}; expected {tuple(own[mine].shape)}")
            own[mine].copy_(value.float() + 1.0 if mine in norms else value)  # Gemma's norms: x̂ · (1 + w)
    return ours.to(state["model.embed_tokens.weight"].dtype)  # the weights' dtype
