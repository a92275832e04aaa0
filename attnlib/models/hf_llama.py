"""Loading Hugging Face Llama, Qwen3, Mistral and SmolLM3 weights into an :class:`attnlib.Decoder`. Chapters 16, 20.

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

from attnlib._checks import weight_tensors
from attnlib.models.config import DecoderConfig
from attnlib.models.decoder import Decoder
from attnlib.positional.scaling import ROPE_TYPES

__all__ = ["config_from_hf_decoder", "config_getter", "from_hf_llama", "from_hf_mistral", "from_hf_qwen3", "from_hf_smollm3",
           "hf_state_and_config", "rope_parameters"]

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
_FAMILIES = ("llama", "qwen3", "mistral", "smollm3")


def config_getter(hf_config):
    """``get(name, default)`` over a transformers config object or its ``config.json`` dict."""
    return hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)


def _flag(get, name: str) -> bool:
    """A boolean field (missing or None: False, every family's default); a str such as "false" is refused."""
    value = get(name, None)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a bool (true/false)")
    return bool(value)


def _int_field(get, name: str, *, optional: bool = False) -> int | None:
    value = get(name, None)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1 (the config's {name})")
    return value


def rope_parameters(get, default_theta: float) -> tuple[float, object, dict]:
    """``(rope_theta, rope type, the rest)`` of a config's ``rope_parameters`` (transformers 5) or ``rope_scaling``
    (older ``config.json``), ``rope_theta`` read from either. Raises ValueError: not a dict, a theta not a number."""
    rope = get("rope_parameters", None) or get("rope_scaling", None) or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict or None; got {rope!r}")
    rope = dict(rope)
    theta = rope.pop("rope_theta", get("rope_theta", default_theta))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"rope_theta={theta!r} must be a number")
    return float(theta), rope.get("rope_type", rope.get("type", "default")), rope


def _full_or_sliding(types, n_layers: int) -> list[str]:
    """``types`` as a list, checked: ``n_layers`` of ``"full_attention"`` / ``"sliding_attention"``; else ValueError."""
    if isinstance(types, (str, bytes)) or not hasattr(types, "__iter__"):
        raise ValueError(f"layer_types={types!r} must be a list of 'full_attention' / 'sliding_attention'")
    types = list(types)
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"cannot reproduce layer_types={types!r}: expected {n_layers} of 'full_attention' / "
                         "'sliding_attention'")
    return types


