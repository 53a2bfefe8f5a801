"""Sequence block tables over the KV pages of the unified pool, and the prefix cache.

A KV page holds K and V of `block_size` consecutive positions of one sequence for every layer:
the pool tensor viewed as [pages, layers, 2, block_size, kv_heads, head_dim]. A sequence of n
tokens owns ceil(n / block_size) pages, listed in order in its block table.

The block tables live in one int array, a row per sequence holding pages (`block_table`, kept
up to date as sequences grow and free), so the runner gathers a step's tables with one indexing
operation instead of converting a list per sequence per step. The array is host metadata: it
grows (rows or columns doubled) when needed; the pool itself never moves.

Prefix cache (on unless `prefix_cache=False`). Every full block a sequence has computed is
named by a hash chain: block i's key is sha256(key of block i-1, or the sequence's KV salt for
block 0, then the block's token ids). The salt is what decides the KV beyond the tokens: the
adapter's content digest, or the base's salt for no adapter and for adapters that leave every
K and V as the base computes it (`AdapterEntry.kv_salt`). An activated LoRA's request
(`Request.activation`, `adapters/alora.py`) runs as the base before its activation: its blocks
wholly before it chain from the base's salt, so they are the base's blocks, and the block holding
the activation chains from that base key mixed with the adapter's salt and the activation's place
in the block (which of its rows the adapter computed). A request being admitted takes the
longest run of its prompt's leading blocks found under its chain (reference counts: a page may
sit in several block tables), and computes only the rest. Shared blocks are full and never
written again (a sequence writes positions past what it computed, and the run it takes stops
one token short of its end, so that token is computed and yields the first logits), so no
copy-on-write is needed. A hashed page no sequence holds any more is *cached*: owner `CACHED`
in the pool, kept here in least-recently-released order (within one release, deepest block
first: a chain's tail is useless without its head; blocks an admission has reused apart from
those none has), and given back when the residency's one eviction order picks it
(`memory/eviction.py`; its cost order takes never-reused blocks first: most are one request's
question and answer, while a reused one is a shared prefix). Only this module writes the
cache's state.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

import numpy as np

from lorafleet.kernels.reference import scale_bits
from lorafleet.memory.pool import CACHED, KV, PagePool
from lorafleet.snapshot import PrefixCacheStats

BASE_SALT = b"lorafleet-kv:base"
KV_PROJECTIONS = ("k_proj", "v_proj")


def kv_salt(targets: set[tuple[int, str]], digest: str, num_layers: int) -> bytes:
    """The salt of the KV an adapter computes: the base's when the adapter changes no K or V,
    else its content digest. K and V of layer l are projections of the residual stream entering
    layer l, which every module of every earlier layer writes to (q, k, v and o through the
    attention output, gate/up/down through the MLP's). So an adapter leaves all K and V as the
    base computes them only when it targets nothing in layers before the last, and neither
    k_proj nor v_proj in the last (q, o and the MLP of the last layer shape only the logits).
    An MLP-only or q/o-only adapter over all layers changes the K and V of every layer but the
    first: it never shares the base's blocks."""
    last = num_layers - 1  # an adapter's own embedding ((0, "embed_tokens")) changes every layer's input
    if all(layer == last and module not in (*KV_PROJECTIONS, "embed_tokens", "input_layernorm") for layer, module in targets):
        return BASE_SALT
    return b"lorafleet-kv:" + digest.encode()


def request_salt(loras, scales) -> bytes:
    """The salt of the KV a request computes: the base's without adapters; its adapter's salt on
    one adapter at scale 1 (a mix of one at scale 1 is that adapter); for a mix, a hash of each
    member's salt and scale (the fp32 its kernels read), in the order of the salts, the members
    that leave K and V as the base computes them left out. So a mix never shares the blocks of
    one of its adapters alone, nor of another scale, and shares the base's when none of its
    adapters changes K or V."""
    parts = sorted((e.kv_salt, s) for e, s in zip(loras, scales) if e.kv_salt != BASE_SALT)
    if not parts:
        return BASE_SALT
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][0]
    h = hashlib.sha256(b"lorafleet-kv:mix")
    for salt, scale in parts:
        h.update(salt + scale_bits(scale).to_bytes(4, "little"))
    return b"lorafleet-kv:" + h.hexdigest().encode()


