"""The chapter 19 exercise checks, table-driven: correct answers pass, plausible mistakes get a hint naming them.

The expected values here come from independent code (loops over the rows, attnlib's verify_drafts
for the general rule), not from the checks' own helpers.
"""
import math

import torch
from exercise_table import Answers

from attnlib.book.exercises import ch19  # noqa: F401  (registers 19.x)
from attnlib.generation import verify_drafts


# ---------------------------------------------------------------- 19.1
def pack(idx, attention_mask):
    lengths = attention_mask.sum(-1)  # (B,)
    tokens = idx[attention_mask]  # row by row
    positions = (attention_mask.long().cumsum(-1) - 1)[attention_mask]  # real tokens counted within the row
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    return tokens, positions, cu_seqlens


def pack_by_rows(idx, attention_mask):  # another way: one row at a time
    tokens, positions, cu = [], [], [0]
    for row, m in zip(idx, attention_mask):
        real = row[m]
        tokens.append(real)
        positions.append(torch.arange(len(real)))
        cu.append(cu[-1] + len(real))
    return torch.cat(tokens), torch.cat(positions), torch.tensor(cu, dtype=torch.int32)


def pack_columns(idx, attention_mask):  # positions = the columns of the padded batch
    t, _, c = pack(idx, attention_mask)
    return t, torch.arange(idx.shape[1]).expand_as(idx)[attention_mask], c


def pack_left_only(idx, attention_mask):  # the left-padding formula: subtract the pads
    t, _, c = pack(idx, attention_mask)
    n_pad = (~attention_mask).sum(-1, keepdim=True)
    return t, (torch.arange(idx.shape[1]) - n_pad)[attention_mask], c


def pack_global_positions(idx, attention_mask):
    t, _, c = pack(idx, attention_mask)
    return t, torch.arange(len(t)), c


def pack_no_leading_zero(idx, attention_mask):
    t, p, _ = pack(idx, attention_mask)
    return t, p, attention_mask.sum(-1).cumsum(0).to(torch.int32)


def pack_int64_cu(idx, attention_mask):
    t, p, c = pack(idx, attention_mask)
    return t, p, c.long()


def pack_with_pads(idx, attention_mask):
    _, p, c = pack(idx, attention_mask)
    return idx.flatten(), p, c


def pack_column_major(idx, attention_mask):
    _, p, c = pack(idx, attention_mask)
    return idx.T[attention_mask.T], p, c


def pack_swapped(idx, attention_mask):
    t, p, c = pack(idx, attention_mask)
    return t, c, p


def pack_through_attnlib(idx, attention_mask):  # the chapter's import: attnlib's positions
    from attnlib.attention.masks import mask_positions

    t, _, c = pack(idx, attention_mask)
    return t, mask_positions(attention_mask)[attention_mask], c


def pack_in_place(idx, attention_mask):
    out = pack(idx, attention_mask)
    idx.masked_fill_(~attention_mask, -1)  # marks the pads in the caller's tensor
    return out


# ---------------------------------------------------------------- 19.2
def acceptance_from_rounds(accepted, k):
    checked = accepted.sum() + (accepted < k).sum()  # accepted drafts + one rejection per early stop
    return (accepted.sum() / checked).item()


def acceptance_by_loop(accepted, k):  # another way: count the trials round by round
    yes = no = 0
    for a in accepted.tolist():
        yes += a
        no += a < k
    return yes / (yes + no)


def acceptance_per_drafted(accepted, k):  # the chapter's "acceptance" column: accepted / drafted
    return accepted.sum().item() / (k * len(accepted))


def acceptance_all_rounds_reject(accepted, k):
    return accepted.sum().item() / (accepted.sum().item() + len(accepted))


def acceptance_first_draft(accepted, k):
    return (accepted > 0).double().mean().item()


def acceptance_off_by_one(accepted, k):
    return accepted.sum().item() / (accepted.sum().item() + (accepted < k - 1).sum().item())


def acceptance_tensor(accepted, k):
    return accepted.sum() / (accepted.sum() + (accepted < k).sum())


def acceptance_sorts_in_place(accepted, k):
    accepted[:] = accepted.sort().values
    return acceptance_from_rounds(accepted, k)


# ---------------------------------------------------------------- 19.3
def pages_needed(prompt_lengths, new_tokens, page_size):
    return sum(math.ceil((p + n) / page_size) for p, n in zip(prompt_lengths, new_tokens))


