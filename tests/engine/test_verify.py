"""`lorafleet.engine.verify` and the start-up self-check (`engine/selfcheck.py`): the served kernels
agree with the torch reference and with transformers/PEFT on a tiny model; a fast path made wrong
on purpose is a disagreement naming its kernels; an adapter that changes nothing and tensors its
file holds and nothing serves are said."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet import Engine
from lorafleet.config import KERNELS, EngineConfig
from lorafleet.engine.verify import compare_tokens, verify
from lorafleet.errors import ConfigError, SelfCheckError
from lorafleet.kernels import backend
from tests.engine.broken_kernels import break_fast_path
from tests.fixtures import build_adapter, build_model

FAST = dict(prompts=2, tokens=6, device="cpu")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("verify-base"), "llama")


@pytest.fixture(scope="module")
def lora(base, tmp_path_factory):
    return build_adapter(base, tmp_path_factory.mktemp("verify-lora"), r=4, lora_alpha=8, target_modules="all-linear")


def label() -> str:
    return backend.select(torch.device("cpu"), torch.float32).label


def test_the_served_kernels_agree_with_torch_and_with_transformers_and_peft(base, lora):
    pytest.importorskip("peft")
    report = verify(base, {"lora": lora}, **FAST)
    assert report["ok"] and not report["problems"] and not report["warnings"]
    assert report["kernels"] == label() and report["dtype"] == "float32" and report["prompts"] == 2
    assert [t["name"] for t in report["targets"]] == ["base", "lora"]
    for target in report["targets"]:
        for ref in ("torch", "transformers"):
            found = target[ref]
            assert found["ok"] and found["max_logit_diff"] <= found["tolerance"], (target["name"], ref, found)
            assert found["greedy"] == {"agree": 2, "prompts": 2, "near_ties": 0, "differ": []}
    adapter = report["targets"][1]
    assert adapter["effect"] > adapter["torch"]["tolerance"] and not adapter["changes_nothing"]
    assert adapter["tensors"]["used"] == adapter["tensors"]["in_file"] > 0 and adapter["tensors"]["unused"] == []


def test_a_broken_fast_path_is_a_disagreement_naming_its_kernels(base, monkeypatch):
    want = label()
    break_fast_path(monkeypatch)
    report = verify(base, transformers=False, **FAST)
    assert not report["ok"]
    found = report["targets"][0]["torch"]
    assert found["max_logit_diff"] > found["tolerance"] and not found["ok"]
    assert report["targets"][0]["transformers"] == {"skipped": "not asked for"}
    assert any(want in p and "prefill logits differ from the torch reference" in p for p in report["problems"])


def test_an_adapter_that_changes_nothing_is_said(base, tmp_path):
    zero = build_adapter(base, tmp_path / "zero", b_std=0.0, r=2, target_modules=["q_proj", "v_proj"])
    report = verify(base, {"zero": zero}, transformers=False, **FAST)
    target = report["targets"][1]
    assert target["changes_nothing"] and target["effect"] == 0.0
    assert report["ok"]  # a warning, not a disagreement: the kernels still agree
    assert any(w.startswith("zero: changes nothing") for w in report["warnings"])


def test_tensors_the_loader_reads_and_leaves_are_named_and_strangers_refused(base, tmp_path):
    saved = build_adapter(base, tmp_path / "saved", r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    weights = saved / "adapter_model.safetensors"
    tensors = load_file(weights)
    original = "base_model.model.lm_head.original_module.weight"  # PEFT writes it beside a resized vocabulary
    save_file({**tensors, original: tensors["base_model.model.lm_head.weight"].clone()}, weights)
    stranger = build_adapter(base, tmp_path / "stranger", r=2, target_modules=["q_proj"])
    extra = stranger / "adapter_model.safetensors"
    save_file({**load_file(extra), "optimizer.step": torch.zeros(1)}, extra)
    report = verify(base, {"saved": saved, "stranger": stranger}, transformers=False, **FAST)
    _, kept, refused = report["targets"]
    assert kept["tensors"] == {"in_file": len(tensors) + 1, "used": len(tensors), "unused": [original]}
    assert kept["ok"] and any(original in w for w in report["warnings"])
    assert "error" in refused and not refused["ok"] and not report["ok"]
    assert report["problems"] == [p for p in report["problems"] if p.startswith("stranger: refused")]


def test_greedy_tokens_that_part_on_a_near_tie_agree():
    gaps = {(0, 2): 1e-6, (1, 1): 0.5}
    found = compare_tokens([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 4], [4, 9, 6], [7]],
                           lambda p, step, token: gaps.get((p, step)), tol=1e-3)
    assert found == {"agree": 2, "prompts": 3, "near_ties": 1, "differ": [{"prompt": 1, "token": 1}]}


def test_the_self_check_passes_and_is_reported(base):
    engine = Engine(base, pool_bytes=4 << 20, self_check=True)
    found = engine.self_check
    assert found["kernels"] == engine.model.kernels.label and 0 <= found["max_abs_diff"] <= found["tolerance"]
    stats = engine.stats()
    assert stats["self_check"] == found and stats["kernels_label"] == engine.model.kernels.label
    assert Engine(base, pool_bytes=4 << 20).self_check is None  # off unless asked for (serve asks)


def test_the_self_check_refuses_a_broken_fast_path_and_is_skipped_on_the_reference(base, monkeypatch):
    want = label()
    break_fast_path(monkeypatch)
    with pytest.raises(SelfCheckError, match=f"the {want} kernels' logits differ from the torch reference"):
        Engine(base, pool_bytes=4 << 20, self_check=True)
    assert Engine(base, pool_bytes=4 << 20, self_check=True, kernels="torch").self_check == \
        {"kernels": "torch", "skipped": "the kernels are the torch reference"}


def test_the_kernels_option_is_the_backends_choices():
    assert KERNELS == backend.CHOICES  # config spells them without importing torch
    with pytest.raises(ConfigError, match="kernels must be one of"):
        EngineConfig(kernels="fast")


def test_an_alora_adapter_is_probed_with_its_invocation_and_agrees_with_peft(base, tmp_path):
    """The probes lack the sequence: each gets it at its end; fast path, torch and PEFT agree."""
    pytest.importorskip("peft")
    alora = build_adapter(base, tmp_path / "alora", r=4, lora_alpha=8, target_modules="all-linear", b_std=0.3,
                          alora_invocation_tokens=[7, 8, 9])
    report = verify(base, {"alora": alora}, **FAST)
    assert report["ok"] and not report["problems"], report["problems"]
    adapter = report["targets"][1]
    for ref in ("torch", "transformers"):
        assert adapter[ref]["greedy"]["agree"] == 2, adapter[ref]
    assert not adapter["changes_nothing"]
