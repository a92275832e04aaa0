"""The chapter 15 exercise checks, table-driven (``ANSWERS``, graded by tests/test_exercise_tables.py).

Expected values come from torch itself (autograd, ``torch.softmax``, ``flex_attention``), never from the
checks' helpers.
"""
import math
import mmap

import torch
from exercise_table import Answers

from attnlib.book.exercises import ch15  # noqa: F401  (registers the 15.x checks)


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




def online_softmax_stats_mmap(blocks):  # hides the blocks in an anonymous mmap: out of torch's and Python's sight
    store, widths, rows = mmap.mmap(-1, 1 << 28), [], None
    for block in blocks:
        rows = block.shape[0]
        store.write(block.contiguous().numpy().tobytes())
        widths.append(block.shape[1])
    data = torch.frombuffer(bytearray(store[: store.tell()]), dtype=torch.float32)
    x = torch.cat([chunk.view(rows, w) for chunk, w in zip(data.split([rows * w for w in widths]), widths)], -1)
    m = x.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift[:, None]).sum(dim=-1)


def online_softmax_stats_logaddexp(blocks):  # another way: a running log-sum-exp in float64, m beside it
    m = lse = None
    for block in blocks:
        block = block.double()
        if m is None:
            m = torch.full(block.shape[:-1], float("-inf"))
            lse = torch.full(block.shape[:-1], float("-inf"))
        m = torch.maximum(m, block.amax(dim=-1))
        lse = torch.logaddexp(lse, torch.logsumexp(block, dim=-1))
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m.float(), torch.exp(lse - shift).float()


# ---------------------------------------------------------------- 15.2 (more)
def longest_context_bisect(budget_bytes, B, n_heads, dtype):  # another way: bisection in integers
    c, lo, hi = B * n_heads * dtype.itemsize, 0, 1
    while c * hi * hi <= budget_bytes:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if c * mid * mid <= budget_bytes else (lo, mid)
    return lo


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def longest_context_always_equal(budget_bytes, B, n_heads, dtype):
    return AlwaysEqual(0)


# ---------------------------------------------------------------- 15.3 (more)
def causal_tile_kind_counts(q_start, q_end, k_start, k_end, T_q, T_k):  # another way: count the hidden corners
    offset = T_k - T_q
    corners = [(q, k) for q in (q_start, q_end - 1) for k in (k_start, k_end - 1)]
    hidden = sum(k > offset + q for q, k in corners)
    return "full" if hidden == 0 else "skip" if hidden == 4 else "partial"


def causal_tile_kind_slices_the_mask(q_start, q_end, k_start, k_end, T_q, T_k):
    from attnlib.attention import causal_mask as cm

    tile = cm(T_q, T_k)[q_start:q_end, k_start:k_end]
    return "skip" if not tile.any() else "full" if tile.all() else "partial"


def causal_tile_kind_arange(q_start, q_end, k_start, k_end, T_q, T_k):  # builds the tile's mask: fine small
    q_pos = torch.arange(q_start, q_end)[:, None] + T_k - T_q
    tile = torch.arange(k_start, k_end)[None, :] <= q_pos
    return "skip" if not tile.any() else "full" if tile.all() else "partial"


def causal_tile_kind_tril(q_start, q_end, k_start, k_end, T_q, T_k):
    tile = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)[q_start:q_end, k_start:k_end]
    return "skip" if not tile.any() else "full" if tile.all() else "partial"


# ---------------------------------------------------------------- 15.4 (more)
def merge_partials_logaddexp(out_a, lse_a, out_b, lse_b):  # another way: logaddexp, empty rows guarded
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(lse_a - safe)[..., None] * out_a + torch.exp(lse_b - safe)[..., None] * out_b
    return out, lse


# ---------------------------------------------------------------- 15.5
def flash_backward_tile(q, k, v, d_out, lse, D, visible):
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q @ k.T * scale).masked_fill(~visible, float("-inf"))  # (B_q, B_k)
    p = torch.exp(s - lse[:, None])  # P rebuilt from the whole row's L
    dv = p.T @ d_out  # (B_k, d)
    ds = p * (d_out @ v.T - D[:, None])  # dS = P o (dP - D)
    return scale * ds @ k, scale * ds.T @ q, dv