def kv_page_elems(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim


class KVCacheManager:
    def __init__(self, pool: PagePool, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 prefix_cache: bool = True):
        assert pool.page_elems == kv_page_elems(num_layers, block_size, num_kv_heads, head_dim)
        self.pool = pool
        self.block_size = block_size
        self.cache = pool.tensor.view(pool.num_pages + 1, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.rows: dict[str, int] = {}                        # request id -> its row
        self.block_table = np.zeros((16, 16), dtype=np.int64)  # [rows, blocks]: pages in position order
        self.num_blocks = np.zeros(16, dtype=np.int64)         # [rows]: pages each row holds
        self._free_rows = list(range(15, -1, -1))
        # the prefix cache
        self.prefix_cache = prefix_cache
        self.refs = np.zeros(pool.num_pages, dtype=np.int64)   # page -> block tables holding it
        self.page_hash: dict[int, bytes] = {}                  # hashed page -> its key
        self.by_hash: dict[bytes, int] = {}                    # key -> the page holding that block
        # evictable pages -> when released, LRU first: blocks no admission has reused yet, and
        # blocks reused at least once (a system prompt, not one request's question)
        self.cold: OrderedDict[int, float] = OrderedDict()
        self.hot: OrderedDict[int, float] = OrderedDict()
        self.reused: set[int] = set()                          # named pages an admission has taken
        self.num_hashed = np.zeros(16, dtype=np.int64)         # [rows]: leading blocks looked at for hashing
        self.chains: dict[str, list[bytes]] = {}               # request id -> keys of its full blocks so far
        self.query_tokens = 0                                  # prompt tokens looked up at admission
        self.hit_tokens = 0                                    # of which found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_pages(self, request_id: str, num_tokens: int) -> int:
        """Pages still to allocate for the sequence to hold `num_tokens` positions."""
        row = self.rows.get(request_id)
        have = int(self.num_blocks[row]) if row is not None else 0
        return max(0, self.blocks_needed(num_tokens) - have)

    def capacity(self, request_id: str) -> int:
        """Positions the sequence's pages hold now (0 without any)."""
        row = self.rows.get(request_id)
        return 0 if row is None else int(self.num_blocks[row]) * self.block_size

    def grow(self, request_id: str, num_tokens: int) -> None:
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = self._new_row()
        extra = self.extra_pages(request_id, num_tokens)
        if extra:
            have = int(self.num_blocks[row])
            self._fit(have + extra)
            pages = self.pool.allocate(extra, KV)
            self.block_table[row, have:have + extra] = pages
            self.refs[pages] = 1
            self.num_blocks[row] = have + extra

    def free(self, request_id: str) -> None:
        """The sequence lets go of its pages: a page no other sequence holds is freed, or cached
        when it holds a hashed block."""
        row = self.rows.pop(request_id, None)
        self.chains.pop(request_id, None)
        if row is None:
            return
        pages = self.block_table[row, :self.num_blocks[row]]
        self.refs[pages] -= 1
        idle = pages[self.refs[pages] == 0][::-1].tolist()  # deepest first: evicted first
        to_cache = [p for p in idle if p in self.page_hash]
        if to_cache:
            now = time.monotonic()
            for p in to_cache:
                (self.hot if p in self.reused else self.cold)[p] = now
            self.pool.retag(to_cache, CACHED)
        if len(to_cache) < len(idle):
            self.pool.free([p for p in idle if p not in self.page_hash])
        self.num_blocks[row] = 0
        self.num_hashed[row] = 0
        self._free_rows.append(row)

    def table(self, request_id: str) -> np.ndarray:
        """The sequence's pages in position order (a view: valid until it grows or frees)."""
        row = self.rows[request_id]
        return self.block_table[row, :self.num_blocks[row]]

    # -- the prefix cache --------------------------------------------------------------
    def _chain(self, req, blocks: int) -> list[bytes]:
        """`req`'s block keys, extended to its first `blocks` blocks (all tokens known)."""
        chain = self.chains.setdefault(req.request_id, [])
        bs = self.block_size
        if len(chain) < blocks:
            first = len(chain)
            tokens = np.asarray(req.token_at(first * bs, blocks * bs), dtype=np.int64)
            salt = request_salt(req.loras, req.scales)
            act = req.activation if salt != BASE_SALT else None  # an aLoRA's (module doc)
            prev = chain[-1] if chain else salt if act is None else BASE_SALT
            for i in range(first, blocks):
                if act is not None and i == act // bs:  # its adapter takes over in this block
                    at = (act % bs).to_bytes(8, "little")
                    prev = hashlib.sha256(b"lorafleet-kv:alora" + salt + at + prev).digest()
                prev = hashlib.sha256(prev + tokens[(i - first) * bs:(i - first + 1) * bs].tobytes()).digest()
                chain.append(prev)
        return chain

    def adopt_prefix(self, req) -> int:
        """At admission (nothing computed, no pages): take the cached pages of the longest run
        of `req`'s leading blocks, stopping one token short of its end. Returns the tokens they
        hold (0 when none, or with the cache off)."""
        if not self.prefix_cache:
            return 0
        assert req.request_id not in self.rows and req.num_computed == 0
        limit = (req.num_tokens - 1) // self.block_size
        self.query_tokens += req.num_tokens
        pages: list[int] = []
        for key in self._chain(req, limit)[:limit]:
            page = self.by_hash.get(key)
            if page is None:
                break
            pages.append(page)
        if not pages:
            return 0
        row = self.rows[req.request_id] = self._new_row()
        self._fit(len(pages))
        self.block_table[row, :len(pages)] = pages
        self.num_blocks[row] = self.num_hashed[row] = len(pages)
        waking = [p for p in pages if self.refs[p] == 0]
        for p in waking:
            if self.cold.pop(p, None) is None:
                del self.hot[p]
        self.pool.retag(waking, KV)
        self.reused.update(pages)
        self.refs[pages] += 1
        self.hit_tokens += len(pages) * self.block_size
        return len(pages) * self.block_size

    def unadopt(self, req, tokens: int) -> None:
        """Admission failed after `adopt_prefix` gave `req` `tokens` cached tokens: they go back."""
        if not self.prefix_cache:
            return
        chain = self.chains.get(req.request_id)
        self.free(req.request_id)
        if chain is not None:  # kept for its next try
            self.chains[req.request_id] = chain
        self.query_tokens -= req.num_tokens
        self.hit_tokens -= tokens

    def commit(self, req) -> None:
        """After a step: the full blocks `req` has computed are named, so later requests can
        find them (a block whose key another page already holds stays unnamed)."""
        if not self.prefix_cache:
            return
        row = self.rows.get(req.request_id)
        if row is None:
            return
        full = req.num_computed // self.block_size
        start = int(self.num_hashed[row])
        if full <= start:
            return
        chain = self._chain(req, full)
        for i in range(start, full):
            page = int(self.block_table[row, i])
            if chain[i] not in self.by_hash and page not in self.page_hash:
                self.by_hash[chain[i]] = page
                self.page_hash[page] = chain[i]
        self.num_hashed[row] = full

    @property
    def cached(self) -> dict[int, float]:
        """Every cached page -> when it was released (checks, stats, tests: not the hot path)."""
        return {**self.cold, **self.hot}

    def _victims(self, reuse_aware: bool) -> OrderedDict[int, float]:
        """Where the next page to evict comes from: never-reused blocks first when
        `reuse_aware`, else whichever list holds the least recently released page."""
        if not self.hot or (reuse_aware and self.cold):
            return self.cold
        if not self.cold:
            return self.hot
        return self.cold if next(iter(self.cold.values())) <= next(iter(self.hot.values())) else self.hot

    def oldest_cached(self, reuse_aware: bool = False) -> float | None:
        """When the next cached page to evict was released (None: nothing cached)."""
        return next(iter(self._victims(reuse_aware).values()), None)

    def evict_cached(self, reuse_aware: bool = False) -> None:
        """Give the next cached page back to the pool: least recently released (deepest first
        within a release), never-reused blocks before reused ones when `reuse_aware`."""
        page, _ = self._victims(reuse_aware).popitem(last=False)
        del self.by_hash[self.page_hash.pop(page)]
        self.reused.discard(page)
        self.pool.free([page])

    def reset(self) -> int:
        """Forget every named block: cached pages go back to the pool, held ones stay with their
        sequences unnamed. Returns the pages freed."""
        freed = list(self.cached)
        self.cold.clear()
        self.hot.clear()
        self.reused.clear()
        self.page_hash.clear()
        self.by_hash.clear()
        self.pool.free(freed)
        for rid, row in self.rows.items():  # held blocks are not named again either
            self.num_hashed[row] = self.num_blocks[row]
        return len(freed)

    def stats(self) -> PrefixCacheStats:
        return {"enabled": self.prefix_cache, "cached_pages": len(self.cold) + len(self.hot),
                "reused_cached_pages": len(self.hot),
                "hashed_pages": len(self.page_hash), "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens,
                "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0}

    # -- rows --------------------------------------------------------------------------
    def _new_row(self) -> int:
        if not self._free_rows:
            n = len(self.num_blocks)
            self._resize(rows=2 * n)
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _fit(self, blocks: int) -> None:
        if blocks > self.block_table.shape[1]:
            self._resize(cols=max(2 * self.block_table.shape[1], blocks))

    def _resize(self, rows: int | None = None, cols: int | None = None) -> None:
        r, c = self.block_table.shape
        table = np.zeros((rows or r, cols or c), dtype=np.int64)
        table[:r, :c] = self.block_table
        self.block_table = table
        if rows:
            grow = np.zeros(rows - r, dtype=np.int64)
            self.num_blocks = np.concatenate([self.num_blocks, grow])
            self.num_hashed = np.concatenate([self.num_hashed, grow])

    def check_integrity(self) -> None:
        held = np.zeros(self.pool.num_pages, dtype=np.int64)
        for row in self.rows.values():
            pages = self.block_table[row, :self.num_blocks[row]]
            assert len(np.unique(pages)) == len(pages), "a page appears twice in one block table"
            held[pages] += 1
        assert (held == self.refs).all(), "page reference counts disagree with the block tables"
        assert sorted(np.flatnonzero(held).tolist()) == self.pool.pages_of(KV).tolist(), \
            "KV pages and block tables disagree"
        cached = self.cached
        assert sorted(cached) == self.pool.pages_of(CACHED).tolist(), "cached pages and the pool disagree"
        assert all(p in self.page_hash for p in cached), "a cached page holds no named block"
        assert {p: h for h, p in self.by_hash.items()} == self.page_hash, "the hash maps disagree"
        assert all(held[p] or p in cached for p in self.page_hash), "a named page is neither held nor cached"
        assert not self.cold.keys() & self.hot.keys(), "a cached page in both lists"
        assert set(self.hot) <= self.reused <= set(self.page_hash), "reuse marks on pages that are not named"
        assert self.prefix_cache or not self.page_hash, "blocks named with the prefix cache off"
        used = set(self.rows.values())
        assert not used & set(self._free_rows), "a block-table row is both used and free"
        assert all(self.num_blocks[r] == 0 for r in self._free_rows), "a free row still holds pages"
