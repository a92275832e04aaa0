"""The file format of :class:`attnlib.tokenizers.BPETokenizer` (``save`` / ``load``), read strictly.

A saved tokenizer is JSON: ``{"format": "attnlib-bpe", "version": 1, "vocab": {"id": "hex bytes", ...},
"merges": [[a, b, new_id], ...]}``. Reading one refuses anything else with a ``ValueError`` that names the
entry (and ``BPETokenizer.load`` the file), so that a damaged file never becomes a silently wrong tokenizer.
"""
from __future__ import annotations

__all__ = ["FORMAT", "VERSION", "parse_description"]

FORMAT = "attnlib-bpe"
VERSION = 1


def parse_description(data: object) -> tuple[dict[int, bytes], list[tuple[tuple[int, int], int]]]:
    """``(vocab, merges)`` from a description written by ``BPETokenizer.to_dict``.

    Raises:
        ValueError: another ``format`` or ``version``, a missing key, a ``vocab`` that is not an object of
            ``"id": "hex bytes"`` (ids decimal ints >= 0, bytes non-empty), a merge that is not ``[a, b, new_id]``
            of ints (the message names the entry).
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not an {FORMAT} description (missing 'format': {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"unsupported {FORMAT} version {data.get('version')!r}; this is version {VERSION}")
    for key, kind in (("vocab", dict), ("merges", list)):
        if key not in data:
            raise ValueError(f"the {FORMAT} description has no {key!r}")
        if not isinstance(data[key], kind):
            raise ValueError(f"{key!r} must be a JSON {'object' if kind is dict else 'array'}; "
                             f"got {type(data[key]).__name__}")
    vocab = {}
    for key, value in data["vocab"].items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key):
            raise ValueError(f"vocab key {key!r} is not a token id (a decimal int >= 0)")
        try:
            piece = bytes.fromhex(value) if isinstance(value, str) else None
        except ValueError:
            piece = None
        if not piece:
            raise ValueError(f"vocab[{key!r}] = {value!r} is not the hex string of one or more bytes")
        vocab[int(key)] = piece
    merges = []
    for rank, merge in enumerate(data["merges"]):
        if not (isinstance(merge, list) and len(merge) == 3
                and all(isinstance(i, int) and not isinstance(i, bool) for i in merge)):
            raise ValueError(f"merge {rank} is {merge!r}; expected [a, b, new_id], three int token ids")
        a, b, new = merge
        merges.append(((a, b), new))
    return vocab, merges
