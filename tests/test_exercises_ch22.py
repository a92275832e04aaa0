"""The chapter 22 exercise checks, table-driven: correct answers pass, plausible mistakes get a hint naming them.

The checks' expected values are pinned here to attnlib's own mechanisms, which the exercises refuse to the
learner: :class:`attnlib.cache.PrefixPageAllocator` and ``serve(prefix_cache=True)``'s saved prefill tokens
(22.1), :class:`attnlib.cache.KIVILayerCache`'s stored keys (22.2), :class:`attnlib.cache.SnapKVLayerCache`'s
kept positions (22.3), on random cases.
"""
import pytest
import torch
from exercise_table import Answers
from torch.nn import functional as F

from attnlib import Decoder, DecoderConfig
from attnlib.book.exercises import ch22
from attnlib.book.exercises._ch22_snapkv import keep, pooled_votes
from attnlib.cache import KIVILayerCache, PrefixPageAllocator, SnapKVLayerCache
from attnlib.cache.quantize import dequantize_minmax, quantize_minmax
from attnlib.serving import serve


# ---------------------------------------------------------------- 22.1
def reused_tokens(cached_prompts, prompt, page_size):  # the solution's way: vLLM's chained page hashes
    cached = set()
    for c in cached_prompts:
        h = None
        for end in range(page_size, len(c) + 1, page_size):
            h = hash((h, tuple(c[end - page_size:end])))  # a page's key covers every token before it
            cached.add(h)
    h, pages = None, 0
    for end in range(page_size, len(prompt) + 1, page_size):
        h = hash((h, tuple(prompt[end - page_size:end])))
        if h not in cached:
            break
        pages += 1
    return min(pages * page_size, len(prompt) - 1)  # the last token always runs


