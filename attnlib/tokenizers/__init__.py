"""Tokenizers written from scratch (chapter 11): characters, words, byte-level BPE."""
from attnlib.tokenizers.bpe import BPETokenizer, bytes_to_unicode
from attnlib.tokenizers.char import CharTokenizer
from attnlib.tokenizers.word import WordTokenizer

__all__ = ["BPETokenizer", "CharTokenizer", "WordTokenizer", "bytes_to_unicode"]
