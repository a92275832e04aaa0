"""KV-cache eviction (issue 25, item 4): H2O (Zhang et al. 2023) and SnapKV (Li et al. 2024), attnlib.cache.eviction.

What is compared:

* with a budget >= the sequence, decoding through either cache equals decoding through the full cache, exactly
  (both through the eager attention function: the same numbers in the same order);
* H2O's kept positions, step after step, equal an independent simulation written here: queries and keys of one
  GQA layer taken without a cache, the softmax over the kept keys computed by hand, the accumulated attention
  summed over the group's query heads and the step's queries, the ``recent`` latest kept with the top
  ``budget - recent``; the layer's output equals the by-hand attention over the kept keys (to 1e-5; measured 2e-6);
* SnapKV's kept prompt positions equal an independent vote: the last ``window`` queries' weights summed, pooled by
  hand (average with zero padding, or max), summed over the group, the top ``budget - window`` and the window;
  decoding then appends;
* memory: H2O's ``nbytes()`` is fixed at ``budget`` slots (keys, values, positions, scores) over a long decode;
  SnapKV's is ``min(T_p, budget) + block_size - T_p`` slots; both below the full cache's;
* decoding a small random decoder: cached lengths and positions consistent per row and head;
* bad inputs: type and message; and the max |Δlogit| at budget T/2 for a window, sinks, H2O and SnapKV (measured,
  quoted in :mod:`attnlib.cache.eviction`, asserted only to be non-zero: each evicts).
"""
from __future__ import annotations

import pytest
import torch

import attnlib
from attnlib.attention import MultiHeadAttention
from attnlib.attention.talking_heads import TalkingHeadsAttention
from attnlib.cache import H2OLayerCache, KVCache, RingLayerCache, SnapKVLayerCache
from attnlib.positional import RotaryEmbedding

N_HEADS, N_KV, HEAD_DIM = 4, 2, 8


def small_model(**changes):
    torch.manual_seed(0)
    fields = dict(vocab_size=50, block_size=64, n_layers=2, n_heads=N_HEADS, n_kv_heads=N_KV, d_model=32)
    return attnlib.Decoder(attnlib.DecoderConfig.llama(**{**fields, **changes})).eval()


@torch.no_grad()
def stream(model, idx, cache, prompt):
    """Logits of the prompt, then of each token fed alone: ``(B, T, vocab)``."""
    out = [model(idx[:, :prompt], cache=cache)[0]]
    out += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(prompt, idx.shape[1])]
    return torch.cat(out, dim=1)


def layer_and_inputs(T, seed=0):
    torch.manual_seed(seed)
    layer = MultiHeadAttention(32, N_HEADS, N_KV, attn_fn="eager", rope=RotaryEmbedding(HEAD_DIM, 64)).eval()
    with torch.no_grad():
        layer.qkv.weight.mul_(4)  # sharper attention than at init: the heads then disagree on what to keep
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        q, k, v = layer.project(x)  # no cache: every position's query, key and value
    return layer, x, q, k, v


def hand_weights(q, k, t, kept):
    """Softmax of query ``t`` (one head, ``(head_dim,)``) over the keys at positions ``kept`` (all <= t)."""
    scores = torch.stack([q[t] @ k[j] for j in kept]) / HEAD_DIM ** 0.5
    return torch.softmax(scores, dim=0)


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_a_budget_that_holds_everything_is_the_full_cache(method):
    model = small_model(attn_fn="eager")
    idx = torch.randint(0, 50, (2, 30))
    full = stream(model, idx, model.new_cache(), prompt=12)
    cache = KVCache.eviction(model, method, budget=30, window=4)
    torch.testing.assert_close(stream(model, idx, cache, prompt=12), full, atol=0, rtol=0)
    assert cache.length == 30 and cache.layers[0].key_positions[..., :].tolist() == [[list(range(30))] * N_KV] * 2


def run_layer(layer, x, cache, steps):
    """Feed ``x`` step by step; return the outputs ``(B, T, d_model)`` and each step's held positions."""
    outputs, held = [], []
    with torch.no_grad():
        for start, end in steps:
            outputs.append(layer(x[:, start:end], cache=cache))
            held.append(cache.positions[..., :cache.n_held].clone())
    return torch.cat(outputs, dim=1), held


