"""The chapter 08 exercise checks: a table of answers each check accepts and refuses (tests/exercise_table.py)."""
import math

import torch
from exercise_table import Answers

import attnlib
from attnlib import GPT, GPTConfig
from attnlib.attention import attention
from attnlib.book.exercises import NOT_SOLVED, grade
from attnlib.cache import KVCache, LayerCache
from attnlib.models.layers import ATTENTION_LAYERS, build_attention


# ---------------------------------------------------------------- 08.1
class RingCache:
    def __init__(self, window):
        self.window, self.seen = window, 0
        self.k = self.v = None

    def update(self, k, v):
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:-2], self.window, k.shape[-1])
            self.v = v.new_zeros(*v.shape[:-2], self.window, v.shape[-1])
        slot = self.seen % self.window
        self.k[..., slot : slot + 1, :] = k
        self.v[..., slot : slot + 1, :] = v
        self.seen += 1
        n = min(self.seen, self.window)
        return self.k[..., :n, :], self.v[..., :n, :]


class RingKeepsEverything:
    """A plain growing cache: no eviction."""

    def __init__(self, window):
        self.cache = LayerCache(block_size=64)

    def update(self, k, v):
        return self.cache.update(k, v)


class RingWholeBuffer(RingCache):
    def update(self, k, v):
        super().update(k, v)
        return self.k, self.v  # the empty slots too


class RingOffByOne(RingCache):
    def __init__(self, window):
        super().__init__(window)
        self.window = max(1, window - 1)  # "the new one plus window - 1 old ones", minus one


class RingEvictsNewest(RingCache):
    def update(self, k, v):
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:-2], self.window, k.shape[-1])
            self.v = v.new_zeros(*v.shape[:-2], self.window, v.shape[-1])
        slot = min(self.seen, self.window - 1)  # once full, always the last slot
        self.k[..., slot : slot + 1, :] = k
        self.v[..., slot : slot + 1, :] = v
        self.seen += 1
        n = min(self.seen, self.window)
        return self.k[..., :n, :], self.v[..., :n, :]


class RingLastSlots(RingCache):
    """Writes slot t % window, but returns the last n slots, empty ones while filling."""

    def update(self, k, v):
        k_win, _ = super().update(k, v)
        n = k_win.shape[-2]
        return self.k[..., self.window - n :, :], self.v[..., self.window - n :, :]


class RingCat:
    """Right values, but a new tensor at every step."""

    def __init__(self, window):
        self.window, self.k, self.v = window, None, None

    def update(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)[..., -self.window :, :]
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)[..., -self.window :, :]
        return self.k, self.v


class RingShared:
    """The rings on the class: caches of the same window share one."""

    rings = {}

    def __init__(self, window):
        self.ring = RingShared.rings.setdefault(window, RingCache(window))

    def update(self, k, v):
        return self.ring.update(k, v)


class RingStub:
    def __init__(self, window):
        self.window = window

    def update(self, k, v):
        raise NotImplementedError("a ring of window slots")


# ---------------------------------------------------------------- 08.2
def cached_attention(q, k_cache, v_cache):
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache.repeat_interleave(group, dim=1)
    v = v_cache.repeat_interleave(group, dim=1)
    T_new, T_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(T_new, T_k, dtype=torch.bool).tril(diagonal=T_k - T_new)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


def cached_attention_sdpa(q, k_cache, v_cache):
    T_new, T_k = q.shape[-2], k_cache.shape[-2]
    mask = torch.ones(T_new, T_k, dtype=torch.bool).tril(diagonal=T_k - T_new)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k_cache, v_cache, attn_mask=mask, enable_gqa=True
    )


def cached_attention_is_causal(q, k_cache, v_cache):  # SDPA's top-left alignment
    return torch.nn.functional.scaled_dot_product_attention(
        q, k_cache, v_cache, is_causal=True, enable_gqa=True
    )


def cached_attention_no_mask(q, k_cache, v_cache):  # right for one new token only
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)


def cached_attention_tiled(q, k_cache, v_cache):
    group = q.shape[1] // k_cache.shape[1]
    return cached_attention_sdpa(
        q, k_cache.repeat(1, group, 1, 1), v_cache.repeat(1, group, 1, 1)
    )


def cached_attention_unscaled(q, k_cache, v_cache):
    return cached_attention(q * math.sqrt(q.shape[-1]), k_cache, v_cache)


