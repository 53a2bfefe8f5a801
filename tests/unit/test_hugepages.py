"""Host tensors on huge pages (`hugepages`): the model's weights and the page pool live in
mappings advised MADV_HUGEPAGE, with the same values; LORAFLEET_HUGE_PAGES=0 turns it off."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from lorafleet import hugepages
from lorafleet.memory.pool import PagePool
from lorafleet.model.loader import load_model
from tests.fixtures import build_model

MB = 1 << 20


def advised(t: torch.Tensor) -> bool:
    """Whether t's memory lies in a mapping advised onto huge pages ('hg' in its VmFlags)."""
    addr, mapping = t.data_ptr(), None
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            mapping = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif mapping and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.unit
def test_this_host_asks_for_huge_pages():
    # every test below would pass on plain allocations too: this one says they are not plain here
    assert sys.platform.startswith("linux") and hugepages.enabled()


@pytest.mark.unit
def test_place_moves_every_tensor_into_one_advised_buffer_keeping_values_and_ties():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(1024, 768, generator=g)  # 3 MiB: the buffer passes one huge page
    w = {"embed": embed, "lm_head": embed, "qkv": torch.randn(96, 64, generator=g),
         "norm": torch.randn(64, generator=g), "bf": torch.randn(5, 7, generator=g).bfloat16(),
         "strided": torch.randn(64, 32, generator=g).t()}
    before = {n: t.clone() for n, t in w.items()}
    hugepages.place(w)
    for n, t in w.items():
        assert torch.equal(t, before[n]) and t.dtype == before[n].dtype and t.is_contiguous(), n
        assert t.data_ptr() % hugepages.ALIGN == 0, n
    assert w["lm_head"].data_ptr() == w["embed"].data_ptr()  # still tied: one copy, not two
    assert w["embed"].data_ptr() != embed.data_ptr()
    storages = {t.untyped_storage().data_ptr() for t in w.values()}
    assert len(storages) == 1
    assert all(advised(t) for t in w.values())


@pytest.mark.unit
def test_zeros_and_empty_are_advised_tensors_and_the_switch_turns_them_off(monkeypatch):
    t = hugepages.zeros(3, MB, dtype=torch.float32)
    assert t.shape == (3, MB) and t.dtype == torch.float32 and not t.any() and advised(t)
    e = hugepages.empty(2, MB, dtype=torch.bfloat16)
    assert e.shape == (2, MB) and e.dtype == torch.bfloat16 and advised(e)
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.enabled()
    plain = hugepages.zeros(3, MB, dtype=torch.float32)
    assert not plain.any() and not advised(plain)
    small = hugepages.zeros(4, 5, dtype=torch.bfloat16)  # under one huge page: plain either way
    assert small.shape == (4, 5) and small.dtype == torch.bfloat16 and not small.any()


def test_a_cpu_models_weights_and_the_pool_are_on_huge_pages(tmp_path):
    folder = build_model(tmp_path / "m", vocab_size=8192, tie_word_embeddings=True)  # 2 MiB embedding
    model = load_model(folder)
    w = model.w
    assert len({t.untyped_storage().data_ptr() for t in w.values()}) == 1
    assert w["lm_head"].data_ptr() == w["embed"].data_ptr()
    assert all(advised(t) for t in w.values())
    pool = PagePool(64, 16 * 1024, torch.float32, "cpu")  # 4 MiB
    assert advised(pool.tensor) and not pool.tensor.any()


@pytest.mark.parametrize("env", ["1", "0"])
def test_the_model_loads_the_same_weights_either_way(tmp_path, monkeypatch, env):
    folder = build_model(tmp_path / "m", vocab_size=8192)
    monkeypatch.setenv(hugepages.ENV, "0")
    plain = load_model(folder)
    monkeypatch.setenv(hugepages.ENV, env)
    model = load_model(folder)
    assert advised(model.w["embed"]) == (env == "1") and not advised(plain.w["embed"])
    for n, t in plain.w.items():
        assert torch.equal(model.w[n], t), n
