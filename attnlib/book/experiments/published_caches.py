"""The KV cache of published models that mix layer types, at their real sizes. Chapter 20.

Each model's attention settings are typed in from its published ``config.json`` (the source is
named in :data:`PUBLISHED`), made into transformers' own config class, and the cache is computed
twice:

* from the config (:func:`config_plan`: each layer's type, key/value heads and head width, and
  whether it reuses another layer's keys and values), summed by :func:`attnlib.kv_cache_bytes`;
* from the model (:func:`model_widths`): transformers' ``*ForCausalLM`` built on the meta device
  (shapes without memory), each attention layer's ``k_proj`` and ``v_proj`` widths counted (a
  Gemma 4 layer that reuses an earlier layer's keys and values has neither).

Nothing is downloaded: transformers' classes are built locally, offline.
"""
from __future__ import annotations

import torch

from attnlib.cache.memory import kv_cache_bytes

__all__ = ["PUBLISHED", "cache_bytes", "config_plan", "hf_config", "model_widths", "table"]

_HF = "https://huggingface.co/"
#: name -> transformers' config and model classes, the published values (``config.json``; the text
#: model's part for multimodal ones), and where they come from.
PUBLISHED = {
    "Gemma 3 27B": dict(
        config="Gemma3TextConfig", model="Gemma3ForCausalLM",
        source=_HF + "google/gemma-3-27b-it/blob/main/config.json (text_config)",
        fields=dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                    num_key_value_heads=16, head_dim=128, sliding_window=1024, query_pre_attn_scalar=168,
                    max_position_embeddings=131072, vocab_size=262208,
                    rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "Gemma 4 E4B": dict(
        config="Gemma4TextConfig", model="Gemma4ForCausalLM",
        source=("docs.nvidia.com/nemo/megatron-bridge (recipe gemma4_e4b: 42 layers, hidden 2560, 8 heads, "
                "2 KV heads, global head_dim 512, 5:1, KV shared across the last 18 layers) and "
                "github.com/google/gemma.cpp pull 919 (head_dim 256 / 512, window 512)"),
        fields=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512,
                    num_kv_shared_layers=18, vocab_size=262144, max_position_embeddings=131072)),
    "gpt-oss-120b": dict(
        config="GptOssConfig", model="GptOssForCausalLM",
        source=_HF + "openai/gpt-oss-120b/blob/main/config.json",
        fields=dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=128,
                    num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072)),
    "SmolLM3 3B": dict(
        config="SmolLM3Config", model="SmolLM3ForCausalLM",
        source=_HF + "HuggingFaceTB/SmolLM3-3B/blob/main/config.json",
        fields=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                    num_key_value_heads=4, no_rope_layer_interval=4, max_position_embeddings=65536,
                    vocab_size=128256, use_sliding_window=False)),
    "Llama 4 Scout": dict(
        config="Llama4TextConfig", model="Llama4ForCausalLM",
        source=_HF + "meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json (text_config)",
        fields=dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
                    num_attention_heads=40, num_key_value_heads=8, head_dim=128, attention_chunk_size=8192,
                    num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
                    vocab_size=202048, max_position_embeddings=10485760)),
}


def hf_config(name: str):
    """transformers' config of published model ``name`` (a key of :data:`PUBLISHED`), built locally.

    Raises:
        ValueError: an unknown name.
    """
    import transformers

    if name not in PUBLISHED:
        raise ValueError(f"name={name!r} is not one of {tuple(PUBLISHED)}")
    entry = PUBLISHED[name]
    return getattr(transformers, entry["config"])(**entry["fields"])


def config_plan(config) -> dict:
    """Each layer's cache from a transformers config: ``layer_types``, ``n_kv_heads`` and ``head_dim`` (one per
    layer), ``num_kv_shared_layers``, ``sliding_window``, ``attention_chunk_size``: :func:`attnlib.kv_cache_bytes`'
    arguments. A layer without a window is ``"full_attention"`` (SmolLM3's list says nothing else)."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    layers = getattr(config, "per_layer_config", None)  # transformers' per-layer view (Gemma 4: wider global heads)
    layers = [layers[i] for i in range(n)] if layers is not None else [config] * n
    heads = [c.num_key_value_heads for c in layers]
    dims = [getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads for c in layers]
    return dict(layer_types=types, n_kv_heads=heads, head_dim=dims,
                num_kv_shared_layers=getattr(config, "num_kv_shared_layers", 0) or 0,
                sliding_window=getattr(config, "sliding_window", None) if "sliding_attention" in types else None,
                attention_chunk_size=getattr(config, "attention_chunk_size", None)
                if "chunked_attention" in types else None)


def cache_bytes(name: str, seq_len: int, dtype: torch.dtype = torch.bfloat16, batch_size: int = 1) -> int:
    """Bytes of keys and values published model ``name`` caches after ``seq_len`` tokens (from its config)."""
    return kv_cache_bytes(seq_len=seq_len, dtype=dtype, batch_size=batch_size, **config_plan(hf_config(name)))


def model_widths(name: str) -> list[int]:
    """Numbers each layer of ``name``'s transformers model caches per token (keys + values), counted from its
    attention layers built on the meta device: ``k_proj`` and ``v_proj`` output widths, the key's twice where
    the keys are the values (``v_proj`` None), 0 for a layer without ``k_proj`` (it reuses another's)."""
    import transformers
    from transformers.initialization import no_init_weights

    config = hf_config(name)
    with torch.device("meta"), no_init_weights():  # shapes only: no memory, no initialisation to run
        model = getattr(transformers, PUBLISHED[name]["model"])(config)
    widths = []
    for layer in model.model.layers:
        attn = layer.self_attn
        k, v = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
        widths.append(0 if k is None else k.out_features + (k.out_features if v is None else v.out_features))
    return widths


def table(seq_lens: tuple[int, ...] = (8192, 131072), dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per published model: its pattern in counts, and its cache (bytes, one sequence) at ``seq_lens``,
    with the same model's cache if every layer were full attention and kept its own keys and values."""
    rows = []
    for name in PUBLISHED:
        plan = config_plan(hf_config(name))
        types = plan["layer_types"]
        full = dict(plan, layer_types=["full_attention"] * len(types), num_kv_shared_layers=0,
                    sliding_window=None, attention_chunk_size=None)
        rows.append(dict(
            model=name, layers=len(types),
            full=types.count("full_attention"), sliding=types.count("sliding_attention"),
            chunked=types.count("chunked_attention"), shared=plan["num_kv_shared_layers"],
            window=plan["sliding_window"] or plan["attention_chunk_size"],
            bytes={T: kv_cache_bytes(seq_len=T, dtype=dtype, **plan) for T in seq_lens},
            all_full_bytes={T: kv_cache_bytes(seq_len=T, dtype=dtype, **full) for T in seq_lens},
        ))
    return rows