def cached_attention_appends_in_place(q, k_cache, v_cache):
    out = cached_attention(q, k_cache, v_cache)
    k_cache.zero_()
    return out


def _cached_attention_diagonal(q, k_cache, v_cache, shift, dim=-1):
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache.repeat_interleave(group, dim=1)
    v = v_cache.repeat_interleave(group, dim=1)
    T_new, T_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(T_new, T_k, dtype=torch.bool).tril(diagonal=T_k - T_new + shift)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=dim).nan_to_num() @ v


def cached_attention_hides_itself(q, k_cache, v_cache):  # tril(diagonal=T_k - T_new - 1)
    return _cached_attention_diagonal(q, k_cache, v_cache, -1)


def cached_attention_sees_next(q, k_cache, v_cache):  # tril(diagonal=T_k - T_new + 1)
    return _cached_attention_diagonal(q, k_cache, v_cache, 1)


def cached_attention_softmax_over_queries(q, k_cache, v_cache):
    return _cached_attention_diagonal(q, k_cache, v_cache, 0, dim=-2)


def cached_attention_divided_by_head_dim(q, k_cache, v_cache):
    return cached_attention(q / math.sqrt(q.shape[-1]), k_cache, v_cache)


# ---------------------------------------------------------------- 08.3
def kv_cache_bytes(config, batch_size, context, dtype):
    per_layer = {
        "mha": 2 * config.n_heads * config.head_dim,
        "talking_heads": 2 * config.n_heads * config.head_dim,
        "gqa": 2 * config.n_kv_heads * config.head_dim,
        "mqa": 2 * config.head_dim,
        "mla": config.kv_latent_dim,
    }[config.attention]
    return per_layer * config.n_layers * batch_size * context * dtype.itemsize


def kv_cache_bytes_n_heads_everywhere(config, batch_size, context, dtype):
    """kv heads = n_heads for every variant."""
    if config.attention == "mla":
        per_layer = config.kv_latent_dim
    else:
        per_layer = 2 * config.n_heads * config.head_dim
    return per_layer * config.n_layers * batch_size * context * dtype.itemsize


def kv_cache_bytes_n_kv_heads(config, batch_size, context, dtype):
    """One formula for every softmax variant: the config resolves n_kv_heads (n_heads for MHA, 1 for MQA)."""
    if config.attention == "mla":
        per_layer = config.kv_latent_dim
    else:
        per_layer = 2 * config.n_kv_heads * config.head_dim
    return per_layer * config.n_layers * batch_size * context * dtype.itemsize


def kv_cache_bytes_old_names(config, batch_size, context, dtype):
    """attnlib 1.x's names of the resolved sizes (config.kv_heads, config.latent_dim)."""
    per_layer = config.latent_dim if config.attention == "mla" else 2 * config.kv_heads * config.head_dim
    return per_layer * config.n_layers * batch_size * context * dtype.itemsize


def kv_cache_bytes_eager_dict(config, batch_size, context, dtype):
    """Every variant's bytes in one dict: MLA's entry multiplies kv_latent_dim, None for the others."""
    size = dtype.itemsize
    per_layer_bytes = {
        "mha": 2 * config.n_heads * config.head_dim * size,
        "talking_heads": 2 * config.n_heads * config.head_dim * size,
        "gqa": 2 * config.n_kv_heads * config.head_dim * size,
        "mqa": 2 * config.head_dim * size,
        "mla": config.kv_latent_dim * size,
    }[config.attention]
    return per_layer_bytes * config.n_layers * batch_size * context


def kv_cache_bytes_mqa_all_heads(config, batch_size, context, dtype):
    if config.attention == "mqa":
        per_layer = 2 * config.n_heads * config.head_dim
        return per_layer * config.n_layers * batch_size * context * dtype.itemsize
    return kv_cache_bytes(config, batch_size, context, dtype)


def kv_cache_bytes_float32_always(config, batch_size, context, dtype):
    return kv_cache_bytes(config, batch_size, context, torch.float32)


def kv_cache_bytes_bits(config, batch_size, context, dtype):
    bits = torch.finfo(dtype).bits
    return kv_cache_bytes(config, batch_size, context, dtype) // dtype.itemsize * bits


