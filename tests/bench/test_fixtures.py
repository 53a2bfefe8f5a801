"""The random adapters the benchmarks serve are real PEFT adapters, the same for the same seed."""

from __future__ import annotations

import pytest

from lorafleet.bench.adapters import build_adapters, warm_up_adapter, workload_adapters
from lorafleet.bench.workloads import WORKLOADS


def test_built_adapters_load_in_peft_with_their_ranks_and_a_non_zero_b(micro_dir):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    [(name, path), (_, path2)] = build_adapters(micro_dir, 2, ranks=(4, 8), targets=("q_proj", "down_proj"), seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(micro_dir)
    model = peft.PeftModel.from_pretrained(model, path, adapter_name=name)
    model.load_adapter(path2, adapter_name="second")
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    down = model.base_model.model.model.layers[1].mlp.down_proj
    assert q.lora_A[name].weight.shape[0] == 4 and q.lora_A["second"].weight.shape[0] == 8
    assert down.lora_B[name].weight.abs().sum() > 0
    assert not hasattr(model.base_model.model.model.layers[0].self_attn.k_proj, "lora_A")


def test_the_same_seed_gives_the_same_files_and_a_built_adapter_is_reused(micro_dir, monkeypatch):
    import shutil

    from lorafleet.bench import adapters

    [(_, folder)] = build_adapters(micro_dir, 1, ranks=(4,), targets=("v_proj",), seed=5)
    data = (folder / "adapter_model.safetensors").read_bytes()
    shutil.rmtree(folder)
    [(_, again)] = build_adapters(micro_dir, 1, ranks=(4,), targets=("v_proj",), seed=5)
    assert again == folder and (again / "adapter_model.safetensors").read_bytes() == data

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached adapter was rebuilt")
    monkeypatch.setattr(adapters, "write_adapter", no_rebuild)
    assert build_adapters(micro_dir, 1, ranks=(4,), targets=("v_proj",), seed=5) == [("lora-0000", folder)]


def test_a_workload_gets_one_adapter_per_name_its_requests_may_use(micro_dir):
    adapters = workload_adapters(micro_dir, WORKLOADS["quick"])
    assert [n for n, _ in adapters] == ["lora-0000", "lora-0001", "lora-0002", "lora-0003"]
    assert workload_adapters(micro_dir, WORKLOADS["base-only"]) == []


def test_the_warm_up_adapter_is_none_of_a_workloads(micro_dir):
    used = {p for name in WORKLOADS if WORKLOADS[name].num_adapters <= 8
            for _, p in workload_adapters(micro_dir, WORKLOADS[name])}
    path = warm_up_adapter(micro_dir)
    assert (path / "adapter_model.safetensors").is_file() and path not in used


def test_an_on_device_base_has_no_weight_files_and_the_same_seed_gives_the_same_weights(tmp_path):
    import json

    import torch

    from lorafleet.bench.fixtures import ON_DEVICE_ONLY, build_base
    from lorafleet.errors import ModelLoadError
    from lorafleet.model.loader import RANDOM_WEIGHTS, load_model

    folder = build_base("micro", tmp_path, on_device=True)
    assert not list(folder.glob("*.safetensors")) and (folder / RANDOM_WEIGHTS).is_file()
    a, b = load_model(folder), load_model(folder)
    assert a.w.keys() == b.w.keys() and all(torch.equal(a.w[k], b.w[k]) for k in a.w)
    assert torch.equal(a.w["norm"], torch.ones_like(a.w["norm"])) and a.w["layers.0.qkv"].std() > 0
    assert "8b" in ON_DEVICE_ONLY  # its fp32 files would be 32 GB
    (folder / RANDOM_WEIGHTS).write_text(json.dumps({"seed": "x"}))
    with pytest.raises(ModelLoadError, match="seed"):
        load_model(folder)


def test_the_8b_shape_is_refused_with_weight_files():
    from lorafleet.bench.fixtures import build_base
    from lorafleet.errors import ConfigError

    with pytest.raises(ConfigError, match="made on the device"):
        build_base("8b")