def _qwen3_layers(get, n_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Qwen3's ``layer_types`` and window, as ``transformers`` builds them: given, or layers from
    ``max_window_layers`` on slide when ``use_sliding_window``."""
    window = get("sliding_window", None) if _flag(get, "use_sliding_window") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r} must be an int >= 1 (the config's sliding_window)")
    types = get("layer_types", None)
    if types is None:
        first = get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n_layers)]
    types = _full_or_sliding(types, n_layers)
    if window is None and "sliding_attention" in types:
        raise ValueError(f"layer_types={types!r} has sliding layers but no window (use_sliding_window="
                         f"{get('use_sliding_window', None)!r}, sliding_window={get('sliding_window', None)!r}); "
                         "transformers cannot run such a config either")
    return tuple(types), window if "sliding_attention" in types else None


def _smollm3_layers(get, n_layers: int) -> tuple[tuple[str, ...], int | None, tuple[int, ...]]:
    """SmolLM3's ``layer_types``, window and NoPE layers as ``transformers`` builds them: ``no_rope_layers[i] == 1``
    means layer ``i`` *uses* RoPE (given, or every ``no_rope_layer_interval``-th layer without); sliding layers
    (given, or the NoPE layers when ``use_sliding_window``) attend within ``sliding_window``."""
    flags = get("no_rope_layers", None)
    if flags is None:
        interval = _int_field(get, "no_rope_layer_interval")
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if isinstance(flags, (str, bytes)) or not hasattr(flags, "__iter__"):
        raise ValueError(f"no_rope_layers={flags!r} must be a list of 0/1, one per layer (1: the layer uses RoPE)")
    flags = list(flags)
    if len(flags) < n_layers or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise ValueError(f"no_rope_layers={flags!r} must give 0 or 1 for each of the {n_layers} layers "
                         "(1: the layer uses RoPE)")
    window = get("sliding_window", None)
    types = get("layer_types", None)
    if types is None:
        slide = _flag(get, "use_sliding_window") and window is not None
        types = ["sliding_attention" if slide and not flags[i] else "full_attention" for i in range(n_layers)]
    types = _full_or_sliding(types, n_layers)
    if "sliding_attention" in types:
        if not _flag(get, "use_sliding_window"):
            raise ValueError(f"layer_types={types!r} has sliding layers but use_sliding_window="
                             f"{get('use_sliding_window', None)!r}: transformers' attention functions disagree on it")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window={window!r} must be an int >= 1 (layer_types has sliding layers)")
    nope = tuple(i for i in range(n_layers) if not flags[i])
    return tuple(types), window if "sliding_attention" in types else None, nope


def config_from_hf_decoder(hf_config, family: str) -> DecoderConfig:
    """The :class:`~attnlib.DecoderConfig` of a ``transformers`` Llama / Qwen3 / Mistral / SmolLM3 config.

    Qwen3's ``layer_types`` map one to one (sliding and full layers, mixed as the config says); a
    Mistral config's window applies to every layer, as in ``transformers``; SmolLM3's ``no_rope_layers``
    (``0`` at a layer without RoPE) become ``nope_layers``.

    Args:
        hf_config: a ``transformers`` config (``LlamaConfig``, ...) or its dict (``config.json``, either the
            ``rope_parameters`` of transformers 5 or the older ``rope_scaling`` + ``rope_theta``).
        family: ``"llama"``, ``"qwen3"``, ``"mistral"`` or ``"smollm3"``.

    Raises:
        TypeError: ``hf_config`` neither a mapping nor a config object.
        ValueError: a setting attnlib cannot reproduce (another activation, MLP biases, a RoPE
            type or field :func:`~attnlib.positional.rope_frequencies` does not know, partial rotary,
            tensor-parallel pretraining, a layer type other than full or sliding), a size that is missing or not an
            int >= 1, a flag that is not a bool, a ``rms_norm_eps`` or ``rope_theta`` that is not a number; named.
    """
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {_FAMILIES}; got {family!r}")
    if hf_config is None or isinstance(hf_config, (str, bytes, int, float, list, tuple)):
        raise TypeError(f"hf_config must be a transformers config or its dict; got {type(hf_config).__name__}")
    get = config_getter(hf_config)
    model_type = get("model_type")
    if model_type is not None and model_type != family:
        raise ValueError(f"this is a {model_type!r} config; from_hf_{family} loads {family!r} models")
    sizes = {name: _int_field(get, name) for name in ("vocab_size", "max_position_embeddings", "num_hidden_layers",
                                                      "num_attention_heads", "hidden_size", "intermediate_size")}
    n_kv_heads, head_dim = _int_field(get, "num_key_value_heads", optional=True), _int_field(get, "head_dim", optional=True)
    eps = get("rms_norm_eps", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
        raise ValueError(f"rms_norm_eps={eps!r} must be a finite number > 0")
    refused = {
        "hidden_act": (get("hidden_act", "silu") != "silu", "only SiLU (SwiGLU) is reproduced"),
        "mlp_bias": (_flag(get, "mlp_bias"), "MLP biases are not reproduced"),
        "pretraining_tp": ((get("pretraining_tp", 1) or 1) != 1, "tensor-parallel slicing is not reproduced"),
        "partial_rotary_factor": (get("partial_rotary_factor", None) not in (None, 1, 1.0),
                                  "partial rotary (RoPE on part of each head) is not reproduced"),
    }
    theta, kind, rope = rope_parameters(get, 10000.0)
    refused["rope_parameters"] = (not isinstance(kind, str) or kind not in ROPE_TYPES or "partial_rotary_factor" in rope,
                                  f"RoPE type {kind!r} / fields {sorted(rope)} (attnlib reproduces {sorted(ROPE_TYPES)})")
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"cannot reproduce {name}={get(name)!r}: {why}")
    nope = ()
    if family == "qwen3":
        layer_types, window = _qwen3_layers(get, sizes["num_hidden_layers"])
    elif family == "smollm3":
        layer_types, window, nope = _smollm3_layers(get, sizes["num_hidden_layers"])
    else:  # Mistral: one window for every layer (transformers ignores layer_types there); Llama: none
        window = get("sliding_window", None) if family == "mistral" else None
        layer_types = None
    return DecoderConfig.llama(
        vocab_size=sizes["vocab_size"], block_size=sizes["max_position_embeddings"],
        n_layers=sizes["num_hidden_layers"], n_heads=sizes["num_attention_heads"], d_model=sizes["hidden_size"],
        n_kv_heads=n_kv_heads or sizes["num_attention_heads"],
        head_dim=head_dim or sizes["hidden_size"] // sizes["num_attention_heads"],
        d_ff=sizes["intermediate_size"], rope_base=float(theta), rope_scaling=None if kind == "default" else rope,
        norm_eps=float(eps), qk_norm=family == "qwen3", tie_embeddings=_flag(get, "tie_word_embeddings"),
        attention_bias=_flag(get, "attention_bias"), layer_types=layer_types, sliding_window=window, nope_layers=nope,
    )


def check_weight_names(family: str, missing: list[str], unexpected: list[str]) -> None:
    """The loaders' one refusal of a state dict whose names do not match the model (the first five of each).

    Raises:
        ValueError: ``missing`` or ``unexpected`` is not empty (both named, sorted).
    """
    if missing or unexpected:
        raise ValueError(f"the weights do not match a {family} model of this config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")


def check_tied_head(state: dict, tied: bool, embedding: str = "model.embed_tokens.weight") -> set[str]:
    """The loaders' refusal of an ``lm_head.weight`` that a tied config would drop: it differs from ``embedding``.

    Returns:
        the names a tied model leaves unread (``{"lm_head.weight"}``; none when untied).

    Raises:
        ValueError: ``tied`` and the state dict holds both weights, not equal (named).
    """
    head, table = state.get("lm_head.weight"), state.get(embedding)
    if tied and head is not None and table is not None and not (head.shape == table.shape and torch.equal(head, table)):
        raise ValueError(f"lm_head.weight differs from {embedding}, but tie_word_embeddings=True ties them: set "
                         "tie_word_embeddings=False in the config to load an untied head")
    return {"lm_head.weight"} if tied else set()


def hf_state_and_config(model_or_state_dict, config, to_config) -> tuple[dict, object]:
    """The state dict and the ``transformers`` config of a model, or of a state dict and its config (``to_config``:
    the config's :class:`~attnlib.DecoderConfig`, to compare a config given with a model's own). Raises as
    :func:`from_hf_llama` does."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        own_config = getattr(model_or_state_dict, "config", None)
        if config is not None and own_config is not None:  # a second config must describe the same model
            given, own = to_config(config), to_config(own_config)
            differ = {k: (v, own.to_dict()[k]) for k, v in given.to_dict().items() if own.to_dict()[k] != v}
            if differ:
                raise ValueError(f"config contradicts the model's own config: {differ} (given, the model's); "
                                 "leave config=None to use the model's")
        config = own_config if config is None else config
        state = model_or_state_dict.state_dict()
    elif isinstance(model_or_state_dict, Mapping):
        if config is None:
            raise ValueError("a state dict needs its transformers config: from_hf_...(state_dict, config=...)")
        state = dict(model_or_state_dict)
    else:
        raise TypeError(f"expected a transformers model or a state dict; got {type(model_or_state_dict).__name__}")
    weight_tensors(state)
    return state, config


def _load(model_or_state_dict, config, family: str) -> Decoder:
    state, config = hf_state_and_config(model_or_state_dict, config, lambda c: config_from_hf_decoder(c, family))
    ours = Decoder(config_from_hf_decoder(config, family))
    c = ours.config
    own = ours.state_dict()
    ignored = check_tied_head(state, c.tie_embeddings)
    wanted = {"tok_emb.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}
    if not c.tie_embeddings:
        wanted["lm_head.weight"] = "lm_head.weight"
    absent, present = {}, set()  # fused qkv name -> the q/k/v names it lacks; the q/k/v names left unstacked
    rows = {"q": c.n_heads * c.head_dim, "k": c.n_kv_heads * c.head_dim, "v": c.n_kv_heads * c.head_dim}
    for i in range(c.n_layers):
        for mine, theirs in _BLOCK_KEYS.items():
            wanted[f"blocks.{i}.{mine}"] = f"model.layers.{i}.{theirs}"
        p = f"model.layers.{i}.self_attn."
        for suffix in ("weight", "bias"):
            parts = {x: f"{p}{x}_proj.{suffix}" for x in "qkv"}
            mine = f"blocks.{i}.attn.qkv.{suffix}"
            if mine in own and all(k in state for k in parts.values()):
                for x, k in parts.items():  # each part's shape, named, before stacking
                    if state[k].shape != (rows[x], *own[mine].shape[1:]):
                        raise ValueError(f"{k} has shape {tuple(state[k].shape)}; expected {(rows[x], *own[mine].shape[1:])}")
                state[f"{p}qkv.{suffix}"] = torch.cat([state.pop(k) for k in parts.values()])  # rows [W_q; W_k; W_v]
            absent[f"{p}qkv.{suffix}"] = [k for k in parts.values() if k not in state]
            present |= {k for k in parts.values() if k in state and mine in own}  # the rest of an incomplete q/k/v
            wanted[mine] = f"{p}qkv.{suffix}"
    wanted = {mine: theirs for mine, theirs in wanted.items() if mine in own}
    missing = sorted(k for theirs in wanted.values() if theirs not in state for k in absent.get(theirs, [theirs]))
    unused = sorted(set(state) - set(wanted.values()) - ignored - present - {k for k in state if k.endswith("rotary_emb.inv_freq")})
    check_weight_names(family, missing, unused)
    with torch.no_grad():
        for mine, theirs in wanted.items():
            if own[mine].shape != state[theirs].shape:
                raise ValueError(f"{theirs} has shape {tuple(state[theirs].shape)}; expected {tuple(own[mine].shape)}")
            own[mine].copy_(state[theirs])
    return ours.to(state["model.embed_tokens.weight"].dtype)  # the weights' dtype (not a stray float32 buffer's)


def from_hf_llama(model_or_state_dict, config=None) -> Decoder:
    """An attnlib :class:`~attnlib.Decoder` equal to a ``transformers`` ``LlamaForCausalLM``.

    Args:
        model_or_state_dict: a ``LlamaForCausalLM``, or its ``state_dict()`` (then ``config`` is needed).
        config: the ``LlamaConfig`` (or its dict); default: the model's. Given with a model, it must describe
            the same model (a contradiction is refused, never loaded).

    Returns:
        a model in the weights' dtype whose ``forward(idx)`` gives the same logits (1e-5 in float32).

    Raises:
        TypeError: neither a model nor a mapping; a state dict value that is not a floating point tensor
            (an int8 or bool one, named).
        ValueError: a setting attnlib cannot reproduce (:func:`config_from_hf_decoder`), missing or unexpected
            weights (``q_proj``/``k_proj``/``v_proj`` named one by one), a shape mismatch, weights on the meta device,
            an ``lm_head.weight`` that a tied config would drop (:func:`check_tied_head`), a ``config`` that
            contradicts the model's own.
    """
    return _load(model_or_state_dict, config, "llama")


def from_hf_qwen3(model_or_state_dict, config=None) -> Decoder:
    """As :func:`from_hf_llama`, for ``Qwen3ForCausalLM`` (QK-norm, its own ``head_dim``, ``layer_types`` mixing
    sliding and full layers)."""
    return _load(model_or_state_dict, config, "qwen3")


def from_hf_mistral(model_or_state_dict, config=None) -> Decoder:
    """As :func:`from_hf_llama`, for ``MistralForCausalLM`` (a sliding window on every layer)."""
    return _load(model_or_state_dict, config, "mistral")


def from_hf_smollm3(model_or_state_dict, config=None) -> Decoder:
    """As :func:`from_hf_llama`, for ``SmolLM3ForCausalLM`` (chapter 20): layers without RoPE where
    ``no_rope_layers[i] == 0`` (every fourth by default), optionally sliding windows on them
    (``use_sliding_window``); a ``layer_types`` or ``no_rope_layers`` it cannot reproduce is refused, named."""
    return _load(model_or_state_dict, config, "smollm3")
