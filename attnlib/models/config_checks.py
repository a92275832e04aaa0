"""The checks of :class:`~attnlib.models.config.DecoderConfig`, field by field and in combination.

Called once by ``DecoderConfig.__post_init__``: :func:`check_fields` before derived fields are
resolved, :func:`check_combinations` after. Every message names the field and its value.
"""
from __future__ import annotations

from collections.abc import Mapping

from attnlib._checks import divisible, finite_number, positive_int, probability
from attnlib.attention.registry import ATTENTION_FUNCTIONS
from attnlib.attention.temperature import QK_NORMS, check_temperature
from attnlib.positional.rotary import LeadingRotaryEmbedding, RotaryEmbedding

__all__ = ["ATTENTION_VARIANTS", "FEEDFORWARD_KINDS", "LAYER_TYPES", "LINEAR_LAYERS", "NORMS", "NORM_PLACEMENTS",
           "POSITIONS", "check_attention_sinks", "check_combinations", "check_differential", "check_fields",
           "check_kv_reuse", "check_llama4_attention", "check_qwen3_5"]

#: The attention of a decoder's softmax layers (chapter 13): MHA, GQA and MQA are one layer with
#: ``n_kv_heads`` = ``n_heads``, given, 1; talking heads (chapter 05); latent attention (chapter 07);
#: differential attention (DiffLlama, chapter 20).
ATTENTION_VARIANTS = ("mha", "talking_heads", "mqa", "gqa", "mla", "differential")
#: ``layer_types`` entries: transformers' strings. Full causal attention; a sliding window
#: (``sliding_window``); attention within chunks (``attention_chunk_size``, Llama 4); a linear layer
#: (``linear_layer``: gated DeltaNet, as Qwen3-Next's ``"linear_attention"``, or linear attention).
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
#: How positions enter: learned table (GPT-2), RoPE, ALiBi, none (NoPE). Chapters 10, 16, 17.
POSITIONS = ("learned", "rope", "alibi", "nope")
NORMS = ("layernorm", "rmsnorm")
#: ``"pre"``: ``x + f(norm(x))``; ``"sandwich"``: ``x + norm(f(norm(x)))`` (Gemma 2 and 3).
NORM_PLACEMENTS = ("pre", "sandwich")
FEEDFORWARD_KINDS = ("gelu", "swiglu", "geglu")
LINEAR_LAYERS = ("gated_deltanet", "linear")

def check_fields(config) -> None:
    """Each field alone: types, ranges, choices (lists made tuples). Raises TypeError / ValueError naming it."""
    for name in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model"):
        positive_int(name, getattr(config, name))
    for name in ("n_kv_heads", "head_dim", "kv_latent_dim", "sliding_window", "attention_chunk_size", "d_ff"):
        if getattr(config, name) is not None:
            positive_int(name, getattr(config, name))
    choices = {"attention": ATTENTION_VARIANTS, "linear_layer": LINEAR_LAYERS, "position": POSITIONS,
               "norm": NORMS, "norm_placement": NORM_PLACEMENTS, "feedforward": FEEDFORWARD_KINDS,
               "gelu_approximate": ("none", "tanh")}
    for name, options in choices.items():
        if not isinstance(getattr(config, name), str) or getattr(config, name) not in options:
            raise ValueError(f"{name}={getattr(config, name)!r} is not one of {options}")
    for name in ("qk_norm", "bias", "attention_bias", "mlp_bias", "tie_embeddings", "scale_embeddings"):
        if getattr(config, name) is not None and not isinstance(getattr(config, name), bool):
            raise TypeError(f"{name} must be a bool; got {getattr(config, name)!r}")
    probability("dropout", config.dropout)
    if finite_number("norm_eps", config.norm_eps) <= 0:
        raise ValueError(f"norm_eps={config.norm_eps!r} must be > 0 (it keeps the norm's division away from 0)")
    for name in ("rope_base", "rope_local_base"):
        if getattr(config, name) is not None:
            finite_number(name, getattr(config, name), above=1)
    for name in ("attn_softcap", "attention_scale", "logit_softcap"):
        value = getattr(config, name)
        if value is not None and finite_number(name, value) <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if config.layer_types is not None:
        if isinstance(config.layer_types, str) or not hasattr(config.layer_types, "__iter__"):
            raise TypeError(f"layer_types must be a list of {LAYER_TYPES}, one per layer; got {config.layer_types!r}")
        object.__setattr__(config, "layer_types", tuple(config.layer_types))
        bad = [t for t in config.layer_types if t not in LAYER_TYPES]
        if bad or len(config.layer_types) != config.n_layers:
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the n_layers={config.n_layers} "
                             f"layers; got {list(config.layer_types)}")
    if isinstance(config.nope_layers, (str, bytes)) or not hasattr(config.nope_layers, "__iter__"):
        raise TypeError(f"nope_layers must be a list of layer indices; got {config.nope_layers!r}")
    object.__setattr__(config, "nope_layers", tuple(config.nope_layers))
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < config.n_layers for i in config.nope_layers) \
            or len(set(config.nope_layers)) != len(config.nope_layers):
        raise ValueError(f"nope_layers must be distinct layer indices in [0, {config.n_layers}); got {list(config.nope_layers)}")
    if isinstance(config.rope_scaling, Mapping):  # a copy: later edits of the caller's dict cannot reach it
        object.__setattr__(config, "rope_scaling", dict(config.rope_scaling))

