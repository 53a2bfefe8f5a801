"""Sequence block tables over the KV pages of the unified pool.

A KV page holds K and V of `block_size` consecutive positions of one sequence for every layer:
the pool tensor viewed as [pages, layers, 2, block_size, kv_heads, head_dim]. A sequence of n
tokens owns ceil(n / block_size) pages, listed in order in its block table.

The block tables live in one int array, a row per sequence holding pages (`block_table`, kept
up to date as sequences grow and free), so the runner gathers a step's tables with one indexing
operation instead of converting a list per sequence per step. The array is host metadata: it
grows (rows or columns doubled) when needed; the pool itself never moves.
"""

from __future__ import annotations

import numpy as np

from lorafleet.memory.pool import KV, PagePool


def kv_page_elems(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim


class KVCacheManager:
    def __init__(self, pool: PagePool, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int):
        assert pool.page_elems == kv_page_elems(num_layers, block_size, num_kv_heads, head_dim)
        self.pool = pool
        self.block_size = block_size
        self.cache = pool.tensor.view(pool.num_pages + 1, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.rows: dict[str, int] = {}                        # request id -> its row
        self.block_table = np.zeros((16, 16), dtype=np.int64)  # [rows, blocks]: pages in position order
        self.num_blocks = np.zeros(16, dtype=np.int64)         # [rows]: pages each row holds
        self._free_rows = list(range(15, -1, -1))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_pages(self, request_id: str, num_tokens: int) -> int:
        """Pages still to allocate for the sequence to hold `num_tokens` positions."""
        row = self.rows.get(request_id)
        have = int(self.num_blocks[row]) if row is not None else 0
        return max(0, self.blocks_needed(num_tokens) - have)

    def grow(self, request_id: str, num_tokens: int) -> None:
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = self._new_row()
        extra = self.extra_pages(request_id, num_tokens)
        if extra:
            have = int(self.num_blocks[row])
            if have + extra > self.block_table.shape[1]:
                self._resize(cols=max(2 * self.block_table.shape[1], have + extra))
            self.block_table[row, have:have + extra] = self.pool.allocate(extra, KV)
            self.num_blocks[row] = have + extra

    def free(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self.pool.free(self.block_table[row, :self.num_blocks[row]])
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def table(self, request_id: str) -> np.ndarray:
        """The sequence's pages in position order (a view: valid until it grows or frees)."""
        row = self.rows[request_id]
        return self.block_table[row, :self.num_blocks[row]]

    def _new_row(self) -> int:
        if not self._free_rows:
            n = len(self.num_blocks)
            self._resize(rows=2 * n)
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _resize(self, rows: int | None = None, cols: int | None = None) -> None:
        r, c = self.block_table.shape
        table = np.zeros((rows or r, cols or c), dtype=np.int64)
        table[:r, :c] = self.block_table
        self.block_table = table
        if rows:
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(rows - r, dtype=np.int64)])

    def check_integrity(self) -> None:
        owned = [p for row in self.rows.values() for p in self.block_table[row, :self.num_blocks[row]].tolist()]
        assert len(owned) == len(set(owned)), "a KV page appears in two block tables"
        assert sorted(owned) == self.pool.pages_of(KV).tolist(), "KV pages and block tables disagree"
        used = set(self.rows.values())
        assert not used & set(self._free_rows), "a block-table row is both used and free"
        assert all(self.num_blocks[r] == 0 for r in self._free_rows), "a free row still holds pages"
