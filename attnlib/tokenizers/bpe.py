"""Byte-level byte-pair encoding (BPE), from scratch (chapter 11).

BPE {Sennrich et al. 2016, "Neural Machine Translation of Rare Words with Subword Units"} starts
from a small alphabet and repeatedly adds the most frequent pair of adjacent symbols as a new
symbol. The byte-level form (GPT-2) uses the 256 byte values as the alphabet, so every string can
be encoded and nothing is ever unknown.

Conventions of this module:

* A token id maps to a byte string (``vocab[id] -> bytes``). After :meth:`BPETokenizer.train` the
  ids ``0..255`` are the single bytes ``bytes([i])`` and merge ``k`` creates id ``256 + k``. A
  tokenizer converted from Hugging Face (:meth:`BPETokenizer.from_hf`) keeps Hugging Face's ids,
  whatever they are.
* ``merges`` is the ordered list ``[((a, b), new_id), ...]``; its order is the merge *rank*.
* Training counts every window of two adjacent tokens (overlaps included: ``"aaa"`` holds the pair
  ``(a, a)`` twice), takes the most frequent pair and **breaks ties by the smallest pair of ids**
  ``(a, b)``, compared as tuples. It replaces the pair's occurrences left to right without overlap.
* Encoding applies the merges in rank order, each one to all its occurrences left to right. This is
  what Hugging Face's ``models.BPE`` does, so the same vocabulary and merges give the same ids.
* No pre-tokenization: the text is one sequence of bytes, so a token may span a space. (GPT-2 first
  splits text with a regular expression; Hugging Face's ``pre_tokenizers.ByteLevel(use_regex=False)``
  matches this module.)

Implementation: a doubly linked list over the sequence, exact pair counts updated at each merge and
a heap of candidate pairs (the same bookkeeping as Hugging Face's trainer), so that training on a
few hundred kilobytes takes seconds in pure Python.
"""
from __future__ import annotations

import heapq
import json
import os
import time
from collections.abc import Iterable

from attnlib._checks import file_path, read_json, token_id_list
from attnlib.tokenizers._pairs import PairSequence
from attnlib.tokenizers._saved import FORMAT, VERSION, parse_description

__all__ = ["BPETokenizer", "bytes_to_unicode"]



def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table mapping each byte value to a printable character.

    Printable Latin-1 bytes map to themselves; the other 68 (control characters, space, ...) map to
    ``chr(256 + n)`` in byte order, so space (32) becomes ``"Ġ"``. Hugging Face's byte-level BPE
    stores its vocabulary and merges in these characters.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def _check_ids(ids: object, vocab: dict[int, bytes]) -> list[int]:
    return token_id_list("ids", ids, vocab)  # ids kept from Hugging Face need not be 0..n-1


