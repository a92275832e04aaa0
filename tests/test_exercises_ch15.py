"""The chapter 15 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, ch15, grade  # noqa: F401  (ch15 registers the 15.x graders)


# ---------------------------------------------------------------- 15.1
def online_softmax_stats(blocks):
    m = denom = None
    for block in blocks:
        if m is None:
            m = torch.full(block.shape[:-1], float("-inf"))
            denom = torch.zeros(block.shape[:-1])
        m_new = torch.maximum(m, block.amax(dim=-1))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        denom = denom * torch.exp(m - shift) + torch.exp(block - shift[:, None]).sum(dim=-1)
        m = m_new
    return m, denom


def online_softmax_stats_library(blocks):  # attnlib's update, keepdim shapes squeezed at the end
    from attnlib.attention.tiled import online_softmax_update

    m = denom = None
    for block in blocks:
        if m is None:
            m = torch.full((block.shape[0], 1), float("-inf"))
            denom = torch.zeros(block.shape[0], 1)
        m, denom = online_softmax_update(m, denom, block)
    return m[:, 0], denom[:, 0]


def online_softmax_stats_no_rescale(blocks):  # forgets to rescale the old sum when the max grows
    m = denom = None
    for block in blocks:
        if m is None:
            m = torch.full(block.shape[:-1], float("-inf"))
            denom = torch.zeros(block.shape[:-1])
        m_new = torch.maximum(m, block.amax(dim=-1))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        denom = denom + torch.exp(block - shift[:, None]).sum(dim=-1)
        m = m_new
    return m, denom


def online_softmax_stats_nan(blocks):  # no guard: a leading all -inf block gives exp(-inf - (-inf)) = NaN
    m = denom = None
    for block in blocks:
        if m is None:
            m = torch.full(block.shape[:-1], float("-inf"))
            denom = torch.zeros(block.shape[:-1])
        m_new = torch.maximum(m, block.amax(dim=-1))
        denom = denom * torch.exp(m - m_new) + torch.exp(block - m_new[:, None]).sum(dim=-1)
        m = m_new
    return m, denom


def online_softmax_stats_no_max(blocks):  # sums exp(x) itself: overflows for large scores
    m = denom = None
    for block in blocks:
        m = block.amax(dim=-1) if m is None else torch.maximum(m, block.amax(dim=-1))
        denom = torch.exp(block).sum(dim=-1) if denom is None else denom + torch.exp(block).sum(dim=-1)
    return m, torch.exp(torch.log(denom) - torch.where(torch.isinf(m), torch.zeros_like(m), m))


def online_softmax_stats_two_passes(blocks):  # the max first, then the sum: reads the blocks twice
    m = torch.stack([b.amax(dim=-1) for b in blocks], dim=-1).amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    denom = sum(torch.exp(b - shift[:, None]).sum(dim=-1) for b in blocks)
    return m, denom


def online_softmax_stats_list(blocks):  # materialises the stream, then the whole-row softmax
    x = torch.cat(list(blocks), dim=-1)
    m = x.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift[:, None]).sum(dim=-1)


def online_softmax_stats_clones(blocks):  # copies every block (so the buffer can move on), then cat
    kept = [block.clone() for block in blocks]
    x = torch.cat(kept, dim=-1)
    m = x.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift[:, None]).sum(dim=-1)


def online_softmax_stats_growing_cat(blocks):  # one pass, but the row grows with every block
    x = None
    for block in blocks:
        x = block.clone() if x is None else torch.cat([x, block], dim=-1)
    m = x.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift[:, None]).sum(dim=-1)


def online_softmax_stats_tolist(blocks):  # keeps the numbers as Python lists, out of torch's sight
    rows = None
    for block in blocks:
        values = block.tolist()
        rows = values if rows is None else [a + b for a, b in zip(rows, values)]
    x = torch.tensor(rows)
    m = x.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift[:, None]).sum(dim=-1)


def online_softmax_stats_numpy(blocks):  # NumPy copies of the blocks
    import numpy as np

    x = torch.from_numpy(np.concatenate([np.array(block.numpy()) for block in blocks], axis=-1))
    m = x.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift[:, None]).sum(dim=-1)


def online_softmax_stats_keepdim(blocks):  # (rows, 1) instead of (rows,)
    m, denom = online_softmax_stats(blocks)
    return m[:, None], denom[:, None]


# ---------------------------------------------------------------- 15.2
def longest_context(budget_bytes, B, n_heads, dtype):
    per_score = B * n_heads * dtype.itemsize
    return math.isqrt(budget_bytes // per_score)


def longest_context_float(budget_bytes, B, n_heads, dtype):  # float square root, rounded down: fine at these sizes
    return int(math.sqrt(budget_bytes / (B * n_heads * dtype.itemsize)))


def longest_context_bits(budget_bytes, B, n_heads, dtype):
    return math.isqrt(budget_bytes // (B * n_heads * torch.finfo(dtype).bits))


def longest_context_no_heads(budget_bytes, B, n_heads, dtype):
    return math.isqrt(budget_bytes // (B * dtype.itemsize))


def longest_context_no_batch(budget_bytes, B, n_heads, dtype):
    return math.isqrt(budget_bytes // (n_heads * dtype.itemsize))


def longest_context_four_bytes(budget_bytes, B, n_heads, dtype):  # float32's size for every dtype
    return math.isqrt(budget_bytes // (B * n_heads * 4))


def longest_context_rounded(budget_bytes, B, n_heads, dtype):
    return round(math.sqrt(budget_bytes / (B * n_heads * dtype.itemsize)))


def longest_context_returns_float(budget_bytes, B, n_heads, dtype):
    return math.sqrt(budget_bytes / (B * n_heads * dtype.itemsize)) // 1


# ---------------------------------------------------------------- 15.3
def causal_tile_kind(q_start, q_end, k_start, k_end, T_q, T_k):
    offset = T_k - T_q  # query i sits at position offset + i
    if k_start > offset + q_end - 1:  # the first key comes after the last query
        return "skip"
    if k_end - 1 <= offset + q_start:  # the last key is visible to the first query
        return "full"
    return "partial"


def causal_tile_kind_top_left(q_start, q_end, k_start, k_end, T_q, T_k):
    return causal_tile_kind(q_start, q_end, k_start, k_end, T_q, T_q)


def causal_tile_kind_exclusive_end(q_start, q_end, k_start, k_end, T_q, T_k):  # q_end used as the last query
    offset = T_k - T_q
    if k_start > offset + q_end:
        return "skip"
    if k_end - 1 <= offset + q_start:
        return "full"
    return "partial"


def causal_tile_kind_never_full(q_start, q_end, k_start, k_end, T_q, T_k):
    return "skip" if k_start > T_k - T_q + q_end - 1 else "partial"


# ---------------------------------------------------------------- 15.4
def merge_partials(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # 0 when both parts are empty
    wa, wb = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = wa + wb
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / torch.where(total == 0, 1, total)[..., None]
    return out, shift + torch.log(total)


def merge_partials_mean(out_a, lse_a, out_b, lse_b):  # each part is normalised over its own keys
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_partials_naive_exp(out_a, lse_a, out_b, lse_b):  # exp(lse) overflows for large scores
    wa, wb = torch.exp(lse_a), torch.exp(lse_b)
    return (wa[..., None] * out_a + wb[..., None] * out_b) / (wa + wb)[..., None], torch.log(wa + wb)


def merge_partials_no_guard(out_a, lse_a, out_b, lse_b):  # NaN when both parts are empty
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (wa[..., None] * out_a + wb[..., None] * out_b) / (wa + wb)[..., None], m + torch.log(wa + wb)


def merge_partials_lse_max(out_a, lse_a, out_b, lse_b):  # the right output, the max as the lse
    out, _ = merge_partials(out_a, lse_a, out_b, lse_b)
    return out, torch.maximum(lse_a, lse_b)


def merge_partials_in_place(out_a, lse_a, out_b, lse_b):  # writes the result into out_a
    out, lse = merge_partials(out_a.clone(), lse_a, out_b, lse_b)
    out_a.copy_(out)
    return out_a, lse


REFERENCE = [("15.1", online_softmax_stats), ("15.2", longest_context), ("15.3", causal_tile_kind),
             ("15.4", merge_partials)]


@pytest.mark.parametrize(
    "exercise_id, answer",
    REFERENCE + [("15.1", online_softmax_stats_library), ("15.2", longest_context_float)],
)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("15.1", online_softmax_stats_no_rescale, "exp(m - m')"),
        ("15.1", online_softmax_stats_nan, "NaN"),
        ("15.1", online_softmax_stats_no_max, "overflowed"),
        ("15.1", online_softmax_stats_two_passes, "after it had ended"),
        ("15.1", online_softmax_stats_list, "blocks were still held"),
        ("15.1", online_softmax_stats_clones, "more than a few blocks' worth"),
        ("15.1", online_softmax_stats_growing_cat, "more than a few blocks' worth"),
        ("15.1", online_softmax_stats_tolist, "Python holds"),
        ("15.1", online_softmax_stats_numpy, "Python holds"),
        ("15.1", online_softmax_stats_keepdim, "expected (3,)"),
        ("15.2", longest_context_bits, "bits"),
        ("15.2", longest_context_no_heads, "n_heads"),
        ("15.2", longest_context_no_batch, "sequences"),
        ("15.2", longest_context_four_bytes, "you counted 4 bytes per score"),
        ("15.2", longest_context_rounded, "round down"),
        ("15.2", longest_context_returns_float, "Python int"),
        ("15.3", causal_tile_kind_top_left, "top-left"),
        ("15.3", causal_tile_kind_exclusive_end, "nothing is visible"),
        ("15.3", causal_tile_kind_never_full, "expected 'full'"),
        ("15.4", merge_partials_mean, "plain mean"),
        ("15.4", merge_partials_naive_exp, "exp(lse) overflows"),
        ("15.4", merge_partials_no_guard, "sees no key in either part"),
        ("15.4", merge_partials_lse_max, "lse is max(lse_a, lse_b)"),
        ("15.4", merge_partials_in_place, "changed its inputs in place"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


