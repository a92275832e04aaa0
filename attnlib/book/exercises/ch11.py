"""Exercise checks for chapter 11 (tokenizers): WordPiece's encoder, GPT-2's pre-split, padding.

* 11.1 ``wordpiece_encode(word, vocab, unk, max_chars)`` -> ``list[str]``: greedy longest match
  (BERT's WordPiece encoder), checked against Hugging Face's ``models.WordPiece``
* 11.2 ``gpt2_pre_split(text)`` -> ``list[str]``: GPT-2's regular-expression pre-split written
  without regular expressions (``re``, ``regex`` and ``tokenizers`` refused), checked against
  Hugging Face's ``pre_tokenizers.ByteLevel(use_regex=True)`` (offsets into the text)
* 11.3 ``left_pad(batch, pad_id)`` -> ``(ids (B, T) long, attention_mask (B, T) bool)``, padding on the left

Every check calls the answer through :func:`run` and draws fresh random cases from
:func:`case_rng` besides its fixed edge cases; Hugging Face's ``tokenizers`` (and ``transformers``'
tokenizers) are refused while the answer runs: they are what the check compares with.
"""
from __future__ import annotations

import torch

from attnlib.book.exercises._ch10_doors import RefuseModules
from attnlib.book.exercises._core import case_rng, exercise, expect, expect_close, expect_tensor, randint
from attnlib.book.exercises._run import run

__all__ = ["check_wordpiece_encode", "check_gpt2_pre_split", "check_left_pad"]


def _random_ids(g: torch.Generator, n: int, high: int) -> list[int]:
    return torch.randint(0, high, (n,), generator=g).tolist()


def _pick(g: torch.Generator, seq):
    return seq[int(torch.randint(0, len(seq), (1,), generator=g))]


def _expect_pieces(got: object, what: str) -> list[str]:
    expect(type(got) is list and all(type(t) is str for t in got),
           f"{what} should return a list of str, got {type(got).__name__}"
           + (f" of {sorted({type(t).__name__ for t in got})}" if isinstance(got, (list, tuple)) else ""))
    return got


def _no_library(why: str, *extra: str) -> RefuseModules:
    return RefuseModules(why, "tokenizers", "transformers", *extra)


# ---------------------------------------------------------------- 11.1
def _hf_wordpiece(word: str, vocab: set[str], unk: str, max_chars: int) -> list[str]:
    from tokenizers import models

    ids = {unk: 0, **{p: i + 1 for i, p in enumerate(sorted(vocab - {unk}))}}
    model = models.WordPiece(ids, unk_token=unk, max_input_chars_per_word=max_chars)
    return [t.value for t in model.tokenize(word)]


def _shortest_first(word: str, vocab: set[str], unk: str) -> list[str]:
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


def _wordpiece_cases(g: torch.Generator) -> list[tuple[str, set[str], str, int]]:
    cases = [("unaffable", {"un", "##aff", "##able", "a", "##ff", "[UNK]"}, "[UNK]", 100),
             ("abc", {"a", "ab", "##bc", "##c", "[UNK]"}, "[UNK]", 100),
             ("abcd", {"a", "ab", "##c", "[UNK]"}, "[UNK]", 100),
             ("bab", {"a", "b", "##a", "[UNK]"}, "[UNK]", 100),
             ("abab", {"a", "b", "##a", "##b", "ab", "##ab", "<unk>"}, "<unk>", 3),
             ("abab", {"a", "b", "##a", "##b", "ab", "##ab", "<unk>"}, "<unk>", 4),
             ("a", {"a", "[UNK]"}, "[UNK]", 100)]
    letters = "abcd"
    for _ in range(30):
        n = int(torch.randint(1, 9, (1,), generator=g))
        word = "".join(_pick(g, letters) for _ in range(n))
        vocab = {"[UNK]"}
        for _ in range(int(torch.randint(4, 16, (1,), generator=g))):
            k = int(torch.randint(1, 4, (1,), generator=g))
            piece = "".join(_pick(g, letters) for _ in range(k))
            vocab.add(piece if bool(torch.rand(1, generator=g) < 0.4) else "##" + piece)
        for c in letters:  # most words can be cut
            vocab |= {c, "##" + c} if bool(torch.rand(1, generator=g) < 0.8) else {c}
        cases.append((word, vocab, "[UNK]", 100 if n < 7 else 6))
    return cases


