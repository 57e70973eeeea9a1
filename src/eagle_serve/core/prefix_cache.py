"""Automatic prefix caching: requests that share a prefix share its KV pages.

A full target page is named by a hash chained over (the previous page's name, the page's
tokens), the first page's chain starting from the request's `cache_salt`, so tenants with
different salts never share pages. KV depends on nothing else than the tokens before it, so a
page computed for one request is exactly the page another request would compute (the CPU and
GPU kernels are row-invariant: a page computed inside a long prefill equals the same page
computed alone). Pages are named once their KV is final (below the request's computed
positions and any pending tree moves), kept after their requests end, and reused least
recently used first (eagle_serve.core.kv_pages).

The drafter follows: its position p reads the target's features at p and the token at p + 1,
so a drafter page is named by its target page's name and the token after the page. The target
features of every computed position are kept beside its page too (`FeatureStore`): a
speculative request maps the drafter pages the pool holds, and catches the drafter up on the
rest of its cached prefix from the stored features, so it drafts from its first round exactly
as if it had computed the prefix (the drafter saw no page of a prompt that only plain requests
sent, or whose rounds did not call it).

The last token of a request is never served from the cache: its forward gives the logits of
the first new token. A request resumed after preemption also recomputes the token before it,
so its rounds (and a seeded rejection-sampled request's drafts) are those it has without hits.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import Request


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)  # collision-safe (unlike hash()) and fast for 16 tokens
    for part in parts:
        h.update(part)
    return h.digest()


def _token_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


class PrefixCache:
    def __init__(self, target: PagePool, drafter: PagePool, stats, enabled: bool = True):
        """stats: the engine's EngineStats (prefix_cache_queries and _hits are counted there)."""
        assert target.page_size == drafter.page_size
        self.target, self.drafter, self.stats, self.enabled = target, drafter, stats, enabled
        self.page_size = target.page_size
        self.features = FeatureStore(target.num_pages, target.page_size)

    def keys(self, req: Request, num_pages: int) -> list[bytes]:
        """The names of the request's first `num_pages` target pages (kept in the request)."""
        keys, size = req.page_keys, self.page_size
        while len(keys) < num_pages:
            j = len(keys)
            parent = keys[-1] if keys else _digest(b"salt", req.params.cache_salt.encode())
            keys.append(_digest(parent, _token_bytes(req.tokens[j * size:(j + 1) * size])))
        return keys[:num_pages]

    def drafter_key(self, req: Request, j: int) -> bytes:
        return _digest(b"drafter", req.page_keys[j], _token_bytes([req.tokens[(j + 1) * self.page_size]]))

    def admit(self, req: Request) -> None:
        """Map the cached pages of a request that holds none and set what it has computed."""
        if (not self.enabled or req.num_computed or req.target_pages or req.drafter_pages
                or req.params.prompt_logprobs is not None):  # its prompt's logits are wanted
            return
        keep = 2 if req.output else 1  # positions that must be computed (module docstring)
        keys = self.keys(req, max(0, (len(req.tokens) - keep) // self.page_size))
        pages = self.target.cached(keys)
        drafted = 0
        if req.k:
            drafter_pages = self.drafter.cached([self.drafter_key(req, j) for j in range(len(pages))])
            drafted = len(drafter_pages)
            pages = pages[:drafted + self.features.run(pages[drafted:])]
            self.drafter.map(req.drafter_pages, drafter_pages)
            if len(pages) > drafted:  # the drafter catches up on these from their features
                req.undrafted = [self.features.gather(pages[drafted:])]
        self.target.map(req.target_pages, pages)
        req.num_computed = len(pages) * self.page_size
        req.draft_computed = drafted * self.page_size if req.k else req.num_computed

    def plan(self, spans: list[tuple[Request, int, int]]) -> list[int]:
        """spans: (request, first position, n) each, computed this round -> where their
        features go in the store (verify.advance writes them there with `write`)."""
        if not self.enabled:
            return []
        return self.features.plan([(req.target_pages, start, n) for req, start, n in spans])

    def write(self, where: torch.Tensor, features: torch.Tensor) -> None:
        if self.enabled:
            self.features.write(where, features)

    def count(self, req: Request) -> None:
        """The request was admitted: count its lookup (the first admission sets its
        num_cached_tokens, reported to its client)."""
        if not self.enabled:
            return
        self.stats.prefix_cache_queries += len(req.tokens)
        self.stats.prefix_cache_hits += req.num_computed
        if not req.admitted:
            req.num_cached_tokens = req.num_computed

    def publish(self, req: Request) -> None:
        """Name the request's pages whose KV became final (after a verify or drafting round)."""
        if not self.enabled:
            return
        size = self.page_size
        # a stop string cuts the tokens after it: positions past the cut hold KV of tokens the
        # request no longer has, so pages are named only below its tokens
        final = min([req.num_computed, len(req.tokens)] + [dst for _, dst in req.kv_moves])
        keys = self.keys(req, min(final // size, len(req.target_pages)))
        for j in range(req.published_target, len(keys)):
            self.target.name_page(req.target_pages[j], keys[j])
        req.published_target = max(req.published_target, len(keys))
        if req.k:  # a drafter page's name also holds the token after it
            done = min(req.draft_computed // size, (len(req.tokens) - 1) // size, len(keys),
                       len(req.drafter_pages))
            for j in range(req.published_drafter, done):
                self.drafter.name_page(req.drafter_pages[j], self.drafter_key(req, j))
            req.published_drafter = max(req.published_drafter, done)

    def forget(self) -> None:
        """The models lost their KV: no cached page holds what its name says any more."""
        self.target.clear_cache()
        self.drafter.clear_cache()


class FeatureStore:
    """The target's features at each position of each target page ([pages, page_size, F] on
    the features' device, allocated at the first store). A page's features are whole once its
    last position was stored; its owner stores them from its first position on (pages are
    handed out empty and filled in order), which marks them not whole until done."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.data: torch.Tensor | None = None
        self.whole = np.zeros(num_pages, dtype=np.bool_)

    def plan(self, spans: list[tuple[list[int], int, int]]) -> list[int]:
        """spans: (block table, first position, n) each -> the store's rows for those positions,
        in order; their pages' features are whole once the write that follows is done."""
        size = self.page_size
        positions = np.concatenate([np.arange(start, start + n) for _, start, n in spans])
        pages = np.concatenate([np.asarray(table, dtype=np.int64)[np.arange(start, start + n) // size]
                                for table, start, n in spans])
        offsets = positions % size
        self.whole[pages[offsets == 0]] = False
        self.whole[pages[offsets == size - 1]] = True
        return (pages * size + offsets).tolist()

    def write(self, where: torch.Tensor, features: torch.Tensor) -> None:
        """where [N]: rows from `plan`, on features' device; features [N, F]."""
        if not features.shape[0]:
            return
        if self.data is None:  # uninitialised: only whole pages are ever read (`run`, `gather`)
            self.data = features.new_empty((len(self.whole), self.page_size, features.shape[1]))
        self.data.view(-1, features.shape[1]).index_copy_(0, where, features.to(self.data.dtype))

    def run(self, pages: list[int]) -> int:
        """How many of `pages`, from the first, have whole features."""
        count = 0
        while count < len(pages) and self.whole[pages[count]]:
            count += 1
        return count

    def gather(self, pages: list[int]) -> torch.Tensor:
        """-> [len(pages) * page_size, F], in position order."""
        index = torch.as_tensor(pages, device=self.data.device)
        return self.data.index_select(0, index).flatten(0, 1)
