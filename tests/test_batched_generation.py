"""Batched generation with left padding (chapter 19): every prompt of a batch gets, greedily, exactly the tokens
it gets alone, for every attention variant of a GPT and every position scheme of the modern decoder, with and
without the KV cache (generate keeps full caches for a padded batch; the ring caches of sliding windows are driven
step by step), also once the text outgrows block_size; pads are never attended to and nothing is NaN.
The reference is each prompt run alone (no padding, no mask)."""
import pytest
import torch

from attnlib import GPT, Decoder, DecoderConfig, GPTConfig, MultiHeadAttention, RotaryEmbedding
from attnlib.attention.masks import check_attention_mask, mask_positions
from attnlib.cache import KVCache, RingLayerCache
from attnlib.generation import window_step
from attnlib.serving import left_pad

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
N_NEW = 12  # 7 + 12 > block_size 16: the longest row's window slides, the others' do not yet


def sharpen(model):
    """A random model's logits are nearly uniform (N(0, 0.02) weights); larger weights make argmax well separated."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)
    return model.eval()


GPT_VARIANTS = {
    "mha": dict(attention="mha"),
    "gqa": dict(attention="gqa", n_kv_heads=2),
    "mqa": dict(attention="mqa"),
    "talking_heads": dict(attention="talking_heads"),
    "mla": dict(attention="mla"),
    "mha_window": dict(attention="mha", sliding_window=3),
}
MODERN_VARIANTS = {
    "rope": dict(),
    "rope_qk_norm": dict(qk_norm=True),
    "rope_window": dict(sliding_window=3),
    "rope_chunked": dict(attention_chunk_size=3),
    "alibi": dict(position="alibi"),
    "learned": dict(position="learned"),
    "nope": dict(position="nope"),
    "softcap_tiled": dict(attn_softcap=5.0, attn_fn="tiled"),
}


def build(name):
    torch.manual_seed(0)
    if name in GPT_VARIANTS:
        return sharpen(GPT(GPTConfig(vocab_size=32, block_size=16, n_layers=2, n_heads=4, d_model=32,
                                     **GPT_VARIANTS[name])))
    return sharpen(Decoder(DecoderConfig.llama(vocab_size=32, block_size=16, n_layers=2, n_heads=4, d_model=32,
                                               n_kv_heads=2, **MODERN_VARIANTS[name])))


def rotary_layer():
    """Chapter 16's attention: RoPE on queries and keys, no biases."""
    return MultiHeadAttention(16, 2, rope=RotaryEmbedding(8), bias=False)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", [*GPT_VARIANTS, *MODERN_VARIANTS])
def test_each_prompt_gets_the_tokens_it_gets_alone(name, use_cache):
    model = build(name)
    idx, mask = left_pad(PROMPTS, pad_id=31)
    out = model.generate(idx, N_NEW, temperature=0.0, attention_mask=mask, use_cache=use_cache)
    assert out.shape == (len(PROMPTS), idx.shape[1] + N_NEW)
    for i, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), N_NEW, temperature=0.0, use_cache=use_cache)
        assert out[i, -N_NEW:].tolist() == alone[0, -N_NEW:].tolist(), f"row {i}"
        assert out[i, : idx.shape[1]].tolist() == idx[i].tolist()  # the prompt, pads included, is kept


