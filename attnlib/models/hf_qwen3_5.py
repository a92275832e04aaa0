"""Loading Hugging Face Qwen3.5 (dense, text) weights into an :class:`attnlib.Decoder`. Chapter 21.

Qwen3.5 (Qwen Team 2026; the Qwen3-Next design, Qwen Team 2025) is a hybrid: of every four layers, three are
gated DeltaNet layers (Yang, Kautz & Hatamizadeh 2024) and one is softmax attention. In attnlib's terms
(each a :class:`~attnlib.DecoderConfig` field, transformers' names where they exist):

* ``layer_types``: ``"linear_attention"`` / ``"full_attention"`` one per layer (``full_attention_interval``);
* the linear layers are :class:`~attnlib.attention.GatedDeltaNet` with what Qwen adds to chapter 18's layer:
  a short causal depthwise convolution and SiLU over q, k, v (``linear_conv_kernel_dim``, 4), value heads
  grouped over fewer query/key heads, head widths of their own (``linear_num_key_heads``, ...);
  its state is ``S (B, n_v_heads, d_k, d_v)`` and the convolution's last ``K - 1`` inputs;
* the softmax layers gate their heads, ``o_proj(attention(x) ⊙ σ(x W_g))`` (``attn_output_gate``; Qiu et al.
  2025), and turn only the leading quarter of each head with RoPE (``partial_rotary_factor``), with QK-norm.

Weights: transformers' ``q_proj`` holds, head by head, the query and then the gate (``(n_heads, 2, head_dim)``
rows): they are split into attnlib's ``qkv`` query rows and ``gate_proj``. ``in_proj_b`` and ``in_proj_a`` are
stacked into ``beta_decay``, ``in_proj_z`` is ``gate``, ``in_proj_qkv`` is ``qkv``. Qwen3.5's RMSNorms (not the
DeltaNet's gated one) multiply by ``1 + weight``, as Gemma 3's: the loader stores ``weight + 1``, in float32
the same number (see :mod:`attnlib.models.hf_gemma`). Text positions only: with one position per token the
multimodal RoPE's three sections (``mrope_section``) turn by the same angles, plain RoPE.

A vision-language checkpoint (``Qwen3_5ForConditionalGeneration`` and its ``Qwen3_5Config``, as Qwen3.5 is
published) loads as its language model: the ``text_config``, the weights under ``model.language_model.``; the
vision tower (``model.visual.*``) is not built, so the model reads token ids only
(:mod:`~attnlib.models.hf_vision_language`, shared with Gemma 3 and Gemma 4).

Refused with a ``ValueError`` naming the setting: mixture-of-experts configs (``qwen3_5_moe``), another
activation, biases on the attention (transformers gives them to the softmax layers only), attention dropout, a
RoPE type attnlib does not reproduce (YaRN and the other scalings of chapter 17 are reproduced).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from attnlib.models.config import DecoderConfig
from attnlib.models.decoder import Decoder
from attnlib.models.hf_llama import (
    check_tied_head,
    check_weight_names,
    config_getter,
    hf_state_and_config,
    rope_parameters,
)
from attnlib.models.hf_vision_language import language_model_weights, text_config_of
from attnlib.positional.scaling import ROPE_TYPES

__all__ = ["config_from_hf_qwen3_5", "from_hf_qwen3_5"]

_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_BLOCK_KEYS = {  # attnlib name -> transformers name (per layer), loaded as they are
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_CENTRED = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight"}  # 1 + w
_LINEAR_KEYS = {  # the DeltaNet layers
    "attn.qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn.conv1d.weight": "linear_attn.conv1d.weight",
    "attn.gate.weight": "linear_attn.in_proj_z.weight",
    "attn.A_log": "linear_attn.A_log",
    "attn.dt_bias": "linear_attn.dt_bias",
    "attn.norm_weight": "linear_attn.norm.weight",  # the gated norm multiplies by its weight itself
    "attn.out_proj.weight": "linear_attn.out_proj.weight",
}


def _hf_config(hf_config):
    """A ``Qwen3_5TextConfig`` (``layer_types`` and RoPE resolved as transformers does) from a config or its dict."""
    hf_config = text_config_of(hf_config, "qwen3_5")  # a vision-language config: its text decoder's
    if hf_config is None or isinstance(hf_config, (str, bytes, int, float, list, tuple)):
        raise TypeError(f"hf_config must be a transformers Qwen3_5TextConfig or its dict; got {type(hf_config).__name__}")
    get = config_getter(hf_config)
    model_type = get("model_type", "qwen3_5_text")
    moe = [name for name in _MOE_FIELDS if get(name, None)]
    if "moe" in str(model_type) or moe:
        raise ValueError(f"cannot reproduce model_type={model_type!r} with {moe or 'experts'}: mixture-of-experts "
                         "feed-forward blocks (Qwen3.5-MoE) are not built; from_hf_qwen3_5 loads the dense models")
    if model_type != "qwen3_5_text":
        raise ValueError(f"this is a {model_type!r} config; from_hf_qwen3_5 loads 'qwen3_5_text' models")
    if isinstance(hf_config, Mapping):
        from transformers import Qwen3_5TextConfig  # resolves layer_types and RoPE as transformers does

        return Qwen3_5TextConfig(**{k: v for k, v in hf_config.items() if k != "model_type"})
    return hf_config


def config_from_hf_qwen3_5(hf_config) -> DecoderConfig:
    """The :class:`~attnlib.DecoderConfig` of a ``transformers`` ``Qwen3_5TextConfig`` (or its dict), or of a
    vision-language ``Qwen3_5Config``'s ``text_config``. Chapter 21.

    Raises:
        TypeError: ``hf_config`` neither a config nor a mapping.
        ValueError: a mixture-of-experts config, another ``model_type``; a setting attnlib cannot
            reproduce, named: ``hidden_act`` other than ``silu``, ``attention_bias``, ``attention_dropout`` > 0, a
            ``layer_types`` entry other than linear or full attention, a RoPE type attnlib does not reproduce
            (:data:`~attnlib.positional.scaling.ROPE_TYPES`; linear, dynamic, YaRN and Llama 3 scaling are, on the
            turned part of each head, as transformers applies them), or fields that type does not take.
    """
    hf = _hf_config(hf_config)
    get = lambda k, d=None: getattr(hf, k, d)  # noqa: E731
    theta, kind, rope = rope_parameters(get, 10000.0)
    fraction = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0)
    types = list(hf.layer_types)
    # a scaled RoPE (YaRN for long contexts, ...) on the turned part: its fields, the share turned kept apart
    # (the multimodal sections turn text positions as plain RoPE does: see the module's docstring)
    apart = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
    scaling = None if kind == "default" else {k: v for k, v in rope.items() if k not in apart}
    refused = {
        "hidden_act": (hf.hidden_act != "silu", "only SiLU (SwiGLU and the convolution's SiLU) is reproduced"),
        "attention_bias": (bool(hf.attention_bias), "transformers puts biases on the softmax layers only; attnlib's "
                           "attention_bias covers the DeltaNet layers too"),
        "attention_dropout": (bool(hf.attention_dropout), "dropout on attention weights alone is not reproduced"),
        "layer_types": (not set(types) <= {"linear_attention", "full_attention"}, "only linear and full layers"),
        "rope_parameters": (not isinstance(kind, str) or kind not in ROPE_TYPES,
                            f"RoPE type {kind!r} (attnlib reproduces {sorted(ROPE_TYPES)})"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"cannot reproduce {name}={getattr(hf, name)!r}: {why}")
    return DecoderConfig(
        vocab_size=hf.vocab_size, block_size=hf.max_position_embeddings, n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads, d_model=hf.hidden_size, n_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim or hf.hidden_size // hf.num_attention_heads, attention="gqa", layer_types=tuple(types),
        linear_layer="gated_deltanet", position="rope", rope_base=theta, norm="rmsnorm", norm_eps=hf.rms_norm_eps,
        qk_norm=True, feedforward="swiglu", d_ff=hf.intermediate_size, bias=False, attention_bias=False,
        mlp_bias=False, tie_embeddings=bool(hf.tie_word_embeddings), rope_scaling=scaling,
        partial_rotary_factor=None if fraction == 1.0 else fraction, attn_output_gate=True,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim, linear_num_key_heads=hf.linear_num_key_heads,
        linear_num_value_heads=hf.linear_num_value_heads, linear_key_head_dim=hf.linear_key_head_dim,
        linear_value_head_dim=hf.linear_value_head_dim,
    )


def _split_q_proj(weight: torch.Tensor, c: DecoderConfig, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``q_proj`` rows ``(n_heads, [query; gate], head_dim)`` → the query rows and the gate rows."""
    if weight.shape[0] != 2 * c.n_heads * c.head_dim:
        raise ValueError(f"{name} has shape {tuple(weight.shape)}; expected {2 * c.n_heads * c.head_dim} rows "
                         f"(query and gate of {c.n_heads} heads of {c.head_dim})")
    heads = weight.reshape(c.n_heads, 2, c.head_dim, *weight.shape[1:])
    return heads[:, 0].reshape(-1, *weight.shape[1:]), heads[:, 1].reshape(-1, *weight.shape[1:])


