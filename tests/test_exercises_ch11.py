"""Chapter 11 exercise graders: reference answers pass, plausible mistakes fail, stubs are 'not solved yet'."""
from collections import Counter

import pytest
import torch

from attnlib.book.exercises import CORRECT, WRONG, grade

# 11.1 pair counts --------------------------------------------------------------------------------

def pair_counts(ids):
    return Counter(zip(ids, ids[1:]))


def pair_counts_no_overlap(ids):
    counts, i = Counter(), 0
    while i + 1 < len(ids):
        counts[(ids[i], ids[i + 1])] += 1
        i += 2 if ids[i] == ids[i + 1] else 1
    return counts


def pair_counts_drops_last(ids):
    return Counter(zip(ids[:-1], ids[1:-1]))


def pair_counts_set(ids):
    return dict.fromkeys(zip(ids, ids[1:]), 1)


def test_11_1_reference_is_correct():
    assert grade("11.1", pair_counts).status == CORRECT


@pytest.mark.parametrize("answer", [pair_counts_no_overlap, pair_counts_drops_last, pair_counts_set])
def test_11_1_mistakes_are_wrong(answer):
    assert grade("11.1", answer).status == WRONG


def test_11_1_overlap_hint():
    assert "overlaps" in grade("11.1", pair_counts_no_overlap).detail


# 11.2 one merge step -----------------------------------------------------------------------------

def merge(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def merge_right_to_left(ids, pair, new_id):
    return merge(ids[::-1], pair[::-1], new_id)[::-1]


def merge_no_skip(ids, pair, new_id):  # forgets to skip the second id of a merged pair
    out = []
    for i, x in enumerate(ids):
        out.append(new_id if i + 1 < len(ids) and (x, ids[i + 1]) == pair else x)
    return out


def merge_in_place(ids, pair, new_id):
    result = merge(ids, pair, new_id)
    ids[:] = result
    return result


def test_11_2_reference_is_correct():
    assert grade("11.2", merge).status == CORRECT


@pytest.mark.parametrize("answer", [merge_right_to_left, merge_no_skip, merge_in_place])
def test_11_2_mistakes_are_wrong(answer):
    assert grade("11.2", answer).status == WRONG


def test_11_2_agrees_with_attnlib_training():
    from attnlib.tokenizers import BPETokenizer

    ids = list(b"aaabdaaabac")
    tok = BPETokenizer().train("aaabdaaabac", vocab_size=259)
    for pair, new_id in tok.merges:
        ids = merge(ids, pair, new_id)
    assert ids == tok.encode("aaabdaaabac")


# 11.3 left padding -------------------------------------------------------------------------------

def left_pad(batch, pad_id):
    T = max(len(s) for s in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.bool)
    for b, s in enumerate(batch):
        if s:
            ids[b, T - len(s):] = torch.tensor(s)
            mask[b, T - len(s):] = True
    return ids, mask


def right_pad(batch, pad_id):
    T = max(len(s) for s in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.bool)
    for b, s in enumerate(batch):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, : len(s)] = True
    return ids, mask


def left_pad_mask_from_ids(batch, pad_id):  # pad_id may also be a real token id
    ids, _ = left_pad(batch, pad_id)
    return ids, ids != pad_id


def left_pad_float_mask(batch, pad_id):
    ids, mask = left_pad(batch, pad_id)
    return ids, mask.float()


def test_11_3_reference_is_correct():
    assert grade("11.3", left_pad).status == CORRECT


@pytest.mark.parametrize("answer", [right_pad, left_pad_mask_from_ids, left_pad_float_mask])
def test_11_3_mistakes_are_wrong(answer):
    assert grade("11.3", answer).status == WRONG


def test_11_3_right_padding_hint():
    assert "on the right" in grade("11.3", right_pad).detail