@pytest.mark.parametrize(("name", "windows"), [
    *[(name, False) for name in ("mha", "mla", "talking_heads", "rope", "learned", "alibi", "mha_window", "rope_window",
                                 "rope_chunked")],
    ("mha_window", True), ("rope_window", True),  # ring caches (a chunked cache refuses padding: test_bad_inputs)
])
def test_padded_logits_equal_each_prompt_alone_and_are_finite(name, windows):
    """The prefill through the cache (a windowed layer's: every position, or its ring): each row's real positions
    have the logits of the prompt alone (1e-5); the pads' own outputs are finite (never NaN), and the pads' ids
    change nothing."""
    model = build(name)
    idx, mask = left_pad(PROMPTS, pad_id=0)
    with torch.no_grad():
        logits, _ = model(idx, cache=model.new_cache(windows=windows), attention_mask=mask)
        other, _ = model(torch.where(mask, idx, 30), attention_mask=mask)  # other pad ids, no cache
        assert torch.isfinite(logits).all() and torch.isfinite(other).all()
        for i, prompt in enumerate(PROMPTS):
            alone, _ = model(torch.tensor([prompt]))
            torch.testing.assert_close(logits[i, mask[i]], alone[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(other[i, mask[i]], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mha_window", "rope_window"])
def test_ring_caches_decode_a_padded_batch_as_each_prompt_alone(name):
    """generate keeps full caches for a padded batch; the ring caches of model.new_cache() take the padding too:
    greedy decoding through them (window_step, the step generate drives), past block_size, gives each row the
    tokens it gets alone."""
    model = build(name)
    idx, mask = left_pad(PROMPTS, pad_id=31)
    cache = model.new_cache()
    assert all(isinstance(layer, RingLayerCache) for layer in cache.layers)
    n_new = idx.shape[1]
    with torch.no_grad():
        for _ in range(N_NEW):
            logits, cache = window_step(model, idx, cache, n_new, mask)
            next_id = logits.argmax(-1, keepdim=True)  # (B, 1)
            idx, mask = torch.cat([idx, next_id], dim=1), torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            n_new = 1
    for i, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), N_NEW, temperature=0.0)
        assert idx[i, -N_NEW:].tolist() == alone[0, -N_NEW:].tolist(), f"row {i}"


def test_a_full_mask_changes_nothing():
    model = build("rope")
    idx = torch.randint(0, 32, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, _ = model(idx)
        masked, _ = model(idx, attention_mask=torch.ones_like(idx, dtype=torch.bool))
    torch.testing.assert_close(masked, plain, atol=1e-6, rtol=1e-6)


def test_positions_count_real_tokens():
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert mask_positions(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    idx, m = left_pad([[5, 6], [7]], pad_id=0)
    assert idx.tolist() == [[5, 6], [0, 7]] and m.tolist() == [[True, True], [False, True]]


def test_stop_tokens_with_padding():
    model = build("mha")
    idx, mask = left_pad(PROMPTS)
    out = model.generate(idx, N_NEW, temperature=0.0, attention_mask=mask, stop_tokens=[3, 7, 11])
    for i, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), N_NEW, temperature=0.0, stop_tokens=[3, 7, 11])
        n = alone.shape[1] - len(prompt)
        assert out[i, idx.shape[1]: idx.shape[1] + n].tolist() == alone[0, len(prompt):].tolist()


# --- bad input -------------------------------------------------------------------------------------------------------

def _gen(mask, idx=None):
    model = build("mha")
    idx = torch.ones(2, 3, dtype=torch.long) if idx is None else idx
    return model.generate(idx, 2, temperature=0.0, attention_mask=mask)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: _gen(torch.tensor([[True, True, True], [False, False, False]])), ValueError,
         r"attention_mask row 1 is all padding \(rows \[1\] hold no real token\)"),
        (lambda: _gen(torch.ones(2, 3, dtype=torch.long)), TypeError, r"attention_mask must be a bool tensor.*int64"),
        (lambda: _gen(torch.ones(2, 4, dtype=torch.bool)), ValueError, r"must have shape \(B, T\) = \(2, 3\); got \(2, 4\)"),
        (lambda: _gen(torch.tensor([[True, True, True], [True, True, False]])), ValueError,
         "attention_mask row 1 has padding after a real token; prompts must be left-padded"),
        (lambda: build("mha")(torch.ones(2, 3, dtype=torch.long), attention_mask=torch.zeros(2, 3, dtype=torch.bool)),
         ValueError, "attention_mask row 0 is all padding"),
        (lambda: build("rope_chunked")(torch.ones(1, 3, dtype=torch.long), cache=build("rope_chunked").new_cache(),
                                       attention_mask=torch.ones(1, 3, dtype=torch.bool)),
         ValueError, "masks are not supported with a chunked cache: with left padding each row's chunks start"),
        (lambda: build("rope")(torch.ones(1, 3, dtype=torch.long), cache=KVCache.streaming(build("rope"), 4, n_sink=1),
                               attention_mask=torch.ones(1, 3, dtype=torch.bool)),
         ValueError, "masks are not supported with a sink cache"),
        (lambda: rotary_layer()(torch.randn(2, 3, 16), positions=torch.zeros(2, 4, dtype=torch.long)),
         ValueError, r"positions must have shape \(B, T\) = \(2, 3\); got \(2, 4\)"),
        (lambda: rotary_layer()(torch.randn(1, 3, 16), positions=torch.zeros(1, 3)), TypeError,
         "positions must be an integer tensor"),
        (lambda: left_pad([[1, 2], []]), ValueError, r"prompts\[1\] must be a non-empty 1-D sequence"),
        (lambda: left_pad([[1, 40]], vocab_size=32), ValueError, r"prompts\[0\] holds token id 40"),
        (lambda: left_pad([]), ValueError, "prompts must be a non-empty list"),
        (lambda: check_attention_mask(torch.ones(1, 2, dtype=torch.bool), (1, 3)), ValueError, r"\(1, 3\); got \(1, 2\)"),
    ],
)
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_bad_mask_is_refused_before_any_forward_pass():
    model = build("mha")
    calls = []
    model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="row 0 is all padding"):
        model.generate(torch.ones(1, 2, dtype=torch.long), 3, attention_mask=torch.zeros(1, 2, dtype=torch.bool))
    assert calls == []


def test_rotary_layer_rotates_each_row_at_its_positions():
    """A RoPE layer given positions (B, T) equals the same layer run on each row alone at those positions."""
    torch.manual_seed(0)
    layer = rotary_layer().eval()
    x = torch.randn(2, 5, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    kpm = torch.tensor([[True] * 5, [False, False, True, True, True]])
    with torch.no_grad():
        out = layer(x, attention_mask=kpm, positions=pos)
        torch.testing.assert_close(out[1, 2:], layer(x[1:, 2:])[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out[0], layer(x[:1])[0], atol=1e-6, rtol=1e-6)
