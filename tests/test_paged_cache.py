"""The paged KV cache (vLLM's PagedAttention scheme, chapter 19): logits through it equal those through the
contiguous KVCache (1e-6) for every attention variant and page size; a batch of sequences of different lengths
equals each sequence alone; pages come from and return to one free list; the memory it wastes is measured;
continuous batching gives every request what it gets alone."""
import math

import pytest
import torch

from attnlib import GPT, Decoder, DecoderConfig, GPTConfig
from attnlib.cache import OutOfPages, PageAllocator, PagedKVCache
from attnlib.serving import cache_memory, request_lengths, serve

VARIANTS = ["mha", "gqa", "mqa", "talking_heads", "mla", "modern", "modern_learned", "modern_window"]


def build(name, block_size=24):
    torch.manual_seed(0)
    if name.startswith("modern"):
        position = "learned" if name == "modern_learned" else "rope"
        window = 4 if name == "modern_window" else None  # the paged cache keeps every position, the window is a mask
        model = Decoder(DecoderConfig.llama(vocab_size=32, block_size=block_size, n_layers=2, n_heads=4, d_model=32,
                                            n_kv_heads=2, qk_norm=True, position=position, sliding_window=window))
    else:
        model = GPT(GPTConfig(vocab_size=32, block_size=block_size, n_layers=2, n_heads=4, d_model=32, attention=name,
                              n_kv_heads=2 if name == "gqa" else None))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)  # peaked distributions: greedy comparisons are not decided by rounding
    return model.eval()


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("name", VARIANTS)
@torch.no_grad()
def test_logits_equal_the_contiguous_cache(name, page_size):
    model = build(name)
    g = torch.Generator().manual_seed(1)
    # The contiguous cache of every position, as the paged one keeps (windows=False: a window is then a mask on both;
    # a ring cache attends over fewer keys, equal up to float32 rounding: tests/test_sliding_window.py).
    reference = model.new_cache(windows=False)
    paged = PagedKVCache.for_model(model, n_pages=64, page_size=page_size)
    paged.select([paged.add_sequence(), paged.add_sequence()])
    for T in (5, 1, 1, 3, 1, 1, 1):  # a prefill, decode steps, a chunk
        idx = torch.randint(0, 32, (2, T), generator=g)
        torch.testing.assert_close(model(idx, cache=paged)[0], model(idx, cache=reference)[0], atol=1e-6, rtol=1e-6)
    assert paged.length == reference.length == 13
    assert paged.allocator.pages_used == 2 * math.ceil(13 / page_size)