def attend_by_hand(q, k, v, b, h, keys, start, end, y_hand, score):
    """Each query head of key/value head ``h`` at positions ``start … end-1`` over ``keys`` (and causality):
    write its output in ``y_hand``, add its weights to ``score`` (the accumulated attention)."""
    group = N_HEADS // N_KV
    for g in range(h * group, (h + 1) * group):
        for t in range(start, end):
            seen = [j for j in keys if j <= t]
            w = hand_weights(q[b, g], k[b, h], t, seen)
            y_hand[b, g, t] = w @ v[b, h, seen]
            for j, wj in zip(seen, w.tolist()):
                score[j] = score.get(j, 0.0) + wj


def test_h2o_keeps_the_recent_window_and_the_heavy_hitters():
    T, prompt, budget, recent = 24, 10, 8, 2
    layer, x, q, k, v = layer_and_inputs(T)
    steps = [(0, prompt)] + [(t, t + 1) for t in range(prompt, T)]
    y, held = run_layer(layer, x, H2OLayerCache(64, budget, recent), steps)
    y_hand = torch.zeros(2, N_HEADS, T, HEAD_DIM)
    for b in range(2):
        for h in range(N_KV):
            kept, score = [], {}
            for i, (start, end) in enumerate(steps):
                keys = kept + list(range(start, end))  # held, then the step's new positions
                attend_by_hand(q, k, v, b, h, keys, start, end, y_hand, score)
                if len(keys) > budget:
                    heavy = sorted(sorted(keys[:-recent], key=lambda j: -score[j])[:budget - recent])
                    keys = heavy + keys[-recent:]
                kept = keys
                assert held[i][b, h].tolist() == kept, (b, h, start)
    assert len(kept) == budget and kept != list(range(T - budget, T))  # heavy hitters, not a window
    assert len({tuple(p) for p in held[-1].flatten(0, 1).tolist()}) == 2 * N_KV  # each row and head its own
    torch.testing.assert_close(y, layer.merge(y_hand), atol=1e-5, rtol=0)  # measured: 2e-6


def pool_by_hand(vote, kernel_size, pooling):
    """A 1-D pool of ``kernel_size`` along ``vote`` (a list), stride 1, padding ``kernel_size // 2``: the average
    counts the padding as zeros (``avg_pool1d``'s default), the max ignores it."""
    r, out = kernel_size // 2, []
    for j in range(len(vote)):
        inside = [vote[i] for i in range(j - r, j + r + 1) if 0 <= i < len(vote)]
        out.append(sum(inside) / kernel_size if pooling == "avgpool" else max(inside))
    return out


@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_snapkv_keeps_the_window_and_what_it_votes_for(pooling):
    T, prompt, budget, window, kernel = 19, 16, 8, 4, 3
    layer, x, q, k, v = layer_and_inputs(T, seed=1)
    steps = [(0, prompt)] + [(t, t + 1) for t in range(prompt, T)]
    y, held = run_layer(layer, x, SnapKVLayerCache(64, budget, window, kernel, pooling), steps)
    y_hand, group = torch.zeros(2, N_HEADS, T, HEAD_DIM), N_HEADS // N_KV
    for b in range(2):
        for h in range(N_KV):
            attend_by_hand(q, k, v, b, h, list(range(prompt)), 0, prompt, y_hand, {})
            total = [0.0] * (prompt - window)
            for g in range(h * group, (h + 1) * group):
                vote = [0.0] * (prompt - window)
                for t in range(prompt - window, prompt):  # the observation window's queries
                    w = hand_weights(q[b, g], k[b, h], t, list(range(t + 1)))
                    vote = [a + w[j].item() for j, a in enumerate(vote)]
                total = [a + p for a, p in zip(total, pool_by_hand(vote, kernel, pooling))]
            kept = held[0][b, h].tolist()  # the top budget - window by the vote, then the window
            assert kept[budget - window:] == list(range(prompt - window, prompt)) and kept == sorted(set(kept))
            top = sorted(total, reverse=True)[:budget - window]  # max pooling ties neighbours: compare the votes
            assert sorted((total[j] for j in kept[:budget - window]), reverse=True) == pytest.approx(top, abs=1e-6)
            if pooling == "avgpool":  # no ties: the very positions
                assert kept[:budget - window] == sorted(sorted(range(prompt - window), key=lambda j: -total[j])[:budget - window])
            for i, (start, end) in enumerate(steps[1:], 1):  # decoding appends
                attend_by_hand(q, k, v, b, h, kept + [start], start, end, y_hand, {})
                kept = kept + [start]
                assert held[i][b, h].tolist() == kept
    torch.testing.assert_close(y, layer.merge(y_hand), atol=1e-5, rtol=0)  # measured: 2e-6


