"""Bad inputs to chapter 19's serving code (attnlib.serving, the paged cache, speculative decoding): each is refused with a
TypeError or ValueError naming the argument, its value and what was expected, before any forward pass or
sampling; a refused forward pass leaves a paged cache as it was. Complements the bad-input cases of
tests/test_batched_generation.py, tests/test_paged_cache.py and tests/test_speculative.py."""
import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.attention.masks import mask_positions
from attnlib.cache import OutOfPages, PageAllocator, PagedKVCache
from attnlib.generation import speculative_generate, verify_drafts
from attnlib.serving import cache_memory, left_pad, request_lengths, serve


def tiny(seed=0, block_size=16):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=16, block_size=block_size, n_layers=1, n_heads=2, d_model=8)).eval()


def probs(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).softmax(-1)


P, Q, D = probs(2, 3, 5), probs(2, 2, 5, seed=1), torch.tensor([[1, 2], [3, 4]])
X = torch.tensor([[1, 2]])


def allocator_with_one_page():
    alloc = PageAllocator(4, 4)
    alloc.ensure(alloc.new_sequence(), 3)
    return alloc


CASES = {
    # left_pad and the mask helpers
    "prompts a string": (lambda: left_pad("abc"), ValueError, "prompts must be a non-empty list of prompts; got str"),
    "one prompt, not a list of prompts": (lambda: left_pad([1, 2, 3]), TypeError,
                                          r"prompts\[0\] must be a list or 1-D tensor of token ids; got int 1"),
    "float ids are refused, not rounded": (lambda: left_pad([[1.5, 2]]), TypeError,
                                           r"prompts\[0\] must hold integer token ids.*float32"),
    "vocab_size 0": (lambda: left_pad([[1]], vocab_size=0), ValueError, "vocab_size=0 must be a positive integer"),
    "vocab_size float": (lambda: left_pad([[1]], vocab_size=16.0), TypeError, r"vocab_size must be an int; got 16.0"),
    "prompts on two devices": (lambda: left_pad([torch.tensor([1]), torch.tensor([2], device="meta")]), ValueError,
                               r"prompts\[1\] is on meta but prompts\[0\] is on cpu"),
    "integer mask to mask_positions": (lambda: mask_positions(torch.ones(2, 3, dtype=torch.long)), TypeError,
                                       r"attention_mask must be a bool tensor.*int64 \(use mask.bool\(\)\)"),
    "1-D mask to mask_positions": (lambda: mask_positions(torch.ones(3, dtype=torch.bool)), ValueError,
                                   r"attention_mask must have shape \(B, T\); got \(3,\)"),
    # the allocator and the paged cache
    "ensure a negative length": (lambda: PageAllocator(4, 4).ensure(0, -3), ValueError,
                                 "sequence 0 is not in the cache"),
    "ensure -3 positions": (lambda: (lambda a: a.ensure(a.new_sequence(), -3))(PageAllocator(4, 4)), ValueError,
                            "n_positions=-3 must be an int >= 0"),
    "ensure 2.5 positions": (lambda: (lambda a: a.ensure(a.new_sequence(), 2.5))(PageAllocator(4, 4)), TypeError,
                             r"n_positions must be an int; got 2.5"),
    "locate past the table": (lambda: allocator_with_one_page().locate(0, torch.tensor([9])), ValueError,
                              r"positions must lie in \[0, 4\) \(sequence 0 holds 1 pages of 4\); got 9..9"),
    "locate a negative position (would wrap)": (lambda: allocator_with_one_page().locate(0, torch.tensor([-1])),
                                                ValueError, r"positions must lie in \[0, 4\).*got -1..-1"),
    "locate float positions": (lambda: allocator_with_one_page().locate(0, torch.tensor([1.0])), TypeError,
                               "positions must be an integer tensor; got torch.float32"),
    "select one id, not a list": (lambda: (lambda c: c.select(c.add_sequence()))(PagedKVCache(1, 16, 4, 4)),
                                  TypeError, "seqs must be a list of sequence ids"),
    "attention_mask(-1)": (lambda: PagedKVCache(1, 16, 4, 4).attention_mask(-1), ValueError,
                           "n_new=-1 must be an int >= 0"),
    "attention_mask(1.5)": (lambda: PagedKVCache(1, 16, 4, 4).attention_mask(1.5), TypeError,
                            r"n_new must be an int; got 1.5"),
    # cache_memory, request_lengths
    "bytes_per_token 0": (lambda: cache_memory([3], 8, 2, 0), ValueError, "bytes_per_token=0 must be a positive"),
    "bytes_per_token -1": (lambda: cache_memory([3], 8, 2, -1), ValueError, "bytes_per_token=-1 must be a positive"),
    "bytes_per_token 1.5": (lambda: cache_memory([3], 8, 2, 1.5), TypeError, r"bytes_per_token must be an int"),
    "lengths an int": (lambda: cache_memory(3, 8, 2), TypeError, "lengths must be a list of ints.*got int"),
    "seed a string": (lambda: request_lengths(3, 8, seed="a"), TypeError, "seed must be an int; got 'a'"),
    # serve
    "serve no prompts": (lambda: serve(tiny(), [], 3), ValueError, "prompts must be a non-empty list of prompts"),
    "serve a string": (lambda: serve(tiny(), "ab", 3), ValueError, "prompts must be a non-empty list of prompts"),
    "serve an empty prompt": (lambda: serve(tiny(), [[1], []], 3), ValueError,
                              r"prompts\[1\] must be a non-empty 1-D sequence of ids; got shape \(0,\)"),
    "serve a 2-D prompt": (lambda: serve(tiny(), [[[1, 2]]], 3), ValueError,
                           r"prompts\[0\] must be a non-empty 1-D sequence of ids; got shape \(1, 2\)"),
    "serve float ids": (lambda: serve(tiny(), [[1.5]], 3), TypeError, r"prompts\[0\] must hold integer token ids"),
    "serve a prompt on another device": (lambda: serve(tiny(), [torch.tensor([1], device="meta")], 3), ValueError,
                                         r"prompts\[0\] is on meta but the model is on cpu"),
    "serve max_new_tokens 0": (lambda: serve(tiny(), [[1]], 0), ValueError,
                               r"max_new_tokens\[0\]=0 must be a positive integer"),
    "serve max_new_tokens -1": (lambda: serve(tiny(), [[1]], -1), ValueError,
                                r"max_new_tokens\[0\]=-1 must be a positive integer"),
    "serve max_new_tokens 2.0": (lambda: serve(tiny(), [[1]], 2.0), TypeError,
                                 "max_new_tokens must be an int or a list of ints, one per prompt; got 2.0"),
    "serve max_batch 0": (lambda: serve(tiny(), [[1]], 3, max_batch=0), ValueError, "max_batch=0 must be a positive"),
    "serve n_pages 0": (lambda: serve(tiny(), [[1]], 3, n_pages=0), ValueError, "n_pages=0 must be a positive"),
    "serve temperature nan": (lambda: serve(tiny(), [[1]], 3, temperature=float("nan")), ValueError,
                              "temperature=nan must be a finite number"),
    "serve temperature -1": (lambda: serve(tiny(), [[1]], 3, temperature=-1.0), ValueError,
                             r"temperature=-1.0 must be >= 0"),
    "serve generator an int": (lambda: serve(tiny(), [[1]], 3, temperature=1.0, generator=3), TypeError,
                               "generator must be a torch.Generator or None; got int"),
    "serve not a model": (lambda: serve("model", [[1]], 3), TypeError, "model must be a decoder with vocab_size"),
    # speculative_generate and verify_drafts
    "speculative temperature nan": (lambda: speculative_generate(tiny(), tiny(1), X, 3, temperature=float("nan")),
                                    ValueError, "temperature=nan must be a finite number"),
    "speculative generator an int": (lambda: speculative_generate(tiny(), tiny(1), X, 3, temperature=1.0,
                                                                  generator=5),
                                     TypeError, "generator must be a torch.Generator or None; got int"),
    "speculative max_new_tokens 2.0": (lambda: speculative_generate(tiny(), tiny(1), X, 2.0), TypeError,
                                       r"max_new_tokens must be an int; got 2.0"),
    "speculative an empty prompt": (lambda: speculative_generate(tiny(), tiny(1), torch.zeros(1, 0, dtype=torch.long),
                                                                 3),
                                    ValueError, r"idx must hold at least one prompt token per row"),
    "speculative a draft with a shorter context": (lambda: speculative_generate(tiny(), tiny(1, block_size=4), X, 3),
                                                   ValueError, "exceeds the draft's block_size=4"),
    "verify: p one position short": (lambda: verify_drafts(P[:, :2], Q, D), ValueError,
                                     r"p must be \(N, k \+ 1, V\) and q \(N, k, V\); got p \(2, 2, 5\)"),
    "verify: q another vocabulary": (lambda: verify_drafts(P, Q[..., :4], D), ValueError, r"q \(2, 2, 4\)"),
    "verify: float drafts": (lambda: verify_drafts(P, Q, D.float()), TypeError,
                             r"drafts must be an integer tensor \(N, k\); got torch.float32"),
    "verify: a draft outside the vocabulary": (lambda: verify_drafts(P, Q, D + 3), ValueError,
                                               r"drafts must be token ids in \[0, V=5\); got 4..7"),
    "verify: negative probabilities": (lambda: verify_drafts(-P, Q, D), ValueError,
                                       r"p must hold probabilities \(finite, >= 0\)"),
    "verify: nan in q": (lambda: verify_drafts(P, Q * float("nan"), D), ValueError,
                         r"q must hold probabilities \(finite, >= 0\); got a value nan"),
    "verify: a row of p with no mass": (lambda: verify_drafts(P * 0, Q, D), ValueError,
                                        "every row of p must have some probability mass"),
    "verify: 2-D inputs": (lambda: verify_drafts(P[0], Q[0], D[0]), ValueError,
                           r"drafts must be \(N, k\) and p \(N, k \+ 1, V\); got \(2,\) and \(3, 5\)"),
    "verify: p a list": (lambda: verify_drafts(P.tolist(), Q, D), TypeError,
                         "p must be a floating tensor of probabilities; got list"),
    "verify: greedy a string": (lambda: verify_drafts(P, Q, D, greedy="no"), TypeError,
                                "greedy must be a bool; got 'no'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_with_a_message(name):
    call, error, match = CASES[name]
    with pytest.raises(error, match=match):
        call()


def test_a_batch_without_enough_pages_is_refused_before_any_row_is_written():
    """Two sequences need 3 pages, the pool has 2: the forward pass raises OutOfPages and every sequence keeps
    its length and pages (before, the first row took the last page and was written; the second then failed)."""
    model = tiny()
    cache = PagedKVCache.for_model(model, n_pages=2, page_size=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    with torch.no_grad():
        model(torch.ones(1, 3, dtype=torch.long), cache=cache.select([a]))  # a holds page 0
        with pytest.raises(OutOfPages, match=r"the batch needs 2 more pages, 1 free \(2 pages of 4 positions\)"):
            model(torch.ones(2, 2, dtype=torch.long), cache=cache.select([a, b]),
                  attention_mask=cache.attention_mask(2))
    assert cache.allocator.tables == {a: [0], b: []} and cache.allocator.free == [1]
    assert [cache.sequence_length(s) for s in (a, b)] == [3, 0]


def test_serve_refuses_before_any_forward_pass():
    model = tiny()
    calls = []
    model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    for bad, error, match in ((dict(prompts=[[1], []]), ValueError, r"prompts\[1\] must be a non-empty"),
                              (dict(generator=3, temperature=1.0), TypeError, "generator must be a torch.Generator"),
                              (dict(max_new_tokens=[2, 0]), ValueError, r"max_new_tokens\[1\]=0 must be a positive")):
        args = dict(prompts=[[1], [2]], max_new_tokens=2) | bad
        with pytest.raises(error, match=match):
            serve(model, **args)
    assert calls == []


def test_serve_accepts_a_batch_tensor_and_tuples_of_prompts():
    """Right answers for inputs that are not lists: rows of a (B, T) tensor, and a tuple of tuples."""
    model = tiny()
    outs, _ = serve(model, torch.tensor([[1, 2], [3, 4]]), 3)
    again, _ = serve(model, ((1, 2), (3, 4)), 3)
    for out, other, prompt in zip(outs, again, ([1, 2], [3, 4])):
        alone = model.generate(torch.tensor([prompt]), 3, temperature=0.0)[0]
        assert out.tolist() == other.tolist() == alone.tolist()
