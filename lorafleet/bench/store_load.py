"""`lorafleet bench store-load`: the CPU one adapter load costs, disk -> host -> pool pages, for an
adapter read from the store (validated, hashed and laid out at pull: `adapters.layout.read_saved`) against
the same files loaded as any folder is (read, validated, hashed: `load_adapter`). Rank 16 on
q/k/v/o by default, the issue's setting; CPU time of the loading thread (torch on one thread, so
that all the work is that thread's), median of the repeats, both in one run."""

from __future__ import annotations

import time

import torch

from lorafleet.bench.adapters import stored, write_adapter
from lorafleet.bench.fixtures import build_base
from lorafleet.adapters.adapter import BaseShapes
from lorafleet.config import EngineConfig
from lorafleet.memory import host_cache
from lorafleet.memory.kv import kv_page_elems
from lorafleet.memory.pool import PagePool
from lorafleet.memory.prefetch import copy_in
from lorafleet.model.config import ModelConfig

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGET_MS = 3.0


def run_store_load(shape: str = "smol", rank: int = 16, repeats: int = 20, root=None) -> dict:
    base_dir = build_base(shape, root)
    folder = base_dir.parent / f"{base_dir.name}-store-load"
    adapter_dir = folder / f"r{rank}"
    if not adapter_dir.is_dir():
        folder.mkdir(exist_ok=True)
        write_adapter(base_dir, adapter_dir, rank, targets=QKVO, seed=rank)
    name = f"store-load-r{rank}"
    _, in_store = stored(base_dir, [(name, adapter_dir)])
    path, digest = in_store[name]
    nbytes = (path / "adapter_model.safetensors").stat().st_size
    model = ModelConfig.from_folder(base_dir)
    shapes = BaseShapes.from_model_config(model)
    # the pages of an engine at the default block size: those the store laid the adapter out for
    page_elems = kv_page_elems(model.num_layers, EngineConfig().block_size, model.num_kv_heads, model.head_dim)
    pool = PagePool(2 * (-(-nbytes // 4 // page_elems)) + 2, page_elems, torch.float32, "cpu")

    def load(trusted: bool) -> float:
        t0 = time.thread_time()
        host = host_cache.build_host_adapter(path, shapes, page_elems, torch.float32, False,
                                             digest if trusted else None)
        copy_in(pool, host, list(range(-(-host.layout.paged_numel(4) // page_elems))))
        return time.thread_time() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times: dict[str, list[float]] = {"store": [], "folder": []}
        for i in range(repeats + 2):
            for kind in ("store", "folder") if i % 2 else ("folder", "store"):
                s = load(kind == "store")
                if i >= 2:  # two untimed rounds: page cache, allocator
                    times[kind].append(s)
    finally:
        torch.set_num_threads(threads)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return {"shape": shape, "rank": rank, "targets": list(QKVO), "bytes": nbytes, "repeats": repeats,
            "store_cpu_ms": med["store"], "folder_cpu_ms": med["folder"],
            "speedup": med["folder"] / med["store"], "target_ms": TARGET_MS, "target_met": med["store"] <= TARGET_MS}
