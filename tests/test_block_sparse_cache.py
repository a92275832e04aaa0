"""MoBA and NSA with a KV cache (chapter 21, issue 24): queries that are the last T_q of T_k positions in both
forms (blocked ≡ readable ≡ the rows of one pass), layers through a LayerCache token by token and in chunks ≡ one
pass, a decoder built on them, and caches of the wrong kind refused."""
from __future__ import annotations

import pytest
import torch

from attnlib.attention.block_sparse import MoBAAttention, moba_attention, moba_attention_reference
from attnlib.attention.native_sparse import (
    BlockCompressor,
    NativeSparseAttention,
    nsa_attention,
    nsa_attention_reference,
)
from attnlib.cache import (
    ChunkedLayerCache,
    H2OLayerCache,
    KVCache,
    LayerCache,
    RecurrentState,
    RingLayerCache,
    SinkLayerCache,
)
from attnlib.models import Decoder, DecoderConfig
from attnlib.positional.rotary import RotaryEmbedding

TOL = 1e-12  # float64, the offset path against the readable form and against one pass (max abs)
CACHED_TOL = 1e-12  # float64, a layer through its cache against one pass (max abs; measured 3.4e-16)
NSA = dict(compress_block=8, compress_stride=4, select_block=8, top_n=3, window=6, initial_blocks=1, local_blocks=1)
MOBA = dict(moba_chunk_size=4, moba_topk=2)


def qkv(T=29, B=2, H=4, h=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, d, generator=g, dtype=torch.float64).requires_grad_() for n in (H, h, h)]


def assert_close(a, b, tol):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol:.3g}"


def grads(out, tensors):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), tensors)


