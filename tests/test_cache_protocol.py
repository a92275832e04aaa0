"""One protocol for every layer cache (issue 21, item 3), checked on every implementation.

Each cache is fed tensors whose entries are their own position (row ``b`` adds ``1000 · b``), so
what ``update`` returns can be read as positions and compared with what the definitions say a new
query may need:

* contiguous: every position;
* ring (window ``w``): the last ``w - 1`` positions before the new ones (Mistral's window);
* sink (``s`` sinks, window ``w``): the first ``s`` positions and the last ``w - 1`` (StreamingLLM);
* chunked (``C``): the positions of the current chunk (Llama 4);
* paged: every position (of each row, right-aligned).

``crop(L)`` is checked by behaviour: it is allowed exactly when, afterwards, the cache returns what a
fresh cache that only ever saw positions ``0 … L-1`` returns; otherwise it raises ``ValueError`` and
changes nothing. ``reorder``, ``reset``, ``length``, ``key_positions`` and the bytes are checked on every
implementation; the recurrent state honours the parts of the protocol a state can.
"""
from __future__ import annotations

import copy

import pytest
import torch

from attnlib.cache import (
    ChunkedLayerCache,
    KVCache,
    LayerCache,
    PagedKVCache,
    RecurrentState,
    RingLayerCache,
    SinkLayerCache,
)

BLOCK = 40
HEADS, WIDTH = 2, 3


def expected_positions(kind: str, start: int, end: int) -> list[int]:
    """The positions ``update`` returns for new positions ``start … end-1``, from each cache's definition."""
    new = list(range(start, end))
    name, size = kind
    if name in ("contiguous", "paged"):
        return list(range(end))
    if name == "ring":
        return list(range(max(0, start - size + 1), start)) + new
    if name == "sink":
        window, n_sink = size
        sinks = list(range(min(n_sink, start)))
        return sinks + [p for p in range(max(0, start - window + 1), start) if p >= n_sink] + new
    if name == "chunked":
        return list(range(start - start % size, start)) + new
    raise AssertionError(kind)


KINDS = [("contiguous", None), ("ring", 4), ("ring", 1), ("sink", (4, 2)), ("sink", (3, 0)), ("chunked", 5),
         ("chunked", 1), ("paged", None)]


def make(kind):
    name, size = kind
    if name == "contiguous":
        return LayerCache(BLOCK)
    if name == "ring":
        return RingLayerCache(BLOCK, size)
    if name == "sink":
        return SinkLayerCache(BLOCK, *size)
    if name == "chunked":
        return ChunkedLayerCache(BLOCK, size)
    paged = PagedKVCache(1, BLOCK, n_pages=32, page_size=3)
    paged.select([paged.add_sequence(), paged.add_sequence()])
    return paged.layers[0]


def positions_tensor(start: int, end: int, B: int = 2) -> torch.Tensor:
    """``(B, HEADS, T_new, WIDTH)`` whose entries are the position, plus 1000 per row."""
    pos = torch.arange(start, end, dtype=torch.float64)
    rows = 1000.0 * torch.arange(B, dtype=torch.float64)
    return (pos[None, None, :, None] + rows[:, None, None, None]).expand(B, HEADS, end - start, WIDTH).contiguous()


def returned_positions(t: torch.Tensor) -> list[int]:
    """Row 0 of a returned tensor read back as positions (every head and channel must agree)."""
    assert bool((t[0] == t[0, :1, :, :1]).all()), "a position's entries disagree across heads or channels"
    return [int(x) for x in t[0, 0, :, 0]]


