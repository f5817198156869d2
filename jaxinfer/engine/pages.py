"""The page allocator of the engine's paged KV cache: free list, reference counts, prefix cache.

Host-side bookkeeping only: the pools live on the device (jaxinfer/cache.py PagedKVCache), and
nothing here touches them, so allocating or freeing a page costs no device work.

Prefix caching (vLLM's scheme): a full page of tokens is keyed by a hash chain, hash(parent
page's key, the page's token ids, extras), so a key names the whole prefix up to and including
that page. A request whose pages fill registers them; another request whose prompt starts with
the same tokens finds them by walking its own keys, and shares the pages (reference count + 1)
instead of computing them again. A page nobody references stays cached in an LRU queue until
its memory is needed: allocation takes free pages first, then evicts the least recently used
cached ones. Page 0 is the null page and is never handed out.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence


class OutOfPages(Exception):
    """No free or evictable page is left (the scheduler preempts a request and retries)."""


def page_keys(tokens: Sequence[int], page_size: int, extra: bytes = b"",
              parent: bytes = b"") -> list[bytes]:
    """The hash-chain keys of the full pages of `tokens` (a partial last page has none).
    extra: what else changes the K/V (the model, dtypes, adapter): part of every key."""
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(parent + extra, digest_size=16)
        h.update(b",".join(str(int(t)).encode() for t in tokens[start:start + page_size]))
        parent = h.digest()
        keys.append(parent)
    return keys


class PagePool:
    """Pages 1..num_pages-1 of the device pools: who holds each, and which are cached."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is the null page), "
                             f"got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_pages  # per page: requests holding it
        self.free: collections.deque[int] = collections.deque(range(1, num_pages))
        self.key_of: dict[int, bytes] = {}  # cached page -> its key
        self.page_of: dict[bytes, int] = {}  # key -> cached page
        # Cached pages nobody holds, least recently used first (an ordered set).
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up

    @property
    def total(self) -> int:
        """Pages a request can get (the null page left out)."""
        return self.num_pages - 1

    @property
    def available(self) -> int:
        """Pages an allocation can take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def in_use(self) -> int:
        """Pages some request holds."""
        return self.total - self.available

    def allocate(self, n: int) -> list[int]:
        """n pages for one request (reference count 1), free ones first, then the least
        recently used cached ones (forgotten by the cache). All or nothing."""
        if n > self.available:
            raise OutOfPages(f"{n} pages wanted, {self.available} available")
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.evictable.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; a page nobody holds goes back to the free list,
        or, when cached, to the back of the LRU queue (most recently used)."""
        for page in pages:
            if page == 0:
                continue
            if self.refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than it was held")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `keys`, each now held once more."""
        if not self.prefix_caching:
            return []
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1
            pages.append(page)
        return pages

    def register(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Make full pages findable by their keys (the first len(keys) of `pages`, held by the
        caller). A key already cached on another page keeps that page."""
        if not self.prefix_caching:
            return
        for page, key in zip(pages, keys):
            if page in self.key_of or key in self.page_of:
                continue
            self.key_of[page] = key
            self.page_of[key] = page

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (those nobody holds become free)."""
        for page in list(self.evictable):
            self.free.append(page)
        self.evictable.clear()
        self.key_of.clear()
        self.page_of.clear()
