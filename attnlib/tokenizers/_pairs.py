"""The bookkeeping behind BPE training (chapter 11): token ids in a linked list with exact pair counts.

:class:`attnlib.tokenizers.BPETokenizer.train` merges the most frequent adjacent pair many
thousand times; recounting every pair after each merge would cost a pass over the whole corpus.
:class:`PairSequence` keeps the count of every adjacent pair and where it occurs, and a merge
updates only the pairs around the positions it touches (the approach of Hugging Face's
``tokenizers`` trainer).
"""
from __future__ import annotations

__all__ = ["PairSequence"]


class PairSequence:
    """A doubly linked list of token ids with exact counts of adjacent pairs and where they occur."""

    def __init__(self, pieces: list[list[int]]) -> None:
        # several pieces share one list; no pair crosses from one piece to the next
        self.tok: list[int] = []
        self.prev: list[int] = []
        self.next: list[int] = []
        self.counts: dict[tuple[int, int], int] = {}
        self.where: dict[tuple[int, int], set[int]] = {}
        for ids in pieces:
            start, n = len(self.tok), len(ids)
            self.tok.extend(ids)
            self.prev.extend(range(start - 1, start + n - 1))
            self.next.extend(range(start + 1, start + n + 1))
            if n:
                self.prev[start] = -1
                self.next[-1] = -1
            for i in range(n - 1):
                self._add((ids[i], ids[i + 1]), start + i)
        self.length = len(self.tok)

    def _add(self, pair: tuple[int, int], pos: int) -> None:
        self.counts[pair] = self.counts.get(pair, 0) + 1
        self.where.setdefault(pair, set()).add(pos)

    def _remove(self, pair: tuple[int, int], pos: int) -> None:
        # positions in `where` are cleaned lazily: merge() re-checks each one
        self.counts[pair] -= 1

    def merge(self, pair: tuple[int, int], new_id: int) -> list[tuple[int, int]]:
        """Replace the occurrences of ``pair`` left to right; return the pairs whose count grew."""
        a, b = pair
        grown = []
        tok, prev, nxt = self.tok, self.prev, self.next
        for p in sorted(self.where.pop(pair, ())):
            q = nxt[p]
            # an earlier merge in this loop may have consumed p or q (overlaps such as "aaa")
            if tok[p] != a or q == -1 or tok[q] != b:
                continue
            left, right = prev[p], nxt[q]
            self._remove(pair, p)
            if left != -1:
                self._remove((tok[left], a), left)
            if right != -1:
                self._remove((b, tok[right]), q)
            tok[p], tok[q] = new_id, -1  # q is dead
            nxt[p] = right
            if right != -1:
                prev[right] = p
            self.length -= 1
            if left != -1:
                self._add((tok[left], new_id), left)
                grown.append((tok[left], new_id))
            if right != -1:
                self._add((new_id, tok[right]), p)
                grown.append((new_id, tok[right]))
        self.counts.pop(pair, None)
        return grown
