"""Word-level tokenizer with special tokens BOS, EOS, PAD and UNK (chapter 11).

The split is a regular expression, :data:`WORD_PATTERN`: a token is either a run of word characters
(letters, digits, underscore, any script) or a single other non-space character (punctuation).
Whitespace only separates tokens and is not kept, so decoding joins tokens with one space:
``decode(encode("Hi, you!"))`` is ``"Hi , you !"``.

Special tokens have fixed ids, the same for every vocabulary:

======  ==========  ==
token   constant    id
======  ==========  ==
<pad>   PAD_ID      0
<bos>   BOS_ID      1
<eos>   EOS_ID      2
<unk>   UNK_ID      3
======  ==========  ==

PAD is 0 so that a zero-initialised batch is all padding.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from attnlib._checks import token_id_list

__all__ = ["WordTokenizer", "WORD_PATTERN", "PAD", "BOS", "EOS", "UNK", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID"]

WORD_PATTERN = re.compile(r"\w+|[^\w\s]")
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


def _check_max_length(max_length: object, smallest: int) -> int | None:
    if max_length is None:
        return None
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"max_length must be an int or None, got {type(max_length).__name__}")
    if max_length < smallest:
        raise ValueError(f"max_length={max_length} is too small: it must be at least {smallest}")
    return max_length


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r} ({type(value).__name__})")


def _check_words(name: str, words: object) -> None:
    if isinstance(words, (str, bytes)) or not isinstance(words, Iterable):
        raise TypeError(f"{name} must be an iterable of str (e.g. a list); got {type(words).__name__}")


class WordTokenizer:
    """One id per word of a vocabulary, plus the four special tokens (chapter 11).

    Build one from a corpus with :meth:`from_corpus`, or pass the words directly.

    Args:
        words: the vocabulary's words, in id order; they get ids ``4, 5, ...`` after the special
            tokens. Duplicates and special tokens are not allowed.

    Raises:
        TypeError: ``words`` is a str, bytes or not iterable, or a word is not a str.
        ValueError: a word is repeated, empty, or is a special token.
    """

    def __init__(self, words: Iterable[str]) -> None:
        _check_words("words", words)
        self.itos: list[str] = list(SPECIAL_TOKENS)
        self.stoi: dict[str, int] = {t: i for i, t in enumerate(self.itos)}
        for w in words:
            if not isinstance(w, str):
                raise TypeError(f"vocabulary words must be str, got {type(w).__name__}")
            if not w or w in self.stoi:
                raise ValueError(f"word {w!r} is empty, repeated or a special token")
            self.stoi[w] = len(self.itos)
            self.itos.append(w)

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    @staticmethod
    def split(text: str) -> list[str]:
        """The words and punctuation of ``text`` (see :data:`WORD_PATTERN`); ``[]`` for ``""``."""
        return WORD_PATTERN.findall(_check_text(text))

    @classmethod
    def from_corpus(cls, texts: str | Iterable[str], min_freq: int = 1, max_size: int | None = None) -> WordTokenizer:
        """Build the vocabulary from the words of ``texts``.

        Words are ranked by frequency, most frequent first, ties in alphabetical order; words seen
        fewer than ``min_freq`` times are left out (they will encode as UNK).

        Args:
            texts: one string or an iterable of strings.
            min_freq: the smallest count a word needs to enter the vocabulary (>= 1).
            max_size: the largest vocabulary size, special tokens included (>= 4), or None.

        Raises:
            TypeError: ``texts`` is neither a str nor an iterable of str; ``min_freq`` / ``max_size`` not an int.
            ValueError: ``min_freq < 1`` or ``max_size < 4``.
        """
        if isinstance(texts, str):
            texts = [texts]
        _check_words("texts", texts)
        for name, value in (("min_freq", min_freq), ("max_size", max_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int{' or None' if name == 'max_size' else ''}; "
                                f"got {value!r} ({type(value).__name__})")
        if min_freq is None or min_freq < 1:
            raise ValueError(f"min_freq={min_freq!r} must be an int >= 1")
        if max_size is not None and max_size < 4:
            raise ValueError(f"max_size={max_size!r} must be None or an int >= 4 (the special tokens take 4 ids)")
        counts: Counter[str] = Counter()
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be a str; got {text!r} ({type(text).__name__})")
            counts.update(cls.split(text))
        ranked = sorted((w for w, c in counts.items() if c >= min_freq and w not in SPECIAL_TOKENS),
                        key=lambda w: (-counts[w], w))
        if max_size is not None:
            ranked = ranked[: max_size - len(SPECIAL_TOKENS)]
        return cls(ranked)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return len(self.itos)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Ids of the words of ``text``; unknown words become ``UNK_ID``.

        Args:
            text: the text (``""`` gives ``[BOS_ID, EOS_ID]``, or ``[]`` without special tokens).
            add_special_tokens: put ``BOS_ID`` first and ``EOS_ID`` last.
            max_length: truncate to at most this many ids. The words are cut, BOS and EOS are kept, so
                with special tokens ``max_length`` must be at least 2.

        Raises:
            TypeError: ``text`` is not a str, ``add_special_tokens`` not a bool, ``max_length`` not an int.
            ValueError: ``max_length`` is negative (or below 2 with special tokens).
        """
        _check_flag("add_special_tokens", add_special_tokens)
        max_length = _check_max_length(max_length, 2 if add_special_tokens else 0)
        ids = [self.stoi.get(w, UNK_ID) for w in self.split(text)]
        if add_special_tokens:
            if max_length is not None:
                ids = ids[: max_length - 2]
            return [BOS_ID, *ids, EOS_ID]
        return ids if max_length is None else ids[:max_length]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The words of ``ids`` joined by single spaces.

        Args:
            ids: a list of ints or a 1-D integer tensor.
            skip_special_tokens: drop PAD, BOS and EOS. UNK is always shown as ``<unk>``: it
                stands for a word.

        Raises:
            TypeError: a str, a bool/float tensor, or an element that is not an integer;
                ``skip_special_tokens`` not a bool.
            ValueError: an id is outside ``[0, vocab_size)`` (the message names it).
        """
        _check_flag("skip_special_tokens", skip_special_tokens)
        words = []
        for i in token_id_list("ids", ids, self.vocab_size):
            if skip_special_tokens and i in (PAD_ID, BOS_ID, EOS_ID):
                continue
            words.append(self.itos[i])
        return " ".join(words)

    def pad_batch(self, batch: Sequence[Sequence[int]], max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad sequences of ids into one tensor.

        Args:
            batch: B sequences of ids (lists or 1-D tensors), e.g. from :meth:`encode`.
            max_length: truncate longer sequences to this length (``T <= max_length``); None keeps all.

        Returns:
            ``(ids, attention_mask)``: ``ids`` a LongTensor ``(B, T)`` filled with ``PAD_ID`` after
            each sequence, ``T`` the longest (truncated) length; ``attention_mask`` a bool tensor
            ``(B, T)``, True at real tokens. ``attention_mask.sum(1)`` gives the lengths, the
            ``lengths`` argument of ``attnlib.attention.masks.padding_mask``.

        Raises:
            ValueError: the batch is empty, ``max_length`` is negative, or an id is outside the vocabulary (named).
            TypeError: ``batch`` is not a sequence (a str included), or an element is not a sequence of ints
                (a bool/float tensor included).
        """
        max_length = _check_max_length(max_length, 0)
        if isinstance(batch, (str, bytes)) or not isinstance(batch, (Sequence, torch.Tensor)):
            raise TypeError(f"batch must be a sequence of sequences of token ids (e.g. a list of lists); "
                            f"got {type(batch).__name__}")
        if isinstance(batch, torch.Tensor):
            batch = list(batch)
        if len(batch) == 0:
            raise ValueError("cannot pad an empty batch")
        rows = []
        for b, seq in enumerate(batch):
            seq = token_id_list(f"batch[{b}]", seq, self.vocab_size)
            rows.append(seq[:max_length] if max_length is not None else seq)
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), T, dtype=torch.bool)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[b, : len(r)] = True
        return ids, attention_mask