def _wanted(c: DecoderConfig, state: dict) -> tuple[dict, set, set]:
    """attnlib name -> the transformers value (from ``state``); the transformers names used; the centred norms."""
    values, used, centred = {}, set(), set()

    def take(mine: str, theirs: str, plus_one: bool = False) -> None:
        if theirs in state:
            values[mine] = state[theirs]
            used.add(theirs)
            if plus_one:
                centred.add(mine)
        else:
            values[mine] = theirs  # a name: reported missing

    take("tok_emb.weight", "model.embed_tokens.weight")
    take("ln_f.weight", "model.norm.weight", plus_one=True)
    if not c.tie_embeddings:
        take("lm_head.weight", "lm_head.weight")
    for i, kind in enumerate(c.layer_types):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        for mine, theirs in _BLOCK_KEYS.items():
            take(b + mine, p + theirs)
        for mine, theirs in _CENTRED.items():
            take(b + mine, p + theirs, plus_one=True)
        if kind == "linear_attention":
            for mine, theirs in _LINEAR_KEYS.items():
                take(b + mine, p + theirs)
            parts = [p + "linear_attn.in_proj_b.weight", p + "linear_attn.in_proj_a.weight"]
            values[b + "attn.beta_decay.weight"] = (torch.cat([state[k] for k in parts])
                                                    if all(k in state for k in parts) else parts)
            used |= {k for k in parts if k in state}
            continue
        a = p + "self_attn."
        take(b + "attn.out_proj.weight", a + "o_proj.weight")
        take(b + "attn.q_norm.weight", a + "q_norm.weight", plus_one=True)
        take(b + "attn.k_norm.weight", a + "k_norm.weight", plus_one=True)
        parts = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        if all(k in state for k in parts):
            query, gate = _split_q_proj(state[parts[0]], c, parts[0])
            values[b + "attn.qkv.weight"] = torch.cat([query, state[parts[1]], state[parts[2]]])  # [W_q; W_k; W_v]
            values[b + "attn.gate_proj.weight"] = gate
        else:
            values[b + "attn.qkv.weight"] = parts
        used |= {k for k in parts if k in state}
    return values, used, centred


