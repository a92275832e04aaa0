"""How much memory a KV cache needs, before allocating it. Chapters 08 and 17.

Each layer keeps, per token of each sequence, ``2 · n_kv_heads · head_dim`` numbers (a key
and a value per key/value head). A layer with a sliding window keeps at most ``window``
positions, whatever the length; in a local:global pattern (Gemma 3: five local layers, then
one global) only the global layers grow with the context:

    bytes = Σ_layers  B · 2 · n_kv_heads · head_dim · min(T, window_of_layer) · bytes_per_number

For a model with d_model 4096, 32 heads of 128 and 32 layers at T = 32,768 in bfloat16 this
gives 17.18 GB (MHA), 4.29 GB (GQA, 8 key/value heads), 3.14 GB (MHA with a 1,024-token window
on 5 of every 6 layers) and 0.78 GB (both): the figures of *LLMs from Scratch*'s bonus
material, checked in tests/test_kv_memory.py, which also measures real cache tensors.

Chapter 20 gives the pattern as transformers' ``layer_types`` list instead: a full layer holds every
position, a sliding one ``min(T, window)``, a chunked one (Llama 4) ``min(T, chunk)`` (the chunk's
slots, allocated once), a linear-attention layer no keys or values (its fixed state is not counted
here), and a layer that reuses an earlier layer's keys and values (Gemma 4's last
``num_kv_shared_layers``) nothing of its own. Sizes may differ per layer (Gemma 4's global layers
have wider heads): ``n_kv_heads`` and ``head_dim`` then take one value per layer.
"""
from __future__ import annotations

import torch

from attnlib._checks import positive_int

__all__ = ["kv_cache_bytes", "layer_cache_lengths", "layer_windows"]

#: The layer types a cache holds keys and values for (transformers' strings), and the one it holds none for.
CACHED_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def layer_windows(n_layers: int, sliding_window: int | None = None, global_every: int | None = None,
                  ) -> list[int | None]:
    """The window of each layer: ``None`` (global, sees everything) or the window length.

    Args:
        n_layers: number of layers.
        sliding_window: window of the local layers; ``None``: every layer is global.
        global_every: with a window, every ``global_every``-th layer is global (layers
            ``global_every - 1, 2·global_every - 1, …``; Gemma 3: 6, i.e. 5 local : 1 global);
            ``None``: every layer is local.

    Raises:
        ValueError: a count or window not an int >= 1; ``global_every`` without a window.
    """
    positive_int("n_layers", n_layers)
    if sliding_window is None:
        if global_every is not None:
            raise ValueError(f"global_every={global_every!r} needs a sliding_window for the other layers")
        return [None] * n_layers
    positive_int("sliding_window", sliding_window)
    if global_every is None:
        return [sliding_window] * n_layers
    positive_int("global_every", global_every)
    return [None if (layer + 1) % global_every == 0 else sliding_window for layer in range(n_layers)]


def layer_cache_lengths(layer_types, seq_len: int, *, sliding_window: int | None = None,
                        attention_chunk_size: int | None = None, num_kv_shared_layers: int = 0) -> list[int]:
    """Positions of one sequence each layer's cache holds after ``seq_len`` tokens. Chapter 20.

    Args:
        layer_types: one of ``"full_attention"``, ``"sliding_attention"``, ``"chunked_attention"``,
            ``"linear_attention"`` per layer (transformers' strings).
        seq_len: tokens so far.
        sliding_window: the window of the sliding layers (needed when there is one).
        attention_chunk_size: the chunk of the chunked layers (needed when there is one).
        num_kv_shared_layers: the last this many layers reuse an earlier layer's keys and values
            (Gemma 4): they hold none of their own.

    Returns:
        list of ints, one per layer: ``seq_len`` (full), ``min(seq_len, window)`` (sliding),
        ``min(seq_len, chunk)`` (chunked: the slots of a chunk, the most it holds), 0 (linear, shared).

    Raises:
        TypeError: ``layer_types`` not a list or tuple of strings.
        ValueError: an unknown type (named with its index), a sliding or chunked layer without its
            size, a size not an int >= 1, ``num_kv_shared_layers`` outside ``[0, n_layers)``.
    """
    if not isinstance(layer_types, (list, tuple)) or not all(isinstance(t, str) for t in layer_types):
        raise TypeError(f"layer_types must be a list or tuple of strings; got {layer_types!r}")
    if not layer_types:
        raise ValueError("layer_types must name at least one layer; got an empty list")
    for i, kind in enumerate(layer_types):
        if kind not in (*CACHED_TYPES, "linear_attention"):
            raise ValueError(f"layer_types[{i}]={kind!r} is not one of {(*CACHED_TYPES, 'linear_attention')}")
    positive_int("seq_len", seq_len)
    sizes = {"sliding_attention": ("sliding_window", sliding_window),
             "chunked_attention": ("attention_chunk_size", attention_chunk_size)}
    for kind, (name, value) in sizes.items():
        if kind in layer_types:
            if value is None:
                raise ValueError(f"layer_types has {kind!r} layers: {name} must be given")
            positive_int(name, value)
    if not isinstance(num_kv_shared_layers, int) or not 0 <= num_kv_shared_layers < len(layer_types):
        raise ValueError(f"num_kv_shared_layers={num_kv_shared_layers!r} must be an int in "
                         f"[0, {len(layer_types)}) (at least one layer computes keys and values)")
    lengths = []
    for i, kind in enumerate(layer_types):
        if kind == "linear_attention" or i >= len(layer_types) - num_kv_shared_layers:
            lengths.append(0)
        else:
            lengths.append(seq_len if kind == "full_attention" else min(seq_len, sizes[kind][1]))
    return lengths


