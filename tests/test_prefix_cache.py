"""Prefix caching (SGLang's RadixAttention, vLLM's automatic prefix caching; chapter 19): the page index is keyed by
the whole prefix (equal pages after different prefixes never meet), reference counts, LRU eviction deepest page first,
copy-on-write; logits through shared pages equal the uncached model's (1e-5); ``serve(prefix_cache=True)`` gives
every request, greedily, exactly the tokens it gets alone and without the cache, under pool pressure too, saves the
prefill tokens counted by hand, and leaves no page held."""
import pytest
import torch

from attnlib.cache import OutOfPages, PagedKVCache, PrefixPageAllocator
from attnlib.serving import serve
from tests.test_paged_cache import build


def filled(alloc, tokens):
    """A sequence holding pages for ``tokens``, its full pages indexed."""
    seq = alloc.new_sequence()
    alloc.ensure(seq, len(tokens))
    alloc.register(seq, tokens)
    return seq


def test_the_index_is_keyed_by_the_whole_prefix():
    alloc = PrefixPageAllocator(n_pages=8, page_size=2)
    a = filled(alloc, [1, 2, 3, 4, 5])  # pages 0, 1 full and indexed, page 2 partial: not indexed
    assert alloc.tables[a] == [0, 1, 2] and set(alloc.index.values()) == {0, 1}
    assert alloc.lookup([1, 2, 3, 4, 5, 6]) == [0, 1]
    assert alloc.lookup([1, 2, 3, 9]) == [0]  # the second page differs
    assert alloc.lookup([7, 7, 3, 4]) == []  # the same page [3, 4] after another prefix: no hit
    assert alloc.lookup([1]) == []  # a partial page is never a hit
    b = filled(alloc, [7, 7, 3, 4])  # now [3, 4] after [7, 7] is a page of its own
    assert alloc.lookup([7, 7, 3, 4]) == alloc.tables[b] and alloc.tables[b][1] != 1


def test_reference_counts_release_and_lru_eviction_deepest_first():
    alloc = PrefixPageAllocator(n_pages=4, page_size=2)
    a = filled(alloc, [1, 2, 3, 4, 5, 6])  # pages 0, 1, 2 all indexed
    b = alloc.new_sequence()
    alloc.share(b, alloc.lookup([1, 2, 3, 4, 9]))  # b takes pages 0 and 1
    assert alloc.refs == [2, 2, 1, 0] and alloc.must_copy(0) and alloc.must_copy(2)  # 2: indexed
    alloc.release(a)
    assert alloc.refs == [1, 1, 0, 0] and list(alloc.lru) == [2] and alloc.available == 2
    alloc.release(b)
    assert alloc.refs == [0] * 4 and list(alloc.lru) == [2, 1, 0]  # b's pages deepest first, after a's page 2
    c = alloc.new_sequence()
    alloc.ensure(c, 6)  # the free page 3, then pages evicted least recently used first: 2, then 1
    assert alloc.tables[c] == [3, 2, 1] and alloc.evictions == 2
    assert alloc.lookup([1, 2, 3, 4, 5, 6]) == [0]  # page 0, the prefix's start, stayed
    assert alloc.index == {(1, 2): 0}
    d = alloc.new_sequence()
    alloc.ensure(d, 2)  # the last evictable page
    with pytest.raises(OutOfPages, match="all held by sequences"):
        alloc.ensure(d, 3)


def test_a_prefix_computed_twice_stays_private_and_is_freed():
    alloc = PrefixPageAllocator(n_pages=4, page_size=2)
    a, b = filled(alloc, [1, 2]), filled(alloc, [1, 2])  # both prefilled it before either was indexed
    assert alloc.index == {(1, 2): alloc.tables[a][0]} and not alloc.must_copy(alloc.tables[b][0])
    alloc.release(b)
    assert alloc.free[-1] == 1 and len(alloc.lru) == 0


