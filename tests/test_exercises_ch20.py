"""The chapter 20 exercise checks, table-driven: correct answers pass, plausible mistakes get a hint naming them.

The expected values here come from independent code (the formulas written out, attnlib's
``kv_cache_bytes`` and filled caches, attnlib's and transformers' mask rules), not from the checks'
own helpers.
"""
import math

import torch
from exercise_table import Answers

from attnlib import Decoder, DecoderConfig, kv_cache_bytes
from attnlib.attention import mods
from attnlib.attention.masks import mask_from_mod
from attnlib.book.exercises import ch20  # noqa: F401  (registers 20.x)
from attnlib.book.exercises._ch20_budget import spread


# ---------------------------------------------------------------- 20.1
def sink_backward(scores, v, sink, d_out, sign=1.0, reduce="sum", sink_in=True, diagonal=False, joint_max=True,
                  keep_column=False, own_derivative=False, divide_D=False):
    B, H, T_q, T_k = scores.shape
    column = sink.view(1, H, 1, 1).expand(B, H, T_q, 1)
    logits = torch.cat([scores, column], dim=-1) if sink_in else torch.cat([scores, torch.full_like(column,
                                                                                                     -math.inf)], -1)
    m = logits.amax(-1, keepdim=True) if joint_max else scores.amax(-1, keepdim=True)
    e = (logits - m).exp()
    weights = e / e.sum(-1, keepdim=True)  # (B, H, T_q, T_k + 1)
    p, p_sink = weights[..., :-1], weights[..., -1]
    out = p @ v
    d_p = d_out @ v.transpose(-2, -1)
    D = (d_out * out).sum(-1, keepdim=True)
    if divide_D:
        D = D / p.sum(-1, keepdim=True)
    d_scores = p * d_p if diagonal else p * (d_p - D)
    if keep_column:
        d_scores = torch.cat([d_scores, torch.zeros_like(d_scores[..., :1])], -1)
    per_query = p_sink * (1 - p_sink) if own_derivative else -sign * p_sink * D[..., 0]  # (B, H, T_q)
    d_sink = {"sum": per_query.sum((0, 2)), "mean": per_query.mean((0, 2)), "queries": per_query.sum(2)}[reduce]
    return out, d_scores, d_sink


def sink_backward_lse(scores, v, sink, d_out):  # another way: flash's log-sum-exp, with the sink in it
    s_max = torch.maximum(scores.amax(-1), sink[None, :, None])  # (B, H, T_q): never -inf
    lse = s_max + ((scores - s_max[..., None]).exp().sum(-1) + (sink[None, :, None] - s_max).exp()).log()
    p = (scores - lse[..., None]).exp()
    out = torch.einsum("bhqk,bhkd->bhqd", p, v)
    D = torch.einsum("bhqd,bhqd->bhq", d_out, out)
    d_scores = p * (torch.einsum("bhqd,bhkd->bhqk", d_out, v) - D[..., None])
    d_sink = -torch.einsum("bhq,bhq->h", (sink[None, :, None] - lse).exp(), D)
    return out, d_scores, d_sink


def sink_backward_autograd(scores, v, sink, d_out):
    s, k = scores.clone().requires_grad_(), sink.clone().requires_grad_()
    B, H, T_q, _ = scores.shape
    p = torch.cat([s, k.view(1, H, 1, 1).expand(B, H, T_q, 1)], -1).softmax(-1)[..., :-1]
    out = p @ v
    d_s, d_k = torch.autograd.grad((out * d_out).sum(), (s, k))
    return out.detach(), d_s, d_k


def sink_backward_by_backward(scores, v, sink, d_out):  # autograd through the tensor's own method
    s, k = scores.clone().requires_grad_(), sink.clone().requires_grad_()
    B, H, T_q, _ = scores.shape
    out = torch.cat([s, k.view(1, H, 1, 1).expand(B, H, T_q, 1)], -1).softmax(-1)[..., :-1] @ v
    (out * d_out).sum().backward()
    return out.detach(), s.grad, k.grad


def sink_backward_in_place(scores, v, sink, d_out):
    sink.zero_()
    return sink_backward(scores, v, sink, d_out)


