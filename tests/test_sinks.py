"""StreamingLLM's attention sinks (attnlib.cache.SinkLayerCache) on the modern decoder."""
from __future__ import annotations

import pytest
import torch

from attnlib import GPT, Decoder, DecoderConfig, GPTConfig
from attnlib.cache import KVCache, SinkLayerCache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Decoder(DecoderConfig.llama(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                       d_model=32)).eval()


def stream(model, idx, cache, first=5):
    with torch.no_grad():
        outs = [model(idx[:, :first], cache=cache)[0]]
        outs += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(first, idx.shape[1])]
    return torch.cat(outs, 1)


def test_nothing_evicted_is_full_attention(model):
    idx = torch.randint(0, 50, (2, 40))
    cache = KVCache.streaming(model, window=64, n_sink=4, block_size=1000)
    with torch.no_grad():
        torch.testing.assert_close(stream(model, idx, cache), model(idx)[0], atol=1e-5, rtol=1e-5)


def test_no_sinks_is_the_sliding_window(model):
    # RoPE scores depend on offsets only: positions renumbered within the cache change nothing.
    windowed = Decoder(model.config.replace(sliding_window=8)).eval()
    windowed.load_state_dict(model.state_dict())
    idx = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        expected = windowed(idx)[0]
    torch.testing.assert_close(stream(model, idx, KVCache.streaming(model, window=8, n_sink=0, block_size=1000)), expected,
                               atol=1e-5, rtol=1e-5)


def test_each_query_sees_the_sinks_and_its_window():
    cache = SinkLayerCache(block_size=100, window=3, n_sink=2)
    for t in range(10):
        cache.update(torch.full((1, 1, 1), float(t)))
    (keys,) = cache.update(torch.tensor([[[10.0], [11.0]]]))
    assert keys.flatten().tolist() == [0, 1, 8, 9, 10, 11]  # sinks, the kept window - 1, the new
    kv = cache.key_positions
    assert kv.tolist() == [0, 1, 8, 9, 10, 11]
    seen = cache.mask_mod(None, None, kv[-2:, None], kv[None, :])  # the cache's rule; causality is the layer's
    assert seen.tolist() == [[True, True, True, True, True, True], [True, True, False, True, True, True]]


def test_a_long_stream_keeps_sinks_plus_window(model):
    cache = KVCache.streaming(model, window=8, n_sink=4, block_size=10_000)
    sizes, positions = set(), set()
    with torch.no_grad():
        for token in torch.randint(0, 50, (1, 300))[0]:  # 300 tokens > block_size 64
            model(token.view(1, 1), cache=cache)
            sizes |= {b.shape[-2] for layer in cache.layers for b in layer.buffers}
            positions.add(len(cache.layers[0].key_positions) - 1)  # the query's position within the cache
    assert sizes == {12} and max(positions) == 4 + 7 and cache.length == 300


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: SinkLayerCache(10, window=2, n_sink=3), "n_sink=3 is larger than window=2"),
        (lambda: SinkLayerCache(10, window=4, n_sink=-1), "n_sink must be an int >= 0, got -1"),
        (lambda: SinkLayerCache(10, window=0), "window=0 must be a positive integer"),
    ],
)
def test_bad_settings(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_sink_cache_refuses_what_it_would_change(model):
    idx = torch.zeros(1, 3, dtype=torch.long)
    windowed = Decoder(model.config.replace(sliding_window=4)).eval()
    with pytest.raises(ValueError, match=r"a sink cache of window=8 shows keys this layer \(sliding_window=4\) must not"):
        windowed(idx, cache=KVCache.streaming(windowed, window=8, n_sink=2))
    with pytest.raises(ValueError, match="masks are not supported with a sink cache"):
        model(idx, cache=KVCache.streaming(model, window=8), attention_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="window=0 must be a positive integer"):
        KVCache.streaming(model, window=0)


def test_learned_positions_cannot_be_renumbered():
    gpt = GPT(GPTConfig(vocab_size=50, block_size=16, n_layers=1, n_heads=2, d_model=16))
    with pytest.raises(ValueError, match="a sink cache renumbers positions; MultiHeadAttention has no RoPE"):
        gpt(torch.zeros(1, 3, dtype=torch.long), cache=KVCache.streaming(gpt, window=8, n_sink=2))