def from_hf_qwen3_5(model_or_state_dict, config=None) -> Decoder:
    """An attnlib :class:`~attnlib.Decoder` equal to a ``transformers`` ``Qwen3_5ForCausalLM`` (dense, text).
    Chapter 21.

    Args:
        model_or_state_dict: a ``Qwen3_5ForCausalLM`` or a ``Qwen3_5ForConditionalGeneration`` (its language
            model), or its ``state_dict()`` (then ``config`` is needed).
        config: the ``Qwen3_5TextConfig`` or ``Qwen3_5Config`` (or its dict); default: the model's. Given with a
            model, it must describe the same model.

    Returns:
        a model in the weights' dtype whose ``forward(idx)`` gives the same logits (1e-5 in float32); its
        ``new_cache()`` holds a :class:`~attnlib.cache.RecurrentState` for each DeltaNet layer (the state and the
        convolution's last inputs) and a KV cache for each softmax layer. Left-padded batches are refused (the
        DeltaNet layers would fold the padding into their state).

    Raises:
        TypeError: neither a model nor a mapping; a state dict value that is not a floating point tensor.
        ValueError: a setting attnlib cannot reproduce (:func:`config_from_hf_qwen3_5`: MoE, ...),
            missing or unexpected weights (named; multi-token-prediction ``mtp.*`` weights are ignored, as
            transformers does), a shape mismatch, an ``lm_head.weight`` that a tied config would drop, a
            ``config`` that contradicts the model's own.
    """
    state, config = hf_state_and_config(model_or_state_dict, config, config_from_hf_qwen3_5)
    state, family = language_model_weights(state, "Qwen3.5")  # a vision-language checkpoint's decoder
    ours = Decoder(config_from_hf_qwen3_5(config))
    c, own = ours.config, ours.state_dict()
    ignored = check_tied_head(state, c.tie_embeddings)
    values, used, centred = _wanted(c, state)
    names = [[v] if isinstance(v, str) else v for v in values.values() if not isinstance(v, torch.Tensor)]
    missing = sorted(k for group in names for k in group if k not in state)
    unused = sorted(k for k in set(state) - used - ignored if not k.startswith("mtp."))
    check_weight_names(family, missing, unused)
    with torch.no_grad():
        for mine, value in values.items():
            if own[mine].shape != value.shape:
                raise ValueError(f"the weight for {mine} has shape {tuple(value.shape)}; expected {tuple(own[mine].shape)}")
            own[mine].copy_(value.float() + 1.0 if mine in centred else value)  # Qwen's norms: x̂ · (1 + w)
    return ours.to(state["model.embed_tokens.weight"].dtype)