@pytest.mark.parametrize("name", ["mha", "mla", "modern"])
@torch.no_grad()
def test_logits_through_shared_pages_equal_the_uncached_model(name):
    model = build(name)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 32, (9,), generator=g)
    cache = PagedKVCache.for_model(model, n_pages=32, page_size=4, prefix_cache=True)
    a = cache.add_sequence()
    model(system[None], cache=cache.select([a]))
    assert cache.cache_prefix(a, system) == 2  # two full pages of 4
    for prompt in (torch.cat([system, torch.randint(0, 32, (5,), generator=g)]), system[:8], system[:5]):
        b = cache.add_sequence()
        cached = cache.take_prefix(b, prompt)
        assert cached == min(8, prompt.numel() - 1, 4 * (prompt.numel() // 4))
        logits = model(prompt[None, cached:], cache=cache.select([b]))[0][0, -1]
        torch.testing.assert_close(logits, model(prompt[None])[0][0, -1], atol=1e-5, rtol=1e-5)
        nxt = torch.tensor([[3]])
        torch.testing.assert_close(model(nxt, cache=cache)[0][0, -1], model(torch.cat([prompt, nxt[0]])[None])[0][0, -1],
                                   atol=1e-5, rtol=1e-5)
    assert cache.allocator.copies == 1  # system[:8] is all cached: its last page was copied before its last token
    # the shared pages were never written: a still continues as alone
    step = model(torch.tensor([[7]]), cache=cache.select([a]))[0][0, -1]
    torch.testing.assert_close(step, model(torch.cat([system, torch.tensor([7])])[None])[0][0, -1], atol=1e-5, rtol=1e-5)


def test_copy_on_write_after_a_crop_leaves_the_shared_page_alone():
    model = build("mha")
    cache = PagedKVCache.for_model(model, n_pages=8, page_size=4, prefix_cache=True)
    a = cache.add_sequence()
    prompt = torch.arange(8)[None]
    model(prompt, cache=cache.select([a]))
    cache.cache_prefix(a, prompt[0])
    page = cache.allocator.tables[a][1]
    before = [pool[page].clone() for layer in cache.layers for pool in layer.buffers]
    cache.crop(6)  # a rewrites positions 6, 7 with other tokens: page 1 is indexed, so a takes a copy
    model(torch.tensor([[9, 9]]), cache=cache)
    assert cache.allocator.tables[a][1] != page and cache.allocator.copies == 1
    assert all(torch.equal(pool[page], old) for pool, old in
               zip((pool for layer in cache.layers for pool in layer.buffers), before))


def system_prompts():
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, 32, (12,), generator=g).tolist()  # three pages of 4
    return [system + torch.randint(0, 32, (n,), generator=g).tolist() for n in (1, 6, 3, 9, 2)], 4 * 12


def disjoint():
    g = torch.Generator().manual_seed(8)
    return [[first] + torch.randint(0, 32, (n,), generator=g).tolist() for first, n in zip(range(5), (6, 2, 9, 4, 7))], 0


def nested():
    p = torch.randint(0, 32, (14,), generator=torch.Generator().manual_seed(9)).tolist()
    # served in order: p[:5] caches 1 page; p[:10] takes it, caches 2; p[:14] takes 2; p (again) takes 3
    return [p[:5], p[:10], p[:14], p], 4 + 8 + 12


def page_multiples():
    p = torch.randint(0, 32, (12,), generator=torch.Generator().manual_seed(10)).tolist()
    # p[:8] after p: both pages cached, so it prefills only its last token (copy-on-write); p[:4] and p again likewise
    return [p, p[:8], p[:4], p], 7 + 3 + 11


@pytest.mark.parametrize("workload", [system_prompts, disjoint, nested, page_multiples])
@pytest.mark.parametrize("n_pages", [None, 12])
def test_serve_with_a_prefix_cache_gives_the_tokens_of_each_request_alone(workload, n_pages):
    model = build("modern", block_size=32)
    prompts, saved = workload()
    budgets = [5, 3, 6, 4, 2][: len(prompts)]
    plain, _ = serve(model, prompts, budgets, max_batch=1 if n_pages else 3, page_size=4, n_pages=n_pages)
    outputs, trace, stats = serve(model, prompts, budgets, max_batch=1 if n_pages else 3, page_size=4,
                                  n_pages=n_pages, prefix_cache=True, return_stats=True)
    for p, n, out, base in zip(prompts, budgets, outputs, plain):
        assert out.tolist() == base.tolist() == model.generate(torch.tensor(p)[None], n, temperature=0.0)[0].tolist()
    assert stats["pages_held"] == 0 and max(t["pages_used"] for t in trace) <= (n_pages or 3 * 8)
    assert stats["prefill_tokens"] + stats["prefill_tokens_saved"] == stats["prompt_tokens"] == sum(map(len, prompts))
    if n_pages is None:  # no pressure: every hit counted by hand above
        assert stats["prefill_tokens_saved"] == saved and stats["evictions"] == 0
    assert stats["copies"] == (3 if workload is page_multiples else 0)


def test_serve_under_pool_pressure_evicts_and_stays_exact():
    """Three system prompts in turn and a pool too small to keep them all: cached pages are evicted (LRU)."""
    model = build("modern", block_size=32)
    g = torch.Generator().manual_seed(11)
    systems = [torch.randint(0, 32, (8,), generator=g).tolist() for _ in range(3)]
    prompts = [systems[i % 3] + torch.randint(0, 32, (3,), generator=g).tolist() for i in range(9)]
    outputs, _, stats = serve(model, prompts, 4, max_batch=2, page_size=4, n_pages=8, prefix_cache=True,
                              return_stats=True)
    assert stats["evictions"] > 0 and stats["pages_held"] == 0 and stats["pages_cached"] <= 8
    assert 0 < stats["prefill_tokens_saved"] < 8 * 6  # some hits were lost to eviction
    for p, out in zip(prompts, outputs):
        assert out.tolist() == model.generate(torch.tensor(p)[None], 4, temperature=0.0)[0].tolist()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: serve(build("mha"), [[1, 2]], 2, prefix_cache=1), TypeError, "prefix_cache must be a bool; got 1"),
        (lambda: serve(build("mha"), [[1, 2]], 2, prefix_cache="yes"), TypeError, "prefix_cache must be a bool"),
        (lambda: serve(build("mha"), [[1, 2]], 2, return_stats=None), TypeError, "return_stats must be a bool"),
        (lambda: PagedKVCache(2, 16, 8, 4, prefix_cache=0), TypeError, "prefix_cache must be a bool; got 0"),
        (lambda: PagedKVCache(2, 16, 8, 4).take_prefix(0, [1]), ValueError, "take_prefix needs a cache made with"),
        (lambda: PagedKVCache(2, 16, 8, 4).cache_prefix(0, [1]), ValueError, "cache_prefix needs a cache made with"),
        (lambda: take_twice(), ValueError, "take_prefix needs an empty sequence and a non-empty prompt"),
        (lambda: PagedKVCache(2, 16, 8, 4, prefix_cache=True).take_prefix(7, [1]), ValueError,
         "sequence 7 is not in the cache"),
        (lambda: cache_wrong_length(), ValueError, r"tokens must be the ids of the 0 positions cached for sequence 0"),
        (lambda: share_uncached(), ValueError, r"pages \[3\] are not all cached pages"),
    ],
)
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def take_twice():
    cache = PagedKVCache(1, 16, 8, 4, prefix_cache=True)
    return cache.take_prefix(cache.add_sequence(), [])


def share_uncached():
    alloc = PrefixPageAllocator(4, 2)
    alloc.share(alloc.new_sequence(), [3])


def cache_wrong_length():
    cache = PagedKVCache(1, 16, 8, 4, prefix_cache=True)
    return cache.cache_prefix(cache.add_sequence(), [1, 2])


def test_serve_refuses_the_new_arguments_before_any_forward_pass():
    model = build("mha")
    calls = []
    model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    for bad, error, match in ((dict(prefix_cache=None), TypeError, "prefix_cache must be a bool"),
                              (dict(prefill_chunk=0), ValueError, "prefill_chunk=0 must be a positive integer"),
                              (dict(return_stats="no"), TypeError, "return_stats must be a bool")):
        with pytest.raises(error, match=match):
            serve(model, [[1, 2], [3]], 2, **bad)
    assert calls == []