def check_combinations(config) -> None:
    """The fields together, after derivation: settings that contradict or do not apply. Raises ValueError."""
    expected = {"mha": config.n_heads, "mqa": 1}.get(config.attention)
    if "n_kv_heads" not in config._derived:
        if config.attention in ("talking_heads", "mla"):
            raise ValueError(f"n_kv_heads={config.n_kv_heads} does not apply to attention={config.attention!r}; leave it None")
        if expected is not None and config.n_kv_heads != expected:
            raise ValueError(f"n_kv_heads={config.n_kv_heads} contradicts attention={config.attention!r}, which has "
                             f"{expected} key/value head(s); use attention='gqa' for another number")
    divisible("n_heads", config.n_heads, "n_kv_heads", config.n_kv_heads)
    if config.kv_latent_dim is not None and config.attention != "mla":
        raise ValueError(f"kv_latent_dim={config.kv_latent_dim} applies to attention='mla' only; got {config.attention!r}")
    for kind, size, name in (("sliding_attention", config.sliding_window, "sliding_window"),
                             ("chunked_attention", config.attention_chunk_size, "attention_chunk_size")):
        used = kind in config.layer_types
        if used != (size is not None):
            raise ValueError(f"{name}={size!r} but layer_types has {'a' if used else 'no'} {kind!r} layer; "
                             f"give both or neither")
    rope_only = {"rope_scaling": config.rope_scaling, "rope_local_base": config.rope_local_base,
                 "nope_layers": config.nope_layers or None}
    for name, value in rope_only.items():
        if value is not None and config.position != "rope":
            raise ValueError(f"{name}={value!r} is given but position={config.position!r} does not use RoPE")
    if config.rope_local_base is not None and "sliding_attention" not in config.layer_types:
        raise ValueError(f"rope_local_base={config.rope_local_base} is for sliding layers; layer_types has none")
    if config.attention == "mla" and (config.position == "rope" or config.qk_norm):
        raise ValueError("attention='mla' takes neither RoPE (DeepSeek-V2's decoupled RoPE key is not built "
                         "here) nor qk_norm; use position='learned', 'alibi' or 'nope'")
    if config.attention in ("talking_heads", "mla") and config.head_dim * config.n_heads != config.d_model:
        raise ValueError(f"head_dim={config.head_dim} with n_heads={config.n_heads} must make d_model={config.d_model} "
                         f"for attention={config.attention!r}")
    if config.attention_scale is not None and config.attention in ("talking_heads", "mla"):
        raise ValueError(f"attention_scale={config.attention_scale} is for attention='mha'/'gqa'/'mqa'; got "
                         f"{config.attention!r}")
    if config.attention == "talking_heads" and config.score_mods():
        raise ValueError("attention='talking_heads' mixes raw scores itself: it takes no ALiBi or attn_softcap")
    if config.attn_fn not in ATTENTION_FUNCTIONS:
        raise ValueError(f"attn_fn={config.attn_fn!r} is not one of {sorted(ATTENTION_FUNCTIONS)}")
    if config.dropout and config.attn_fn in ("tiled", "flash"):
        raise ValueError(f"dropout={config.dropout} needs attn_fn='eager' or 'sdpa' ({config.attn_fn!r} has no dropout)")
    if config.score_mods() and config.attn_fn in ("sdpa", "flash"):
        raise ValueError(f"attn_fn={config.attn_fn!r} cannot modify scores (ALiBi / attn_softcap): use 'eager' or 'tiled'")
    check_differential(config)
    check_kv_reuse(config)
    if config.position == "rope":
        for base in {config.rope_base, config.rope_local_base or config.rope_base}:
            RotaryEmbedding(config.head_dim, base, config.rope_scaling, config.block_size)  # checks RoPE's settings
    check_attention_sinks(config)
    check_llama4_attention(config)
    check_qwen3_5(config)


