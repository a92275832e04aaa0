"""Prefix caching: sequences that start with the same tokens share the pages of that prefix. Chapter 19.

Requests to a served model often begin alike: one system prompt, the same few-shot examples, the
previous turns of a conversation. Their keys and values over that prefix are the same (a position's
keys depend only on the tokens up to it), so a cache can compute them once and let every later
request read the same pages. SGLang's RadixAttention (Zheng et al. 2024, "SGLang: Efficient Execution
of Structured Language Model Programs", §3) keeps them in a radix tree of token sequences; vLLM's
automatic prefix caching keys each full page by a hash of its tokens and of every token before it.
:class:`PrefixPageAllocator` is the latter, exactly:

* **the index** maps the token ids of the whole prefix up to the end of a *full* page (a tuple, so two
  keys are equal only when the tokens are: the same page of tokens after different prefixes never
  collides, and no hash can collide either) to the page that holds its keys and values;
* **reference counts**: how many sequences hold each page in their block tables. A new sequence takes
  the pages of its longest cached prefix (:meth:`~PrefixPageAllocator.share`, count + 1) instead of
  computing them; a finished one gives them back (count - 1);
* **copy-on-write**: only full pages are indexed, so a sequence never writes into a shared page while
  it grows. It does when its whole prompt is cached (its last token must still go through the model
  to give the logits of the first new token) or after a crop: the writer first gets a private copy
  (:meth:`~PrefixPageAllocator.replace`; :class:`attnlib.cache.PagedKVCache` copies the tensors);
* **eviction**: a cached page that no sequence holds stays indexed, on a least-recently-used list; when
  the free list is empty, :meth:`~PrefixPageAllocator.take` evicts the least recently used (leaving the
  index). A sequence's pages enter that list deepest first, so a prefix is evicted from its end and its
  start, the part most requests share, stays longest.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from attnlib.cache.allocator import OutOfPages, PageAllocator

__all__ = ["PrefixPageAllocator"]


class PrefixPageAllocator(PageAllocator):
    """A :class:`~attnlib.cache.PageAllocator` whose full pages are shared by prefix (see the module's docstring).

    Args:
        n_pages: pages in the pool.
        page_size: positions per page, an int >= 1.

    Attributes:
        refs: per page, the sequences holding it (0 for a free or an evictable page).
        index: the token ids of a prefix ending at a page boundary (a tuple) -> the page holding its last page.
        keys: the inverse of ``index``: page -> its key, for every cached page.
        lru: the cached pages no sequence holds, least recently used first.
        evictions, copies: counters: cached pages reused for other contents, pages copied before a write.

    Raises:
        TypeError / ValueError: ``n_pages`` or ``page_size`` not an int >= 1 (named).
    """

    def __init__(self, n_pages: int, page_size: int) -> None:
        super().__init__(n_pages, page_size)
        self.refs = [0] * n_pages
        self.index: dict[tuple[int, ...], int] = {}
        self.keys: dict[int, tuple[int, ...]] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.evictions = self.copies = 0

    @property
    def available(self) -> int:
        """Pages :meth:`take` can hand out: the free list and the cached pages no sequence holds."""
        return len(self.free) + len(self.lru)

    @property
    def pages_cached(self) -> int:
        """Pages in the index (held by sequences or evictable)."""
        return len(self.keys)

    def take(self, seq: int) -> int:
        """A page for ``seq`` (count 1): off the free list, else the least recently used cached page, evicted.

        Raises:
            OutOfPages: every page is held by a sequence.
        """
        if self.free:
            page = self.free.pop()
        elif self.lru:
            page, _ = self.lru.popitem(last=False)
            del self.index[self.keys.pop(page)]
            self.evictions += 1
        else:
            raise OutOfPages(f"no free page for sequence {seq} ({self.n_pages} pages of {self.page_size} "
                             f"positions, all held by sequences)")
        self.refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        """One holder fewer; an unheld page goes to the evictable list if cached, else to the free list."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.keys:
                self.lru[page] = None  # the most recently used end
            else:
                self.free.append(page)

    def release(self, seq: int) -> None:
        """Give back the pages of ``seq`` (deepest first, see the module's docstring) and forget it."""
        for page in reversed(self.table(seq)):
            self._drop(page)
        del self.tables[seq]

    def must_copy(self, page: int) -> bool:
        """Whether a write into ``page`` must go to a copy: another sequence holds it, or it is indexed."""
        return self.refs[page] > 1 or page in self.keys

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The pages of the longest cached prefix of ``tokens`` (a list of ids), full pages only; nothing changes."""
        pages, tokens = [], tuple(tokens)
        for end in range(self.page_size, len(tokens) + 1, self.page_size):
            page = self.index.get(tokens[:end])
            if page is None:
                break
            pages.append(page)
        return pages

    def share(self, seq: int, pages: list[int]) -> None:
        """Give the empty sequence ``seq`` the cached ``pages`` (from :meth:`lookup`) as its first pages.

        Raises:
            ValueError: ``seq`` already holds pages, or a page that is not cached.
        """
        table = self.table(seq)
        if table:
            raise ValueError(f"sequence {seq} already holds {len(table)} pages; a prefix is shared into an empty one")
        if any(page not in self.keys for page in pages):
            raise ValueError(f"pages {pages} are not all cached pages (PrefixPageAllocator.lookup gives them)")
        for page in pages:
            self.refs[page] += 1
            self.lru.pop(page, None)  # held again: not evictable
        table.extend(pages)

    def register(self, seq: int, tokens: Sequence[int]) -> int:
        """Index the full pages of ``seq``, whose cached positions hold ``tokens`` (their ids, in order).

        A page already indexed stays as it is; a page whose prefix another page already holds (two requests
        prefilled the same prefix at once) stays private to ``seq`` and is freed with it. Returns the pages
        newly indexed.
        """
        table, tokens, added = self.table(seq), tuple(tokens), 0
        for i in range(min(len(tokens) // self.page_size, len(table))):
            key = tokens[: (i + 1) * self.page_size]
            if table[i] not in self.keys and key not in self.index:
                self.index[key], self.keys[table[i]] = table[i], key
                added += 1
        return added

    def replace(self, seq: int, i: int) -> tuple[int, int]:
        """Copy-on-write: page ``i`` of ``seq``'s table becomes a fresh page; returns ``(old, new)`` so that the
        caller copies the tensors. The old page loses a holder.

        Raises:
            OutOfPages: no page to take.
        """
        table = self.table(seq)
        old, new = table[i], self.take(seq)
        table[i] = new
        self._drop(old)
        self.copies += 1
        self._slots = (None,)  # the slots of seq moved
        return old, new
