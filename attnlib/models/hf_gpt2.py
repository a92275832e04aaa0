"""GPT-2 in attnlib: loading Hugging Face GPT-2 weights, and how big the models are. Chapter 14.

Hugging Face's ``GPT2LMHeadModel`` stores its linear layers as ``Conv1D`` modules,
whose weight is ``(in_features, out_features)``: the transpose of ``nn.Linear``'s.
Its fused ``c_attn`` produces ``[q | k | v]`` along the output axis, the same order as
attnlib's ``qkv``; its causal-mask buffers (``attn.bias``, ``attn.masked_bias`` in older
versions) are not weights and are skipped; its output head is tied to ``wte``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from attnlib._checks import weight_tensors
from attnlib.models.config import GPTConfig
from attnlib.models.decoder import GPT

__all__ = ["config_from_hf", "from_hf_gpt2", "hf_gpt2_key_map", "parameter_breakdown", "saved_activation_bytes"]

# attnlib module (per block) -> (Hugging Face module, whether its weight is a transposed Conv1D)
_BLOCK_MODULES = {"ln_1": ("ln_1", False), "attn.qkv": ("attn.c_attn", True), "attn.out_proj": ("attn.c_proj", True),
                  "ln_2": ("ln_2", False), "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}
# attnlib name (per block) -> (Hugging Face name, transpose?): a weight and a bias per module, biases never transposed
_BLOCK_KEYS = {f"{ours}.{kind}": (f"{theirs}.{kind}", transpose and kind == "weight")
               for ours, (theirs, transpose) in _BLOCK_MODULES.items() for kind in ("weight", "bias")}


def hf_gpt2_key_map(n_layers: int) -> dict[str, tuple[str, bool]]:
    """attnlib parameter name → (Hugging Face ``GPT2LMHeadModel`` name, whether to transpose)."""
    keys = {
        "tok_emb.weight": ("transformer.wte.weight", False),
        "pos_emb.weight": ("transformer.wpe.weight", False),
        "ln_f.weight": ("transformer.ln_f.weight", False),
        "ln_f.bias": ("transformer.ln_f.bias", False),
    }
    for i in range(n_layers):
        for ours, (theirs, transpose) in _BLOCK_KEYS.items():
            keys[f"blocks.{i}.{ours}"] = (f"transformer.h.{i}.{theirs}", transpose)
    return keys


# Hugging Face activation_function -> attnlib's gelu_approximate
_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, what attnlib's GPT uses


def _hf(hf_config, field: str, default=None):
    return getattr(hf_config, field, default)


def config_from_hf(hf_config) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``GPT2Config``, refusing what attnlib's GPT cannot reproduce.

    Reproduced: the sizes, the tanh GELU (``gelu_new``, ``gelu_pytorch_tanh``) and the exact one
    (``gelu``), and ``reorder_and_upcast_attn`` (it only computes the scores in fp32, which attnlib's
    fp32 model does anyway).

    Raises:
        TypeError: not a GPT-2 configuration (``model_type`` is not ``"gpt2"``).
        ValueError: a variant attnlib cannot reproduce, naming the field and its value: another
            activation, ``layer_norm_epsilon`` other than 1e-5, ``n_inner`` other than ``4 * n_embd``,
            ``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx=True``,
            ``tie_word_embeddings=False`` (attnlib's head is tied to the token embedding),
            ``add_cross_attention=True``.
    """
    if _hf(hf_config, "model_type") != "gpt2":
        raise TypeError(f"expected a GPT2Config (model_type='gpt2'); got model_type={_hf(hf_config, 'model_type')!r}")
    activation = hf_config.activation_function
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation_function={activation!r}: attnlib's GPT has a GELU, one of {sorted(_ACTIVATIONS)}")
    refusals = [
        ("layer_norm_epsilon", hf_config.layer_norm_epsilon, abs(hf_config.layer_norm_epsilon - _LAYER_NORM_EPS) > 1e-12,
         f"attnlib's LayerNorms use {_LAYER_NORM_EPS}"),
        ("n_inner", hf_config.n_inner, hf_config.n_inner not in (None, 4 * hf_config.n_embd),
         f"attnlib's MLP is 4 * n_embd = {4 * hf_config.n_embd} wide"),
        ("scale_attn_weights", _hf(hf_config, "scale_attn_weights", True),
         not _hf(hf_config, "scale_attn_weights", True), "attnlib always scales the scores by 1/sqrt(head_dim)"),
        ("scale_attn_by_inverse_layer_idx", _hf(hf_config, "scale_attn_by_inverse_layer_idx", False),
         bool(_hf(hf_config, "scale_attn_by_inverse_layer_idx", False)), "attnlib does not scale the scores by layer"),
        ("tie_word_embeddings", _hf(hf_config, "tie_word_embeddings", True),
         not _hf(hf_config, "tie_word_embeddings", True), "attnlib's output head is tied to the token embedding"),
        ("add_cross_attention", _hf(hf_config, "add_cross_attention", False),
         bool(_hf(hf_config, "add_cross_attention", False)), "attnlib's GPT has no cross-attention"),
    ]
    for field, value, refused, why in refusals:
        if refused:
            raise ValueError(f"{field}={value!r} cannot be reproduced: {why}")
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        block_size=hf_config.n_positions,
        n_layers=hf_config.n_layer,
        n_heads=hf_config.n_head,
        d_model=hf_config.n_embd,
        bias=True,
        dropout=0.0,
        gelu_approximate=_ACTIVATIONS[activation],
    )