def test_memory_stays_within_the_budget():
    model, B = small_model(), 2
    idx = torch.randint(0, 50, (B, 60))
    per_slot = N_KV * (2 * HEAD_DIM * 4 + 8)  # keys and values float32, the position int64, every head
    h2o = KVCache.eviction(model, "h2o", budget=8)
    with torch.no_grad():
        model(idx[:, :20], cache=h2o)
        first = h2o.nbytes()
        for t in range(20, 60):
            model(idx[:, t:t + 1], cache=h2o)
            assert all(layer.key_positions.shape[-1] <= 8 + 1 for layer in h2o.layers)
    assert h2o.nbytes() == first == 2 * B * 8 * (per_slot + N_KV * 4)  # + the float32 scores
    snap = KVCache.eviction(model, "snapkv", budget=8, window=4)
    stream(model, idx[:, :48], snap, prompt=40)
    assert snap.nbytes() == 2 * B * (8 + 64 - 40) * per_slot and all(layer.n_held == 16 for layer in snap.layers)
    full = model.new_cache()
    stream(model, idx[:, :48], full, prompt=40)
    assert h2o.nbytes() < snap.nbytes() < full.nbytes()


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_decoding_keeps_lengths_and_positions_consistent(method):
    model = small_model(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    cache = KVCache.eviction(model, method, budget=10, recent=4, window=4)
    assert type(cache.layers[0]) is RingLayerCache  # a windowed layer keeps its own window
    idx = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        model(idx[:, :16], cache=cache)
        for t in range(16, 40):
            model(idx[:, t:t + 1], cache=cache)
            assert cache.length == t + 1
            evicting = cache.layers[1]
            kp = evicting.key_positions  # (B, n_kv_heads, T_k): held before this step, then the new position
            assert kp.shape[:2] == (2, N_KV) and (kp[..., -1] == t).all() and (kp.diff(dim=-1) > 0).all()
            pos = evicting.positions[..., :evicting.n_held]
            assert (pos < t + 1).all() and (pos.diff(dim=-1) > 0).all()
            if method == "h2o":
                assert evicting.n_held == 10 and (pos[..., -4:] == torch.arange(t - 3, t + 1)).all()
            else:
                assert evicting.n_held == 10 + t + 1 - 16
    assert cache.layers[0].length == cache.layers[1].length == 40


def test_logit_error_at_half_budget():
    """Measured (quoted in attnlib.cache.eviction): max |Δlogit| of the decoded steps against the full cache."""
    model = small_model()
    T, prompt = 48, 40
    idx = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(0))
    full = stream(model, idx, model.new_cache(), prompt)[:, prompt:]
    caches = {"window": KVCache.streaming(model, window=T // 2, n_sink=0),
              "sinks": KVCache.streaming(model, window=T // 2 - 4, n_sink=4),
              "h2o": KVCache.eviction(model, "h2o", budget=T // 2),
              "snapkv": KVCache.eviction(model, "snapkv", budget=T // 2, window=8)}
    errors = {name: (stream(model, idx, cache, prompt)[:, prompt:] - full).abs().max().item()
              for name, cache in caches.items()}
    print({name: round(e, 4) for name, e in errors.items()})
    assert all(e > 1e-4 for e in errors.values()), errors  # each kept T/2 positions of T: each changed the logits


# ------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: H2OLayerCache(64, budget=2, recent=3), ValueError, "budget=2 is below the recent window recent=3"),
        (lambda: H2OLayerCache(64, budget=0, recent=0), ValueError, "budget=0 must be a positive integer"),
        (lambda: H2OLayerCache(64, budget=4, recent=-1), ValueError, "recent=-1 must be an int >= 0"),
        (lambda: H2OLayerCache(64, budget="8", recent=2), TypeError, "budget must be an int; got '8'"),
        (lambda: SnapKVLayerCache(64, budget=4, window=8), ValueError, "budget=4 is below the observation window"),
        (lambda: SnapKVLayerCache(64, budget=8, window=4, kernel_size=4), ValueError, "kernel_size=4 must be odd"),
        (lambda: SnapKVLayerCache(64, budget=8, window=4, pooling="mean"), ValueError,
         r"pooling must be one of \('avgpool', 'maxpool'\); got 'mean'"),
        (lambda: H2OLayerCache(64, 4, 2).observe(torch.zeros(1, 2, 1, 1)), ValueError, "observe needs an update first"),
    ],
)
def test_bad_settings(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_kv_cache_eviction_refuses_what_cannot_work():
    model = small_model()
    with pytest.raises(ValueError, match="method must be one of .*; got 'lru'"):
        KVCache.eviction(model, "lru", budget=8)
    with pytest.raises(ValueError, match="budget=4 is below the observation window window=32"):
        KVCache.eviction(model, "snapkv", budget=4)
    with pytest.raises(ValueError, match="multi-head latent attention .*kv_latent_dim=16"):
        KVCache.eviction(small_model(attention="mla", n_kv_heads=None, kv_latent_dim=16, position="learned"),
                         "h2o", budget=8)
    with pytest.raises(ValueError, match="layer 0 .*linear_attention.* recurrent state"):
        KVCache.eviction(small_model(layer_types=["linear_attention", "full_attention"]), "h2o", budget=8)
    shared = small_model(n_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
                         num_kv_shared_layers=2)
    with pytest.raises(ValueError, match=r"layers \[2, 3\] share other layers' keys and values"):
        KVCache.eviction(shared, "h2o", budget=8)


def test_the_cache_refuses_layers_and_uses_it_cannot_serve():
    model, idx = small_model(), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="masks are not supported with H2OLayerCache"):
        model(idx, cache=KVCache.eviction(model, "h2o", budget=8), attention_mask=torch.ones(1, 4, dtype=torch.bool))
    x = torch.randn(1, 4, 32)
    windowed = MultiHeadAttention(32, 4, sliding_window=4)
    with pytest.raises(ValueError, match="cannot serve a layer with sliding_window=4"):
        windowed(x, cache=H2OLayerCache(64, 8, 4))
    alibi = MultiHeadAttention(32, 4, attn_fn="eager", score_mod=lambda s, b, h, q, kv: s - (q - kv))
    with pytest.raises(ValueError, match="cannot serve a layer with a score_mod"):
        alibi(x, cache=SnapKVLayerCache(64, 8, 4))
    with pytest.raises(ValueError, match="needs MultiHeadAttention's attend.*TalkingHeadsAttention.attend"):
        TalkingHeadsAttention(32, 4)(x, cache=H2OLayerCache(64, 8, 4))
    cache = H2OLayerCache(64, 8, 4)
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match="update called again before observe"):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    with pytest.raises(ValueError, match=r"weights must be \(B, n_heads, T_new, T_k\) = \(1, a multiple of 2, 3, 3\)"):
        cache.observe(torch.zeros(1, 3, 3, 3))


def test_crop_only_where_nothing_it_evicted_is_needed():
    model = small_model()
    idx = torch.randint(0, 50, (1, 30))
    h2o, snap = KVCache.eviction(model, "h2o", budget=8), KVCache.eviction(model, "snapkv", budget=8, window=4)
    stream(model, idx, h2o, prompt=20)
    stream(model, idx, snap, prompt=20)
    with pytest.raises(ValueError, match="H2OLayerCache cannot crop to length=25"):
        h2o.crop(25)
    with pytest.raises(ValueError, match=r"SnapKVLayerCache cannot crop to length=19: .* 0 or to 20 … 30"):
        snap.crop(19)
    snap.crop(25)  # the decoded positions were appended: dropping the last five is exact
    assert snap.length == 25 and all(layer.n_held == 8 + 5 for layer in snap.layers)
    reference = KVCache.eviction(model, "snapkv", budget=8, window=4)
    stream(model, idx[:, :25], reference, prompt=20)
    for ours, theirs in zip(snap.layers, reference.layers):
        assert torch.equal(ours.positions[..., :ours.n_held], theirs.positions[..., :theirs.n_held])
    h2o.crop(0)
    assert h2o.length == 0 and all(layer.n_held == 0 for layer in h2o.layers)
