"""The unified page pool: ownership, predicate/action allocation, integrity."""

from __future__ import annotations

import pytest
import torch

from lorafleet.config import EngineConfig
from lorafleet.errors import ConfigError, PoolExhaustedError
from lorafleet.memory.pool import KV, PagePool, lora_dtype

pytestmark = pytest.mark.unit


def make_pool(n=32):
    return PagePool(n, 8, torch.float32, "cpu")


def test_kv_pages_come_from_the_low_end_and_adapters_as_a_high_run():
    pool = make_pool()
    kv = pool.allocate(4, KV)
    assert kv == [0, 1, 2, 3]
    a = pool.allocate(5, pool.new_owner("a"))
    assert a == list(range(27, 32))
    pool.check_integrity()
    assert pool.stats()["pages_by_adapter"] == {"a": 5}
    assert pool.stats()["kv_pages"] == 4 and pool.stats()["free_pages"] == 23


def test_adapter_runs_use_best_fit_holes():
    pool = make_pool(20)
    owners = [pool.new_owner(n) for n in "abcd"]
    a = pool.allocate(3, owners[0])     # 17..19
    b = pool.allocate(6, owners[1])     # 11..16
    c = pool.allocate(2, owners[2])     # 9..10
    pool.free(b)                        # hole of 6 at 11..16, big free run 0..8
    d = pool.allocate(5, owners[3])
    assert d == list(range(12, 17))     # the smaller hole that fits, not the big run
    pool.check_integrity()
    assert a == [17, 18, 19] and c == [9, 10]


def test_an_adapter_that_finds_no_free_run_gets_the_highest_free_pages_scattered():
    pool = make_pool(10)
    kv = pool.allocate(10, KV)
    pool.free(kv[::2])                  # 5 free pages, none adjacent
    pages = pool.allocate(4, pool.new_owner("x"))
    assert sorted(pages) == [2, 4, 6, 8]  # capacity is never lost to fragmentation, only contiguity
    assert pool.allocate(1, KV) == [0]
    pool.check_integrity()


def test_allocate_beyond_free_pages_raises_and_changes_nothing():
    pool = make_pool(8)
    pool.allocate(6, KV)
    assert not pool.can_allocate(3)
    with pytest.raises(PoolExhaustedError, match="3 pages requested, 2 free"):
        pool.allocate(3, KV)
    pool.check_integrity()
    assert pool.num_free == 2


def test_double_free_is_caught():
    pool = make_pool(8)
    pages = pool.allocate(2, KV)
    pool.free(pages)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(pages)


def test_integrity_check_detects_corrupt_counters():
    pool = make_pool(8)
    pool.allocate(2, KV)
    pool.num_free += 1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_the_tensor_is_never_reallocated():
    pool = make_pool(16)
    ptr = pool.tensor.data_ptr()
    for _ in range(5):
        pages = pool.allocate(7, pool.new_owner("a"))
        kv = pool.allocate(9, KV)
        pool.free(pages)
        pool.free(kv)
    assert pool.tensor.data_ptr() == ptr


def test_adapter_pages_come_from_the_high_end_scattered_when_no_run_is_free():
    pool = make_pool(12)
    a, b, c = (pool.new_owner(n) for n in "abc")
    assert pool.allocate(2, a) == [10, 11]
    assert pool.allocate(3, b) == [7, 8, 9]
    assert pool.allocate(2, KV) == [0, 1]
    pool.free([8, 10])
    assert pool.allocate(4, c) == [5, 6, 8, 10]   # the highest free pages, no run needed
    pool.check_integrity()


def test_page_runs_are_the_owner_table_in_page_order():
    pool = make_pool(20)
    a, b = pool.new_owner("a"), pool.new_owner("b")
    kv = pool.allocate(3, KV)                 # 0..2
    pa = pool.allocate(4, a)                  # a high run
    pb = pool.allocate(2, b)
    pool.free(kv[1:2])                        # a hole inside the KV run
    runs = pool.page_runs()
    assert sum(n for _, n in runs) == pool.num_pages
    expanded = [label for label, n in runs for _ in range(n)]
    for page in range(pool.num_pages):
        want = ("kv" if page in kv and page != kv[1] else "a" if page in pa else "b" if page in pb else "free")
        assert expanded[page] == want, page
    assert all(runs[i][0] != runs[i + 1][0] for i in range(len(runs) - 1)), "neighbouring runs must differ"


def test_adapters_held_in_16_bits_see_the_same_pages_as_twice_the_elements():
    pool = PagePool(4, 8, torch.float32, "cpu", torch.bfloat16)
    assert pool.adapter_dtype == torch.bfloat16 and pool.adapter_page_elems == 16
    assert pool.adapter_tensor.data_ptr() == pool.tensor.data_ptr() and pool.page_bytes == 32
    pool.adapter_tensor[2, :16] = 1.0  # one page in bf16 is exactly one page in fp32
    assert pool.tensor[2].ne(0).all() and pool.tensor[[0, 1, 3, 4]].eq(0).all()
    assert lora_dtype("auto", torch.bfloat16) == torch.bfloat16 and lora_dtype("fp16", torch.float32) == torch.float16
    for name, dtype in (("float16", torch.bfloat16), ("float32", torch.bfloat16), ("bfloat16", torch.float16)):
        with pytest.raises(ConfigError, match=f"lora_dtype={name}: adapters are held in the model's dtype"):
            lora_dtype(name, dtype)
    with pytest.raises(ValueError, match="cannot hold adapters"):
        PagePool(4, 8, torch.bfloat16, "cpu", torch.float32)
    with pytest.raises(ConfigError, match="lora_dtype must be one of"):
        EngineConfig(lora_dtype="int8")