def pages_needed_floor_division(prompt_lengths, new_tokens, page_size):
    return sum(-(-(p + n) // page_size) for p, n in zip(prompt_lengths, new_tokens))


class AlwaysEqual(int):  # an int whose == is always true
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


# ---------------------------------------------------------------- 19.4
def gather_pages(pool, tables, lengths):
    B, T, page_size = len(lengths), max(lengths), pool.shape[1]
    keys = pool.new_zeros(B, T, *pool.shape[2:])
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        p = torch.arange(n)
        pages = torch.tensor(tables[b], dtype=torch.long)[p // page_size]  # (n,)
        keys[b, T - n:] = pool[pages, p % page_size]  # right-aligned
        mask[b, T - n:] = True
    return keys, mask


def gather_pages_by_concat(pool, tables, lengths):  # another way: whole pages, concatenated, then cut
    T = max(lengths)
    rows, masks = [], []
    for table, n in zip(tables, lengths):
        flat = pool[table].reshape(-1, *pool.shape[2:])[:n] if table else pool[:0, 0]
        pad = pool.new_zeros(T - n, *pool.shape[2:])
        rows.append(torch.cat([pad, flat]))
        masks.append(torch.arange(T) >= T - n)
    return torch.stack(rows), torch.stack(masks)


def gather_left_aligned(pool, tables, lengths):
    keys, mask = gather_pages(pool, tables, lengths)
    for b, n in enumerate(lengths):
        keys[b] = keys[b].roll(-(keys.shape[1] - n), 0)
    return keys, mask.flip(-1)


def gather_sorted_pages(pool, tables, lengths):
    return gather_pages(pool, [sorted(t) for t in tables], lengths)


def gather_mask_inverted(pool, tables, lengths):
    keys, mask = gather_pages(pool, tables, lengths)
    return keys, ~mask


def gather_empty_pads(pool, tables, lengths):
    keys, mask = gather_pages(pool, tables, lengths)
    keys[~mask] = 1.0
    return keys, mask


def gather_offset_swapped(pool, tables, lengths):  # page p % n_pages, offset p // page_size
    B, T, page_size = len(lengths), max(lengths), pool.shape[1]
    keys = pool.new_zeros(B, T, *pool.shape[2:])
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        for p in range(n):
            keys[b, T - n + p] = pool[tables[b][p % len(tables[b])], (p // len(tables[b])) % page_size]
        mask[b, T - n:] = True
    return keys, mask


def gather_swapped(pool, tables, lengths):
    keys, mask = gather_pages(pool, tables, lengths)
    return mask, keys


def gather_float_mask(pool, tables, lengths):
    keys, mask = gather_pages(pool, tables, lengths)
    return keys, mask.float()


def gather_through_attnlib(pool, tables, lengths):  # the chapter's import: the allocator locates positions
    from attnlib.cache import PageAllocator

    alloc = PageAllocator(n_pages=pool.shape[0], page_size=pool.shape[1])
    B, T = len(lengths), max(lengths)
    keys = pool.new_zeros(B, T, *pool.shape[2:])
    for b, n in enumerate(lengths):
        s = alloc.new_sequence()
        alloc.tables[s] = list(tables[b])
        page, offset = alloc.locate(s, torch.arange(n))
        keys[b, T - n:] = pool[page, offset]
    return keys, torch.arange(T)[None] >= T - torch.tensor(lengths)[:, None]


def gather_in_place(pool, tables, lengths):
    out = gather_pages(pool, tables, lengths)
    pool.zero_()
    return out


# ---------------------------------------------------------------- 19.5
def greedy_draft_round(p, drafts, generator=None):  # transformers' assisted generation: sample, keep matches
    t = torch.multinomial(p, 1, generator=generator)[:, 0]  # (k + 1,): the target's own sample at each position
    n = 0
    while n < len(drafts) and t[n] == drafts[n]:
        n += 1
    return torch.cat([drafts[:n], t[n:n + 1]])


def round_by_the_general_rule(p, drafts, generator=None):  # Algorithm 1 with q a point mass on each draft
    q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
    n, nxt = verify_drafts(p[None], q[None], drafts[None], generator=generator)
    return torch.cat([drafts[: int(n)], nxt])


def round_variant(p, drafts, g, *, accept="p", replace="residual", bonus_from=None, stop=True, in_place=False,
                  global_rng=False):
    """One round with a planted mistake: accept d with probability p(d) ("p"), always ("always") or iff it is
    p's argmax ("argmax"); replace from the residual or from p; the bonus from p[bonus_from]; stop or not at the
    first rejection; build the residual in place or not; draw from the global generator."""
    g = None if global_rng else g
    k, out = len(drafts), []
    for j in range(k):
        d = int(drafts[j])
        ok = {"p": bool(torch.rand(1, generator=g, dtype=p.dtype) < p[j, d]), "always": True,
              "argmax": d == int(p[j].argmax())}[accept]
        if ok:
            out.append(d)
            continue
        r = p[j] if in_place else p[j].clone()
        if replace == "residual":
            r[d] = 0.0
        out.append(int(torch.multinomial(r, 1, generator=g)))
        if stop:
            return torch.tensor(out)
    if bonus_from is not None:
        out.append(int(torch.multinomial(p[k if bonus_from == "k" else k - 1], 1, generator=g)))
    return torch.tensor(out[: k + 1])


ANSWERS = {
    "19.1": Answers(
        correct=[pack, pack_by_rows],
        wrong=[
            (pack_columns, "your positions are the columns"),
            (pack_global_positions, "run on across sequences"),
            (pack_left_only, "right for left padding only"),
            (pack_no_leading_zero, "has shape"),
            (pack_int64_cu, "int32"),
            (pack_with_pads, "drop the pads"),
            (pack_column_major, "row by row"),
            (pack_swapped, "in this order"),
            (pack_through_attnlib, "count the positions yourself"),
            (pack_in_place, "in place"),
        ],
    ),
    "19.2": Answers(
        correct=[acceptance_from_rounds, acceptance_by_loop],
        wrong=[
            (acceptance_per_drafted, "never checked"),
            (acceptance_all_rounds_reject, "had no rejection"),
            (acceptance_first_draft, "the first draft of each round only"),
            (acceptance_off_by_one, "over the drafts the target checked"),
            (acceptance_tensor, "should be a Python float"),
            (acceptance_sorts_in_place, "in place"),
        ],
    ),
    "19.3": Answers(
        correct=[pages_needed, pages_needed_floor_division],
        wrong=[
            (lambda ps, ns, s: -(-sum(p + n for p, n in zip(ps, ns)) // s), "you rounded the total"),
            (lambda ps, ns, s: sum((p + n) // s for p, n in zip(ps, ns)), "round up"),
            (lambda ps, ns, s: sum((p + n) // s + 1 for p, n in zip(ps, ns)), "not m + 1"),
            (lambda ps, ns, s: sum(-(-p // s) - (n // -s) for p, n in zip(ps, ns)), "together"),
            (lambda ps, ns, s: sum(-(-p // s) for p in ps), "count the new tokens"),
            (lambda ps, ns, s: sum(-(-n // s) for n in ns), "count the prompt too"),
            (lambda ps, ns, s: sum(-(-(p + n - 1) // s) for p, n in zip(ps, ns)), "prompt + new - 1"),
            (lambda ps, ns, s: float(pages_needed(ps, ns, s)), "should be a Python int"),
            (lambda ps, ns, s: AlwaysEqual(pages_needed(ps, ns, s) + 1), "should be a Python int"),
        ],
    ),
    "19.4": Answers(
        correct=[gather_pages, gather_pages_by_concat],
        wrong=[
            (gather_left_aligned, "right-align each sequence"),
            (gather_sorted_pages, "in the order of the block table"),
            (gather_mask_inverted, "True at the pads"),
            (gather_empty_pads, "the pads should be zeros"),
            (gather_offset_swapped, "tables[b][p // page_size]"),
            (gather_swapped, "in this order"),
            (gather_float_mask, "return a bool mask"),
            (gather_through_attnlib, "read the pages yourself"),
            (gather_in_place, "in place"),
        ],
    ),
    "19.5": Answers(
        correct=[greedy_draft_round, round_by_the_general_rule,
                 lambda p, d, g: round_variant(p, d, g, bonus_from="k")],
        wrong=[
            (lambda p, d, g: round_variant(p, d, g), "add the bonus token"),
            (lambda p, d, g: round_variant(p, d, g, accept="always", bonus_from="k"), "not q / p"),
            (lambda p, d, g: round_variant(p, d, g, accept="argmax", bonus_from="k"), "you accept it always"),
            (lambda p, d, g: round_variant(p, d, g, replace="p", bonus_from="k"), "you drew from p"),
            (lambda p, d, g: round_variant(p, d, g, stop=False, bonus_from="k"), "ends at the first rejection"),
            (lambda p, d, g: round_variant(p, d, g, bonus_from="k-1"), "the bonus token must follow p[k]"),
            (lambda p, d, g: round_variant(p, d, g, bonus_from="k", in_place=True), "in place"),
            (lambda p, d, g: round_variant(p, d, g, bonus_from="k", global_rng=True), "draw every random number"),
            (lambda p, d, g: greedy_draft_round(p, d, g).float(), "1-D integer tensor"),
        ],
    ),
}
