"""Sliding-window attention and its ring-buffer KV cache (chapter 17)."""
from __future__ import annotations

import pytest
import torch

from attnlib import GPT, Decoder, DecoderConfig, GPTConfig, MultiHeadAttention
from attnlib.cache import KVCache, LayerCache, RingLayerCache

VARIANTS = [("mha", {}), ("gqa", {"n_kv_heads": 2}), ("mqa", {}), ("talking_heads", {}), ("mla", {})]


def gpt(attention="mha", window=6, block_size=64, **kw):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=block_size, n_layers=2, n_heads=4, d_model=32, attention=attention,
                       sliding_window=window, **kw)
    return GPT(config).eval()


@pytest.mark.parametrize(("attention", "kw"), VARIANTS)
def test_cached_generation_equals_uncached_over_many_windows(attention, kw):
    model = gpt(attention, window=5, **kw)
    prompt = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, 50, temperature=0.0)  # 59 tokens: about 12 windows
    assert torch.equal(cached, model.generate(prompt, 50, temperature=0.0, use_cache=False))


@pytest.mark.parametrize(("attention", "kw"), VARIANTS)
def test_the_cache_holds_at_most_the_window(attention, kw):
    model = gpt(attention, window=5, **kw)
    cache = model.new_cache()
    idx = torch.randint(0, 50, (2, 60))
    with torch.no_grad():
        model(idx[:, :20], cache=cache)
        sizes = set()
        for t in range(20, 60):
            model(idx[:, t : t + 1], cache=cache)
            sizes |= {b.shape[-2] for layer in cache.layers for b in layer.buffers}
    assert sizes == {5} and cache.length == 60


def test_modern_decoder_long_generation_with_a_flat_cache():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.llama(vocab_size=50, block_size=256, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                        sliding_window=4)).eval()
    prompt = torch.randint(0, 50, (1, 6))
    cached = model.generate(prompt, 200, temperature=0.0)  # 50 windows long
    assert torch.equal(cached, model.generate(prompt, 200, temperature=0.0, use_cache=False))
    cache = model.new_cache()
    with torch.no_grad():
        model(cached[:, :100], cache=cache)
        small = cache.nbytes()
        model(cached[:, 100:], cache=cache)
    assert cache.nbytes() == small == 2 * 2 * 2 * 4 * 8 * 4  # layers x (K, V) x kv heads x window x head_dim x bytes


def test_chunked_prefill_equals_one_pass():
    model = gpt("gqa", window=4, n_kv_heads=2)
    idx = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache()
        chunks = [model(idx[:, i : i + 7], cache=cache)[0] for i in range(0, 40, 7)]
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


def test_window_of_the_whole_context_is_full_attention():
    full, windowed = gpt(window=None), gpt(window=64)
    windowed.load_state_dict(full.state_dict())
    idx = torch.randint(0, 50, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(windowed(idx)[0], full(idx)[0])


def test_window_changes_what_a_position_sees():
    # Position t's output depends on token t - w + 1 but, in the first layer, not on t - w.
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, sliding_window=3).eval()
    x = torch.randn(1, 8, 16, requires_grad=True)
    layer(x)[0, 7].sum().backward()
    seen = x.grad[0].abs().sum(-1) > 0
    assert seen.tolist() == [False] * 5 + [True] * 3


def test_ring_cache_against_a_plain_list():
    # update returns the w - 1 positions before the new ones (all the first new query may see) and the new ones.
    ring, kept = RingLayerCache(block_size=100, window=4), []
    for step, T_new in enumerate([3, 1, 5, 1, 1, 2, 6]):
        new = torch.arange(T_new, dtype=torch.float32).view(1, T_new, 1) + 10 * step
        (got,) = ring.update(new)
        expected = torch.cat([*kept[-3:], *new.unbind(1)]) if kept else new.flatten()
        torch.testing.assert_close(got.flatten(), torch.as_tensor(expected).flatten())
        n = len(kept)
        assert ring.key_positions.tolist() == list(range(max(0, n - 3), n + T_new))
        kept += list(new.unbind(1))
        assert ring.buffers[0].shape[-2] == 4 and ring.length == len(kept)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: GPTConfig(sliding_window=0), ValueError, "sliding_window=0 must be a positive integer"),
        (lambda: MultiHeadAttention(16, 2, causal=False, sliding_window=4), ValueError, "sliding_window=4 / chunk_size=None need a causal layer"),
        (lambda: RingLayerCache(10, 0), ValueError, "window=0 must be a positive integer"),
        (lambda: gpt(window=4)(torch.zeros(1, 3, dtype=torch.long), cache=KVCache([RingLayerCache(64, 4)])),
         ValueError, "cache has 1 layers; this model has n_layers=2"),
        (lambda: MultiHeadAttention(16, 2, sliding_window=4)(torch.randn(1, 3, 16), cache=RingLayerCache(10, 2)),
         ValueError, r"a ring cache of window=2 drops keys this layer \(sliding_window=4\) still attends to"),
        (lambda: MultiHeadAttention(16, 2)(torch.randn(1, 3, 16), cache=RingLayerCache(10, 2)),
         ValueError, r"sliding_window=None\) still attends to"),
    ],
)
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_plain_layer_cache_is_unchanged():
    cache = LayerCache(8)
    (k,) = cache.update(torch.ones(1, 3, 2))
    (k,) = cache.update(torch.zeros(1, 2, 2))
    assert k.shape == (1, 5, 2) and cache.buffers[0].shape == (1, 8, 2)


@pytest.mark.parametrize("T_prefill", [1, 4, 9])
def test_a_ring_cache_takes_a_padding_mask_and_each_row_gets_what_it_gets_alone(T_prefill):
    # Row 1 is left-padded by 3: through the ring (window 3), its real tokens' outputs equal the row alone, uncached.
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, sliding_window=3).eval()
    x = torch.randn(2, 12, 16)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False
    cache = RingLayerCache(12, 3)
    with torch.no_grad():
        out = [layer(x[:, :T_prefill], cache=cache, attention_mask=mask[:, :T_prefill])]
        out += [layer(x[:, t : t + 1], cache=cache, attention_mask=mask[:, : t + 1]) for t in range(T_prefill, 12)]
        out = torch.cat(out, dim=1)
        torch.testing.assert_close(out[0], layer(x[:1])[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out[1, 3:], layer(x[1:, 3:])[0], atol=1e-6, rtol=1e-5)
    assert cache.buffers[0].shape[-2] == 3