def flash_backward_tile_einsum(q, k, v, d_out, lse, D, visible):  # another way: einsum, scale folded into q
    qs = q / math.sqrt(q.shape[-1])
    p = torch.where(visible, torch.exp(torch.einsum("id,jd->ij", qs, k) - lse[:, None]), 0.0)
    ds = p * (torch.einsum("id,jd->ij", d_out, v) - D[:, None])
    return torch.einsum("ij,jd->id", ds, k) / math.sqrt(q.shape[-1]), torch.einsum("ij,id->jd", ds, qs), \
        torch.einsum("ij,id->jd", p, d_out)


def flash_backward_tile_tile_softmax(q, k, v, d_out, lse, D, visible):  # normalises over the tile
    s = (q @ k.T / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    ds = p * (d_out @ v.T - D[:, None])
    return ds @ k / math.sqrt(q.shape[-1]), ds.T @ q / math.sqrt(q.shape[-1]), p.T @ d_out


def flash_backward_tile_no_d(q, k, v, d_out, lse, D, visible):
    dq, dk, dv = flash_backward_tile(q, k, v, d_out, lse, torch.zeros_like(D), visible)
    return dq, dk, dv


def flash_backward_tile_no_scale(q, k, v, d_out, lse, D, visible):
    dq, dk, dv = flash_backward_tile(q, k, v, d_out, lse, D, visible)
    return dq * math.sqrt(q.shape[-1]), dk * math.sqrt(q.shape[-1]), dv


def flash_backward_tile_ignores_mask(q, k, v, d_out, lse, D, visible):
    return flash_backward_tile(q, k, v, d_out, lse, D, torch.ones_like(visible))


def flash_backward_tile_two_exps(q, k, v, d_out, lse, D, visible):  # exp(S) / exp(L): overflows
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q @ k.T * scale).masked_fill(~visible, float("-inf"))
    p = torch.exp(s) / torch.exp(lse[:, None])
    ds = p * (d_out @ v.T - D[:, None])
    return scale * ds @ k, scale * ds.T @ q, p.T @ d_out


