"""Loading Hugging Face Gemma 4 (text) weights into an :class:`attnlib.Decoder`. Chapter 20.

``transformers``' ``Gemma4ForCausalLM`` is Gemma 3's layout (sliding and global layers, sandwich norms,
QK-norm, GeGLU, embeddings times √d_model) with what Gemma 4 adds, each a :class:`~attnlib.DecoderConfig`
field here: the last ``num_kv_shared_layers`` layers attend with the keys and values of the last earlier
layer of their type (``kv_source``; no ``k_proj``/``v_proj`` and no cache of their own); global layers with
their own head width and key/value heads (``global_head_dim``, ``global_n_kv_heads``) and "proportional"
RoPE on part of each head (``global_partial_rotary_factor``); their values taken from the key projection
(``attention_k_eq_v``); an RMSNorm without scale on values (``value_norm``); the factor on ``q · k`` 1
(``attention_scale``); per-layer input embeddings (``d_per_layer_input``); a stored scalar per layer
(``layer_scalar``). Gemma 4's RMSNorm multiplies by its weight itself (not ``1 + w`` as Gemma 3's): the
weights load unchanged. ``q_proj``, ``k_proj`` and ``v_proj`` are stacked into the fused ``qkv``.

Settings attnlib cannot reproduce are refused with a ``ValueError`` naming them (mixture-of-experts blocks,
the double-wide MLP of shared layers, bidirectional attention, another activation, ...).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from attnlib.models.config import DecoderConfig
from attnlib.models.decoder import Decoder
from attnlib.models.hf_llama import check_tied_head, check_weight_names, hf_state_and_config
from attnlib.models.hf_vision_language import language_model_weights, text_config_of

__all__ = ["config_from_hf_gemma4", "from_hf_gemma4"]

_BLOCK_KEYS = {  # attnlib name -> transformers name (per layer); qkv is stacked from q/k/v_proj
    "ln_1.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "ln_2.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "attn.out_proj.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
    "per_layer_input.gate.weight": "per_layer_input_gate.weight",
    "per_layer_input.up.weight": "per_layer_projection.weight",
    "per_layer_input.norm.weight": "post_per_layer_input_norm.weight",
    "layer_scalar": "layer_scalar",
}
_MODEL_KEYS = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "ln_f.weight": "model.norm.weight",
    "per_layer.tok_emb.weight": "model.embed_tokens_per_layer.weight",
    "per_layer.proj.weight": "model.per_layer_model_projection.weight",
    "per_layer.norm.weight": "model.per_layer_projection_norm.weight",
}


def _hf_config(hf_config):
    """A ``Gemma4TextConfig`` (per-layer sizes resolved) from a config object or its dict (a vision-language
    ``Gemma4Config``: its text decoder's, :mod:`~attnlib.models.hf_vision_language`)."""
    hf_config = text_config_of(hf_config, "gemma4")
    if hf_config is None or isinstance(hf_config, (str, bytes, int, float, list, tuple)):
        raise TypeError(f"hf_config must be a transformers Gemma4TextConfig or its dict; got {type(hf_config).__name__}")
    if isinstance(hf_config, Mapping):
        from transformers import Gemma4TextConfig  # resolves per_layer_config as transformers does

        model_type = hf_config.get("model_type", "gemma4_text")
        if model_type != "gemma4_text":
            raise ValueError(f"this is a {model_type!r} config; from_hf_gemma4 loads 'gemma4_text' models")
        return Gemma4TextConfig(**{k: v for k, v in hf_config.items() if k != "model_type"})
    model_type = getattr(hf_config, "model_type", None)
    if model_type != "gemma4_text":
        raise ValueError(f"this is a {model_type!r} config; from_hf_gemma4 loads 'gemma4_text' models")
    return hf_config


def _rope(rope: Mapping, kind: str) -> tuple[float, float | None]:
    """``(rope_theta, partial_rotary_factor or None)`` of one layer type's ``rope_parameters``, or a ValueError."""
    params = dict(rope.get(kind) or {})
    rope_type, theta = params.pop("rope_type", "default"), params.pop("rope_theta", None)
    fraction = params.pop("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0
    factor = params.pop("factor", 1.0) if rope_type == "proportional" else 1.0
    allowed = ("default", "proportional") if kind == "full_attention" else ("default",)
    if rope_type not in allowed or params or factor != 1.0 or isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"cannot reproduce rope_parameters[{kind!r}]={rope.get(kind)!r}: attnlib reproduces "
                         f"rope_type {allowed} with a rope_theta (and a partial_rotary_factor, no factor)")
    return float(theta), None if fraction == 1.0 else float(fraction)


def config_from_hf_gemma4(hf_config) -> DecoderConfig:
    """The :class:`~attnlib.DecoderConfig` of a ``transformers`` ``Gemma4TextConfig`` (or its dict).

    Raises:
        TypeError: ``hf_config`` neither a config nor a mapping.
        ValueError: another ``model_type``; a setting attnlib cannot reproduce, named: ``enable_moe_block``,
            ``use_double_wide_mlp`` with shared layers, ``use_bidirectional_attention``, ``hidden_activation``
            other than ``gelu_pytorch_tanh``, ``attention_dropout`` > 0, a ``layer_types`` entry other than full or
            sliding, ``rope_parameters`` other than default / proportional RoPE, per-layer sizes that differ
            among layers of one type, ``vocab_size_per_layer_input`` < ``vocab_size``.
    """
    hf = _hf_config(hf_config)
    n_layers, types = hf.num_hidden_layers, list(hf.layer_types)
    shared = hf.num_kv_shared_layers or 0
    refused = {
        "enable_moe_block": (bool(hf.enable_moe_block), "mixture-of-experts blocks are outside this book"),
        "use_double_wide_mlp": (bool(hf.use_double_wide_mlp) and shared > 0, "shared layers' double-wide MLP is not built"),
        "use_bidirectional_attention": (hf.use_bidirectional_attention is not None, "attnlib's decoder is causal"),
        "hidden_activation": (hf.hidden_activation != "gelu_pytorch_tanh", "only GeGLU with tanh GELU is reproduced"),
        "attention_dropout": (bool(hf.attention_dropout), "dropout on attention weights alone is not reproduced"),
        "layer_types": (not set(types) <= {"sliding_attention", "full_attention"}, "only full and sliding layers"),
    }
    d_input = hf.hidden_size_per_layer_input or None
    refused["vocab_size_per_layer_input"] = (d_input is not None and hf.vocab_size_per_layer_input < hf.vocab_size,
                                             "every token id needs a per-layer embedding")
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"cannot reproduce {name}={getattr(hf, name)!r}: {why}")
    sizes = {kind: {(hf.per_layer_config[i].head_dim, hf.per_layer_config[i].num_key_value_heads)
                    for i in range(n_layers) if types[i] == kind} for kind in set(types)}
    for kind, found in sizes.items():
        if len(found) != 1:
            raise ValueError(f"cannot reproduce per_layer_config: the {kind!r} layers have (head_dim, "
                             f"num_key_value_heads) {sorted(found)}; attnlib gives one pair per layer type")
    local = next(iter(sizes.get("sliding_attention") or sizes["full_attention"]))  # (head_dim, n_kv_heads)
    wide = next(iter(sizes.get("full_attention") or {local}))
    rope = hf.rope_parameters
    rope_base, fraction = _rope(rope, "full_attention") if "full_attention" in types else (10000.0, None)
    local_base = _rope(rope, "sliding_attention")[0] if "sliding_attention" in types else None
    if "full_attention" not in types:
        rope_base, local_base = local_base, None
    return DecoderConfig(
        vocab_size=hf.vocab_size, block_size=hf.max_position_embeddings, n_layers=n_layers,
        n_heads=hf.num_attention_heads, d_model=hf.hidden_size, n_kv_heads=local[1], head_dim=local[0],
        attention="gqa", layer_types=tuple(types),
        sliding_window=hf.sliding_window if "sliding_attention" in types else None,
        position="rope", rope_base=rope_base, rope_local_base=local_base, norm="rmsnorm", norm_eps=hf.rms_norm_eps,
        norm_placement="sandwich", qk_norm=True, feedforward="geglu", d_ff=hf.intermediate_size, bias=False,
        attention_bias=bool(hf.attention_bias), mlp_bias=False, tie_embeddings=bool(hf.tie_word_embeddings),
        attention_scale=1.0, scale_embeddings=True, logit_softcap=hf.final_logit_softcapping,
        num_kv_shared_layers=shared, global_head_dim=None if wide[0] == local[0] else wide[0],
        global_n_kv_heads=None if wide[1] == local[1] else wide[1], global_partial_rotary_factor=fraction,
        attention_k_eq_v=bool(hf.attention_k_eq_v), value_norm=True, d_per_layer_input=d_input, layer_scalar=True,
    )


