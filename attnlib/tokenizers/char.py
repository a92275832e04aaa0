"""Character-level tokenizer: one id per distinct character of a corpus (chapters 11, 12)."""
from __future__ import annotations

from collections.abc import Iterable

from attnlib._checks import token_id_list

__all__ = ["CharTokenizer"]


class CharTokenizer:
    """Maps each character seen in a text to an id, in sorted order.

    Args:
        text: the corpus whose distinct characters make the vocabulary
            (Tiny Shakespeare has 65).

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: if ``text`` is empty.
    """

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        if not text:
            raise ValueError("cannot build a vocabulary from an empty text")
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text``.

        Raises:
            TypeError: ``text`` is not a str.
            ValueError: a character is not in the vocabulary (the first one is named).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary of {self.vocab_size} characters") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (a list or a 1-D tensor of any integer dtype).

        Raises:
            TypeError: a str, a bool/float tensor, or an element that is not an integer.
            ValueError: an id outside ``[0, vocab_size)`` (named).
        """
        return "".join(self.chars[i] for i in token_id_list("ids", ids, self.vocab_size))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