@pytest.mark.parametrize("name", ["mha", "mla", "modern", "modern_learned", "modern_window"])
@torch.no_grad()
def test_sequences_of_different_lengths_decode_together_as_alone(name):
    model = build(name)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 32, (n,), generator=g) for n in (7, 2, 4)]
    cache = PagedKVCache.for_model(model, n_pages=32, page_size=3)
    seqs = [cache.add_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        model(p[None], cache=cache.select([s]))  # each prefilled alone, into its own pages
    steps = torch.randint(0, 32, (3, 4), generator=g)
    cache.select(seqs)
    for t in range(4):
        batched = model(steps[:, t:t + 1], cache=cache, attention_mask=cache.attention_mask(1))[0][:, -1]
        for i, p in enumerate(prompts):
            alone = model(torch.cat([p, steps[i, :t + 1]])[None])[0][0, -1]  # no cache at all
            torch.testing.assert_close(batched[i], alone, atol=1e-4, rtol=1e-5)  # logits of size ~10
    assert [cache.sequence_length(s) for s in seqs] == [11, 6, 8]
    assert cache.attention_mask(1).tolist()[1] == [False] * 5 + [True] * 7


def test_block_tables_and_the_free_list():
    alloc = PageAllocator(n_pages=5, page_size=4)
    a, b = alloc.new_sequence(), alloc.new_sequence()
    alloc.ensure(a, 5)  # two pages
    alloc.ensure(b, 4)  # one page
    alloc.ensure(a, 8)  # still two
    assert alloc.tables == {a: [0, 1], b: [2]} and alloc.pages_used == 3
    pages, offsets = alloc.locate(a, torch.tensor([0, 3, 4, 7]))
    assert pages.tolist() == [0, 0, 1, 1] and offsets.tolist() == [0, 3, 0, 3]
    alloc.release(a)  # its pages go back and are handed out again
    c = alloc.new_sequence()
    alloc.ensure(c, 9)
    assert alloc.tables[c] == [0, 1, 3] and alloc.pages_used == 4
    with pytest.raises(OutOfPages, match=r"no free page for sequence 2 \(5 pages of 4 positions, all in use\)"):
        alloc.ensure(c, 17)


def test_slots_of_a_batch_are_each_sequences_pages_right_aligned():
    """The batch's flat slots, worked out by hand from the block tables (page * page_size + offset)."""
    alloc = PageAllocator(n_pages=6, page_size=3)
    a, b = alloc.new_sequence(), alloc.new_sequence()
    alloc.ensure(b, 2)  # page 0
    alloc.ensure(a, 7)  # pages 1, 2, 3
    slots, held = alloc.slots([a, b], [7, 2], width=8)
    assert held.tolist() == [[False] + [True] * 7, [False] * 6 + [True] * 2]
    assert slots[0, 1:].tolist() == [3, 4, 5, 6, 7, 8, 9]  # page 1 (3, 4, 5), page 2 (6, 7, 8), page 3 (9)
    assert slots[1, 6:].tolist() == [0, 1]  # page 0
    assert slots[~held].eq(0).all()
    alloc.ensure(b, 4)  # page 4 joins b's table: its first slots stay where they were
    later, _ = alloc.slots([a, b], [7, 4], width=8)
    assert later[1, 4:].tolist() == [0, 1, 2, 12]


def test_paged_memory_wastes_less_than_a_page_per_request():
    lengths = request_lengths(200, 1024, seed=0)
    m = cache_memory(lengths, block_size=1024, page_size=16, bytes_per_token=10)
    assert m["tokens"] == sum(lengths) and m["contiguous_positions"] == 200 * 1024
    assert m["paged_positions"] == 16 * sum(math.ceil(n / 16) for n in lengths)
    assert m["paged_positions"] - m["tokens"] < 16 * 200
    assert m["paged_bytes"] == 10 * m["paged_positions"]
    assert m["contiguous_waste"] > 0.8 and m["paged_waste"] < 0.1  # this mix: ~88% vs ~7%
    assert cache_memory([4, 8], 8, 1)["paged_waste"] == 0.0


@pytest.mark.parametrize("name", ["mha", "modern"])
def test_continuous_batching_gives_each_request_what_it_gets_alone(name):
    model = build(name, block_size=32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 32, (n,), generator=g) for n in (3, 9, 1, 5, 12, 2, 7)]
    budgets = [5, 3, 8, 1, 6, 9, 4]
    outputs, trace = serve(model, prompts, budgets, max_batch=3, page_size=4)
    for p, n, out in zip(prompts, budgets, outputs):
        assert out.tolist() == model.generate(p[None], n, temperature=0.0)[0].tolist()
    assert max(len(t["running"]) for t in trace) == 3
    assert any(t["joined"] for t in trace[1:])  # requests joined a running batch
    assert sorted(r for t in trace for r in t["left"]) == list(range(7))


def test_continuous_batching_waits_for_pages():
    model = build("mha", block_size=32)
    prompts = [[1, 2, 3]] * 4
    outputs, trace = serve(model, prompts, 5, max_batch=4, page_size=4, n_pages=4)  # 2 pages each: two at a time
    assert max(len(t["running"]) for t in trace) == 2 and max(t["pages_used"] for t in trace) <= 4
    assert all(o.tolist() == outputs[0].tolist() for o in outputs)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: PagedKVCache(2, 16, n_pages=8, page_size=0), ValueError, "page_size=0 must be a positive integer"),
        (lambda: PageAllocator(8, -3), ValueError, "page_size=-3 must be a positive integer"),
        (lambda: PageAllocator(8, 2.0), TypeError, r"page_size must be an int; got 2.0"),
        (lambda: PagedKVCache(2, 16, n_pages=0, page_size=4), ValueError, "n_pages=0 must be a positive integer"),
        (lambda: cache_memory([3], 8, 0), ValueError, "page_size=0 must be a positive integer"),
        (lambda: cache_memory([9], 8, 2), ValueError, r"lengths must be a non-empty list of ints in \[1, block_size=8\]"),
        (lambda: PagedKVCache(2, 16, 8, 4).select([5]), ValueError, "sequence 5 is not in the cache"),
        (lambda: PagedKVCache(2, 16, 8, 4).reorder(torch.tensor([0])), ValueError, "copy-on-write"),
        (lambda: serve(build("mha"), [[1] * 20], 5), ValueError, r"request 0: prompt of 20 tokens \+ 5 new"),
        (lambda: serve(build("mha"), [[1, 2]], 5, page_size=0), ValueError, "page_size=0 must be a positive integer"),
        (lambda: serve(build("mha"), [[1, 2]], 9, page_size=2, n_pages=3), ValueError,
         "request 0 may need 6 pages of 2; the pool has n_pages=3"),
        (lambda: serve(build("mha"), [[1, 99]], 2), ValueError, r"prompts\[0\] holds token id 99"),
    ],
)
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()
