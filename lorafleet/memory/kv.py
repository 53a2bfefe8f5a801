"""Sequence block tables over the KV pages of the unified pool.

A KV page holds K and V of `block_size` consecutive positions of one sequence for every layer:
the pool tensor viewed as [pages, layers, 2, block_size, kv_heads, head_dim]. A sequence of n
tokens owns ceil(n / block_size) pages, listed in order in its block table.
"""

from __future__ import annotations

import torch

from lorafleet.memory.pool import KV, PagePool


def kv_page_elems(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim


class KVCacheManager:
    def __init__(self, pool: PagePool, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int):
        assert pool.page_elems == kv_page_elems(num_layers, block_size, num_kv_heads, head_dim)
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}  # request id -> pages in position order
        self.cache = pool.tensor.view(pool.num_pages, num_layers, 2, block_size, num_kv_heads, head_dim)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_pages(self, request_id: str, num_tokens: int) -> int:
        """Pages still to allocate for the sequence to hold `num_tokens` positions."""
        return max(0, self.blocks_needed(num_tokens) - len(self.tables.get(request_id, ())))

    def can_grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        return self.pool.can_allocate(self.extra_pages(request_id, num_tokens) + reserve)

    def grow(self, request_id: str, num_tokens: int) -> None:
        table = self.tables.setdefault(request_id, [])
        table.extend(self.pool.allocate(self.extra_pages(request_id, num_tokens), KV))

    def free(self, request_id: str) -> None:
        self.pool.free(self.tables.pop(request_id, []))

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    def block_table_tensor(self, request_id: str, device) -> torch.Tensor:
        return torch.tensor(self.tables[request_id], dtype=torch.long, device=device)

    def check_integrity(self) -> None:
        owned = [p for t in self.tables.values() for p in t]
        assert len(owned) == len(set(owned)), "a KV page appears in two block tables"
        assert sorted(owned) == self.pool.pages_of(KV).tolist(), "KV pages and block tables disagree"
