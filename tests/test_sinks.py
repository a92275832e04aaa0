"""StreamingLLM's attention sinks (attnlib.cache.SinkLayerCache) on the modern decoder."""
from __future__ import annotations

import pytest
import torch

from attnlib import GPT, GPTConfig, ModernConfig, ModernDecoder
from attnlib.cache import KVCache, SinkLayerCache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ModernDecoder(ModernConfig(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                      d_model=32)).eval()


def stream(model, idx, cache, first=5):
    with torch.no_grad():
        outs = [model(idx[:, :first], cache=cache)[0]]
        outs += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(first, idx.shape[1])]
    return torch.cat(outs, 1)


def test_nothing_evicted_is_full_attention(model):
    idx = torch.randint(0, 50, (2, 40))
    cache = KVCache(2, 1000, windows=[64, 64], n_sink=4)
    with torch.no_grad():
        torch.testing.assert_close(stream(model, idx, cache), model(idx)[0], atol=1e-5, rtol=1e-5)


def test_no_sinks_is_the_sliding_window(model):
    # RoPE scores depend on offsets only: positions renumbered within the cache change nothing.
    windowed = ModernDecoder(model.config.replace(sliding_window=8)).eval()
    windowed.load_state_dict(model.state_dict())
    idx = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        expected = windowed(idx)[0]
    torch.testing.assert_close(stream(model, idx, KVCache(2, 1000, windows=[8, 8], n_sink=0)), expected,
                               atol=1e-5, rtol=1e-5)


def test_each_query_sees_the_sinks_and_its_window():
    cache = SinkLayerCache(max_len=100, window=3, n_sink=2)
    for t in range(10):
        cache.update(k=torch.full((1, 1, 1), float(t)))
    (keys,) = cache.update(k=torch.tensor([[[10.0], [11.0]]]))
    assert keys.flatten().tolist() == [0, 1, 8, 9, 10, 11]  # sinks, the kept window - 1, the new
    assert cache.visible(2).tolist() == [[True, True, True, True, True, True], [True, True, False, True, True, True]]


def test_a_long_stream_keeps_sinks_plus_window(model):
    cache = KVCache(2, 10_000, windows=[8, 8], n_sink=4)
    sizes, positions = set(), set()
    with torch.no_grad():
        for token in torch.randint(0, 50, (1, 300))[0]:  # 300 tokens > block_size 64
            model(token.view(1, 1), cache=cache)
            sizes |= {b.shape[-2] for layer in cache.layers for b in layer.buffers.values()}
            positions.add(cache.next_position)
    assert sizes == {12} and max(positions) == 4 + 7 and cache.length == 300


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: SinkLayerCache(10, window=2, n_sink=3), "n_sink=3 is larger than window=2"),
        (lambda: SinkLayerCache(10, window=4, n_sink=-1), "n_sink must be an int >= 0, got -1"),
        (lambda: SinkLayerCache(10, window=0), "window=0 must be a positive integer"),
        (lambda: KVCache(2, 10, windows=[4, None], n_sink=2), "n_sink needs a window for every layer"),
    ],
)
def test_bad_settings(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_learned_positions_cannot_be_renumbered():
    gpt = GPT(GPTConfig(vocab_size=50, block_size=16, n_layers=1, n_heads=2, d_model=16))
    with pytest.raises(ValueError, match="a sink cache renumbers positions; MultiHeadAttention cannot"):
        gpt(torch.zeros(1, 3, dtype=torch.long), cache=KVCache(1, 16, windows=[8], n_sink=2))
