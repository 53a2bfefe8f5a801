"""The engine on the Triton kernels (interpreted on the CPU: tests/conftest.py sets
TRITON_INTERPRET=1 where there is no GPU) gives the greedy tokens of the torch reference path:
on every parity family, with a batch mixing adapters of different ranks, at the fixed decode
shapes CUDA graphs capture, and on the demo fleet, whose skills make a wrong adapter visible."""

from __future__ import annotations

import pytest

from lorafleet import Engine, SamplingParams
from tests.fixtures import ALL7, FAMILIES, assert_demo_fleet_matches_torch, build_adapter, build_model

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 3, [20, 21, 22], [30] * 17, [40, 41]]


def greedy(kernels: str, monkeypatch, folder, adapters=None, names=None, **options):
    monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
    engine = Engine(folder, pool_bytes=4 << 20, **options)
    assert engine.model.kernels.name == kernels
    for name, path in (adapters or {}).items():
        engine.load_adapter(name, path)
    outs = engine.generate(PROMPTS, GREEDY, adapters=names)
    return [o.token_ids for o in outs], engine


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_the_torch_paths_tokens(family, tmp_path, monkeypatch):
    folder = build_model(tmp_path, family)
    assert greedy("triton", monkeypatch, folder)[0] == greedy("torch", monkeypatch, folder)[0]


@pytest.mark.heavy  # an engine under the Triton interpreter, slow
def test_mixed_ranks_eager_and_at_fixed_decode_shapes(llama_dir, tmp_path, monkeypatch):
    adapters = {f"r{r}": build_adapter(llama_dir, tmp_path / f"r{r}", seed=r, r=r, lora_alpha=2 * r,
                                       target_modules=ALL7) for r in (3, 8)}
    names = ["r3", "r8", None, "r3"]
    want, _ = greedy("torch", monkeypatch, llama_dir, adapters, names)
    assert greedy("triton", monkeypatch, llama_dir, adapters, names)[0] == want
    got, engine = greedy("triton", monkeypatch, llama_dir, adapters, names, decode_graphs="fixed")
    assert got == want
    graphs = engine.stats()["decode_graphs"]
    assert graphs["replays"] >= GREEDY.max_tokens - 1 and graphs["recaptures"] == 0


@pytest.mark.heavy  # the demo fleet through the Triton interpreter
def test_the_demo_fleet_answers_through_the_triton_kernels(monkeypatch):
    """The base and three skills of different ranks and targets in one batch (10 tokens each:
    the interpreter is slow): token for token what the torch path answers."""
    assert_demo_fleet_matches_torch("triton", monkeypatch, skills=3, max_tokens=10)


@pytest.mark.heavy  # an engine under the Triton interpreter, slow
def test_an_alora_beside_plain_adapters_eager_and_at_fixed_decode_shapes(llama_dir, tmp_path, monkeypatch):
    """An aLoRA (on from the last [7, 8] of its prompt, rows before it in no segment) beside a
    plain adapter and the base: the torch path's tokens, eager and through the captured shapes."""
    adapters = {"a4": build_adapter(llama_dir, tmp_path / "a4", seed=4, b_std=0.3, r=4, lora_alpha=8,
                                    target_modules=ALL7, alora_invocation_tokens=[7, 8]),
                "r8": build_adapter(llama_dir, tmp_path / "r8", seed=8, r=8, lora_alpha=16, target_modules=ALL7)}
    names = ["a4", "r8", None, "r8"]
    want, engine = greedy("torch", monkeypatch, llama_dir, adapters, names)
    assert want[0] != greedy("torch", monkeypatch, llama_dir, {}, None)[0][0]  # the aLoRA changes its answer
    assert greedy("triton", monkeypatch, llama_dir, adapters, names)[0] == want
    got, engine = greedy("triton", monkeypatch, llama_dir, adapters, names, decode_graphs="fixed")
    assert got == want and engine.stats()["alora"]["requests"] == 1
