"""Decoders that mix layer types (issue 21, items 1–4): equal to transformers, and to a reference built by hand.

* Qwen3 with sliding windows on its last layers (``max_window_layers`` below ``num_hidden_layers``) and with
  an explicit ``layer_types`` alternating full and sliding layers: ``from_hf_qwen3`` maps the types one to
  one; logits within 1e-5 of ``Qwen3ForCausalLM`` in float32, greedy tokens equal to its ``generate``.
* A decoder with Gemma 3's pattern (five sliding layers to one full, the sliding layers with their own
  RoPE base), checked against a reference that runs the same weights layer by layer with attnlib's parts
  and a window mask built by a loop.
* For every mixed model: cached = uncached, a prefill in chunks = one pass, and the decoding loops
  (``generate``, beam search of width 1, speculative decoding with the model as its own draft, ``serve``)
  give the same greedy tokens on every cache that applies (ring, chunked, contiguous, paged, recurrent).
"""
from __future__ import annotations

import pytest
import torch

from attnlib import Decoder, DecoderConfig, from_hf_qwen3
from attnlib.attention import attention
from attnlib.cache import ChunkedLayerCache, KVCache, LayerCache, RecurrentState, RingLayerCache
from attnlib.generation import beam_search, speculative_generate
from attnlib.serving import serve

transformers = pytest.importorskip("transformers")

V, T = 50, 24


def qwen3(**fields):
    config = transformers.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, attn_implementation="eager", **fields)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval()


QWEN3_MIXES = {
    "max_window_layers": dict(use_sliding_window=True, sliding_window=5, max_window_layers=2),
    "alternating": dict(use_sliding_window=True, sliding_window=5, layer_types=["full_attention", "sliding_attention"] * 2),
}


@pytest.mark.parametrize("mix", QWEN3_MIXES)
def test_qwen3_with_mixed_layers_equals_transformers(mix):
    hf = qwen3(**QWEN3_MIXES[mix])
    ours = from_hf_qwen3(hf).eval()
    assert list(ours.config.layer_types) == list(hf.config.layer_types)
    assert {"sliding_attention", "full_attention"} == set(ours.config.layer_types)
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (hf(idx).logits - ours(idx)[0]).abs().max().item()
    assert difference < 1e-5, difference
    cache_kinds = [type(layer).__name__ for layer in ours.new_cache().layers]
    assert cache_kinds == ["RingLayerCache" if t == "sliding_attention" else "LayerCache" for t in ours.config.layer_types]
    prompt = idx[:, :4]
    theirs = hf.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 16, temperature=0), theirs)


def test_qwen3_sliding_layers_without_a_window_are_refused():
    """``use_sliding_window=False`` with sliding layer types: transformers cannot run it (no window to build the
    sliding layers' mask from); the loader refuses it before building anything, naming the fields."""
    config = transformers.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      use_sliding_window=False, sliding_window=5,
                                      layer_types=["full_attention", "sliding_attention"] * 2)
    with pytest.raises(ValueError, match="has sliding layers but no window.*use_sliding_window=False"):
        from_hf_qwen3(transformers.Qwen3ForCausalLM(config))


GEMMA_LIKE = dict(vocab_size=V, block_size=64, n_layers=6, n_heads=4, n_kv_heads=2, d_model=32, head_dim=8,
                  layer_types=("sliding_attention",) * 5 + ("full_attention",), sliding_window=4, rope_base=1e6,
                  rope_local_base=1e4, qk_norm=True, norm_placement="sandwich", feedforward="geglu", norm_eps=1e-6)


