"""KV cache and generation: cached ≡ uncached for every variant, sizes measured from the tensors, beam search."""
import re

import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.cache import ChunkedLayerCache, KVCache, LayerCache, RingLayerCache, SinkLayerCache
from attnlib.generation import beam_search
from attnlib.models.config import ATTENTION_VARIANTS

ATOL = 1e-5
VARIANTS = sorted(ATTENTION_VARIANTS)


def small_model(attention, **overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=23, block_size=16, n_layers=2, n_heads=4, d_model=32)
    config.update(n_kv_heads=2 if attention == "gqa" else None, kv_latent_dim=8 if attention == "mla" else None)
    return GPT(GPTConfig(**{**config, **overrides}, attention=attention)).eval()


@pytest.mark.parametrize("attention", VARIANTS)
def test_cached_logits_equal_uncached_at_every_step(attention):
    model = small_model(attention)
    tokens = torch.randint(0, 23, (3, 16))
    cache = KVCache.for_model(model)
    with torch.no_grad():
        logits, _ = model(tokens[:, :5], cache=cache)  # prefill 5 tokens
        torch.testing.assert_close(logits, model(tokens[:, :5])[0], atol=ATOL, rtol=0)
        for t in range(5, 16):  # decode one token at a time
            step, _ = model(tokens[:, t : t + 1], cache=cache)
            full, _ = model(tokens[:, : t + 1])
            torch.testing.assert_close(step[:, -1], full[:, -1], atol=ATOL, rtol=0)
    assert cache.length == 16


def test_mla_absorbed_decode_equals_naive_uncached():
    model = small_model("mla")
    tokens = torch.randint(0, 23, (2, 12))
    with torch.no_grad():
        reference, _ = model(tokens)
        for block in model.blocks:
            block.attn.absorb = True
        cache = KVCache.for_model(model)
        model(tokens[:, :4], cache=cache)
        for t in range(4, 12):
            step, _ = model(tokens[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, -1], reference[:, t], atol=ATOL, rtol=0)


@pytest.mark.parametrize("attention", VARIANTS)
def test_greedy_generation_is_the_same_with_and_without_cache(attention):
    model = small_model(attention)
    prompt = torch.randint(0, 23, (2, 5))
    # 30 new tokens run past block_size=16: the window slides in both paths
    with_cache = model.generate(prompt, 30, temperature=0, use_cache=True)
    without = model.generate(prompt, 30, temperature=0, use_cache=False)
    assert torch.equal(with_cache, without)


def test_sampling_is_the_same_with_and_without_cache():
    model = small_model("gqa")
    prompt = torch.randint(0, 23, (2, 20))  # longer than block_size: cropped from the left
    a = model.generate(prompt, 12, top_k=5, generator=torch.Generator().manual_seed(1), use_cache=True)
    b = model.generate(prompt, 12, top_k=5, generator=torch.Generator().manual_seed(1), use_cache=False)
    assert torch.equal(a, b) and torch.equal(a[:, :20], prompt)


@pytest.mark.parametrize("attention", VARIANTS)
def test_cache_holds_exactly_what_the_variant_needs(attention):
    model = small_model(attention)
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(torch.randint(0, 23, (3, 7)), cache=cache)
    # DeepSeek-V2 Table 1, per token and layer: 2·n_h·d_h, 2·n_g·d_h, 2·d_h, d_c
    per_token = {"mha": 2 * 4 * 8, "talking_heads": 2 * 4 * 8, "gqa": 2 * 2 * 8, "mqa": 2 * 8, "mla": 8,
                 "differential": 2 * 4 * 8}[attention]  # differential: plain keys and values (chapter 20)
    assert model.blocks[0].attn.cache_width == per_token
    assert cache.bytes_per_token() == per_token * model.config.n_layers * 4  # fp32
    assert model.kv_cache_bytes_per_token() == cache.bytes_per_token()
    assert model.kv_cache_bytes_per_token(torch.float16) == per_token * model.config.n_layers * 2
    assert cache.nbytes() == 3 * 16 * per_token * model.config.n_layers * 4  # pre-allocated to block_size
    shapes = [tuple(b.shape) for b in cache.layers[0].buffers]  # keys and values, or MLA's latent
    expected = {
        "mha": [(3, 4, 16, 8), (3, 4, 16, 8)],
        "talking_heads": [(3, 4, 16, 8), (3, 4, 16, 8)],
        "gqa": [(3, 2, 16, 8), (3, 2, 16, 8)],
        "mqa": [(3, 1, 16, 8), (3, 1, 16, 8)],
        "mla": [(3, 16, 8)],
        "differential": [(3, 4, 16, 8), (3, 4, 16, 8)],
    }[attention]
    assert shapes == expected


