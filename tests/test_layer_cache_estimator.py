"""Chapter 20's cache estimator: ``kv_cache_bytes(layer_types=...)`` against the caches the tiny models fill."""
import pytest
import torch

from attnlib import kv_cache_bytes
from attnlib.book.experiments import layer_patterns as lp
from attnlib.cache import layer_cache_lengths


def _held(cache) -> int:
    """Bytes of the positions each layer holds, from its tensors: a position's bytes times the positions kept."""
    return sum(layer.bytes_per_token() * min(layer.length, layer.capacity) for layer in cache.layers)


@pytest.mark.parametrize("name", lp.available())
def test_estimate_is_what_a_filled_cache_holds(name):
    """Every pattern of chapter 20's experiment: prefill T tokens (then one decoded token) into the model's own
    cache; the estimate from the config's layer_types equals the bytes held, exactly, at every length tried."""
    model = lp.build_model(name, 0).eval()
    c = model.config
    for T in (1, 15, 16, 17, 40, 63):
        cache = model.new_cache()
        with torch.no_grad():
            model(torch.randint(0, c.vocab_size, (1, T)), cache=cache)
            model(torch.randint(0, c.vocab_size, (1, 1)), cache=cache)
        estimate = kv_cache_bytes(n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, seq_len=T + 1, dtype=torch.float32,
                                  layer_types=list(c.layer_types), sliding_window=c.sliding_window,
                                  attention_chunk_size=c.attention_chunk_size,
                                  num_kv_shared_layers=getattr(c, "num_kv_shared_layers", 0) or 0)
        assert estimate == _held(cache), (name, T)
    assert cache.nbytes() == kv_cache_bytes(  # at the full context, what is allocated is what is held
        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, seq_len=c.block_size, dtype=torch.float32,
        layer_types=list(c.layer_types), sliding_window=c.sliding_window, attention_chunk_size=c.attention_chunk_size,
        num_kv_shared_layers=getattr(c, "num_kv_shared_layers", 0) or 0)


def test_the_list_form_equals_chapter_17s_period_form():
    """Gemma 3's 5:1 written as a list gives chapter 17's ``global_every=6`` numbers (and its 3.14 GB example)."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 6
    for T in (1, 1000, 1024, 1025, 32768):
        listed = kv_cache_bytes(n_kv_heads=32, head_dim=128, seq_len=T, layer_types=types, sliding_window=1024)
        period = kv_cache_bytes(n_layers=36, n_kv_heads=32, head_dim=128, seq_len=T, sliding_window=1024,
                                global_every=6)
        assert listed == period
    assert kv_cache_bytes(n_kv_heads=32, head_dim=128, seq_len=32768, sliding_window=1024,
                          layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 2,
                          ) == 3_137_339_392  # 32 layers: LLMs from Scratch's 3.14 GB


def test_lengths_per_layer_type_and_sharing():
    types = ["sliding_attention", "chunked_attention", "full_attention", "linear_attention", "full_attention",
             "sliding_attention"]
    assert layer_cache_lengths(types, 10, sliding_window=4, attention_chunk_size=8) == [4, 8, 10, 0, 10, 4]
    assert layer_cache_lengths(types, 3, sliding_window=4, attention_chunk_size=8) == [3, 3, 3, 0, 3, 3]
    assert layer_cache_lengths(types, 10, sliding_window=4, attention_chunk_size=8,
                               num_kv_shared_layers=2) == [4, 8, 10, 0, 0, 0]


def test_per_layer_widths():
    """Gemma 4's global layers: wider heads, other key/value heads; the bytes add layer by layer."""
    types = ["sliding_attention", "full_attention"]
    got = kv_cache_bytes(n_kv_heads=[4, 2], head_dim=[256, 512], seq_len=100, layer_types=types, sliding_window=10,
                         dtype=torch.float16)
    assert got == 2 * 2 * (4 * 256 * 10 + 2 * 512 * 100)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(layer_types=["full_attention", "global"]), ValueError, r"layer_types\[1\]='global' is not one of"),
    (dict(layer_types="full_attention"), TypeError, "layer_types must be a list or tuple of strings"),
    (dict(layer_types=[]), ValueError, "at least one layer"),
    (dict(layer_types=["sliding_attention"]), ValueError, "'sliding_attention' layers: sliding_window must be given"),
    (dict(layer_types=["chunked_attention"]), ValueError, "attention_chunk_size must be given"),
    (dict(layer_types=["full_attention"] * 2, num_kv_shared_layers=2), ValueError,
     r"num_kv_shared_layers=2 must be an int in \[0, 2\)"),
    (dict(layer_types=["full_attention"] * 2, n_layers=3), ValueError, "n_layers=3 but layer_types names 2"),
    (dict(layer_types=["full_attention"] * 2, global_every=2), ValueError, "global_every=2 and layer_types"),
    (dict(n_layers=2, num_kv_shared_layers=1), ValueError, "need a layer_types list"),
    (dict(layer_types=["full_attention"] * 2, head_dim=[8]), ValueError, r"head_dim=\[8\] must be an int or one"),
    (dict(layer_types=["full_attention"] * 2, head_dim=[8, 0]), ValueError, r"head_dim\[1\]=0 must be a positive"),
    (dict(layer_types=["full_attention"], n_kv_heads=2.0), TypeError, "n_kv_heads must be an int"),
    (dict(), ValueError, "n_layers must be given"),
])
def test_bad_inputs_are_refused_with_the_argument_named(kwargs, error, match):
    args = {"n_kv_heads": 2, "head_dim": 8, "seq_len": 10, **kwargs}
    with pytest.raises(error, match=match):
        kv_cache_bytes(**args)
