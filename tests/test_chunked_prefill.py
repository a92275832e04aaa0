"""Chunked prefill in ``serve`` (Sarathi-Serve; chapter 19): greedy tokens equal those of each request alone and of
``serve`` without chunks, for every chunk size, with a prefix cache too; no step prefills more than ``prefill_chunk``
tokens; the longest stall of a running request, counted by hand in tokens through the model and in model calls,
shrinks from a whole prompt to one chunk."""
import pytest
import torch

from attnlib.serving import serve
from tests.test_paged_cache import build


def requests():
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 32, (n,), generator=g) for n in (3, 17, 1, 26, 8, 12)]
    return prompts, [6, 4, 1, 5, 7, 3]


@pytest.mark.parametrize("name", ["mha", "modern", "modern_window"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_chunked_prefill_gives_the_tokens_of_each_request_alone(name, chunk):
    model = build(name, block_size=32)
    prompts, budgets = requests()
    whole, _ = serve(model, prompts, budgets, max_batch=3, page_size=4)
    chunked, trace, stats = serve(model, prompts, budgets, max_batch=3, page_size=4, prefill_chunk=chunk,
                                  return_stats=True)
    for p, n, a, b in zip(prompts, budgets, chunked, whole):
        assert a.tolist() == b.tolist() == model.generate(p[None], n, temperature=0.0)[0].tolist()
    assert max(t["prefilled"] for t in trace) <= chunk
    assert stats["prefill_tokens"] == stats["prompt_tokens"] == sum(p.numel() for p in prompts)
    assert stats["pages_held"] == 0 and stats["prefill_tokens_saved"] == 0


def test_chunked_prefill_with_a_prefix_cache():
    model = build("modern", block_size=32)
    g = torch.Generator().manual_seed(13)
    system = torch.randint(0, 32, (10,), generator=g)
    prompts = [torch.cat([system, torch.randint(0, 32, (n,), generator=g)]) for n in (2, 9, 0, 5)]
    outputs, _, stats = serve(model, prompts, 4, max_batch=2, page_size=4, prefill_chunk=3, prefix_cache=True,
                              return_stats=True)
    for p, out in zip(prompts, outputs):
        assert out.tolist() == model.generate(p[None], 4, temperature=0.0)[0].tolist()
    # one request in prefill at a time: each later one finds the system prompt's two full pages cached
    assert stats["prefill_tokens_saved"] == 3 * 8 and stats["pages_held"] == 0


def test_chunks_bound_the_longest_stall_of_running_requests():
    """Two short requests and a long one, admitted at once: counted by hand, without chunks the first request waits
    for the others' prefills (3 + 40 tokens) and the decode step (3 rows) between its first two tokens; with chunks
    of 4, one request is in prefill at a time and the longest wait is a chunk and a decode step (three rows once the
    long prompt's last chunk is in)."""
    model = build("mha", block_size=48)
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, 32, (n,), generator=g) for n in (3, 3, 40)]
    budgets = [20, 20, 3]
    whole, _, plain = serve(model, prompts, budgets, max_batch=3, page_size=4, return_stats=True)
    chunked, _, stats = serve(model, prompts, budgets, max_batch=3, page_size=4, prefill_chunk=4, return_stats=True)
    assert [a.tolist() for a in whole] == [b.tolist() for b in chunked]
    assert (plain["longest_stall_tokens"], plain["longest_stall_calls"]) == (3 + 40 + 3, 3)
    assert (stats["longest_stall_tokens"], stats["longest_stall_calls"]) == (4 + 3, 2)
    assert plain["longest_stall_s"] > 0 and stats["longest_stall_s"] > 0  # measured (compared in the bench)
    assert stats["model_tokens"] == plain["model_tokens"]  # the same work, spread over more steps


@pytest.mark.parametrize(
    ("chunk", "error", "match"),
    [
        (0, ValueError, "prefill_chunk=0 must be a positive integer"),
        (-2, ValueError, "prefill_chunk=-2 must be a positive integer"),
        (2.5, TypeError, r"prefill_chunk must be an int; got 2.5 \(float\)"),
        (True, TypeError, r"prefill_chunk must be an int; got True \(bool\)"),
        ("4", TypeError, "prefill_chunk must be an int; got '4'"),
    ],
)
def test_bad_prefill_chunk(chunk, error, match):
    with pytest.raises(error, match=match):
        serve(build("mha"), [[1, 2]], 2, prefill_chunk=chunk)