class BPETokenizer:
    """A byte-level BPE tokenizer: train, encode, decode, save and load (chapter 11).

    Create an empty one (only the 256 bytes, no merges) and :meth:`train` it, or :meth:`load` a
    saved one, or convert a Hugging Face tokenizer with :meth:`from_hf`.

    Attributes:
        vocab: ``dict[int, bytes]``, token id -> the bytes it stands for.
        merges: ``list[tuple[tuple[int, int], int]]``, ``((a, b), new_id)`` in rank order.
    """

    def __init__(self) -> None:
        self.vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
        self.merges: list[tuple[tuple[int, int], int]] = []
        self._rebuild()

    # -- bookkeeping -------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Recompute the lookup tables from ``vocab`` and ``merges``, validating them."""
        byte_ids: dict[int, int] = {}
        for i, piece in self.vocab.items():
            if len(piece) == 1:
                byte_ids.setdefault(piece[0], i)
        missing = [b for b in range(256) if b not in byte_ids]
        if missing:
            raise ValueError(f"the vocabulary lacks {len(missing)} single bytes, e.g. byte {missing[0]}: "
                             f"a byte-level vocabulary needs all 256")
        self._byte_ids = [byte_ids[b] for b in range(256)]
        self._ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, ((a, b), new) in enumerate(self.merges):
            for i in (a, b, new):
                if i not in self.vocab:
                    raise ValueError(f"merge {rank} ((({a}, {b}) -> {new})) uses id {i}, which is not in the vocabulary")
            if self.vocab[new] != self.vocab[a] + self.vocab[b]:
                raise ValueError(f"merge {rank}: vocab[{new}] = {self.vocab[new]!r} is not "
                                 f"vocab[{a}] + vocab[{b}] = {self.vocab[a] + self.vocab[b]!r}")
            self._ranks.setdefault((a, b), (rank, new))

    @property
    def vocab_size(self) -> int:
        """Number of tokens: 256 bytes plus one per merge (for a tokenizer trained here)."""
        return len(self.vocab)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)})"

    # -- training ----------------------------------------------------------------------------------
    def train(self, text: str | list[str], vocab_size: int, verbose: bool = False) -> BPETokenizer:
        """Learn ``vocab_size - 256`` merges from ``text`` (replacing any previous ones).

        Args:
            text: the training text; its UTF-8 bytes are the starting sequence. A list of strings
                is trained as separate sequences: no pair is counted across two of them (as with
                a pre-tokenizer that splits the text into lines or words).
            vocab_size: the final vocabulary size, at least 256. Training stops early if no pair
                occurs twice or more (a merge that saves nothing is not learned).
            verbose: print each merge.

        Returns:
            ``self``, trained: ``merges[k] = ((a, b), 256 + k)``.

        Raises:
            TypeError: ``text`` is not a str (or list of str; the first other element is named),
                ``vocab_size`` not an int, ``verbose`` not a bool.
            ValueError: ``vocab_size < 256``.
        """
        pieces = [text] if isinstance(text, str) else text
        if not isinstance(pieces, (list, tuple)):
            raise TypeError(f"text must be a str or a list of str, got {type(text).__name__}")
        for i, t in enumerate(pieces):
            if not isinstance(t, str):
                raise TypeError(f"text must be a str or a list of str, got text[{i}]={t!r} ({type(t).__name__})")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool, got {verbose!r} ({type(verbose).__name__})")
        if vocab_size < 256:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the 256 byte tokens")
        self.vocab = {i: bytes([i]) for i in range(256)}
        self.merges = []
        seq = PairSequence([list(t.encode("utf-8")) for t in pieces])
        n_bytes = seq.length
        # max-heap on count, then min on the pair: entries (-count, pair); stale ones are re-checked
        heap = [(-c, pair) for pair, c in seq.counts.items()]
        heapq.heapify(heap)
        start = time.perf_counter()
        while len(self.vocab) < vocab_size and heap:
            neg, pair = heapq.heappop(heap)
            count = seq.counts.get(pair, 0)
            if count != -neg:
                if count > 0:
                    heapq.heappush(heap, (-count, pair))
                continue
            if count < 2:
                break
            new_id = len(self.vocab)
            self.vocab[new_id] = self.vocab[pair[0]] + self.vocab[pair[1]]
            self.merges.append((pair, new_id))
            for grown in set(seq.merge(pair, new_id)):
                heapq.heappush(heap, (-seq.counts[grown], grown))
            if verbose:
                print(f"merge {len(self.merges):4d}: {pair} -> {new_id} {self.vocab[new_id]!r} ({count} times)")
        if verbose:
            print(f"{len(self.merges)} merges in {time.perf_counter() - start:.2f} s; "
                  f"{n_bytes} bytes -> {seq.length} tokens")
        self._rebuild()
        return self

    # -- encoding and decoding ---------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (``[]`` for ``""``): the merges applied in rank order.

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = [self._byte_ids[b] for b in text.encode("utf-8")]
        if len(ids) < 2 or not self._ranks:
            return ids
        ranks = self._ranks
        n = len(ids)
        tok, nxt, prev = ids, list(range(1, n + 1)), list(range(-1, n - 1))
        nxt[-1] = -1
        # heap of (rank, position, pair): lowest rank first, leftmost first among equal ranks
        heap = [(ranks[p][0], i, p) for i, p in enumerate(zip(ids, ids[1:])) if p in ranks]
        heapq.heapify(heap)
        while heap:
            rank, p, pair = heapq.heappop(heap)
            q = nxt[p]
            if tok[p] != pair[0] or q == -1 or tok[q] != pair[1]:
                continue  # stale: p or q was consumed by an earlier merge
            new = ranks[pair][1]
            tok[p], tok[q] = new, -1
            right = nxt[q]
            nxt[p] = right
            if right != -1:
                prev[right] = p
                r = ranks.get((new, tok[right]))
                if r is not None:
                    heapq.heappush(heap, (r[0], p, (new, tok[right])))
            left = prev[p]
            if left != -1:
                r = ranks.get((tok[left], new))
                if r is not None:
                    heapq.heappush(heap, (r[0], left, (tok[left], new)))
        return [t for t in tok if t != -1]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of a sequence of ids (a list or a 1-D tensor); ValueError names an unknown id."""
        return b"".join(self.vocab[i] for i in _check_ids(ids, self.vocab))

    def decode(self, ids: Iterable[int]) -> str:
        """The text of a sequence of ids.

        A byte-level token need not end on a character boundary, so a sequence of ids can be
        invalid UTF-8 (e.g. the first byte of "é" alone). Such bytes decode to U+FFFD (``"�"``),
        as ``bytes.decode(errors="replace")`` does, instead of raising.

        Raises:
            ValueError: an id is not in the vocabulary (the message names it).
            TypeError: ``ids`` is a str or bytes.
        """
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # -- saving and loading ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-ready description: bytes as hex strings, merges as ``[a, b, new_id]``."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "vocab": {str(i): piece.hex() for i, piece in sorted(self.vocab.items())},
            "merges": [[a, b, new] for (a, b), new in self.merges],
        }

    @classmethod
    def from_dict(cls, data: dict) -> BPETokenizer:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: the data is not an attnlib BPE description: another ``format`` or ``version``, a
                missing key, a ``vocab`` that is not an object of ``"id": "hex bytes"`` (ids decimal ints >= 0,
                bytes non-empty), a merge that is not ``[a, b, new_id]`` of ints, or merges inconsistent
                with the vocabulary (the message names the entry).
        """
        vocab, merges = parse_description(data)
        tok = cls()
        tok.vocab, tok.merges = vocab, merges
        tok._rebuild()
        return tok

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer to ``path`` as JSON (see :meth:`to_dict`).

        Raises:
            TypeError: ``path`` is not a str / PathLike.
        """
        with open(file_path("path", path), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        """Read a tokenizer written by :meth:`save`.

        Raises:
            TypeError: ``path`` is not a str / PathLike.
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a saved tokenizer; the message starts with the path and says what is
                wrong: not UTF-8 text, invalid JSON (with json's line and column), or what :meth:`from_dict` refuses.
        """
        path = file_path("path", path)
        data = read_json(path, f"{path}: not a saved tokenizer: ")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    # -- Hugging Face --------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_tokenizer: object) -> BPETokenizer:
        """Convert a Hugging Face byte-level BPE tokenizer, keeping its ids.

        Args:
            hf_tokenizer: a ``tokenizers.Tokenizer`` whose model is ``models.BPE`` over GPT-2's
                byte-to-character alphabet (:func:`bytes_to_unicode`), e.g. trained with
                ``pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)`` and
                ``initial_alphabet=pre_tokenizers.ByteLevel.alphabet()``; or the dict of its
                ``to_str()`` JSON.

        Returns:
            A tokenizer whose ``encode`` gives Hugging Face's ids for every text, provided the
            Hugging Face tokenizer does not split the text first (no regex pre-tokenizer).

        Raises:
            TypeError: ``hf_tokenizer`` is neither a ``tokenizers.Tokenizer`` nor a dict.
            ValueError: the model is not BPE or lacks its vocab / merges, or a vocabulary entry is not made
                of byte characters.
        """
        if not isinstance(hf_tokenizer, dict) and not callable(getattr(hf_tokenizer, "to_str", None)):
            raise TypeError(f"hf_tokenizer must be a tokenizers.Tokenizer or the dict of its JSON; "
                            f"got {type(hf_tokenizer).__name__}")
        data = hf_tokenizer if isinstance(hf_tokenizer, dict) else json.loads(hf_tokenizer.to_str())
        model = data.get("model", {})
        if not isinstance(model, dict) or model.get("type") != "BPE":
            raise ValueError(f"expected a Hugging Face BPE model, got {model.get('type') if isinstance(model, dict) else model!r}")
        for key in ("vocab", "merges"):
            if key not in model:
                raise ValueError(f"the Hugging Face BPE model has no {key!r}")
        char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        special = {t["content"] for t in data.get("added_tokens", [])}
        vocab: dict[int, bytes] = {}
        for token, i in model["vocab"].items():
            if token in special:
                continue
            try:
                vocab[int(i)] = bytes(char_to_byte[c] for c in token)
            except KeyError as e:
                raise ValueError(f"vocabulary entry {token!r} has the character {e.args[0]!r}, which is not in "
                                 f"the byte-level alphabet") from None
        ids = {token: int(i) for token, i in model["vocab"].items()}
        merges = []
        for m in model["merges"]:
            left, right = m.split(" ") if isinstance(m, str) else m
            merges.append(((ids[left], ids[right]), ids[left + right]))
        tok = cls()
        tok.vocab, tok.merges = vocab, merges
        tok._rebuild()
        return tok
