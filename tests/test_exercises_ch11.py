"""Chapter 11 exercise graders: reference answers pass, plausible mistakes fail with a hint that
names them, stubs are 'not solved yet'."""
import re

import regex
import torch
from exercise_table import Answers

from attnlib.book.exercises import grade


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


def wordpiece_recursive(word, vocab, unk="[UNK]", max_chars=100):  # another way: longest prefix, recurse
    def rest(start):
        if start == len(word):
            return []
        for end in range(len(word), start, -1):
            piece = ("##" if start else "") + word[start:end]
            if piece in vocab:
                tail = rest(end)
                return None if tail is None else [piece] + tail
        return None

    pieces = rest(0) if len(word) <= max_chars else None
    return [unk] if pieces is None else pieces


def hf_wordpiece(word, vocab, unk="[UNK]", max_chars=100):  # the library the check compares with
    from tokenizers import models

    ids = {unk: 0, **{p: i + 1 for i, p in enumerate(sorted(vocab - {unk}))}}
    model = models.WordPiece(ids, unk_token=unk, max_input_chars_per_word=max_chars)
    return [t.value for t in model.tokenize(word)]


def hf_wordpiece_through_transformers(word, vocab, unk="[UNK]", max_chars=100):
    from transformers import BertTokenizerFast  # noqa: F401 - any door into the libraries
    return hf_wordpiece(word, vocab, unk, max_chars)


def wordpiece_tuple(word, vocab, unk="[UNK]", max_chars=100):
    return tuple(wordpiece(word, vocab, unk, max_chars))


# 11.2 GPT-2's pre-split ------------------------------------------------------------------

CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


def scan(text, lookahead=True, space_before=True, contractions=True, letter=str.isalpha,
         number=str.isnumeric):
    """GPT-2's pre-split by hand; the flags make the plausible mistakes."""
    def kind(c):
        return "L" if letter(c) else "N" if number(c) else "S" if c.isspace() else "O"

    pieces, i, n = [], 0, len(text)
    while i < n:
        if contractions and text[i] == "'":
            c = next((c for c in CONTRACTIONS if text.startswith(c, i)), None)
            if c:
                pieces.append(c)
                i += len(c)
                continue
        start = i
        if space_before and text[i] == " " and i + 1 < n and kind(text[i + 1]) != "S":
            i += 1
        k = kind(text[i])
        if k != "S":
            while i < n and kind(text[i]) == k:
                i += 1
            pieces.append(text[start:i])
            continue
        j = i
        while j < n and text[j].isspace():
            j += 1
        if lookahead and j < n and j - 1 > i:
            j -= 1  # \s+(?!\S): the last space stays for the word after it
        pieces.append(text[i:j])
        i = j
    return pieces


def gpt2_pre_split(text):
    return scan(text)


def by_alternatives(text):  # another way: the regex's alternatives as functions, tried in order
    n = len(text)

    def run_of(i, pred):
        while i < n and pred(text[i]):
            i += 1
        return i

    def contraction(i):
        return next((i + len(c) for c in CONTRACTIONS if text.startswith(c, i)), None)

    def spaced(pred):
        def match(i):
            j = i + 1 if text[i] == " " else i
            k = run_of(j, pred)
            return k if k > j else None
        return match

    def other(c):
        return not (c.isalpha() or c.isnumeric() or c.isspace())

    def spaces_not_before_a_word(i):
        k = run_of(i, str.isspace)
        k = k - 1 if k < n else k
        return k if k > i else None

    def spaces(i):
        k = run_of(i, str.isspace)
        return k if k > i else None

    alternatives = [contraction, spaced(str.isalpha), spaced(str.isnumeric), spaced(other),
                    spaces_not_before_a_word, spaces]
    pieces, i = [], 0
    while i < n:
        end = next(e for e in (m(i) for m in alternatives) if e is not None)
        pieces.append(text[i:end])
        i = end
    return pieces


GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
COMPILED = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|_+|\s+(?!\S)|\s+""")


def with_regex(text):  # the pattern itself: what the exercise asks to do without
    return regex.findall(GPT2, text)


def with_compiled_re(text):  # a pattern compiled in an earlier cell
    return COMPILED.findall(text)


def with_hf(text):
    from tokenizers import pre_tokenizers

    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return [text[a:b] for _, (a, b) in splitter.pre_tokenize_str(text)]


def word_split(text):  # the chapter's word tokenizer: whitespace is lost
    return [p for p in scan(text, space_before=False) if not p.isspace()]


def space_after(text):  # each word keeps the spaces after it
    pieces = []
    for p in scan(text, lookahead=False, space_before=False):
        if p.isspace() and pieces and not pieces[-1].isspace():
            pieces[-1] += p
        else:
            pieces.append(p)
    return pieces


def no_lookahead(text):  # without \s+(?!\S): all spaces go into one piece
    return scan(text, lookahead=False)


def no_contractions(text):
    return scan(text, contractions=False)


def ascii_letters(text):  # [A-Za-z] for \p{L}: naïve, café and 日本語 split apart
    return scan(text, letter=lambda c: c.isascii() and c.isalpha())


def word_chars(text):  # \w instead of \p{L}: letters, digits and '_' in one piece
    return scan(text, letter=lambda c: c.isalnum() or c == "_")


def as_tuple(text):
    return tuple(scan(text))


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


def left_pad_rows(batch, pad_id):  # another way: build each row as a list
    T = max(map(len, batch))
    ids = torch.tensor([[pad_id] * (T - len(s)) + s for s in batch], dtype=torch.long).view(len(batch), T)
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in batch], dtype=torch.long)
    mask = mask.view(len(batch), T).bool()
    return ids, mask


def left_pad_swapped(batch, pad_id):
    ids, mask = left_pad(batch, pad_id)
    return mask, ids


def left_pad_list(batch, pad_id):
    return list(left_pad(batch, pad_id))


def left_pad_int32(batch, pad_id):
    ids, mask = left_pad(batch, pad_id)
    return ids.int(), mask


def left_pad_with_zeros(batch, pad_id):  # pads with 0 whatever pad_id is
    ids, mask = left_pad(batch, 0)
    return ids, mask


def test_stubs_are_not_solved():
    for exercise_id in ("11.1", "11.2", "11.3"):
        assert grade(exercise_id, stub).status == "not solved yet"


ANSWERS = {
    "11.1": Answers(
        correct=[wordpiece, wordpiece_recursive],
        wrong=[
            (shortest_first, "LONGEST"),
            (no_prefix, "'##' prefix"),
            (unk_only_the_part, "WHOLE word"),
            (ignores_max_chars, "max_chars"),
            (hard_coded_unk, "'<unk>'"),
            (unk_at_max_chars, "exactly max_chars"),
            (hf_wordpiece, "not with Hugging Face's WordPiece"),
            (hf_wordpiece_through_transformers, "not with Hugging Face's WordPiece"),
            (wordpiece_tuple, "should return a list of str"),
        ],
    ),
    "11.2": Answers(
        correct=[gpt2_pre_split, by_alternatives],
        wrong=[
            (with_regex, "without regular expressions"),
            (with_compiled_re, "without regular expressions"),
            (with_hf, "without regular expressions"),
            (word_split, "join back"),
            (space_after, "AFTER it"),
            (no_lookahead, "\\s+(?!\\S)"),
            (no_contractions, "contractions"),
            (ascii_letters, "any script"),
            (word_chars, "\\w mixes them"),
            (as_tuple, "should return a list of str"),
        ],
    ),
    "11.3": Answers(
        correct=[left_pad, left_pad_rows],
        wrong=[
            (right_pad, "on the right"),
            (left_pad_mask_from_ids, "cannot be computed from the ids"),
            (left_pad_float_mask, "should be a bool tensor"),
            (left_pad_swapped, "the ids first"),
            (left_pad_list, "should return a tuple"),
            (left_pad_int32, "should be a torch.long tensor"),
            (left_pad_with_zeros, "ids differs"),
        ],
    ),
}
