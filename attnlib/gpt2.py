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

from attnlib.config import GPTConfig
from attnlib.model import GPT

__all__ = ["config_from_hf", "from_hf_gpt2", "hf_gpt2_key_map", "parameter_breakdown", "saved_activation_bytes"]

# attnlib name (per block) -> (Hugging Face name, transpose?)
_BLOCK_KEYS = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.out_proj.weight": ("attn.c_proj.weight", True),
    "attn.out_proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}


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


def config_from_hf(hf_config) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``GPT2Config``.

    Raises:
        ValueError: a GPT-2 variant attnlib cannot reproduce (another activation or LayerNorm epsilon,
            a separate inner MLP width).
    """
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function={hf_config.activation_function!r}: attnlib's GPT-2 uses the tanh GELU")
    if abs(hf_config.layer_norm_epsilon - 1e-5) > 1e-12:
        raise ValueError(f"layer_norm_epsilon={hf_config.layer_norm_epsilon}: attnlib's LayerNorms use 1e-5")
    if hf_config.n_inner not in (None, 4 * hf_config.n_embd):
        raise ValueError(f"n_inner={hf_config.n_inner}: attnlib's MLP is 4 * d_model = {4 * hf_config.n_embd} wide")
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        block_size=hf_config.n_positions,
        n_layers=hf_config.n_layer,
        n_heads=hf_config.n_head,
        d_model=hf_config.n_embd,
        bias=True,
        dropout=0.0,
        gelu_approximate="tanh",
    )


def from_hf_gpt2(source, config: GPTConfig | None = None) -> GPT:
    """An :class:`attnlib.GPT` holding the weights of a Hugging Face GPT-2.

    Args:
        source: a ``transformers.GPT2LMHeadModel`` (its config gives the sizes) or its
            ``state_dict()`` (then ``config`` is required: a state dict does not say ``n_heads``).
        config: the sizes; must have the tanh GELU (``GPTConfig.gpt2(...)`` does).

    Returns:
        The model in eval mode, on the CPU, in fp32.

    Raises:
        ValueError: no config for a raw state dict, a config without the tanh GELU,
            a missing key, or a shape that does not match (the message names the key).
        TypeError: ``source`` is neither a model nor a mapping.
    """
    if hasattr(source, "state_dict") and hasattr(source, "config"):
        config = config or config_from_hf(source.config)
        state = source.state_dict()
    elif isinstance(source, Mapping):
        state = source
        if config is None:
            raise ValueError("a raw state dict does not say n_heads: pass config=GPTConfig.gpt2(...) or the HF model")
    else:
        raise TypeError(f"source must be a GPT2LMHeadModel or its state_dict; got {type(source).__name__}")
    if config.gelu_approximate != "tanh":
        raise ValueError("GPT-2 uses the tanh GELU: build the config with gelu_approximate='tanh'")
    model = GPT(config)
    ours = model.state_dict()
    with torch.no_grad():
        for name, (theirs, transpose) in hf_gpt2_key_map(config.n_layers).items():
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
