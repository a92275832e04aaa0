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
"""
from __future__ import annotations

import torch

from attnlib._checks import positive_int

__all__ = ["kv_cache_bytes", "layer_windows"]


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


def kv_cache_bytes(*, n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int,
                   dtype: torch.dtype = torch.bfloat16, batch_size: int = 1, sliding_window: int | None = None,
                   global_every: int | None = None) -> int:
    """Bytes of the keys and values a cache holds after ``seq_len`` tokens.

    Args:
        n_layers, n_kv_heads, head_dim: the model's sizes (``n_kv_heads = n_heads`` for MHA).
        seq_len: tokens per sequence held (prompt + generated).
        dtype: the cache's dtype (its element size is used: bfloat16/float16 2 bytes, float32 4).
        batch_size: sequences.
        sliding_window, global_every: see :func:`layer_windows`.

    Returns:
        int, bytes (divide by 1e9 for GB, by 2**30 for GiB).

    Raises:
        ValueError: a size not an int >= 1; TypeError: ``dtype`` not a torch dtype.
    """
    for name, value in (("n_kv_heads", n_kv_heads), ("head_dim", head_dim), ("seq_len", seq_len),
                        ("batch_size", batch_size)):
        positive_int(name, value)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    per_position = batch_size * 2 * n_kv_heads * head_dim * dtype.itemsize  # K and V
    windows = layer_windows(n_layers, sliding_window, global_every)
    return sum(per_position * (seq_len if w is None else min(w, seq_len)) for w in windows)