@exercise("11.1")
def check_wordpiece_encode(answer) -> None:
    """Check greedy longest-match WordPiece encoding against Hugging Face's ``models.WordPiece``."""
    g = case_rng()
    for word, vocab, unk, max_chars in _wordpiece_cases(g):
        frozen = frozenset(vocab)
        what = f"wordpiece_encode({word!r}, vocab={sorted(vocab)}, unk={unk!r}, max_chars={max_chars})"
        hook = _no_library("write the greedy match yourself, not with Hugging Face's WordPiece")
        got = _expect_pieces(run(answer, word, set(vocab), unk, max_chars, what=what, inside=(hook,)), what)
        hook.verdict()
        expected = _hf_wordpiece(word, set(frozen), unk, max_chars)
        if got == expected:
            continue
        if len(word) > max_chars and expected == [unk]:
            expect(False, f"{what}: the word has {len(word)} > max_chars characters: it is [{unk!r}] whole")
        if expected == [unk] and unk in got:
            expect(False, f"{what} gave {got}: when a part of the word cannot be matched, the WHOLE word "
                          f"is [{unk!r}], not only that part")
        if expected == [unk]:
            expect(False, f"{what} gave {got}, but no cut of the word from the left by longest pieces "
                          f"reaches its end: the answer is [{unk!r}]")
        if got == [unk] and len(word) == max_chars:
            expect(False, f"{what} gave {got}: the word has exactly max_chars characters; only a "
                          f"LONGER word is [{unk!r}] whole; expected {expected}")
        if got == _shortest_first(word, frozen, unk):
            expect(False, f"{what} gave {got}: take the LONGEST piece in the vocabulary at each step, "
                          f"not the first one that fits; expected {expected}")
        plain = [t.removeprefix("##") for t in expected]
        if got == plain:
            expect(False, f"{what} gave {got}: a piece that continues the word is looked up and returned "
                          f"with the '##' prefix; expected {expected}")
        expect(False, f"{what} should be {expected}, got {got}")


# ---------------------------------------------------------------- 11.2
def _hf_pre_split(text: str) -> list[str]:
    from tokenizers import pre_tokenizers

    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return [text[a:b] for _, (a, b) in splitter.pre_tokenize_str(text)]


_PIECES = ["Hello", "world", "it", "'s", "'re", "'ll", "don't", "I'm", "naïve", "café", "日本語",
           "2024", "3.14", "!", "...", ",", "?!", "😀", "x", "A1", "-", "__init__", "we've", "'d"]
_SPACES = [" ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", ""]


def _pre_split_cases(g: torch.Generator) -> list[str]:
    cases = ["Hello world", "Hello  world", "It's 2024!", "  leading", "trailing  ", "a\n\nb",
             "don't stop", "x = 3.14;", "", "a \nb", "it 's", "!'s", "x\t y", "'ll'd"]
    for _ in range(25):
        n = int(torch.randint(1, 8, (1,), generator=g))
        cases.append("".join(_pick(g, _PIECES) + _pick(g, _SPACES) for _ in range(n)))
    return cases