def reused_by_common_prefix(cached_prompts, prompt, page_size):  # another way: the longest shared prefix
    best = 0
    for c in cached_prompts:
        n = 0
        while n < min(len(c), len(prompt)) and c[n] == prompt[n]:
            n += 1
        best = max(best, n // page_size * page_size)
    return min(best, len(prompt) - 1)


def common(c, prompt):
    n = 0
    while n < min(len(c), len(prompt)) and c[n] == prompt[n]:
        n += 1
    return n


def reused_with(cached_prompts, prompt, P, rounding="down", cap=True, unit="tokens", only=None):
    cached = cached_prompts if only is None else cached_prompts[only:][:1]
    longest = max((common(c, prompt) for c in cached), default=0)
    n = {"down": longest // P * P, "up": -(-longest // P) * P, "none": longest, "pages": longest // P}[rounding]
    if cap == "page" and n == len(prompt):
        return n - P
    return min(n, len(prompt) - 1) if cap is True else n


def reused_by_own_tokens(cached_prompts, prompt, P, anywhere=False):
    pages = {(i if not anywhere else 0, tuple(c[i * P:(i + 1) * P])) for c in cached_prompts
             for i in range(len(c) // P)}
    n = 0
    while (n + 1) * P <= len(prompt) and ((n if not anywhere else 0), tuple(prompt[n * P:(n + 1) * P])) in pages:
        n += 1
    return min(n * P, len(prompt) - 1)


def reused_through_allocator(cached_prompts, prompt, page_size):
    alloc = PrefixPageAllocator(64, page_size)
    for c in cached_prompts:
        seq = alloc.new_sequence()
        alloc.ensure(seq, len(c))
        alloc.register(seq, c)
    return min(len(alloc.lookup(prompt)) * page_size, len(prompt) - 1)


def by_allocator(cached_prompts, prompt, page_size):  # attnlib's own index, filled as serve fills it
    alloc = PrefixPageAllocator(256, page_size)
    for c in cached_prompts:
        if c:
            seq = alloc.new_sequence()
            alloc.ensure(seq, len(c))
            alloc.register(seq, c)
    return min(len(alloc.lookup(prompt)) * page_size, len(prompt) - 1)


def test_the_count_is_the_prefix_allocators():
    """The check's reference and the solution against PrefixPageAllocator's lookup, on the check's own cases."""
    for seed in range(40):
        for cached, prompt, P in ch22._reused_cases(torch.Generator().manual_seed(seed)):
            want = by_allocator(cached, prompt, P)
            assert ch22._reused(cached, prompt, P) == want == reused_tokens(cached, prompt, P)


def test_the_count_is_what_serve_saves():
    """serve(prefix_cache=True) one request at a time: its prefill_tokens_saved is the sum of the counts."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.llama(vocab_size=8, block_size=32, n_layers=1, n_heads=2, d_model=8,
                                        n_kv_heads=1)).eval()
    g = torch.Generator().manual_seed(3)
    for P in (1, 3, 4):
        base = torch.randint(0, 3, (16,), generator=g).tolist()
        prompts = [base[:12], base[:12], base[:7] + [7, 7], base[:4] + [1] * 9, [7] * 5, base[:9]]
        _, _, stats = serve(model, prompts, 1, max_batch=1, page_size=P, n_pages=128, prefix_cache=True,
                            return_stats=True)
        saved = sum(reused_tokens(prompts[:i], prompts[i], P) for i in range(len(prompts)))
        assert stats["prefill_tokens_saved"] == saved > 0 and stats["evictions"] == 0


# ---------------------------------------------------------------- 22.2
def kivi_keys(k, bits, group_size):  # the solution's way: the tokens of a group on their own axis
    B, H, T, d = k.shape
    x = k.reshape(B, H, T // group_size, group_size, d)
    lo, hi = x.amin(dim=-2, keepdim=True), x.amax(dim=-2, keepdim=True)  # per channel and group
    scale = (hi - lo) / (2**bits - 1)
    codes = torch.where(scale > 0, (x - lo) / torch.where(scale > 0, scale, 1), 0).round()
    return (lo + codes * scale).reshape(B, H, T, d)


def kivi_by_loop(k, bits, group_size):  # another way: group by group, in float64, a tiny floor on the scale
    out = torch.empty_like(k)
    for start in range(0, k.shape[2], group_size):
        x = k[:, :, start:start + group_size].double()
        lo, hi = x.amin(2, keepdim=True), x.amax(2, keepdim=True)
        scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-30)
        out[:, :, start:start + group_size] = (lo + ((x - lo) / scale).round() * scale).to(k.dtype)
    return out


def kivi_with(k, bits, G, axis="group", levels=None, how=torch.round, clamp=True, guard=True):
    B, H, T, d = k.shape
    x, dim = {"group": (k.reshape(B, H, T // G, G, d), -2), "token": (k, -1), "all": (k, -2)}[axis]
    L = 2**bits - 1 if levels is None else levels
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / L
    q = how(torch.where(scale > 0, (x - lo) / torch.where(scale > 0, scale, 1), 0) if guard else (x - lo) / scale)
    if clamp:
        q = q.clamp(0, 2**bits - 1)
    return (lo + q * scale).reshape(B, H, T, d)


def kivi_symmetric(k, bits, G):
    B, H, T, d = k.shape
    x = k.reshape(B, H, T // G, G, d)
    half = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-2, keepdim=True) / half
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1), 0).round().clamp(-half, half)
    return (q * scale).reshape(B, H, T, d)


def kivi_integer_zero_point(k, bits, G):  # torch's affine quantisation: zero point rounded to a code
    B, H, T, d = k.shape
    x = k.reshape(B, H, T // G, G, d)
    L = 2**bits - 1
    scale = (x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)) / L
    safe = torch.where(scale > 0, scale, 1)
    zp = torch.where(scale > 0, (-x.amin(-2, keepdim=True) / safe).round(), 0)
    q = (torch.where(scale > 0, x / safe, 0).round() + zp).clamp(0, L)
    return ((q - zp) * scale).reshape(B, H, T, d)


def kivi_codes(k, bits, G):
    B, H, T, d = k.shape
    x = k.reshape(B, H, T // G, G, d)
    lo, hi = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-30)
    return ((x - lo) / scale).round().to(torch.uint8).reshape(B, H, T, d)


def kivi_through_attnlib(k, bits, G):
    B, H, T, d = k.shape
    codes, scale, zero = quantize_minmax(k.reshape(B, H, T // G, G, d), bits, dim=-2)
    return dequantize_minmax(codes, scale, zero).reshape(B, H, T, d)


def kivi_through_torch(k, bits, G):
    B, H, T, d = k.shape
    x = k.reshape(B, H, T // G, G, d).transpose(-2, -1).reshape(-1, G)  # a row per (channel, group)
    lo, hi = x.amin(-1), x.amax(-1)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
    zp = (-lo / scale).round().int()
    out = torch.fake_quantize_per_channel_affine(x.float(), scale.float(), zp, 0, 0, 2**bits - 1)
    return out.reshape(B, H, T // G, d, G).transpose(-2, -1).reshape(B, H, T, d).to(k.dtype)


@pytest.mark.parametrize(("bits", "G", "d"), [(2, 4, 4), (4, 8, 8), (2, 1, 8), (4, 3, 2)])
def test_the_keys_are_kivi_layer_caches(bits, G, d):
    """KIVILayerCache (no residual) stores the prompt's keys quantised: they come back as the solution's and the
    check's reference, random keys with an outlier channel, float32 (max abs diff measured: <= 5e-7)."""
    g = torch.Generator().manual_seed(bits * 100 + G)
    B, H, T = 2, 3, 4 * G
    k = torch.randn(B, H, T, d, generator=g) + torch.randn(d, generator=g)
    k[..., 0] *= 20
    cache = KIVILayerCache(block_size=T + 1, bits=bits, group_size=G, residual_length=0)
    cache.update(k, k.clone())
    stored = cache.update(torch.zeros(B, H, 1, d), torch.zeros(B, H, 1, d))[0][..., :T, :]  # as read back
    reference = ch22._minmax(ch22._grouped(k, G), bits, -2).reshape(k.shape)
    assert (stored - kivi_keys(k, bits, G)).abs().max() <= 5e-7 * k.abs().max()
    assert (stored.double() - reference).abs().max() <= 5e-7 * k.abs().max()


# ---------------------------------------------------------------- 22.3
def snapkv_keep(weights, window, budget, kernel_size):  # the solution's way: F.avg_pool1d
    B, H, T, _ = weights.shape
    if T <= budget:
        return torch.arange(T).expand(B, H, T)
    vote = weights[..., T - window:, :T - window].sum(dim=-2)  # (B, H, T - window)
    pooled = F.avg_pool1d(vote.reshape(B * H, 1, -1), kernel_size, stride=1, padding=kernel_size // 2)
    top = pooled.reshape(B, H, -1).topk(budget - window, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, torch.arange(T - window, T).expand(B, H, window)], dim=-1)


def snapkv_by_cumsum(weights, window, budget, kernel_size):  # another way: the mean vote, pooled by cumsums
    B, H, T, _ = weights.shape
    if T <= budget:
        return torch.arange(T).expand(B, H, T).clone()
    vote = weights[..., T - window:, :T - window].double().mean(dim=-2)  # a mean ranks as the sum
    r = kernel_size // 2
    padded = F.pad(vote, (r + 1, r))  # one more zero in front for the cumsum's difference
    c = padded.cumsum(-1)
    pooled = (c[..., kernel_size:] - c[..., :-kernel_size]) / kernel_size  # (B, H, T - window)
    keep_mask = torch.zeros(B, H, T, dtype=torch.bool)
    keep_mask[..., T - window:] = True
    keep_mask.scatter_(-1, pooled.topk(budget - window, dim=-1).indices, True)
    return keep_mask.nonzero()[:, 2].reshape(B, H, budget)


def snapkv_with(weights, window, budget, K, **variant):
    B, H, T, _ = weights.shape
    if T <= budget:
        return torch.arange(T).expand(B, H, T)
    return keep(pooled_votes(weights, window, K, **variant), T, window, budget)


def snapkv_unpadded(weights, window, budget, K):
    B, H, T, _ = weights.shape
    if T <= budget:
        return torch.arange(T).expand(B, H, T)
    return keep(pooled_votes(weights, window, K, pad=False), T, window, budget)


def snapkv_without_window(weights, window, budget, K):
    B, H, T, _ = weights.shape
    if T <= budget:
        return torch.arange(T).expand(B, H, T)
    vote = weights[..., T - window:, :].sum(-2)  # every key a candidate, the window's own too
    pooled = F.avg_pool1d(vote.reshape(B * H, 1, -1), K, stride=1, padding=K // 2).reshape(B, H, T)
    return pooled.topk(budget, dim=-1).indices.sort(-1).values


def snapkv_unsorted(weights, window, budget, K):
    B, H, T, _ = weights.shape
    if T <= budget:
        return torch.arange(T).expand(B, H, T)
    pooled = pooled_votes(weights, window, K)
    top = pooled.topk(budget - window, dim=-1).indices  # in the order of the votes
    return torch.cat([top, torch.arange(T - window, T).expand(B, H, window)], -1)


def snapkv_through_attnlib(weights, window, budget, K):
    B, H, T, _ = weights.shape
    cache = SnapKVLayerCache(T + 1, budget, window, K)
    cache.update(torch.zeros(B, H, T, 2), torch.zeros(B, H, T, 2))
    cache.observe(weights)
    return cache.positions[..., :cache.n_held].clone()


def snapkv_ignoring_short_prompts(weights, window, budget, K):
    B, H, T, _ = weights.shape
    return keep(pooled_votes(weights, window, K), T, window, budget)  # topk of more than there is: raises


def test_the_choice_is_snapkv_layer_caches():
    """SnapKVLayerCache, given the prompt's weights (one query head per key/value head), keeps the positions the
    solution and the check's reference choose, on the check's own random cases."""
    from attnlib.book.exercises._ch22_snapkv import _cases, _weights

    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        for size, window, budget, K, scale, pattern in _cases(g):
            weights = _weights(g, size, scale, pattern, window, K)
            B, H, T, _ = size
            cache = SnapKVLayerCache(block_size=T + 1, budget=budget, window=window, kernel_size=K)
            cache.update(torch.randn(B, H, T, 4), torch.randn(B, H, T, 4))
            cache.observe(weights)
            kept = cache.positions[..., :cache.n_held]
            assert torch.equal(kept, snapkv_keep(weights, window, budget, K))
            if T > budget:
                assert torch.equal(kept, keep(pooled_votes(weights, window, K), T, window, budget))


def test_a_near_tie_decided_the_other_way_is_right():
    """Two keys of equal pooled vote: either is kept (float32's rounding decides), a third is not."""
    from attnlib.book.exercises._ch22_snapkv import _as_good

    T, window = 6, 2
    pooled = torch.tensor([[[0.1, 0.5, 0.5, 0.2]]], dtype=torch.float64)
    want = torch.tensor([[[1, 4, 5]]])
    assert _as_good(torch.tensor([[[2, 4, 5]]]), want, pooled, T, window)
    assert not _as_good(torch.tensor([[[3, 4, 5]]]), want, pooled, T, window)
    assert not _as_good(torch.tensor([[[2, 3, 5]]]), want, pooled, T, window)  # the window not kept


ANSWERS = {
    "22.1": Answers(
        correct=[reused_tokens, reused_by_common_prefix, lambda c, p, P: reused_with(c, p, P)],
        wrong=[
            (lambda c, p, P: reused_by_own_tokens(c, p, P), "the whole prefix up to its end"),
            (lambda c, p, P: reused_by_own_tokens(c, p, P, anywhere=True), "not by its own tokens"),
            (lambda c, p, P: reused_with(c, p, P, rounding="none"), "round the shared prefix down to whole pages"),
            (lambda c, p, P: reused_with(c, p, P, rounding="up"), "not up"),
            (lambda c, p, P: reused_with(c, p, P, cap=False), "last token always goes through the model"),
            (lambda c, p, P: reused_with(c, p, P, cap="page"), "not a page fewer"),
            (lambda c, p, P: reused_with(c, p, P, rounding="pages"), "not of pages"),
            (lambda c, p, P: reused_with(c, p, P, only=-1), "not only the last prompt's"),
            (lambda c, p, P: reused_with(c, p, P, only=0), "not only the first prompt's"),
            (reused_through_allocator, "without attnlib's prefix cache"),
            (lambda c, p, P: float(reused_tokens(c, p, P)), "should be a Python int"),
        ],
    ),
    "22.2": Answers(
        correct=[kivi_keys, kivi_by_loop, lambda k, b, G: kivi_with(k.double(), b, G).to(k.dtype)],
        wrong=[
            (lambda k, b, G: kivi_with(k, b, G, axis="token"), "not per token over its channels"),
            (lambda k, b, G: kivi_with(k, b, G, axis="all"), "not one over all T tokens"),
            (kivi_symmetric, "KIVI is asymmetric"),
            (lambda k, b, G: kivi_with(k, b, G, levels=2**b), "dividing by 2^bits"),
            (lambda k, b, G: kivi_with(k, b, G, levels=2**b, clamp=False), "dividing by 2^bits"),
            (lambda k, b, G: kivi_with(k, b, G, how=torch.floor), "round to the nearest level"),
            (lambda k, b, G: kivi_with(k, b, G, guard=False), "has NaN"),
            (kivi_integer_zero_point, "not rounded to an integer code"),
            (kivi_codes, "return the keys read back"),
            (lambda k, b, G: kivi_keys(k, b, G).double(), "in k's dtype"),
            (kivi_through_attnlib, "quantise by hand"),
            (kivi_through_torch, "quantise by hand"),
        ],
    ),
    "22.3": Answers(
        correct=[snapkv_keep, snapkv_by_cumsum],
        wrong=[
            (lambda w, n, b, K: snapkv_with(w, n, b, K, pool="none"), "pool the votes along the keys"),
            (lambda w, n, b, K: snapkv_with(w, n, b, K, queries=w.shape[-1]), "not of every query"),
            (lambda w, n, b, K: snapkv_with(w, n, b, K, queries=n + 1), "not window + 1"),
            (lambda w, n, b, K: snapkv_with(w, n, b, K, queries=max(n - 1, 1)), "not window - 1"),
            (lambda w, n, b, K: snapkv_with(w, n, b, K, pool="max"), "not a max"),
            (lambda w, n, b, K: snapkv_with(w, n, b, K, count_pad=False), "count_include_pad"),
            (lambda w, n, b, K: snapkv_with(w, n, b, K, keys=w.shape[-1]), "the keys before the window only"),
            (snapkv_unpadded, "centred on key j"),
            (snapkv_without_window, "always kept"),
            (snapkv_unsorted, "sort them ascending"),
            (lambda w, n, b, K: snapkv_keep(w, n, b, K)[..., :-n] if w.shape[-1] > b else snapkv_keep(w, n, b, K),
             "the last window positions are kept too"),
            (lambda w, n, b, K: snapkv_keep(w, n, b, K).int(), "as int64"),
            (snapkv_through_attnlib, "without attnlib's evicting caches"),
            (snapkv_ignoring_short_prompts, "keeps them all, 0 … T - 1: nothing to choose"),
        ],
    ),
}


def test_the_slips_are_distinct_on_the_fixed_cases():
    """Every slip of 22.3 differs from the right choice in some fixed case, whatever the seed of the weights (else
    its hint could not show, and the slip would pass)."""
    from attnlib.book.exercises._ch22_snapkv import _cases, _slips, _weights

    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        seen: dict[str, bool] = {}
        for size, window, budget, K, scale, pattern in _cases(g)[:10]:  # the fixed ones
            weights = _weights(g, size, scale, pattern, window, K)
            if size[2] <= budget:
                continue
            want = keep(pooled_votes(weights, window, K), size[2], window, budget)
            for name, (_, wrong) in _slips(weights, window, budget, K).items():
                seen[name] = seen.get(name, False) or not (wrong.shape == want.shape and torch.equal(wrong, want))
        assert len(seen) == 10 and all(seen.values()), (seed, [h for h, v in seen.items() if not v])