def _wanted(c: DecoderConfig, state: dict, own: dict) -> tuple[dict, set]:
    """attnlib name -> transformers name(s) (a list: stacked into ``qkv``); and the transformers names ignored."""
    wanted = {**_MODEL_KEYS, **({} if c.tie_embeddings else {"lm_head.weight": "lm_head.weight"})}
    ignored = check_tied_head(state, c.tie_embeddings)  # (refusing a head that tying would drop)
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        wanted.update({f"blocks.{i}.{mine}": p + theirs for mine, theirs in _BLOCK_KEYS.items()})
        parts = "q" if c.kv_source(i) is not None else "qk" if c.attention_k_eq_v and c.layer_types[i] == "full_attention" else "qkv"
        for suffix in ("weight", "bias"):
            wanted[f"blocks.{i}.attn.qkv.{suffix}"] = [f"{p}self_attn.{x}_proj.{suffix}" for x in parts]
        if c.kv_source(i) is not None:  # transformers ignores these too (_keys_to_ignore_on_load_unexpected)
            ignored |= {f"{p}self_attn.{n}.{s}" for n in ("k_proj", "v_proj", "k_norm", "v_norm") for s in ("weight", "bias")}
    return {mine: theirs for mine, theirs in wanted.items() if mine in own}, ignored