@exercise("11.2")
def check_gpt2_pre_split(answer) -> None:
    """Check GPT-2's pre-split against Hugging Face's byte-level pre-tokenizer (offsets mapped back)."""
    import re

    g = case_rng()
    for text in _pre_split_cases(g):
        what = f"gpt2_pre_split({text!r})"
        hook = _no_library("write the rules with str methods, without regular expressions (re, regex) or "
                           "Hugging Face's pre-tokenizer", "re", "_sre", "regex", "_regex")
        got = _expect_pieces(run(answer, text, what=what, inside=(hook,)), what)
        hook.verdict()
        expected = _hf_pre_split(text)
        if got == expected:
            continue
        expect("".join(got) == text, f"{what} gave {got}: the pieces must join back to the text "
                                     f"(no whitespace dropped)")
        expect(got != re.findall(r"\w+|[^\w\s]", text) or not text.strip(),
               f"{what} gave {got}: that is the word tokenizer's split; GPT-2 keeps each space with the "
               f"word after it")
        if any(p.endswith(" ") and p.strip() for p in got):
            expect(False, f"{what} gave {got}: a space belongs to the piece AFTER it (' world'), "
                          f"not before it")
        contractions = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"}
        if [p for p in got if p in contractions] != [p for p in expected if p in contractions]:
            expect(False, f"{what} gave {got}: contractions ('s, 't, 're, 've, 'm, 'll, 'd) are "
                          f"pieces of their own")
        cuts = {sum(map(len, expected[:k])) for k in range(1, len(expected))}
        got_cuts = {sum(map(len, got[:k])) for k in range(1, len(got))}
        if any(text[b - 1].isalpha() and text[b].isalpha() for b in got_cuts - cuts):
            expect(False, f"{what} gave {got}: a run of letters of any script is one piece "
                          f"(\\p{{L}}, which [A-Za-z] is not)")
        if any(text[b - 1].isalpha() != text[b].isalpha()
               and (text[b - 1] in "_0123456789" or text[b] in "_0123456789")
               for b in cuts - got_cuts):
            expect(False, f"{what} gave {got}: letters (\\p{{L}}), digits (\\p{{N}}) and other "
                          f"symbols such as '_' are separate pieces (\\w mixes them)")
        for k in range(len(expected) - 1):
            ws, nxt = expected[k], expected[k + 1]
            if ws.isspace() and nxt[:1] == " " and not nxt.isspace() and ws + " " in got:
                expect(False, f"{what} gave {got}: with several spaces before a word, the last one "
                              f"joins the word and the rest form a piece (the rule \\s+(?!\\S))")
        expect(False, f"{what} should be {expected}, got {got}")


def _expected_left(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in batch)
    ids = torch.tensor([[pad_id] * (T - len(s)) + list(s) for s in batch], dtype=torch.long).reshape(len(batch), T)
    mask = torch.tensor([[False] * (T - len(s)) + [True] * len(s) for s in batch], dtype=torch.bool)
    mask = mask.reshape(len(batch), T)
    return ids, mask


@exercise("11.3")
def check_left_pad(fn) -> None:
    """Check padding a batch on the left, with its attention mask (True at real tokens)."""
    g = case_rng()
    cases = [([[5, 6, 7], [8]], 0), ([[1], [2], [3]], 0), ([[4, 5], []], 9), ([[], []], 0), ([[0, 3], [4]], 0),
             ([[7, 7, 1]], 7)]
    for _ in range(3):  # fresh each run; real tokens often equal pad_id
        lengths = torch.randint(0, 7, (randint(g, 1, 5),), generator=g).tolist()
        cases.append(([_random_ids(g, n, 6) for n in lengths], randint(g, 0, 5)))
    for batch, pad_id in cases:
        what = f"left_pad({batch}, pad_id={pad_id})"
        got = run(fn, [list(s) for s in batch], pad_id, what=what)
        expect(type(got) is tuple and len(got) == 2, f"{what} should return a tuple (ids, attention_mask), "
                                                     f"got {type(got).__name__}")
        ids, mask = got
        exp_ids, exp_mask = _expected_left(batch, pad_id)
        expect_tensor(ids, f"{what} ids")
        expect_tensor(mask, f"{what} attention_mask")
        if ids.dtype == torch.bool and mask.dtype == torch.long:
            expect(False, f"{what}: return (ids, attention_mask) in this order, the ids first")
        expect(ids.dtype == torch.long, f"{what}: ids should be a torch.long tensor, got {ids.dtype}")
        expect(mask.dtype == torch.bool, f"{what}: attention_mask should be a bool tensor, got {mask.dtype}")
        right = torch.tensor([list(s) + [pad_id] * (exp_ids.shape[1] - len(s)) for s in batch],
                             dtype=torch.long).reshape(exp_ids.shape)
        if ids.shape == exp_ids.shape and torch.equal(ids, right) and not torch.equal(right, exp_ids):
            expect(False, f"{what} pads on the right; put the pad ids before each sequence, so that every "
                          f"sequence ends in the last column")
        expect_close(ids, exp_ids, f"{what} ids")
        if mask.shape == exp_mask.shape and torch.equal(mask, ids != pad_id) and not torch.equal(mask, exp_mask):
            expect(False, f"{what}: the mask cannot be computed from the ids: pad_id may also be a real token; "
                          f"mark positions by the sequence lengths")
        expect_close(mask, exp_mask, f"{what} attention_mask")