def check_attention_sinks(config) -> None:
    """``attention_sinks``: a bool; only for MHA / GQA / MQA layers, and never with ``attn_fn='sdpa'``."""
    if not isinstance(config.attention_sinks, bool):
        raise TypeError(f"attention_sinks must be a bool; got {config.attention_sinks!r}")
    if config.attention_sinks and config.attention not in ("mha", "gqa", "mqa"):
        raise ValueError(f"attention_sinks=True applies to attention='mha', 'gqa' or 'mqa'; got {config.attention!r}")
    if config.attention_sinks and config.attn_fn == "sdpa":
        raise ValueError("attention_sinks=True cannot run with attn_fn='sdpa' (its softmax has no sink term): "
                         "use 'eager', 'tiled' or 'flash', or leave attn_fn None")


def check_differential(config) -> None:
    """``attention="differential"`` (chapter 20) pairs its heads, first half with second half: ``n_heads`` and
    ``n_kv_heads`` even; no ALiBi (its slopes are per head, and a differential head is two maps). Raises ValueError."""
    if config.attention != "differential":
        return
    for name in ("n_heads", "n_kv_heads"):
        if getattr(config, name) % 2:
            raise ValueError(f"{name}={getattr(config, name)} must be even for attention='differential' "
                             "(its heads pair up: first half with second half)")
    if config.position == "alibi":
        raise ValueError("position='alibi' does not apply to attention='differential': ALiBi's slopes are per "
                         "head, and a differential head subtracts two maps; use 'rope', 'learned' or 'nope'")


