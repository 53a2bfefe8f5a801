"""The DoRA workloads (issue 53's figure): dora-mixed serves half its adapters as DoRA ones, whose
magnitudes are DoRA's init (so they change the model as the plain ones do), beside plain LoRA;
dora-plain the same requests on the same A and B, all plain."""

from __future__ import annotations

import dataclasses
import json

import pytest
from safetensors import safe_open

from lorafleet.bench.adapters import workload_adapters
from lorafleet.bench.systems import get_system
from lorafleet.bench.workloads import WORKLOADS, make_requests
from lorafleet.errors import ConfigError
from tests.bench.test_mix import job_for

MIXED, PLAIN = WORKLOADS["dora-mixed"], WORKLOADS["dora-plain"]


def test_half_the_adapters_of_dora_mixed_are_dora_with_the_plain_ones_a_and_b(micro_dir):
    mixed, plain = workload_adapters(micro_dir, MIXED), workload_adapters(micro_dir, PLAIN)
    assert [n for n, _ in mixed] == [n for n, _ in plain]
    for i, ((_, d), (_, p)) in enumerate(zip(mixed, plain)):
        assert json.loads((d / "adapter_config.json").read_text())["use_dora"] is (i % 2 == 0)
        with safe_open(d / "adapter_model.safetensors", "pt") as fd, safe_open(p / "adapter_model.safetensors",
                                                                              "pt") as fp:
            assert all(fd.get_tensor(k).equal(fp.get_tensor(k)) for k in fp.keys())  # the same A and B
            assert sum(k.endswith("lora_magnitude_vector") for k in fd.keys()) == (len(list(fp.keys())) // 2
                                                                                 if i % 2 == 0 else 0)
    assert make_requests(MIXED, 512) == make_requests(PLAIN, 512)


def test_the_dora_magnitudes_are_the_row_norms_so_each_scale_g_is_one(micro_dir):
    from lorafleet.engine.engine import Engine

    name, path = workload_adapters(micro_dir, MIXED)[0]
    engine = Engine(micro_dir, pool_bytes=8 << 20)
    engine.load_adapter(name, path)
    entry = engine.adapters.get(name)
    assert set(entry.posts.values()) == {"dora"}
    layout, buf = entry.host.layout, entry.host.buffer
    for m in layout.modules:
        g = buf[int(m.post_rows[0]):int(m.post_rows[0]) + m.n_out]
        assert (g - 1).abs().max().item() < 1e-5


def test_lorafleet_serves_dora_beside_plain_adapters(micro_dir):
    small = dataclasses.replace(MIXED, name="small-dora", num_requests=8, prompt_len=(4, 8), output_len=(3, 5))
    result = get_system("lorafleet")(threads=1).run(job_for(micro_dir, small))
    assert result.status == "ok", result.reason
    assert result.generated_tokens == sum(r.max_tokens for r in make_requests(small, 512))


def test_dora_is_not_drawn_into_mixes():
    with pytest.raises(ConfigError, match="dora_every"):
        dataclasses.replace(WORKLOADS["mix"], dora_every=2)
