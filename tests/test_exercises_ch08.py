"""The chapter 08 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.attention import ATTENTION_REGISTRY
from attnlib.book.exercises import CORRECT, WRONG, grade
from attnlib.cache import KVCache


# ---------------------------------------------------------------- 08.1
class MiniCache:
    def __init__(self, max_len):
        self.max_len, self.length = max_len, 0
        self.k = self.v = None

    def update(self, k, v):
        end = self.length + k.shape[-2]
        if end > self.max_len:
            raise ValueError(f"{self.length} cached + {k.shape[-2]} new > max_len={self.max_len}")
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:-2], self.max_len, k.shape[-1])
            self.v = v.new_zeros(*v.shape[:-2], self.max_len, v.shape[-1])
        self.k[..., self.length : end, :] = k
        self.v[..., self.length : end, :] = v
        self.length = end
        return self.k[..., :end, :], self.v[..., :end, :]


class CatCache(MiniCache):
    """Right values, but a new tensor at every step."""

    def update(self, k, v):
        if self.length + k.shape[-2] > self.max_len:
            raise ValueError("full")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        self.length += k.shape[-2]
        return self.k, self.v


class WholeBufferCache(MiniCache):
    def update(self, k, v):
        super().update(k, v)
        return self.k, self.v


class NoOverflowCheckCache(MiniCache):
    def update(self, k, v):
        self.max_len = 10**6 if self.k is None else self.max_len  # never refuses
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:-2], 16, k.shape[-1])
            self.v = v.new_zeros(*v.shape[:-2], 16, v.shape[-1])
        end = self.length + k.shape[-2]
        self.k[..., self.length : end, :] = k
        self.v[..., self.length : end, :] = v
        self.length = end
        return self.k[..., :end, :], self.v[..., :end, :]


class Float32Cache(MiniCache):
    def update(self, k, v):
        return super().update(k.float(), v.float())


class LengthNotAdvancedCache(MiniCache):
    def update(self, k, v):
        k_all, v_all = super().update(k, v)
        self.length -= k.shape[-2]  # forgot to move the write position
        return k_all, v_all


class SharedStateCache:
    """Buffers on the class: every instance shares them."""

    state = {"length": 0}

    def __init__(self, max_len):
        SharedStateCache.state = {"length": 0, "cache": MiniCache(max_len)}

    @property
    def length(self):
        return SharedStateCache.state["cache"].length

    def update(self, k, v):
        return SharedStateCache.state["cache"].update(k, v)


class MiniCacheStub:
    def __init__(self, max_len):
        self.length = 0

    def update(self, k, v):
        raise NotImplementedError("allocate, write, return views")


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
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)


def cached_attention_is_causal(q, k_cache, v_cache):  # SDPA's top-left alignment
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True, enable_gqa=True)


def cached_attention_no_mask(q, k_cache, v_cache):  # right for one new token only
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)


def cached_attention_tiled(q, k_cache, v_cache):
    group = q.shape[1] // k_cache.shape[1]
    return cached_attention_sdpa(q, k_cache.repeat(1, group, 1, 1), v_cache.repeat(1, group, 1, 1))


def cached_attention_unscaled(q, k_cache, v_cache):
    return cached_attention(q * math.sqrt(q.shape[-1]), k_cache, v_cache)


def cached_attention_appends_in_place(q, k_cache, v_cache):
    out = cached_attention(q, k_cache, v_cache)
    k_cache.zero_()
    return out


# ---------------------------------------------------------------- 08.3
def kv_cache_bytes(config, batch_size, context, dtype):  # the sizes as given; None = the config's default
    n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    per_layer = {
        "mha": 2 * config.n_heads * config.head_dim,
        "talking_heads": 2 * config.n_heads * config.head_dim,
        "gqa": 2 * n_kv_heads * config.head_dim,
        "mqa": 2 * config.head_dim,
        "mla": config.d_model // 4 if config.kv_latent_dim is None else config.kv_latent_dim,
    }[config.attention]
    return per_layer * config.n_layers * batch_size * context * dtype.itemsize


def kv_cache_bytes_n_heads_everywhere(config, batch_size, context, dtype):  # kv heads = n_heads for every variant
    per_layer = config.latent_dim if config.attention == "mla" else 2 * config.n_heads * config.head_dim
    return per_layer * config.n_layers * batch_size * context * dtype.itemsize


def kv_cache_bytes_given_sizes(config, batch_size, context, dtype):  # n_kv_heads is None when not given
    per_layer = config.kv_latent_dim if config.attention == "mla" else 2 * config.n_kv_heads * config.head_dim
    return per_layer * config.n_layers * batch_size * context * dtype.itemsize


def kv_cache_bytes_mqa_all_heads(config, batch_size, context, dtype):
    if config.attention == "mqa":
        return 2 * config.n_heads * config.head_dim * config.n_layers * batch_size * context * dtype.itemsize
    return kv_cache_bytes(config, batch_size, context, dtype)


def kv_cache_bytes_float32_always(config, batch_size, context, dtype):
    return kv_cache_bytes(config, batch_size, context, torch.float32)


def kv_cache_bytes_no_batch(config, batch_size, context, dtype):
    return kv_cache_bytes(config, 1, context, dtype)


def kv_cache_bytes_reserved(config, batch_size, context, dtype):
    return kv_cache_bytes(config, batch_size, config.block_size, dtype)


def kv_cache_bytes_mla_twice(config, batch_size, context, dtype):
    factor = 2 if config.attention == "mla" else 1
    return factor * kv_cache_bytes(config, batch_size, context, dtype)


def kv_cache_bytes_tensor(config, batch_size, context, dtype):
    return torch.tensor(kv_cache_bytes(config, batch_size, context, dtype))


REFERENCE = [
    ("08.1", MiniCache),
    ("08.2", cached_attention),
    ("08.2", cached_attention_sdpa),
    ("08.3", kv_cache_bytes),
]


@pytest.mark.parametrize("exercise_id, answer", REFERENCE)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("08.1", CatCache, "torch.cat"),
        ("08.1", WholeBufferCache, "whole buffer"),
        ("08.1", NoOverflowCheckCache, "must raise ValueError"),
        ("08.1", Float32Cache, "dtype"),
        ("08.1", LengthNotAdvancedCache, "length should now be"),
        ("08.1", SharedStateCache, "on the instance"),
        ("08.2", cached_attention_is_causal, "top-left"),
        ("08.2", cached_attention_no_mask, "a mask is needed"),
        ("08.2", cached_attention_tiled, "repeat_interleave"),
        ("08.2", cached_attention_unscaled, "sqrt(head_dim)"),
        ("08.2", cached_attention_appends_in_place, "changed q, k_cache or v_cache"),
        ("08.3", kv_cache_bytes_n_heads_everywhere, "GQA caches n_kv_heads key/value heads, not n_heads"),
        ("08.3", kv_cache_bytes_given_sizes, "config.kv_heads and config.latent_dim"),
        ("08.3", kv_cache_bytes_mqa_all_heads, "one key/value head"),
        ("08.3", kv_cache_bytes_float32_always, "bytes per number"),
        ("08.3", kv_cache_bytes_no_batch, "batch_size"),
        ("08.3", kv_cache_bytes_reserved, "block_size"),
        ("08.3", kv_cache_bytes_mla_twice, "latent once"),
        ("08.3", kv_cache_bytes_tensor, "Python int"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


def test_reference_answers_agree_with_the_library():
    """The references are what attnlib's cache does, not a second opinion."""
    config = GPTConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, attention="gqa")
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(0))
    for name in ATTENTION_REGISTRY:
        # 08.3: the formula equals the bytes measured on a KVCache after a prefill of 5 tokens
        torch.manual_seed(0)
        sized = {"gqa": dict(n_kv_heads=2), "mla": dict(kv_latent_dim=6)}.get(name, {})
        model = GPT(config.replace(**{"attention": name, "n_kv_heads": None, **sized})).eval()
        cache = KVCache.for_model(model)
        with torch.no_grad():
            model(tokens, cache=cache)
        assert kv_cache_bytes(model.config, 3, 5, torch.float32) == cache.bytes_per_token() * 3 * 5
    # 08.2: the answer is the last rows of a GQA layer's attention over the whole sequence
    layer = ATTENTION_REGISTRY["gqa"](config).eval()
    x = torch.randn(2, 6, config.d_model)
    with torch.no_grad():
        q, k, v = layer.project(x)
        full, _ = layer.attend(q, k, v, None, True, False)
        torch.testing.assert_close(cached_attention(q[:, :, -2:], k, v), full[:, :, -2:])
    # 08.1: the reference behaves like LayerCache inside a model layer
    mini = MiniCache(8)
    outs = [mini.update(k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(6)]
    assert torch.equal(outs[-1][0], k) and mini.length == 6
