"""KV page allocation: which pages of a model's paged cache each request maps.

A `PagePool` hands out page ids of one cache (target or drafter); a request keeps one block
table (a list of page ids, in position order) per pool. A page may be mapped by several tables
at once: a full page whose KV is final can be named by a key (eagle_serve.core.prefix_cache) and is
then shared by every request whose tokens give the same key. Each page counts the tables that
map it; a named page no table maps stays cached (idle) until a page is needed and none is free,
then the least recently used idle page is reused. The pool knows nothing about tensors: the
model processes hold those, and the engine tells them which slots to use.
"""
from __future__ import annotations

from collections import OrderedDict


class PagePool:
    def __init__(self, num_pages: int, page_size: int, name: str = "target"):
        assert num_pages > 0 and page_size > 0
        self.name, self.num_pages, self.page_size = name, num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages                     # tables mapping each page
        self._key_of: dict[int, bytes] = {}              # named (cached) pages
        self._page_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named pages no table maps, LRU first

    @property
    def num_free(self) -> int:
        """Pages a table can get now: empty ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_hold(self, num_tokens: int) -> bool:
        """Could a request of this many tokens ever fit (the pool empty of others)?"""
        return self.pages_for(num_tokens) <= self.num_pages

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` with new pages to cover positions 0 .. num_tokens-1; all or nothing."""
        need = self.pages_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            page = self._free.pop() if self._free else self._evict()
            self._refs[page] = 1
            table.append(page)
        return True

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Roll back: unmap pages past those covering positions 0 .. num_tokens-1."""
        keep = self.pages_for(num_tokens)
        while len(table) > keep:
            self._unref(table.pop())

    def release(self, table: list[int]) -> None:
        self.shrink(table, 0)

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.page_size] * self.page_size + position % self.page_size

    # ---- named pages (the prefix cache) ----

    def cached(self, keys: list[bytes]) -> list[int]:
        """The pages named by the longest prefix of `keys` that the pool holds."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def map(self, table: list[int], pages: list[int]) -> None:
        """Append cached `pages` (from `cached`) to an empty-tailed `table`: shared, not copied."""
        for page in pages:
            self._idle.pop(page, None)
            self._refs[page] += 1
            table.append(page)

    def name_page(self, page: int, key: bytes) -> None:
        """Name a mapped page whose KV is final; a key already cached keeps its page (this one
        stays private to its table)."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key

    def clear_cache(self) -> None:
        """Forget every name (pages mapped now stay mapped): after KV was lost."""
        for page in self._idle:
            self._free.append(page)
        self._idle.clear()
        self._key_of.clear()
        self._page_of.clear()

    def _unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._key_of:
                self._idle[page] = None  # most recently used at the end
            else:
                self._free.append(page)

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page