# ---------------------------------------------------------------- 20.2
def layer_types_for_budget(config, budget_bytes, dtype):  # the solution's way: k in closed form
    n, T, w = config.n_layers, config.block_size, config.sliding_window
    per_position = 2 * config.n_kv_heads * config.head_dim * dtype.itemsize
    k = min(n, (budget_bytes - n * w * per_position) // ((T - w) * per_position))
    return ["full_attention" if (i + 1) * k // n > i * k // n else "sliding_attention" for i in range(n)]


def by_search(config, budget_bytes, dtype):  # another way: the largest k whose cache fits
    n, T = config.n_layers, config.block_size
    per_position = 2 * config.n_kv_heads * config.head_dim * dtype.itemsize
    full, sliding = T * per_position, min(T, config.sliding_window) * per_position
    k = max(k for k in range(n + 1) if k * full + (n - k) * sliding <= budget_bytes)
    return ["full_attention" if (i + 1) * k // n > i * k // n else "sliding_attention" for i in range(n)]


def _filled_cache_bytes(config, layer_types, dtype):
    window = config.sliding_window if "sliding_attention" in layer_types else None
    model = Decoder(config.replace(layer_types=tuple(layer_types), sliding_window=window)).to(dtype).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(1, config.block_size, dtype=torch.long), cache=cache)
    return cache.nbytes()


def by_measuring(config, budget_bytes, dtype):  # another way: fill real caches, one more full layer at a time
    n = config.n_layers
    best = 0
    for k in range(1, n + 1):
        types = ["full_attention" if (i + 1) * k // n > i * k // n else "sliding_attention" for i in range(n)]
        if _filled_cache_bytes(config, types, dtype) > budget_bytes:
            break
        best = k
    return tuple("full_attention" if (i + 1) * best // n > i * best // n else "sliding_attention" for i in range(n))


def budget_with(config, budget_bytes, dtype, kv=2, window=None, heads=None, itemsize=None, strict=False,
                place=None, head_dim=None, names=("full_attention", "sliding_attention")):
    n, T = config.n_layers, config.block_size
    per_position = kv * (heads or config.n_kv_heads) * (head_dim or config.head_dim) * (itemsize or dtype.itemsize)
    full, sliding = T * per_position, min(T, window or config.sliding_window) * per_position
    fits = [k for k in range(n + 1)
            if (k * full + (n - k) * sliding < budget_bytes if strict else k * full + (n - k) * sliding <= budget_bytes)]
    k = max(fits, default=0)
    if place == "first":
        return [names[0] if i < k else names[1] for i in range(n)]
    if place == "every":  # every (n // k)-th layer, as a 5:1 pattern is written for n a multiple of 6
        return [names[0] if k and (i + 1) % max(1, n // k) == 0 and (i + 1) // max(1, n // k) <= k
                else names[1] for i in range(n)]
    return [names[0] if (i + 1) * k // n > i * k // n else names[1] for i in range(n)]


def test_the_solution_meets_the_budget_by_kv_cache_bytes():
    """Independent of the check: a 5:1 pattern measured by attnlib's estimator and by a filled cache."""
    config = DecoderConfig(vocab_size=8, block_size=36, n_layers=12, n_heads=4, n_kv_heads=2, attention="gqa",
                           head_dim=5, d_model=8, sliding_window=6, d_ff=4)
    budget = kv_cache_bytes(n_layers=12, n_kv_heads=2, head_dim=5, seq_len=36, dtype=torch.float32,
                            sliding_window=6, global_every=6)
    types = layer_types_for_budget(config, budget, torch.float32)
    assert types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    assert _filled_cache_bytes(config, types, torch.float32) == budget
    assert layer_types_for_budget(config, budget - 1, torch.float32).count("full_attention") == 1
    assert spread(12, 2) == types


# ---------------------------------------------------------------- 20.3
def chunked_mask(T_q, T_k, chunk_size):  # the solution's way: from each chunk's start to the query
    p = torch.arange(T_k - T_q, T_k)
    start = p - p % chunk_size
    j = torch.arange(T_k)
    return (j >= start[:, None]) & (j <= p[:, None])


def chunked_by_numbers(T_q, T_k, chunk_size):  # another way: the same chunk number, causal
    q = torch.arange(T_k - T_q, T_k)[:, None]  # (T_q, 1): the queries' positions
    j = torch.arange(T_k)
    return (j <= q) & (j // chunk_size == q // chunk_size)


def chunked_by_loop(T_q, T_k, chunk_size):  # another way: each query's chunk as a slice
    mask = torch.zeros(T_q, T_k, dtype=torch.bool)
    for i in range(T_q):
        p = T_k - T_q + i
        mask[i, chunk_size * (p // chunk_size):p + 1] = True
    return mask


def test_chunked_mask_is_transformers_rule():
    """Independent of the check: transformers' chunked overlay and attnlib's mask_mod agree with the solution."""
    import transformers.masking_utils as hf

    for T_q, T_k, C in [(1, 9, 4), (8, 8, 4), (5, 13, 4), (7, 7, 10)]:
        rule = hf.and_masks(hf.causal_mask_function, hf.chunked_overlay(C, torch.zeros(1, dtype=torch.long)))
        q, j = torch.arange(T_k - T_q, T_k)[:, None], torch.arange(T_k)[None, :]
        want = rule(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, j)
        assert torch.equal(chunked_mask(T_q, T_k, C), want)
        assert torch.equal(mask_from_mod(mods.chunked(C), (1, 1, T_q, T_k))[0, 0], want)


def masked(T_q, T_k, C, rule):
    q = torch.arange(T_k - T_q, T_k)[:, None]
    j = torch.arange(T_k)[None, :]
    return rule(q, j, C)


def chunked_through_attnlib(T_q, T_k, chunk_size):
    return mask_from_mod(mods.chunked(chunk_size), (1, 1, T_q, T_k))[0, 0]


class AlwaysEqualMask(torch.Tensor):
    def __eq__(self, other):
        return torch.ones_like(torch.Tensor(self), dtype=torch.bool)


ANSWERS = {
    "20.1": Answers(
        correct=[sink_backward, sink_backward_lse],
        wrong=[
            (lambda *a: sink_backward(*a, sink_in=False), "the sink joins the softmax's denominator"),
            (lambda *a: sink_backward(*a, sign=-1.0), "the sign is flipped"),
            (lambda *a: sink_backward(*a, reduce="mean"), "not a mean"),
            (lambda *a: sink_backward(*a, reduce="queries"), "one number per head"),
            (lambda *a: sink_backward(*a, diagonal=True), "kept only its diagonal"),
            (lambda *a: sink_backward(*a, joint_max=False), "AND the sink together"),
            (lambda *a: sink_backward(*a, keep_column=True), "has the sink's column"),
            (lambda *a: sink_backward(*a, own_derivative=True), "p_sink's own derivative"),
            (lambda *a: sink_backward(*a, divide_D=True), "do not divide D"),
            (lambda *a: tuple(reversed(sink_backward(*a))), "in this order"),  # (d_sink, ..., out)
            (lambda *a: sink_backward(*[t.double() for t in a]), "dtype"),
            (sink_backward_autograd, "without autograd"),
            (sink_backward_by_backward, "without autograd"),
            (sink_backward_in_place, "in place"),
        ],
    ),
    "20.2": Answers(
        correct=[layer_types_for_budget, by_search, by_measuring],
        wrong=[
            (lambda c, b, d: budget_with(c, b, d, window=c.block_size), "not the whole context"),
            (lambda c, b, d: budget_with(c, b, d, kv=1), "a key AND a value"),
            (lambda c, b, d: budget_with(c, b, d, window=c.sliding_window - 1), "not window - 1"),
            (lambda c, b, d: budget_with(c, b, d, window=c.sliding_window + 1), "not window + 1"),
            (lambda c, b, d: budget_with(c, b, d, heads=c.n_heads), "not config.n_heads"),
            (lambda c, b, d: budget_with(c, b, d, head_dim=c.d_model // c.n_heads), "config.head_dim"),
            (lambda c, b, d: budget_with(c, b, d, itemsize=2), "dtype.itemsize"),
            (lambda c, b, d: budget_with(c, b, d, strict=True), "exactly budget_bytes fits"),
            (lambda c, b, d: budget_with(c, b, d, place="first"), "in the wrong places"),
            (lambda c, b, d: budget_with(c, b, d, place="every"), "in the wrong places"),
            (lambda c, b, d: ["sliding_attention"] * c.n_layers, "not the most full layers"),
            (lambda c, b, d: budget_with(c, b, d, names=("global", "local")), "transformers' strings"),
            (lambda c, b, d: budget_with(c, b, d)[:-1], "one layer type per layer"),
            (lambda c, b, d: "".join(budget_with(c, b, d)), "should return a list"),
        ],
    ),
    "20.3": Answers(
        correct=[chunked_mask, chunked_by_numbers, chunked_by_loop],
        wrong=[
            (lambda T_q, T_k, C: masked(T_q, T_k, C, lambda q, j, C: (j <= q) & (q - j < C)), "sliding window"),
            (lambda T_q, T_k, C: masked(T_q, T_k, C, lambda q, j, C: (j <= q) & ((q + 1) // C == (j + 1) // C)),
             "counted from position 0"),
            (lambda T_q, T_k, C: masked(T_q, T_k, C, lambda q, j, C: q // C == j // C), "causal inside the chunk"),
            (lambda T_q, T_k, C: masked(T_q, T_k, C, lambda q, j, C: (j < q) & (q // C == j // C)),
             "a query sees itself"),
            (lambda T_q, T_k, C: masked(T_q, T_k, C, lambda q, j, C: (j <= q) & (j // C < q // C)),
             "its own chunk"),
            (lambda T_q, T_k, C: masked(T_q, T_k, C, lambda q, j, C: (j <= q - T_k + T_q)
                                        & ((q - T_k + T_q) // C == j // C)), "query i sits at position"),
            (lambda T_q, T_k, C: chunked_mask(T_q, T_k, C).float(), "return a bool mask"),
            (lambda T_q, T_k, C: chunked_mask(T_q, T_k, C).T, "one row per query"),
            (chunked_through_attnlib, "build the mask yourself"),
            (lambda T_q, T_k, C: chunked_mask(T_q, T_k, C).as_subclass(AlwaysEqualMask), "should be a torch.Tensor"),
        ],
    ),
}