def feed(cache, chunks):
    """Update ``cache`` with consecutive chunks of the given sizes; yield what each update returned."""
    for n in chunks:
        start = cache.length
        new = positions_tensor(start, start + n)
        k, v = cache.update(new, -new)
        assert torch.equal(v, -k), "the second tensor does not follow the first"
        yield start, start + n, k


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 7, 2, 1], [12], [3, 9, 1]], ids=str)
def test_update_returns_what_a_query_may_need(kind, chunks):
    cache = make(kind)
    for start, end, k in feed(cache, chunks):
        expected = expected_positions(kind, start, end)
        assert returned_positions(k) == expected, (kind, start, end)
        assert cache.key_positions.tolist() == expected
        assert cache.length == end
        assert bool((k[1] - k[0] == 1000.0).all()), "rows were mixed"


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_crop_is_allowed_exactly_when_it_can_be_replayed(kind):
    base = make(kind)
    list(feed(base, [5, 1, 6]))  # 12 positions seen
    for L in range(0, 15):
        cache = copy.deepcopy(base)
        fresh = make(kind)
        list(feed(fresh, [L] if L else []))
        fresh_next = list(feed(fresh, [2]))[0][2]
        stored = {int(x) % 1000 for b in cache.buffers for x in b.flatten().tolist()} if kind[0] != "contiguous" \
            else set(range(cache.length))
        needed = set(returned_positions(fresh_next)) - {L, L + 1}
        try:
            cache.crop(L)
        except ValueError as e:
            assert "cannot crop" in str(e)
            assert L < base.length and not needed <= stored, f"refused a crop to {L} that could be replayed"
            assert cache.length == base.length, "a refused crop changed the cache"
            continue
        assert cache.length == min(L, base.length)
        if L <= base.length:
            assert returned_positions(list(feed(cache, [2]))[0][2]) == returned_positions(fresh_next), L


def test_crop_argument_is_checked():
    for cache in (LayerCache(4), RingLayerCache(4, 2), RecurrentState(4)):
        with pytest.raises(TypeError, match="length must be an int"):
            cache.crop(1.0)
        with pytest.raises(ValueError, match="length=-1"):
            cache.crop(-1)


@pytest.mark.parametrize("kind", [k for k in KINDS if k[0] != "paged"], ids=str)
def test_reorder_follows_the_rows(kind):
    cache = make(kind)
    list(feed(cache, [3, 1]))
    cache.reorder(torch.tensor([1, 1]))
    start = cache.length
    k, _ = cache.update(positions_tensor(start, start + 1), positions_tensor(start, start + 1))
    assert bool((k[:, :, :-1] >= 1000.0).all()), "the past of row 0 is not row 1's after reorder([1, 1])"
    with pytest.raises(ValueError, match="rows of the cached batch of 2"):
        cache.reorder(torch.tensor([2]))
    with pytest.raises(TypeError, match="integer tensor"):
        cache.reorder(torch.tensor([0.0]))


def test_the_paged_cache_refuses_reorder_with_the_documented_error():
    with pytest.raises(ValueError, match="copy-on-write"):
        make(("paged", None)).reorder(torch.tensor([0, 1]))


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_reset_forgets_and_reuses_the_buffers(kind):
    cache = make(kind)
    list(feed(cache, [4, 2]))
    cache.reset()
    if kind[0] == "paged":  # the paged cache releases the batch's sequences
        assert cache.owner.batch == []
        return
    buffers = [b.data_ptr() for b in cache.buffers]
    assert cache.length == 0
    assert returned_positions(list(feed(cache, [3]))[0][2]) == expected_positions(kind, 0, 3)
    assert [b.data_ptr() for b in cache.buffers] == buffers, "reset reallocated the buffers"


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_bytes_are_the_slots_it_holds(kind):
    cache = make(kind)
    list(feed(cache, [6]))
    name, size = kind
    slots = {"contiguous": BLOCK, "ring": size, "sink": sum(size) if isinstance(size, tuple) else None,
             "chunked": size, "paged": 32 * 3}[name]
    rows = 1 if name == "paged" else 2  # the pool is shared by the sequences
    per_position = HEADS * WIDTH * 8  # float64
    assert cache.nbytes() == 2 * rows * slots * per_position  # keys and values
    assert cache.bytes_per_token() == 2 * per_position


