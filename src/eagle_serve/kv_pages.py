"""KV page allocation: which pages of a model's paged cache each request owns.

A `PagePool` hands out page ids of one cache (target or drafter); a request keeps one block
table (a list of page ids, in position order) per pool. The pool knows nothing about tensors:
the model processes hold those, and the engine tells them which slots to use.
"""
from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int, page_size: int, name: str = "target"):
        assert num_pages > 0 and page_size > 0
        self.name, self.num_pages, self.page_size = name, num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_hold(self, num_tokens: int) -> bool:
        """Could a request of this many tokens ever fit (the pool empty of others)?"""
        return self.pages_for(num_tokens) <= self.num_pages

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` to cover positions 0 .. num_tokens-1; all or nothing."""
        need = self.pages_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self._free.pop() for _ in range(need))
        return True

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Roll back: free pages past those covering positions 0 .. num_tokens-1."""
        keep = self.pages_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def release(self, table: list[int]) -> None:
        self.shrink(table, 0)

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.page_size] * self.page_size + position % self.page_size
