"""Tokenizers written from scratch."""
from attnlib.tokenizers.char import CharTokenizer

__all__ = ["CharTokenizer"]