def check_llama4_attention(config) -> None:
    """``qk_norm_type``, ``attn_temperature_tuning``, ``floor_scale``, ``attn_scale`` (Llama 4, chapter 20): their types
    and ranges, and that they apply (an L2 QK-norm needs a RoPE layer, temperature tuning a NoPE layer).
    Raises TypeError / ValueError naming the field."""
    if not isinstance(config.qk_norm_type, str) or config.qk_norm_type not in QK_NORMS:
        raise ValueError(f"qk_norm_type={config.qk_norm_type!r} is not one of {QK_NORMS}")
    if not isinstance(config.attn_temperature_tuning, bool):
        raise TypeError(f"attn_temperature_tuning must be a bool; got {config.attn_temperature_tuning!r}")
    check_temperature(config.floor_scale, config.attn_scale)  # floor_scale > 0, attn_scale >= 0, named
    softmax = [i for i, t in enumerate(config.layer_types) if t != "linear_attention"]
    l2, tuning = config.qk_norm_type == "l2", config.attn_temperature_tuning
    if l2 and not config.qk_norm:
        raise ValueError("qk_norm_type='l2' is the kind of QK-norm: it needs qk_norm=True")
    if l2 and not any(config.uses_rope(i) for i in softmax):
        raise ValueError("qk_norm_type='l2' normalises the RoPE layers' queries and keys (Llama 4); "
                         f"no layer uses RoPE (position={config.position!r}, nope_layers={list(config.nope_layers)})")
    if tuning and (config.position not in ("rope", "nope") or all(config.uses_rope(i) for i in softmax)):
        raise ValueError("attn_temperature_tuning=True scales the queries of layers without RoPE (Llama 4); "
                         f"none here (position={config.position!r}, nope_layers={list(config.nope_layers)})")
    if (l2 or tuning) and config.attention not in ("mha", "gqa", "mqa"):
        raise ValueError(f"qk_norm_type={config.qk_norm_type!r} / attn_temperature_tuning={tuning} need "
                         f"attention 'mha', 'gqa' or 'mqa'; got {config.attention!r}")
    for name, default in (("floor_scale", 8192.0), ("attn_scale", 0.1)):
        if not tuning and getattr(config, name) != default:
            raise ValueError(f"{name}={getattr(config, name)!r} is given but attn_temperature_tuning=False does not "
                             "use it")


def check_kv_reuse(config) -> None:
    """Gemma 4's fields (chapter 20): KV sharing, the full-attention layers' own sizes and RoPE, keys as values,
    the value norm, per-layer inputs, layer scalars. Raises TypeError / ValueError naming the field."""
    for name in ("attention_k_eq_v", "value_norm", "layer_scalar"):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{name} must be a bool; got {getattr(config, name)!r}")
    for name in ("global_head_dim", "global_n_kv_heads", "d_per_layer_input"):
        if getattr(config, name) is not None:
            positive_int(name, getattr(config, name))
    n = config.num_kv_shared_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < config.n_layers:
        raise ValueError(f"num_kv_shared_layers={n!r} must be an int in [0, n_layers={config.n_layers})")
    fraction = config.global_partial_rotary_factor
    if fraction is not None and not 0 < finite_number("global_partial_rotary_factor", fraction) <= 1:
        raise ValueError(f"global_partial_rotary_factor={fraction!r} must be in (0, 1]")
    attention_only = {"num_kv_shared_layers": n or None, "global_head_dim": config.global_head_dim,
                      "global_n_kv_heads": config.global_n_kv_heads, "attention_k_eq_v": config.attention_k_eq_v or None,
                      "value_norm": config.value_norm or None}
    for name, value in attention_only.items():
        if value is not None and config.attention not in ("mha", "gqa", "mqa"):
            raise ValueError(f"{name}={value!r} is for attention='mha'/'gqa'/'mqa'; got {config.attention!r}")
        if value is not None and config.position == "alibi":
            raise ValueError(f"{name}={value!r} does not take position='alibi' (Gemma 4's attention uses RoPE)")
    full = {"global_head_dim": config.global_head_dim, "global_n_kv_heads": config.global_n_kv_heads,
            "global_partial_rotary_factor": fraction, "attention_k_eq_v": config.attention_k_eq_v or None}
    for name, value in full.items():
        if value is not None and "full_attention" not in config.layer_types:
            raise ValueError(f"{name}={value!r} is for the 'full_attention' layers; layer_types has none")
    if config.global_n_kv_heads is not None:
        if config.attention != "gqa":
            raise ValueError(f"global_n_kv_heads={config.global_n_kv_heads} needs attention='gqa'; got {config.attention!r}")
        divisible("n_heads", config.n_heads, "global_n_kv_heads", config.global_n_kv_heads)
    if config.position == "rope" and config.global_head_dim is not None and config.global_head_dim % 2:
        raise ValueError(f"global_head_dim={config.global_head_dim} must be even for RoPE")
    if fraction is not None and config.position != "rope":
        raise ValueError(f"global_partial_rotary_factor={fraction!r} is given but position={config.position!r} does not use RoPE")
    first = config.n_layers - n
    for layer in range(first, config.n_layers):
        kind = config.layer_types[layer]
        if kind == "linear_attention":
            raise ValueError(f"num_kv_shared_layers={n}: layer {layer} is a linear layer, which has no keys and "
                             "values to share")
        if kind not in config.layer_types[:first]:
            raise ValueError(f"num_kv_shared_layers={n}: shared layer {layer} ({kind!r}) has no earlier {kind!r} "
                             f"layer among layers 0..{first - 1} to take keys and values from")
        if (layer in config.nope_layers) != (config.kv_source(layer) in config.nope_layers):
            raise ValueError(f"num_kv_shared_layers={n}: layer {layer} and its source {config.kv_source(layer)} "
                             "must both use RoPE or both not (nope_layers)")