# GPTConfig field -> the GPT2Config field it must equal
_MATCHED_FIELDS = {
    "n_layers": "n_layer",
    "n_heads": "n_head",
    "d_model": "n_embd",
    "vocab_size": "vocab_size",
    "block_size": "n_positions",
    "gelu_approximate": "activation_function",
}


def _check_config(config: GPTConfig, source_config: GPTConfig | None) -> None:
    """Refuse a config whose model cannot hold GPT-2's weights (or, given the source's, differs from it)."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be an attnlib.GPTConfig or None; got {type(config).__name__}")
    layout = {"attention": "mha", "bias": True, "position": "learned", "norm": "layernorm", "norm_eps": _LAYER_NORM_EPS,
              "norm_placement": "pre", "feedforward": "gelu", "d_ff": 4 * config.d_model,
              "head_dim": config.d_model // config.n_heads, "qk_norm": False, "tie_embeddings": True,
              "layer_types": ("full_attention",) * config.n_layers, "attn_softcap": None}
    # every other choice (chapters 16-20's fields) as a GPT of these sizes has it by default
    free = {*_MATCHED_FIELDS, *layout, "dropout", "gelu_approximate", "attn_fn"}  # attn_fn: how, not what
    default = GPTConfig(**{k: getattr(config, k) for k in _MATCHED_FIELDS})
    layout |= {k: getattr(default, k) for k in config.to_dict() if k not in free}
    for name, value in layout.items():
        if getattr(config, name) != value:
            raise ValueError(f"config.{name}={getattr(config, name)!r}: GPT-2's layout has {name}={value!r}")
    if source_config is None:
        if config.gelu_approximate != "tanh":
            raise ValueError(f"config.gelu_approximate={config.gelu_approximate!r}: GPT-2 uses the tanh GELU "
                             "(build the config with gelu_approximate='tanh')")
        return
    for ours, theirs in _MATCHED_FIELDS.items():
        mine, source = getattr(config, ours), getattr(source_config, ours)
        if mine != source:
            raise ValueError(f"config.{ours}={mine!r} does not match the source model's {theirs} "
                             f"(config.{ours}={source!r} reproduces it)")


_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # old transformers' causal-mask buffers, not weights


def _layer_count(state: Mapping[str, torch.Tensor]) -> int:
    layers = {int(k.split(".")[2]) for k in state if k.startswith("transformer.h.") and k.split(".")[2].isdigit()}
    return max(layers) + 1 if layers else 0


def _check_state_keys(state: Mapping[str, torch.Tensor], key_map: dict[str, tuple[str, bool]], n_layers: int) -> None:
    """Refuse a state dict with more layers than the config, an untied output head, or weights attnlib has no place for."""
    found = _layer_count(state)
    if found > n_layers:
        raise ValueError(f"the GPT-2 state dict has {found} layers but config.n_layers={n_layers}: "
                         "the extra layers would be dropped")
    head, wte = state.get("lm_head.weight"), state.get("transformer.wte.weight")
    if head is not None and wte is not None and head is not wte and not torch.equal(head, wte):
        raise ValueError("the state dict's 'lm_head.weight' differs from 'transformer.wte.weight': an untied "
                         "output head, which attnlib's GPT (head tied to the token embedding) cannot hold")
    used = {theirs for theirs, _ in key_map.values()} | {"lm_head.weight"}
    extra = sorted(k for k in state if k not in used and not k.endswith(_MASK_BUFFERS))
    if extra:
        raise ValueError(f"the state dict holds {extra[0]!r} ({len(extra)} unknown keys): "
                         "attnlib's GPT has no place for it")


def from_hf_gpt2(source, config: GPTConfig | None = None) -> GPT:
    """An :class:`attnlib.GPT` holding the weights of a Hugging Face GPT-2 (chapter 14).

    Args:
        source: a ``transformers.GPT2LMHeadModel`` (its config gives the sizes) or its
            ``state_dict()`` (then ``config`` is required: a state dict does not say ``n_heads``).
        config: optional for a model, where it must equal what the model's own config gives
            (:func:`config_from_hf`: layers, heads, width, vocabulary, positions, GELU); required for
            a state dict, where it must have the tanh GELU (``GPTConfig.gpt2(...)`` does). Either way:
            ``attention="mha"`` and ``bias=True``.

    Returns:
        The model in eval mode, on the CPU, in fp32.

    Raises:
        TypeError: ``source`` is neither a GPT-2 model nor a mapping; ``config`` not a GPTConfig; a weight that
            is not a floating point tensor (an int8 or bool one, named).
        ValueError: a GPT-2 variant attnlib cannot reproduce (see :func:`config_from_hf`), a config
            that differs from the source's (the field and both values are named), no config for a raw
            state dict, a missing, extra or untied key, more layers than the config, or a shape that
            does not match (the message names the key).
    """
    if hasattr(source, "state_dict") and hasattr(source, "config"):
        source_config = config_from_hf(source.config)
        config = source_config if config is None else config
        state = source.state_dict()
    elif isinstance(source, Mapping):
        source_config, state = None, source
        if config is None:
            raise ValueError("a raw state dict does not say n_heads: pass config=GPTConfig.gpt2(...) or the HF model")
    else:
        raise TypeError(f"source must be a GPT2LMHeadModel or its state_dict; got {type(source).__name__}")
    _check_config(config, source_config)
    weight_tensors(state, ignore=_MASK_BUFFERS)
    key_map = hf_gpt2_key_map(config.n_layers)
    _check_state_keys(state, key_map, config.n_layers)
    model = GPT(config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, (theirs, transpose) in key_map.items():
            if theirs not in state:
                raise ValueError(f"the GPT-2 state dict has no {theirs!r} (for attnlib's {name!r})")
            tensor = state[theirs].t() if transpose else state[theirs]
            if tuple(tensor.shape) != tuple(ours[name].shape):
                raise ValueError(
                    f"{theirs!r} has shape {tuple(state[theirs].shape)}"
                    f"{' (transposed: ' + str(tuple(tensor.shape)) + ')' if transpose else ''}, "
                    f"but attnlib's {name!r} is {tuple(ours[name].shape)}: the config does not match the checkpoint"
                )
            ours[name].copy_(tensor)
    return model.eval()


def parameter_breakdown(config: GPTConfig) -> list[tuple[str, int]]:
    """Parameters by part, counted on a model built on the ``meta`` device (no memory used).

    Returns:
        ``[(part, count), ...]``: token embedding (= output head, tied), position
        embedding, each part of one block, one block, all blocks, the final norm, and
        ``"total"`` (equal to ``GPT(config).num_parameters()``; 124,439,808 for GPT-2 small).
    """
    with torch.device("meta"):
        model = GPT(config)
    named = dict(model.named_parameters())

    def count(prefix: str) -> int:
        return sum(p.numel() for n, p in named.items() if n.startswith(prefix))

    block = [(f"block: {n}", count(f"blocks.0.{n}")) for n, _ in model.blocks[0].named_children()]
    rows = [("token embedding (tied output head)", count("tok_emb")), ("position embedding", count("pos_emb"))]
    rows += block + [("one block", count("blocks.0.")), (f"{config.n_layers} blocks", count("blocks."))]
    rows += [("final LayerNorm", count("ln_f")), ("total", model.num_parameters())]
    return rows


def saved_activation_bytes(model: nn.Module, idx: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of ``model(idx, idx)`` (measured, not estimated).

    Counts each saved storage once (parameters excluded), via
    ``torch.autograd.graph.saved_tensors_hooks``.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    del loss
    return sum(seen.values())