def gemma_like() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.llama(**GEMMA_LIKE)).eval()
    with torch.no_grad():  # norms that are not all ones, so that a norm applied in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
    return model


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, base):
    """RoPE written out (half-split pairs, as transformers' Llama/Qwen/Gemma)."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = positions[:, None].float() * inv_freq  # (T, d/2)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def reference_logits(model: Decoder, idx: torch.Tensor) -> torch.Tensor:
    """The model's weights run layer by layer with plain formulas and a window mask built by a loop."""
    c = model.config
    B, L = idx.shape
    x = model.tok_emb.weight[idx]
    positions = torch.arange(L)
    for layer, block in zip(range(c.n_layers), model.blocks):
        sliding = c.layer_types[layer] == "sliding_attention"
        allowed = torch.zeros(L, L, dtype=torch.bool)
        for i in range(L):
            for j in range(L):
                allowed[i, j] = j <= i and (not sliding or i - j < c.sliding_window)
        a = block.attn
        h = rms(x, block.ln_1.weight, c.norm_eps)
        q, k, v = (h @ a.qkv.weight.T).split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                                               c.n_kv_heads * c.head_dim], dim=-1)
        q = q.view(B, L, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, L, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, L, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rms(q, a.q_norm.weight, c.norm_eps), rms(k, a.k_norm.weight, c.norm_eps)
        base = c.rope_local_base if sliding else c.rope_base
        q, k = rotate(q, positions, base), rotate(k, positions, base)
        k = k.repeat_interleave(c.n_heads // c.n_kv_heads, dim=1)
        v = v.repeat_interleave(c.n_heads // c.n_kv_heads, dim=1)
        y = attention(q, k, v, allowed[None, None])[0].transpose(1, 2).reshape(B, L, -1) @ a.out_proj.weight.T
        x = x + rms(y, block.post_attn_norm.weight, c.norm_eps)
        h = rms(x, block.ln_2.weight, c.norm_eps)
        f = block.mlp
        m = (torch.nn.functional.gelu(h @ f.gate.weight.T, approximate="tanh") * (h @ f.up.weight.T)) @ f.down.weight.T
        x = x + rms(m, block.post_mlp_norm.weight, c.norm_eps)
    return rms(x, model.ln_f.weight, c.norm_eps) @ model.lm_head.weight.T


def test_gemma3_pattern_equals_a_reference_built_layer_by_layer():
    model = gemma_like()
    assert [type(layer).__name__ for layer in model.new_cache().layers] == ["RingLayerCache"] * 5 + ["LayerCache"]
    assert model.blocks[0].attn.rope is model.rope_local and model.blocks[5].attn.rope is model.rope
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        difference = (model(idx)[0] - reference_logits(model, idx)).abs().max().item()
    assert difference < 1e-5, difference
    # the window and the local base both matter at this length: a reference without them differs
    wrong = Decoder(DecoderConfig.llama(**{**GEMMA_LIKE, "layer_types": None, "sliding_window": None,
                                           "rope_local_base": None})).eval()
    wrong.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (wrong(idx)[0] - model(idx)[0]).abs().max().item() > 1e-3


MIXED = {
    "gemma3 5:1": GEMMA_LIKE,
    "chunked + NoPE (Llama 4)": dict(vocab_size=V, block_size=64, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32,
                                     layer_types=("chunked_attention",) * 3 + ("full_attention",),
                                     attention_chunk_size=5, nope_layers=(3,)),
    "3 DeltaNet : 1 full (Qwen3-Next)": dict(vocab_size=V, block_size=64, n_layers=4, n_heads=4, d_model=32,
                                             layer_types=("linear_attention",) * 3 + ("full_attention",)),
    "alternating (gpt-oss)": dict(vocab_size=V, block_size=64, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32,
                                  layer_types=("sliding_attention", "full_attention") * 2, sliding_window=3),
}
CACHES = {"gemma3 5:1": (RingLayerCache, LayerCache), "chunked + NoPE (Llama 4)": (ChunkedLayerCache, LayerCache),
          "3 DeltaNet : 1 full (Qwen3-Next)": (RecurrentState, LayerCache),
          "alternating (gpt-oss)": (RingLayerCache, LayerCache)}


def mixed(name: str) -> Decoder:
    torch.manual_seed(3)
    return Decoder(DecoderConfig.llama(**MIXED[name])).eval()


@pytest.mark.parametrize("name", MIXED)
def test_cached_equals_uncached_and_chunked_prefill_equals_one_pass(name):
    model = mixed(name)
    assert {type(layer) for layer in model.new_cache().layers} == set(CACHES[name])
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(idx)[0]
        for chunks in ([1] * T, [7, 9, 8], [5, 1, 13, 5]):
            for windows in (True, False):
                cache, outs, start = model.new_cache(windows), [], 0
                for n in chunks:
                    outs.append(model(idx[:, start:start + n], cache=cache)[0])
                    start += n
                difference = (torch.cat(outs, dim=1) - full).abs().max().item()
                assert difference < 1e-5, (chunks, windows, difference)


@pytest.mark.parametrize("name", MIXED)
def test_every_decoding_loop_gives_the_same_greedy_tokens(name):
    model = mixed(name)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    alone = [model.generate(torch.tensor([p]), 20, temperature=0)[0] for p in prompts]
    assert torch.equal(model.generate(torch.tensor([prompts[1]]), 20, temperature=0, use_cache=False)[0], alone[1])
    assert torch.equal(beam_search(model, torch.tensor([prompts[1]]), 20, beam_width=1)[0][0], alone[1])
    assert torch.equal(speculative_generate(model, model, torch.tensor([prompts[1]]), 20, n_draft=3)[0], alone[1])
    if RecurrentState in CACHES[name]:
        with pytest.raises(ValueError, match="recurrent state"):
            serve(model, prompts, 20)
        with pytest.raises(ValueError, match=r"cannot be honoured by the linear layers \[0, 1, 2\]"):
            model.generate(torch.tensor([[0, 1, 2]]), 5, attention_mask=torch.tensor([[False, True, True]]))
        return
    outputs, _ = serve(model, prompts, 20, page_size=4)
    for out, expected in zip(outputs, alone):
        assert torch.equal(out, expected)
    padded = torch.tensor([[0] * 4 + prompts[0], prompts[1]])
    mask = torch.tensor([[False] * 4 + [True] * 3, [True] * 7])
    batch = model.generate(padded, 20, temperature=0, attention_mask=mask)
    assert torch.equal(batch[0, 4:], alone[0]) and torch.equal(batch[1], alone[1])


def test_a_kv_cache_built_by_hand_for_the_pattern_works_like_the_models_own():
    model = mixed("gemma3 5:1")
    cache = KVCache([RingLayerCache(64, 4) for _ in range(5)] + [LayerCache(64)])
    idx = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(idx, cache=cache)[0], model(idx, cache=model.new_cache())[0])
    wrong = KVCache([RingLayerCache(64, 3) for _ in range(5)] + [LayerCache(64)])
    with pytest.raises(ValueError, match="drops keys this layer"):
        model(idx, cache=wrong)