def _per_layer(name: str, value, n_layers: int) -> list[int]:
    """``value`` (an int, or one int per layer) as one int per layer."""
    if not isinstance(value, (list, tuple)):
        positive_int(name, value)
        return [value] * n_layers
    values = value
    if len(values) != n_layers:
        raise ValueError(f"{name}={value!r} must be an int or one int per layer ({n_layers})")
    for i, v in enumerate(values):
        positive_int(f"{name}[{i}]", v)
    return list(values)


def kv_cache_bytes(*, n_layers: int | None = None, n_kv_heads, head_dim, seq_len: int,
                   dtype: torch.dtype = torch.bfloat16, batch_size: int = 1, sliding_window: int | None = None,
                   global_every: int | None = None, layer_types=None, attention_chunk_size: int | None = None,
                   num_kv_shared_layers: int = 0) -> int:
    """Bytes of the keys and values a cache holds after ``seq_len`` tokens.

    Args:
        n_layers: number of layers (with ``layer_types``: may be left out, else it must agree).
        n_kv_heads, head_dim: the model's sizes (``n_kv_heads = n_heads`` for MHA); each an int, or
            one int per layer (Gemma 4's global layers: other widths).
        seq_len: tokens per sequence held (prompt + generated).
        dtype: the cache's dtype (its element size is used: bfloat16/float16 2 bytes, float32 4).
        batch_size: sequences.
        sliding_window, global_every: see :func:`layer_windows` (chapter 17's form of a pattern).
        layer_types, attention_chunk_size, num_kv_shared_layers: the pattern as a list, chapter 20
            (see :func:`layer_cache_lengths`); ``global_every`` then cannot be given.

    Returns:
        int, bytes (divide by 1e9 for GB, by 2**30 for GiB).

    Raises:
        ValueError: a size not an int >= 1; a per-layer list of another length; ``layer_types`` with
            ``global_every``, or with an ``n_layers`` of another length; see :func:`layer_cache_lengths`.
        TypeError: ``dtype`` not a torch dtype.
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        positive_int(name, value)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if layer_types is None:
        if attention_chunk_size is not None or num_kv_shared_layers:
            raise ValueError("attention_chunk_size and num_kv_shared_layers need a layer_types list")
        if n_layers is None:
            raise ValueError("n_layers must be given (or a layer_types list)")
        positive_int("n_layers", n_layers)
        windows = layer_windows(n_layers, sliding_window, global_every)
        lengths = [seq_len if w is None else min(w, seq_len) for w in windows]
    else:
        if global_every is not None:
            raise ValueError(f"global_every={global_every!r} and layer_types both describe the pattern; give one")
        lengths = layer_cache_lengths(layer_types, seq_len, sliding_window=sliding_window,
                                      attention_chunk_size=attention_chunk_size,
                                      num_kv_shared_layers=num_kv_shared_layers)
        if n_layers is not None and n_layers != len(lengths):
            raise ValueError(f"n_layers={n_layers} but layer_types names {len(lengths)} layers")
    heads, dims = (_per_layer(n, v, len(lengths)) for n, v in (("n_kv_heads", n_kv_heads), ("head_dim", head_dim)))
    per_position = [batch_size * 2 * h * d * dtype.itemsize for h, d in zip(heads, dims)]  # K and V
    return sum(p * n for p, n in zip(per_position, lengths))