def from_hf_gemma4(model_or_state_dict, config=None) -> Decoder:
    """An attnlib :class:`~attnlib.Decoder` equal to a ``transformers`` ``Gemma4ForCausalLM`` (text). Chapter 20.

    Args:
        model_or_state_dict: a ``Gemma4ForCausalLM`` or a ``Gemma4ForConditionalGeneration`` (its text decoder,
            :mod:`~attnlib.models.hf_vision_language`), or its ``state_dict()`` (then ``config`` is needed).
        config: the ``Gemma4TextConfig`` or ``Gemma4Config`` (or its dict); default: the model's. Given with a model, it must describe
            the same model.

    Returns:
        a model in the weights' dtype whose ``forward(idx)`` gives the same logits (1e-5 in float32), its shared
        layers reading their source's keys and values (``model.new_cache()`` allocates none for them).

    Raises:
        TypeError: neither a model nor a mapping; a state dict value that is not a floating point tensor.
        ValueError: a setting attnlib cannot reproduce (:func:`config_from_hf_gemma4`), missing or unexpected
            weights (named), a shape mismatch, an ``lm_head.weight`` that a tied config would drop, a
            ``config`` that contradicts the model's own.
    """
    state, config = hf_state_and_config(model_or_state_dict, config, config_from_hf_gemma4)
    state, family = language_model_weights(state, "Gemma 4")  # a vision-language checkpoint's decoder
    ours = Decoder(config_from_hf_gemma4(config))
    c, own = ours.config, ours.state_dict()
    wanted, ignored = _wanted(c, state, own)
    names = lambda theirs: theirs if isinstance(theirs, list) else [theirs]  # noqa: E731
    missing = sorted(k for theirs in wanted.values() for k in names(theirs) if k not in state)
    used = {k for theirs in wanted.values() for k in names(theirs)}
    unused = sorted(set(state) - used - ignored)
    check_weight_names(family, missing, unused)
    with torch.no_grad():
        for mine, theirs in wanted.items():
            value = torch.cat([state[k] for k in names(theirs)])  # rows [W_q; W_k; W_v] (or fewer)
            if mine == "per_layer.tok_emb.weight":
                value = value[:c.vocab_size]  # rows past vocab_size are never looked up
            if own[mine].shape != value.shape:
                raise ValueError(f"{theirs} has shape {tuple(value.shape)}; expected {tuple(own[mine].shape)}")
            own[mine].copy_(value)
    return ours.to(state["model.embed_tokens.weight"].dtype)