def kv_cache_bytes_no_factor_2(config, batch_size, context, dtype):
    if config.attention == "mla":
        return kv_cache_bytes(config, batch_size, context, dtype)
    return kv_cache_bytes(config, batch_size, context, dtype) // 2


def kv_cache_bytes_group_size(config, batch_size, context, dtype):
    """GQA: the group size n_heads // n_kv_heads where the number of kv heads belongs."""
    if config.attention == "gqa":
        per_layer = 2 * (config.n_heads // config.n_kv_heads) * config.head_dim
        return per_layer * config.n_layers * batch_size * context * dtype.itemsize
    return kv_cache_bytes(config, batch_size, context, dtype)


def kv_cache_bytes_mla_rope_key(config, batch_size, context, dtype):
    """MLA: DeepSeek-V2's decoupled RoPE key (d_h / 2) added to the latent."""
    extra = config.head_dim // 2 if config.attention == "mla" else 0
    per_token = kv_cache_bytes(config, 1, 1, dtype) + extra * config.n_layers * dtype.itemsize
    return per_token * batch_size * context


def kv_cache_bytes_one_layer(config, batch_size, context, dtype):
    return kv_cache_bytes(config, batch_size, context, dtype) // config.n_layers


def kv_cache_bytes_no_batch(config, batch_size, context, dtype):
    return kv_cache_bytes(config, 1, context, dtype)


def kv_cache_bytes_reserved(config, batch_size, context, dtype):
    return kv_cache_bytes(config, batch_size, config.block_size, dtype)


def kv_cache_bytes_mla_twice(config, batch_size, context, dtype):
    factor = 2 if config.attention == "mla" else 1
    return factor * kv_cache_bytes(config, batch_size, context, dtype)


def kv_cache_bytes_builds_a_model(config, batch_size, context, dtype):
    per_token = GPT(config).kv_cache_bytes_per_token(dtype)
    return per_token * batch_size * context


def kv_cache_bytes_library_estimator(config, batch_size, context, dtype):
    return attnlib.kv_cache_bytes(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                                  seq_len=context, dtype=dtype, batch_size=batch_size)


def kv_cache_bytes_cache_estimator(config, batch_size, context, dtype):
    from attnlib.cache import memory

    return memory.kv_cache_bytes(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                                 seq_len=context, dtype=dtype, batch_size=batch_size)


def kv_cache_bytes_tensor(config, batch_size, context, dtype):
    return torch.tensor(kv_cache_bytes(config, batch_size, context, dtype))


# ---------------------------------------------------------------- 08.4
def chunked_prefill(model, idx, chunk_size):
    cache = KVCache.for_model(model)
    pieces = []
    for start in range(0, idx.shape[1], chunk_size):
        logits, _ = model(idx[:, start : start + chunk_size], cache=cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache


def chunked_prefill_with_step(model, idx, chunk_size):  # the library's decoding step, every position's logits
    from attnlib.generation import step

    cache = model.new_cache()
    pieces = [step(model, idx[:, s : s + chunk_size], cache, all_logits=True) for s in range(0, idx.shape[1], chunk_size)]
    return torch.cat(pieces, dim=1), cache


def chunked_prefill_no_cache(model, idx, chunk_size):
    pieces = [model(idx[:, s : s + chunk_size])[0] for s in range(0, idx.shape[1], chunk_size)]
    return torch.cat(pieces, dim=1), KVCache.for_model(model)


def chunked_prefill_cache_per_chunk(model, idx, chunk_size):
    pieces = []
    for start in range(0, idx.shape[1], chunk_size):
        cache = KVCache.for_model(model)
        pieces.append(model(idx[:, start : start + chunk_size], cache=cache)[0])
    return torch.cat(pieces, dim=1), cache


def chunked_prefill_at_once(model, idx, chunk_size):
    cache = KVCache.for_model(model)
    return model(idx, cache=cache)[0], cache


def chunked_prefill_last_only(model, idx, chunk_size):
    cache = KVCache.for_model(model)
    pieces = []
    for start in range(0, idx.shape[1], chunk_size):
        logits, _ = model(idx[:, start : start + chunk_size], cache=cache, last_only=True)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache


def chunked_prefill_drops_tail(model, idx, chunk_size):  # the last, shorter chunk is lost
    cache = KVCache.for_model(model)
    pieces = []
    for start in range(0, idx.shape[1] - chunk_size + 1, chunk_size):
        logits, _ = model(idx[:, start : start + chunk_size], cache=cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache


class RingCacheIndexed:
    """Another correct ring: index_copy_ into preallocated buffers, the count as a tensor-free int."""

    def __init__(self, window):
        self.window, self.count, self.buffers = window, 0, None

    def update(self, k, v):
        if self.buffers is None:
            self.buffers = [torch.empty(*t.shape[:-2], self.window, t.shape[-1], dtype=t.dtype) for t in (k, v)]
        slot = torch.tensor([self.count % self.window])
        for buffer, new in zip(self.buffers, (k, v)):
            buffer.index_copy_(-2, slot, new)
        self.count += 1
        n = min(self.count, self.window)
        return self.buffers[0].narrow(-2, 0, n), self.buffers[1].narrow(-2, 0, n)


class RingMutatesInput(RingCache):
    def update(self, k, v):
        out = super().update(k, v)
        k.zero_()  # "free" the caller's tensor
        return out


class RingFloat32(RingCache):
    def update(self, k, v):
        if self.k is None:
            self.k = torch.zeros(*k.shape[:-2], self.window, k.shape[-1])  # float32 whatever k is
            self.v = torch.zeros(*v.shape[:-2], self.window, v.shape[-1])
        return super().update(k, v)


def cached_attention_reuses_cache(q, k_cache, v_cache):  # writes the scaled keys back into the cache
    k_cache /= math.sqrt(q.shape[-1])
    return cached_attention(q * math.sqrt(q.shape[-1]), k_cache, v_cache)


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def kv_cache_bytes_always_equal(config, batch_size, context, dtype):
    return AlwaysEqual(0)


def kv_cache_bytes_float(config, batch_size, context, dtype):
    return kv_cache_bytes(config, batch_size, context, dtype) / 1


def kv_cache_bytes_builds_a_layer(config, batch_size, context, dtype):
    with torch.device("meta"):
        layer = build_attention(config, 0)
    return layer.cache_width * config.n_layers * batch_size * context * dtype.itemsize


def chunked_prefill_through_the_class(model, idx, chunk_size):  # the whole prompt, around model.forward
    cache = model.new_cache()
    logits, _ = type(model).forward(model, idx, cache=cache)
    return logits, cache


def chunked_prefill_eats_idx(model, idx, chunk_size):
    out = chunked_prefill(model, idx, chunk_size)
    idx.zero_()
    return out


def chunked_prefill_list(model, idx, chunk_size):
    return list(chunked_prefill(model, idx, chunk_size))


ANSWERS = {
    "08.1": Answers(
        correct=[RingCache, RingCacheIndexed],
        wrong=[
            (RingKeepsEverything, "keep only `window` slots"),
            (RingWholeBuffer, "empty slots"),
            (RingOffByOne, "off by one"),
            (RingEvictsNewest, "replacing the oldest"),
            (RingCat, "new memory"),
            (RingLastSlots, "the filled ones"),
            (RingShared, "on the instance"),
            (RingMutatesInput, "in place"),
            (RingFloat32, "dtype"),
        ],
        function=False,
    ),
    "08.2": Answers(
        correct=[cached_attention, cached_attention_sdpa],
        wrong=[
            (cached_attention_is_causal, "top-left"),
            (cached_attention_no_mask, "a mask is needed"),
            (cached_attention_tiled, "repeat_interleave"),
            (cached_attention_unscaled, "sqrt(head_dim)"),
            (cached_attention_appends_in_place, "in place"),
            (cached_attention_reuses_cache, "in place"),
            (cached_attention_hides_itself, "hides the new token from itself"),
            (cached_attention_sees_next, "see the one after it"),
            (cached_attention_softmax_over_queries, "over the queries' axis"),
            (cached_attention_divided_by_head_dim, "divided by head_dim"),
        ],
    ),
    "08.3": Answers(
        correct=[kv_cache_bytes, kv_cache_bytes_n_kv_heads],
        wrong=[
            (kv_cache_bytes_n_heads_everywhere, "GQA caches n_kv_heads key/value heads"),
            (kv_cache_bytes_old_names, "config.n_kv_heads, not config.kv_heads"),
            (kv_cache_bytes_eager_dict, "only MLA caches a latent"),
            (kv_cache_bytes_mqa_all_heads, "one key/value head"),
            (kv_cache_bytes_float32_always, "bytes per number"),
            (kv_cache_bytes_bits, "bits, not bytes"),
            (kv_cache_bytes_no_factor_2, "a factor 2"),
            (kv_cache_bytes_one_layer, "multiply by n_layers"),
            (kv_cache_bytes_no_batch, "multiply by batch_size"),
            (kv_cache_bytes_reserved, "block_size"),
            (kv_cache_bytes_mla_twice, "latent once"),
            (kv_cache_bytes_tensor, "Python int"),
            (kv_cache_bytes_float, "Python int"),
            (kv_cache_bytes_always_equal, "Python int"),
            (kv_cache_bytes_group_size, "'gqa' 2*n_kv_heads*head_dim"),
            (kv_cache_bytes_mla_rope_key, "no decoupled RoPE key"),
            (kv_cache_bytes_builds_a_model, "do not build a model"),
            (kv_cache_bytes_builds_a_layer, "do not build a model"),
            (kv_cache_bytes_library_estimator, "attnlib's own estimator"),
            (kv_cache_bytes_cache_estimator, "attnlib's own estimator"),
        ],
    ),
    "08.4": Answers(
        correct=[chunked_prefill, chunked_prefill_with_step],
        wrong=[
            (chunked_prefill_no_cache, "got no cache"),
            (chunked_prefill_cache_per_chunk, "different caches"),
            (chunked_prefill_at_once, "more than chunk_size"),
            (chunked_prefill_through_the_class, "more than chunk_size"),
            (chunked_prefill_last_only, "(B, T, vocab_size)"),
            (chunked_prefill_drops_tail, "leave tokens out"),
            (chunked_prefill_eats_idx, "in place"),
            (chunked_prefill_list, "return a pair"),
        ],
    ),
}


def test_stub_is_not_solved():
    assert grade("08.1", RingStub).status == NOT_SOLVED


def test_kv_cache_bytes_grader_restores_what_it_refuses():
    from attnlib.cache import memory
    originals = torch.nn.Module.__init__, attnlib.kv_cache_bytes, attnlib.cache.kv_cache_bytes, memory.kv_cache_bytes
    grade("08.3", kv_cache_bytes_library_estimator)
    grade("08.3", kv_cache_bytes_builds_a_model)
    restored = torch.nn.Module.__init__, attnlib.kv_cache_bytes, attnlib.cache.kv_cache_bytes, memory.kv_cache_bytes
    assert all(a is b for a, b in zip(restored, originals))


def test_reference_answers_agree_with_the_library():
    """The references are what attnlib's cache does, not a second opinion."""
    config = GPTConfig(
        vocab_size=11, block_size=8, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16,
        attention="gqa",
    )
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(0))
    for name in set(ATTENTION_LAYERS) - {"differential"}:  # 08.3 asks for chapters 04-07's five
        # 08.3: the formula equals the bytes measured on a KVCache after a prefill of 5 tokens
        torch.manual_seed(0)
        sized = {"gqa": dict(n_kv_heads=2), "mla": dict(kv_latent_dim=6)}.get(name, {})
        model = GPT(config.replace(**{"attention": name, "n_kv_heads": None, **sized})).eval()
        cache = KVCache.for_model(model)
        with torch.no_grad():
            model(tokens, cache=cache)
        expected = cache.bytes_per_token() * 3 * 5
        assert kv_cache_bytes(model.config, 3, 5, torch.float32) == expected
    # 08.2: the answer is the last rows of a GQA layer's attention over the whole sequence
    layer = build_attention(config, 0).eval()
    x = torch.randn(2, 6, config.d_model)
    with torch.no_grad():
        q, k, v = layer.project(x)
        full, _ = layer.attend(q, k, v, None, True, False)
        torch.testing.assert_close(cached_attention(q[:, :, -2:], k, v), full[:, :, -2:])
    # 08.1: with a window as long as the text, the ring is a plain cache
    ring, window = RingCache(3), 3
    for t in range(6):
        k_win, v_win = ring.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lo = max(0, t - window + 1)
        q_t = q[:, :2, t : t + 1]  # the first group's heads read kv head 0
        got = attention(q_t, k_win[:, :1], v_win[:, :1])[0]
        want = attention(q_t, k[:, :1, lo : t + 1], v[:, :1, lo : t + 1])[0]
        torch.testing.assert_close(got, want)