def test_a_cache_refuses_tensors_that_do_not_fit():
    cache = LayerCache(8)
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="holds 2 tensors"):
        cache.update(torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match="shape"):
        cache.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    with pytest.raises(ValueError, match="float32"):
        cache.update(torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="block_size=8"):
        cache.update(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4))
    assert cache.length == 3


def test_the_recurrent_state_honours_what_a_state_can():
    state = RecurrentState(10)
    assert state.read() is None and state.nbytes() == 0 and state.bytes_per_token() == 0
    S = torch.arange(12.0).view(2, 6)
    state.write((S,), 3)
    assert state.length == 3 and torch.equal(state.read()[0], S) and state.nbytes() == 12 * 4
    state.reorder(torch.tensor([1, 0]))
    assert torch.equal(state.read()[0], S.flip(0))
    state.crop(5)  # longer: nothing changes
    assert state.length == 3
    with pytest.raises(ValueError, match="cannot crop to length=2"):
        state.crop(2)
    with pytest.raises(ValueError, match="block_size=10"):
        state.write((S,), 8)
    with pytest.raises(ValueError, match="shapes"):
        state.write((S[:1],), 1)
    state.crop(0)
    assert state.length == 0 and state.read() is None


def test_kv_cache_crops_all_layers_or_none():
    cache = KVCache([LayerCache(BLOCK), RingLayerCache(BLOCK, 2)])
    for layer in cache.layers:
        list(feed(layer, [6]))
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(2)
    assert [layer.length for layer in cache.layers] == [6, 6], "a refused crop changed a layer"
    cache.crop(5)
    assert cache.length == 5


def test_kv_cache_refuses_what_is_not_a_layer_cache():
    with pytest.raises(TypeError, match="lacks"):
        KVCache([LayerCache(4), object()])
    with pytest.raises(TypeError, match="empty"):
        KVCache([])
    with pytest.raises(TypeError, match="list of per-layer caches"):
        KVCache(LayerCache(4))


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_any_sequence_of_updates_and_crops_returns_the_right_keys(kind):
    """Random updates and crops, one after the other (crops in a row included): after every update the cache
    returns exactly the keys its definition says, read from the stored values (each key is its position), and a
    refused crop changes nothing. A cache that kept a crop it could not honour would return a stale key here."""
    rng = __import__("random").Random(sum(map(ord, str(kind))))
    cache = make(kind)
    for _ in range(120):
        if cache.length and rng.random() < 0.4:
            before = cache.length
            target = rng.randrange(0, before + 2)
            try:
                cache.crop(target)
            except ValueError:
                assert cache.length == before
            else:
                assert cache.length == min(target, before)
            continue
        n = rng.choice([1, 1, 1, 2, 5])
        if cache.length + n > BLOCK:
            cache.reset() if kind[0] != "paged" else None
            if kind[0] == "paged":
                return
            continue
        start, end, k = next(feed(cache, [n]))
        assert returned_positions(k) == expected_positions(kind, start, end), (kind, start, end)
        assert cache.key_positions.tolist() == expected_positions(kind, start, end)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_two_crops_in_a_row_are_checked_against_what_is_stored(kind):
    """Every pair of crops after 12 positions: each allowed pair is replayed exactly, the second crop judged by
    what the slots really hold after the first (a ring cropped to 11 still holds position 11 where 7 was)."""
    base = make(kind)
    list(feed(base, [5, 1, 6]))
    for first in range(13):
        for second in range(first + 1):
            cache = copy.deepcopy(base)
            try:
                cache.crop(first)
                cache.crop(second)
            except ValueError:
                continue
            fresh = make(kind)
            list(feed(fresh, [second] if second else []))
            expected = returned_positions(next(feed(fresh, [2]))[2])
            assert returned_positions(next(feed(cache, [2]))[2]) == expected, (first, second)