def nsa_fns():
    torch.manual_seed(0)
    ck, cv = BlockCompressor(8, 8).double(), BlockCompressor(8, 8).double()
    gates = torch.rand(2, 4, 29, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run(fn, q, k, v):  # the gates of the queries' own positions
        return fn(q, k, v, gates[:, :, k.shape[2] - q.shape[2]:k.shape[2]], ck, cv, **NSA)
    return [lambda q, k, v: run(nsa_attention, q, k, v), lambda q, k, v: run(nsa_attention_reference, q, k, v)]


def moba_fns():
    return [lambda q, k, v: moba_attention(q, k, v, **MOBA), lambda q, k, v: moba_attention_reference(q, k, v, **MOBA)]


# ---------------------------------------------------------------- the last T_q of T_k positions


@pytest.mark.parametrize("method", ["moba", "nsa"])
@pytest.mark.parametrize("T_q,T_k", [(1, 29), (1, 16), (5, 29), (7, 13), (3, 5), (29, 29)])
def test_last_queries_blocked_equals_readable_equals_rows_of_one_pass(method, T_q, T_k):
    """Queries at T_k - T_q … T_k - 1 against keys 0 … T_k - 1: both forms agree (outputs and gradients) and equal
    those rows of one pass over the T_k positions (which no later key can change: causality)."""
    fast, ref = moba_fns() if method == "moba" else nsa_fns()
    q, k, v = qkv()
    q_last, k_k, v_k = q[:, :, T_k - T_q:T_k], k[:, :, :T_k], v[:, :, :T_k]
    a, b = fast(q_last, k_k, v_k), ref(q_last, k_k, v_k)
    assert a.shape == (2, 4, T_q, 8)
    assert_close(a, b, TOL)
    for ga, gb in zip(grads(a, (q, k, v)), grads(b, (q, k, v))):
        assert_close(ga, gb, TOL)
    whole = fast(q[:, :, :T_k], k_k, v_k)[:, :, T_k - T_q:]
    assert_close(a, whole, TOL)


def test_last_query_reads_complete_past_blocks_and_its_own_partial_block():
    """MoBA by hand for one query at position 13 (block 3 of 4-key blocks, partial: keys 12, 13): top-2 takes its own
    block and the best of the complete blocks 0-2 by <q, mean key>; the mask written out here."""
    q, k, v = (x.detach() for x in qkv(14, H=1, h=1))
    q_last = q[:, :, 13:]
    out = moba_attention(q_last, k, v, **MOBA)
    for b in range(2):
        means = torch.stack([k[b, 0, 4 * i:4 * i + 4].mean(0) for i in range(3)])  # complete past blocks
        best = int((means @ q_last[b, 0, 0]).argmax())
        keys = [s for s in range(14) if s // 4 in (best, 3)]
        w = (q_last[b, 0, 0] @ k[b, 0, keys].T / 8 ** 0.5).softmax(-1)
        assert_close(out[b, 0, 0], w @ v[b, 0, keys], TOL)


# ---------------------------------------------------------------- layers through a cache


def make(method, blocked):
    """A float64 layer with RoPE (through a cache, the new keys are rotated at positions cache.length, …)."""
    torch.manual_seed(0)
    if method == "moba":
        return MoBAAttention(32, 4, 2, blocked=blocked, rope=RotaryEmbedding(8), **MOBA).double()
    return NativeSparseAttention(32, 4, 2, blocked=blocked, rope=RotaryEmbedding(8), **NSA).double()


def through_cache(layer, x, cuts):
    """Run ``x (B, T, d)`` through a fresh cache in pieces cut at ``cuts``; return the outputs joined."""
    cache, bounds = layer.new_cache(64), [0, *cuts, x.shape[1]]
    out = torch.cat([layer(x[:, a:b], cache=cache) for a, b in zip(bounds, bounds[1:])], dim=1)
    assert cache.length == x.shape[1]
    return out, cache


@pytest.mark.parametrize("method", ["moba", "nsa"])
@pytest.mark.parametrize("blocked", [True, False])
def test_token_by_token_through_the_cache_equals_one_pass(method, blocked):
    layer = make(method, blocked)
    x = torch.randn(2, 21, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out, _ = through_cache(layer, x, range(1, 21))
    assert_close(out, layer(x), CACHED_TOL)


@pytest.mark.parametrize("method", ["moba", "nsa"])
@pytest.mark.parametrize("cuts", [(6,), (8,), (3, 8), (8, 13), (5, 11, 16)])  # blocks of 4 (MoBA) and 8 (NSA)
def test_prompt_in_chunks_equals_one_pass(method, cuts):
    """Chunks cut inside a block (3, 5, 6, 11, 13) and at a block boundary (8, 16), then one token."""
    layer = make(method, True)
    x = torch.randn(2, 23, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out, _ = through_cache(layer, x, (*cuts, 22))
    assert_close(out, layer(x), CACHED_TOL)


@pytest.mark.parametrize("method", ["moba", "nsa"])
def test_the_cache_holds_the_raw_keys_and_values_the_layer_says(method):
    layer = make(method, True)
    cache = layer.new_cache(64)
    assert type(cache) is LayerCache  # every position, no window
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    layer(x, cache=cache)
    assert cache.bytes_per_token() == layer.cache_bytes_per_token() == 2 * 2 * 8 * 8  # k, v · n_kv · hd · 8 B
    k, v = cache.buffers[0][:, :, :9], cache.buffers[1][:, :, :9]
    assert_close(torch.stack([k, v]), torch.stack(layer.project(x)[1:]), 0.0)  # the projected keys, as they are


@pytest.mark.parametrize("method", ["moba", "nsa"])
def test_a_decoder_of_these_layers_decodes_through_its_kv_cache_as_in_one_pass(method):
    config = DecoderConfig.llama(vocab_size=50, block_size=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)
    model = Decoder(config).double().eval()
    for block in model.blocks:  # the same projections and RoPE, MoBA's or NSA's attention
        old, new = block.attn, make(method, True)
        new.qkv, new.out_proj, new.rope = old.qkv, old.out_proj, old.rope
        block.attn = new
    idx = torch.randint(0, 50, (2, 19), generator=torch.Generator().manual_seed(5))
    cache = KVCache.for_model(model)
    pieces = [model(idx[:, a:b], cache=cache)[0] for a, b in ((0, 10), (10, 17), (17, 18), (18, 19))]
    assert_close(torch.cat(pieces, dim=1), model(idx)[0], CACHED_TOL)


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("method", ["moba", "nsa"])
def test_a_cache_of_the_wrong_kind_is_refused_naming_it(method):
    layer = make(method, True)
    name = type(layer).__name__
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="a ring cache of window=4 drops keys"):
        layer(x, cache=RingLayerCache(64, 4))
    with pytest.raises(ValueError, match="a chunked cache of chunk_size=4 does not fit"):
        layer(x, cache=ChunkedLayerCache(64, 4))
    with pytest.raises(ValueError, match=f"{name} needs a cache of every position .*SinkLayerCache renumbers"):
        layer(x, cache=SinkLayerCache(64, 4, 1))
    with pytest.raises(ValueError, match=f"H2OLayerCache needs MultiHeadAttention's forward.*{name}"):
        layer(x, cache=H2OLayerCache(64, budget=4, recent=2))
    with pytest.raises(ValueError, match=f"{name} needs a cache of every position.*LastFour drops some of the 5"):
        cache = LastFour(64)  # a cache whose check_layer lets it through: refused by what it keeps
        layer(x, cache=cache)
        layer(x, cache=cache)
    assert cache.length == 3  # refused before anything was appended
    for bad in (RecurrentState(64), "cache"):
        with pytest.raises(TypeError, match=f"cache must be a layer cache .*got {type(bad).__name__}"):
            layer(x, cache=bad)


class LastFour(LayerCache):
    """A cache of the last four positions (as a ring of 4 would return) that refuses no layer."""

    def needed(self, length):
        return torch.arange(max(0, length - 3), length)


@pytest.mark.parametrize("fn", [moba_attention, moba_attention_reference])
def test_more_queries_than_keys_is_refused(fn):
    q, k, v = qkv(9)
    with pytest.raises(ValueError, match=r"T_q <= T_k .*got T_q=9 > T_k=5"):
        fn(q, k[:, :, :5], v[:, :, :5], **MOBA)