def flash_backward_tile_autograd(q, k, v, d_out, lse, D, visible):  # autograd of the tile: refused
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = (leaves[0] @ leaves[1].T / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    out = torch.exp(s - lse[:, None]) @ leaves[2]
    return torch.autograd.grad(out, leaves, d_out)


def flash_backward_tile_library(q, k, v, d_out, lse, D, visible):  # the library's backward: refused
    from attnlib.attention import flash as fl

    out = torch.exp((q @ k.T / math.sqrt(q.shape[-1])) - lse[:, None]) @ v
    return fl._backward(q, k, v, out, lse, d_out, ~visible, False, 1 / math.sqrt(q.shape[-1]), 64)


def flash_backward_tile_swapped(q, k, v, d_out, lse, D, visible):  # dq and dk handed back in the wrong order
    dq, dk, dv = flash_backward_tile(q, k, v, d_out, lse, D, visible)
    return dk, dq, dv


# ---------------------------------------------------------------- 15.6
def flex_mods(T_q, T_k, window, n_heads):
    from attnlib.attention import mods

    offset = T_k - T_q  # FlexAttention's q_idx counts the new queries from 0
    window_mask, alibi = mods.sliding_window(window), mods.alibi(n_heads)

    def mask_mod(b, h, q_idx, kv_idx):
        return window_mask(b, h, q_idx + offset, kv_idx)

    def score_mod(score, b, h, q_idx, kv_idx):
        return alibi(score, b, h, q_idx + offset, kv_idx)

    return mask_mod, score_mod


def flex_mods_by_hand(T_q, T_k, window, n_heads):  # another way: the formulas written out
    from attnlib.attention.mods import alibi_slopes

    slopes, offset = alibi_slopes(n_heads), T_k - T_q

    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & (distance < window)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes.to(score.dtype)[h] * (q_idx + offset - kv_idx)

    return mask_mod, score_mod


def _flex_variant(mask_shift=True, bias_shift=True, sign=1.0, one_slope=False, window_fix=0, causal=True,
                  offset_sign=1):
    def answer(T_q, T_k, window, n_heads):
        from attnlib.attention.mods import alibi_slopes

        slopes, offset = alibi_slopes(n_heads), offset_sign * (T_k - T_q)

        def mask_mod(b, h, q_idx, kv_idx):
            distance = q_idx + (offset if mask_shift else 0) - kv_idx
            near = distance < window + window_fix
            return ((distance >= 0) & near) if causal else (distance.abs() < window)

        def score_mod(score, b, h, q_idx, kv_idx):
            slope = slopes.to(score.dtype)[0 * h if one_slope else h]
            return score - sign * slope * (q_idx + (offset if bias_shift else 0) - kv_idx)

        return mask_mod, score_mod

    return answer


def flex_mods_python_if(T_q, T_k, window, n_heads):  # right on the index grid, but Python if under vmap
    mask_mod, score_mod = flex_mods(T_q, T_k, window, n_heads)

    def scalar_mask(b, h, q_idx, kv_idx):
        if q_idx.dim() == 0 and bool(q_idx < 0):
            return q_idx < 0
        return mask_mod(b, h, q_idx, kv_idx)

    return scalar_mask, score_mod


ANSWERS = {
    "15.1": Answers(
        correct=[online_softmax_stats, online_softmax_stats_logaddexp, online_softmax_stats_library],
        wrong=[
            (online_softmax_stats_no_rescale, "exp(m - m')"),
            (online_softmax_stats_nan, "NaN"),
            (online_softmax_stats_no_max, "overflowed"),
            (online_softmax_stats_two_passes, "after it had ended"),
            (online_softmax_stats_list, "blocks were still held"),
            (online_softmax_stats_clones, "more than a few blocks' worth"),
            (online_softmax_stats_growing_cat, "more than a few blocks' worth"),
            (online_softmax_stats_tolist, "Python holds"),
            (online_softmax_stats_numpy, "Python holds"),
            (online_softmax_stats_mmap, "outside torch and Python"),
            (online_softmax_stats_keepdim, "expected (3,)"),
        ],
    ),
    "15.2": Answers(
        correct=[longest_context, longest_context_bisect],
        wrong=[
            (longest_context_bits, "bits"),
            (longest_context_no_heads, "n_heads"),
            (longest_context_no_batch, "sequences"),
            (longest_context_four_bytes, "you counted 4 bytes per score"),
            (longest_context_rounded, "round down"),
            (longest_context_float, "math.isqrt"),
            (longest_context_returns_float, "Python int"),
            (longest_context_always_equal, "Python int"),
        ],
    ),
    "15.3": Answers(
        correct=[causal_tile_kind, causal_tile_kind_counts],
        wrong=[
            (causal_tile_kind_top_left, "top-left"),
            (causal_tile_kind_exclusive_end, "nothing is visible"),
            (causal_tile_kind_never_full, "expected 'full'"),
            (causal_tile_kind_slices_the_mask, "never build the mask"),
            (causal_tile_kind_tril, "never build the mask"),
            (causal_tile_kind_arange, "corners, four integers"),
        ],
    ),
    "15.4": Answers(
        correct=[merge_partials, merge_partials_logaddexp],
        wrong=[
            (merge_partials_mean, "plain mean"),
            (merge_partials_naive_exp, "exp(lse) overflows"),
            (merge_partials_no_guard, "sees no key in either part"),
            (merge_partials_lse_max, "lse is max(lse_a, lse_b)"),
            (merge_partials_in_place, "in place"),
        ],
    ),
    "15.5": Answers(
        correct=[flash_backward_tile, flash_backward_tile_einsum],
        wrong=[
            (flash_backward_tile_tile_softmax, "this tile's keys only"),
            (flash_backward_tile_no_d, "subtract D"),
            (flash_backward_tile_no_scale, "off by a factor"),
            (flash_backward_tile_ignores_mask, "visible False"),
            (flash_backward_tile_two_exps, "overflow"),
            (flash_backward_tile_autograd, "not with autograd"),
            (flash_backward_tile_library, "not with autograd"),
            (flash_backward_tile_swapped, "has shape"),
        ],
    ),
    "15.6": Answers(
        correct=[flex_mods, flex_mods_by_hand],
        wrong=[
            (_flex_variant(mask_shift=False, bias_shift=False), "numbers the new queries from 0"),
            (_flex_variant(bias_shift=False), "ALiBi's distance uses the query's position"),
            (_flex_variant(mask_shift=False), "numbers the new queries from 0"),
            (_flex_variant(window_fix=1), "the query's own included"),
            (_flex_variant(sign=-1.0), "the sign"),
            (_flex_variant(one_slope=True), "head 0's slope"),
            (_flex_variant(causal=False), "keep the mask causal"),
            (_flex_variant(offset_sign=-1), "the other way"),
            (flex_mods_python_if, "under vmap"),
        ],
    ),
}
