"""Chapter 11 exercise graders: reference answers pass, plausible mistakes fail with a hint that
names them, stubs are 'not solved yet'."""
import re

import pytest
import regex
import torch

from attnlib.book.exercises import CORRECT, WRONG, grade


def stub(*args):
    raise NotImplementedError("write me")


# 11.1 WordPiece's greedy longest match ------------------------------------------------

def wordpiece(word, vocab, unk="[UNK]", max_chars=100):
    if len(word) > max_chars:
        return [unk]
    out, start = [], 0
    while start < len(word):
        for end in range(len(word), start, -1):
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                out.append(piece)
                start = end
                break
        else:
            return [unk]
    return out


def shortest_first(word, vocab, unk="[UNK]", max_chars=100):
    if len(word) > max_chars:
        return [unk]
    out, start = [], 0
    while start < len(word):
        for end in range(start + 1, len(word) + 1):
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                out.append(piece)
                start = end
                break
        else:
            return [unk]
    return out


def no_prefix(word, vocab, unk="[UNK]", max_chars=100):  # looks up "##x" but returns "x"
    return [t.removeprefix("##") for t in wordpiece(word, vocab, unk, max_chars)]


def unk_only_the_part(word, vocab, unk="[UNK]", max_chars=100):
    if len(word) > max_chars:
        return [unk]
    out, start = [], 0
    while start < len(word):
        for end in range(len(word), start, -1):
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                out.append(piece)
                start = end
                break
        else:
            out.append(unk)
            start += 1
    return out


def ignores_max_chars(word, vocab, unk="[UNK]", max_chars=100):
    return wordpiece(word, vocab, unk, max_chars=10**9)


def hard_coded_unk(word, vocab, unk="[UNK]", max_chars=100):
    return ["[UNK]"] if wordpiece(word, vocab, unk, max_chars) == [unk] else wordpiece(
        word, vocab, unk, max_chars)


def unk_at_max_chars(word, vocab, unk="[UNK]", max_chars=100):  # >= instead of >
    return [unk] if len(word) >= max_chars else wordpiece(word, vocab, unk, max_chars)


def test_11_1_reference_is_correct():
    assert grade("11.1", wordpiece).status == CORRECT


@pytest.mark.parametrize("answer, phrase", [
    (shortest_first, "LONGEST"),
    (no_prefix, "'##' prefix"),
    (unk_only_the_part, "WHOLE word"),
    (ignores_max_chars, "max_chars"),
    (hard_coded_unk, "'<unk>'"),
    (unk_at_max_chars, "exactly max_chars"),
])
def test_11_1_mistakes_are_wrong(answer, phrase):
    verdict = grade("11.1", answer)
    assert verdict.status == WRONG and phrase in verdict.detail


def test_11_1_stub():
    assert grade("11.1", stub).status == "not solved yet"


# 11.2 GPT-2's pre-split ------------------------------------------------------------------

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_pre_split(text):
    return regex.findall(GPT2, text)


def word_split(text):  # the chapter's word tokenizer: whitespace is lost
    return re.findall(r"\w+|[^\w\s]", text)


def space_after(text):  # each word keeps the spaces after it
    return regex.findall(r"\s+|\S+\s*", text) if text[:1].isspace() else \
        regex.findall(r"\S+\s*|\s+", text)


def no_lookahead(text):  # without \s+(?!\S): all spaces go into one piece
    return regex.findall(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+""",
                         text)


def no_contractions(text):
    return regex.findall(r""" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""", text)


def ascii_letters(text):  # Python's re without \p{L}: naïve, café and 日本語 split apart
    return re.findall(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""",
                      text)


def word_chars(text):  # \w instead of \p{L}: letters, digits and '_' in one piece
    return regex.findall(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?[^\s\w]+|\s+(?!\S)|\s+""", text)


def test_11_2_reference_is_correct():
    assert grade("11.2", gpt2_pre_split).status == CORRECT


@pytest.mark.parametrize("answer, phrase", [
    (word_split, "join back"),
    (space_after, "AFTER it"),
    (no_lookahead, "\\s+(?!\\S)"),
    (no_contractions, "contractions"),
    (ascii_letters, "any script"),
    (word_chars, "\\w mixes them"),
])
def test_11_2_mistakes_are_wrong(answer, phrase):
    verdict = grade("11.2", answer)
    assert verdict.status == WRONG and phrase in verdict.detail


def test_11_2_stub():
    assert grade("11.2", stub).status == "not solved yet"


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