def test_cache_errors():
    model = small_model("mha")
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(torch.randint(0, 23, (1, 10)), cache=cache)
        with pytest.raises(ValueError, match=re.escape("the cache holds 10 tokens; 7 more exceed block_size=16")):
            model(torch.randint(0, 23, (1, 7)), cache=cache)
        with pytest.raises(ValueError, match=re.escape("cached tensor 0 has shape (1, 4, 16, 8); cannot append (2, 4, 1, 8)")):
            model(torch.randint(0, 23, (2, 1)), cache=cache)  # another batch size
    layer = LayerCache(4)
    layer.update(torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match=re.escape("is torch.float32 on cpu; cannot append torch.float64")):
        layer.update(torch.zeros(1, 1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=re.escape("this cache holds 1 tensors (filled by another attention variant?)")):
        layer.update(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    layer.reset()
    assert layer.length == 0 and layer.update(torch.ones(1, 1, 2))[0].shape == (1, 1, 2)
    with pytest.raises(ValueError, match=re.escape("block_size=4; cannot add 5")):
        layer.update(torch.zeros(1, 5, 2))
    with pytest.raises(ValueError, match=re.escape("block_size=0")):
        LayerCache(0)


def test_stop_tokens_end_generation_and_pad():
    model = small_model("mha")
    prompt = torch.randint(0, 23, (2, 3))
    free = model.generate(prompt, 8, temperature=0)
    stop = int(free[0, 4])  # the second token row 0 produces
    out = model.generate(prompt, 8, temperature=0, stop_tokens=[stop])
    row0 = out[0, 3:].tolist()
    first = row0.index(stop)
    assert row0[: first + 1] == free[0, 3 : 3 + first + 1].tolist() and set(row0[first:]) == {stop}
    with pytest.raises(ValueError, match="stop_tokens holds token id 99"):
        model.generate(prompt, 2, stop_tokens=[99])


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_search_with_width_one_is_greedy(use_cache):
    model = small_model("gqa")
    prompt = torch.randint(0, 23, (1, 4))
    tokens, score = beam_search(model, prompt, 20, beam_width=1, use_cache=use_cache)
    assert torch.equal(tokens, model.generate(prompt, 20, temperature=0))
    # its score is the sum of the log-probabilities of the chosen tokens
    logprobs = []
    for t in range(4, 24):
        logits, _ = model(tokens[:, max(0, t - 16) : t])
        logprobs.append(torch.log_softmax(logits[0, -1], -1)[tokens[0, t]].item())
    assert score == pytest.approx(sum(logprobs), abs=1e-4)


def test_wider_beams_find_a_likelier_sequence_and_caching_does_not_change_them():
    model = small_model("mla")
    prompt = torch.randint(0, 23, (1, 3))
    _, greedy = beam_search(model, prompt, 6, beam_width=1)
    wide, wide_score = beam_search(model, prompt, 6, beam_width=5)
    assert wide_score >= greedy - 1e-6
    uncached, uncached_score = beam_search(model, prompt, 6, beam_width=5, use_cache=False)
    assert torch.equal(wide, uncached) and wide_score == pytest.approx(uncached_score, abs=1e-5)


def test_beam_search_rejects_bad_input():
    model = small_model("mha")
    with pytest.raises(ValueError, match=r"shape \(1, T\)"):
        beam_search(model, torch.zeros(2, 3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="beam_width=0"):
        beam_search(model, torch.zeros(1, 3, dtype=torch.long), 3, beam_width=0)


def filled(cache, n):
    """``cache`` after ``n`` positions whose one cached number is the position itself."""
    cache.update(torch.arange(float(n)).view(1, n, 1))
    return cache


def test_crop_forgets_later_positions_and_a_longer_crop_changes_nothing():
    cache = KVCache([filled(LayerCache(8), 5) for _ in range(2)])
    cache.crop(9)  # longer than it holds: nothing changes
    cache.crop(5)
    assert cache.length == 5
    cache.crop(3)
    assert cache.length == 3
    (k,) = cache.layers[0].update(torch.full((1, 1, 1), 9.0))
    assert k.flatten().tolist() == [0.0, 1.0, 2.0, 9.0]  # positions 3 and 4 forgotten, 3 written again
    assert cache.layers[0].key_positions.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=re.escape("length=-1 must be an int >= 0")):
        cache.crop(-1)


# Hand counts. A ring of window w holds the last w positions written; the token at position n needs the w - 1
# before it. A sink cache holds the n_sink first as well, and the token at n needs them too. A chunked cache holds
# the last chunk_size positions; the token at n needs its chunk's, n - n % chunk_size ... n - 1.
@pytest.mark.parametrize(
    ("make", "written", "allowed", "refused", "returned"),
    [
        # ring w=4 after 7: holds 3..6. Crop to 6: needs 3, 4, 5 (held). Crop to 5: needs 2 (overwritten by 6).
        (lambda: RingLayerCache(16, 4), 7, [10, 7, 6], [5, 2, 1], [3.0, 4.0, 5.0]),
        # ring w=4 after 3: nothing overwritten yet, every crop is allowed.
        (lambda: RingLayerCache(16, 4), 3, [0, 1], [], [0.0]),
        # 1 sink + window 4 after 9: holds 0 and 5..8. Crop to 8: needs 0, 5, 6, 7. Crop to 7: needs 4 (gone).
        (lambda: SinkLayerCache(16, 4, 1), 9, [9, 8], [7, 4], [0.0, 5.0, 6.0, 7.0]),
        # chunks of 4 after 7: holds 3..6. Crop to 4: needs nothing (a new chunk). Crop to 3: needs 0, 1, 2 (gone).
        (lambda: ChunkedLayerCache(16, 4), 7, [5, 4], [3, 1], []),
        # chunks of 4 after 6: holds 2..5. Crop to 3: needs 0, 1, 2; 0 and 1 were overwritten by 4 and 5.
        (lambda: ChunkedLayerCache(16, 4), 6, [4], [3, 2], []),
    ],
)
def test_kept_caches_refuse_a_crop_exactly_where_the_next_token_needs_a_lost_position(
        make, written, allowed, refused, returned):
    for length in refused:
        cache = filled(make(), written)
        with pytest.raises(ValueError, match=f"cannot crop to length={length}: it no longer holds positions"):
            cache.crop(length)
        assert cache.length == written  # checked before anything changed
    for length in allowed:
        cache = filled(make(), written)
        cache.crop(length)
        assert cache.length == min(length, written)
    # After the last allowed crop, the next update returns the positions the next token needs, as they were written.
    (k,) = cache.update(torch.full((1, 1, 1), 99.0))
    assert k.flatten().tolist() == [*returned, 99.0]
    assert cache.key_positions.tolist() == [*[int(p) for p in returned], min(allowed[-1], written)]


def test_a_model_cache_crops_all_layers_or_none():
    cache = KVCache([filled(LayerCache(16), 7), filled(RingLayerCache(16, 4), 7)])
    with pytest.raises(ValueError, match="RingLayerCache cannot crop to length=5"):
        cache.crop(5)  # the full layer could, the ring cannot: neither does
    assert [layer.length for layer in cache.layers] == [7, 7]
    cache.crop(6)
    assert [layer.length for layer in cache.layers] == [6, 6]