def check_qwen3_5(config) -> None:
    """Qwen3.5's fields (chapter 21): ``partial_rotary_factor`` (RoPE, an even leading part of each head; not with
    Gemma's other RoPE tables), ``attn_output_gate`` (MHA / GQA / MQA softmax layers, not Gemma 4's attention),
    the ``linear_*`` sizes of gated DeltaNet layers. Raises TypeError / ValueError naming the field."""
    if not isinstance(config.attn_output_gate, bool):
        raise TypeError(f"attn_output_gate must be a bool; got {config.attn_output_gate!r}")
    fraction = config.partial_rotary_factor
    if fraction is not None:
        if config.position != "rope":
            raise ValueError(f"partial_rotary_factor={fraction!r} is given but position={config.position!r} does not "
                             "use RoPE")
        for name in ("rope_local_base", "global_partial_rotary_factor", "global_head_dim"):
            if getattr(config, name) is not None:
                raise ValueError(f"partial_rotary_factor={fraction!r} does not combine with {name}="
                                 f"{getattr(config, name)!r} (Gemma's own RoPE tables)")
        LeadingRotaryEmbedding(config.head_dim, config.rope_base, fraction, config.rope_scaling)  # checks it, named
    softmax = [t for t in config.layer_types if t != "linear_attention"]
    if config.attn_output_gate:
        if config.attention not in ("mha", "gqa", "mqa") or not softmax:
            raise ValueError(f"attn_output_gate=True gates MHA / GQA / MQA softmax layers; got attention="
                             f"{config.attention!r} with {len(softmax)} softmax layer(s)")
        reuse = {"num_kv_shared_layers": config.num_kv_shared_layers or None, "global_n_kv_heads": config.global_n_kv_heads,
                 "attention_k_eq_v": config.attention_k_eq_v or None, "value_norm": config.value_norm or None,
                 "global_head_dim": config.global_head_dim}
        for name, value in reuse.items():
            if value is not None:
                raise ValueError(f"attn_output_gate=True does not combine with {name}={value!r} (Gemma 4's attention)")
    sizes = ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")
    given = [name for name in sizes if getattr(config, name) is not None]
    for name in given:
        positive_int(name, getattr(config, name))
    if given and (config.linear_layer != "gated_deltanet" or "linear_attention" not in config.layer_types):
        raise ValueError(f"{given[0]}={getattr(config, given[0])!r} is for gated DeltaNet layers; got linear_layer="
                         f"{config.linear_layer!r} and {config.layer_types.count('linear_attention')} linear layer(s)")
    n_k = config.linear_num_key_heads or config.n_heads
    if config.linear_num_value_heads is not None:
        divisible("linear_num_value_heads", config.linear_num_value_heads, "linear_num_key_heads", n_k)
    if "linear_attention" in config.layer_types and (config.linear_key_head_dim is None or config.linear_value_head_dim is None):
        divisible("d_model", config.d_model, "linear_num_key_heads (or n_heads)", n_k)
