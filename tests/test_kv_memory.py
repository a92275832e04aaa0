"""The KV-cache estimator: the published figures, and bytes measured on real cache tensors."""
from __future__ import annotations

import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.cache.memory import kv_cache_bytes, layer_windows

BIG = {"n_layers": 32, "head_dim": 128, "seq_len": 32_768, "dtype": torch.bfloat16}


@pytest.mark.parametrize(
    ("n_kv_heads", "window", "gb"),
    [(32, None, 17.18), (8, None, 4.29), (32, 1024, 3.14), (8, 1024, 0.78)],
)
def test_published_figures(n_kv_heads, window, gb):
    # d_model 4096 = 32 heads of 128, 32 layers, 32,768 tokens, bfloat16; window on 5 of every 6 layers.
    n = kv_cache_bytes(n_kv_heads=n_kv_heads, sliding_window=window, global_every=6 if window else None, **BIG)
    assert round(n / 1e9, 2) == gb


def test_mha_by_hand():
    # 2 (K and V) x 32 layers x 32 heads x 128 x 32,768 tokens x 2 bytes.
    assert kv_cache_bytes(n_kv_heads=32, **BIG) == 2 * 32 * 32 * 128 * 32_768 * 2


def test_gemma3_pattern():
    windows = layer_windows(12, sliding_window=1024, global_every=6)
    assert windows == [1024] * 5 + [None] + [1024] * 5 + [None]


@pytest.mark.parametrize(("attention", "n_kv_heads"), [("mha", None), ("gqa", 2), ("mqa", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4])
def test_agrees_with_the_tensors_of_a_filled_cache(attention, n_kv_heads, dtype, window):
    # With a window: two local layers, then a global one (global_every=3); the local layers' caches are rings.
    local = None if window is None else ("sliding_attention", "sliding_attention", "full_attention")
    config = GPTConfig(vocab_size=50, block_size=16, n_layers=3, n_heads=4, d_model=32, attention=attention,
                       n_kv_heads=n_kv_heads, sliding_window=window, layer_types=local)
    model = GPT(config).to(dtype).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 50, (2, 16)), cache=cache)
    measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.buffers)
    estimate = kv_cache_bytes(n_layers=3, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, seq_len=16,
                              dtype=dtype, batch_size=2, sliding_window=window, global_every=3 if window else None)
    assert measured == estimate


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sliding_window": 0}, ValueError, "sliding_window=0 must be a positive integer"),
        ({"global_every": 6}, ValueError, "global_every=6 needs a sliding_window"),
        ({"seq_len": 0}, ValueError, "seq_len=0 must be a positive integer"),
        ({"dtype": "bfloat16"}, TypeError, "dtype must be a torch.dtype, got 'bfloat16'"),
        ({"n_kv_heads": 2.5}, TypeError, r"n_kv_heads must be an int; got 2.5 \(float\)"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = {"n_layers": 2, "n_kv_heads": 2, "head_dim": 8, "seq_len": 16, **kwargs}
    with pytest.raises(error, match=match):
        kv_cache_bytes(**args)
