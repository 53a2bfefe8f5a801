"""llama.cpp as a bench system: the closed loop of the HTTP replay, the request bodies, the
conversion of a random model and a PEFT adapter to GGUF, and llama-server's greedy tokens against
lorafleet's, for the base and for an adapter, over the bench's replay path.

The conversions need llama.cpp's converters (fetched once from the llama-cpp-python sdist); the
end-to-end tests need llama-server, built once into the bench cache (minutes, the first time) or
named by LORAFLEET_LLAMA_SERVER. When either cannot be had, those tests skip with the reason,
unless LORAFLEET_REQUIRE_LLAMACPP=1, when it fails them."""

from __future__ import annotations

import asyncio
import os

import pytest

from lorafleet.bench import http_replay
from lorafleet.bench.adapters import workload_adapters
from lorafleet.bench.jobs import Job
from lorafleet.bench.llamacpp import LlamaCpp, request_body
from lorafleet.bench.llamacpp_build import LlamaCppUnavailable, server_binary
from lorafleet.bench.llamacpp_convert import convert_adapter, convert_model, stand_in_tokenizer
from lorafleet.bench.workloads import BenchRequest, Workload

pytestmark = pytest.mark.heavy  # builds llama-server

REQUIRE = os.environ.get("LORAFLEET_REQUIRE_LLAMACPP") == "1"
ONE_ADAPTER = Workload("one", 1, (4, 4), (4, 4), num_adapters=1, ranks=(8,))
EOS = 2  # the bench models' </s>


def need(get):
    """What `get` returns, or the test skipped (failed with LORAFLEET_REQUIRE_LLAMACPP=1) with the reason."""
    try:
        return get()
    except LlamaCppUnavailable as e:
        if REQUIRE:
            pytest.fail(f"llama.cpp is required (LORAFLEET_REQUIRE_LLAMACPP=1): {e}")
        pytest.skip(f"llama.cpp unavailable: {e}")


@pytest.fixture(scope="module")
def adapter_dir(micro_dir):
    [(_, path)] = workload_adapters(micro_dir, ONE_ADAPTER)
    return path


@pytest.fixture(scope="module")
def converted(micro_dir, adapter_dir):
    return need(lambda: (convert_model(micro_dir), convert_adapter(micro_dir, adapter_dir)))


@pytest.fixture(scope="module")
def server(converted):
    return need(server_binary)


@pytest.fixture(scope="module")
def parity_job(micro_dir, adapter_dir) -> Job:
    """Two prompts, each on the base and on the adapter, two in flight."""
    prompts = [[5, 17, 300, 42, 9, 77], [100, 101, 102, 3, 480]]
    requests = [BenchRequest(p, 8, adapter) for p in prompts for adapter in (None, "lora-0000")]
    return Job("llama.cpp", str(micro_dir), requests, {"lora-0000": str(adapter_dir)}, threads=1, concurrency=2)


# -- without llama.cpp -------------------------------------------------------------------------

def test_a_closed_loop_keeps_n_requests_in_flight_and_sends_each_when_one_finishes():
    requests = [BenchRequest([3], 1, arrival_s=5.0 * i) for i in range(7)]  # arrival times are not waited for
    sent, in_flight, peak = [], 0, 0

    async def send(req, http, sent_at):
        nonlocal in_flight, peak
        sent.append(req)
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01 * (1 + len(sent) % 3))
        in_flight -= 1
        return http_replay.figures(req, sent_at, sent_at + 0.001, sent_at + 0.002, 1)

    seconds, metrics = asyncio.run(asyncio.wait_for(http_replay.replay(None, requests, 3, send), timeout=30))
    assert peak == 3 and sent == requests and seconds < 5.0
    assert [m["arrival_s"] for m in metrics] == sorted(m["arrival_s"] for m in metrics)
    assert metrics[0]["arrival_s"] < 0.01 < metrics[-1]["arrival_s"]  # the last waited for a slot


def test_without_a_closed_loop_each_request_is_sent_at_its_arrival_time():
    requests = [BenchRequest([3], 1, arrival_s=0.05 * i) for i in range(3)]

    async def send(req, http, sent_at):
        return http_replay.figures(req, sent_at, sent_at, sent_at, 1)

    seconds, metrics = asyncio.run(asyncio.wait_for(http_replay.replay(None, requests, None, send), timeout=30))
    assert [m["arrival_s"] for m in metrics] == [0.0, 0.05, 0.1] and seconds >= 0.1


def test_a_request_names_every_adapter_with_its_scale_and_the_base_none_applied():
    base, on_one = request_body([5, 6], 3, None, [0, 1, 2]), request_body([5, 6], 3, 1, [0, 1, 2])
    assert base["lora"] == [{"id": i, "scale": 0.0} for i in range(3)]
    assert on_one["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
    assert request_body([5], 3, None, [])["lora"] == []  # nothing loaded: nothing to name
    assert base["prompt"] == [5, 6] and base["n_predict"] == 3 and base["ignore_eos"]
    assert base["temperature"] == 0.0 and base["top_k"] == 1 and not base["cache_prompt"]


def test_the_stand_in_tokenizer_has_one_token_per_id_of_the_model():
    from tokenizers import Tokenizer
    import json

    spec = stand_in_tokenizer(512)
    vocab = spec["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(512))
    assert [vocab[s] for s in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    assert Tokenizer.from_str(json.dumps(spec)).get_vocab_size() == 512


def test_a_system_without_a_closed_loop_skips_one():
    from lorafleet.bench.lorafleet_system import LorafleetInProcess

    result = LorafleetInProcess(threads=1).run(Job("lorafleet", "unused", [BenchRequest([3], 1)], concurrency=4))
    assert result.status == "skipped" and "closed loop of 4" in result.reason


# -- the converters ----------------------------------------------------------------------------

def test_the_model_and_a_peft_adapter_convert_to_f32_gguf_once(micro_dir, adapter_dir, converted):
    import gguf
    model, lora = converted
    reader = gguf.GGUFReader(model)
    fields = {name: f.contents() for name, f in reader.fields.items() if name.startswith(("general.", "llama."))}
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 512
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    adapter = gguf.GGUFReader(lora)
    assert adapter.fields["general.type"].contents() == "adapter"
    assert adapter.fields["adapter.type"].contents() == "lora"
    assert adapter.fields["adapter.lora.alpha"].contents() == 16  # PEFT's lora_alpha: llama.cpp scales by it / rank
    assert len(adapter.tensors) == 2 * 7 * 2  # A and B of every projection of both layers
    mtimes = model.stat().st_mtime_ns, lora.stat().st_mtime_ns
    assert (convert_model(micro_dir), convert_adapter(micro_dir, adapter_dir)) == converted  # cached by content
    assert (model.stat().st_mtime_ns, lora.stat().st_mtime_ns) == mtimes


# -- llama-server ------------------------------------------------------------------------------

def lorafleet_greedy(micro_dir, job: Job) -> list[list[int]]:
    from lorafleet import Engine, SamplingParams

    engine = Engine(str(micro_dir), device="cpu", dtype="float32")
    try:
        for name, path in job.adapters.items():
            engine.load_adapter(name, path)
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in job.requests]
        outs = engine.generate([r.prompt for r in job.requests], params, adapters=[r.adapter for r in job.requests])
        return [o.token_ids for o in outs]
    finally:
        engine.close()


def test_llama_server_answers_the_replay_with_lorafleets_greedy_tokens_on_the_base_and_an_adapter(
        micro_dir, server, parity_job):
    result = LlamaCpp(threads=1).run(parity_job)
    assert result.status == "ok", result.reason
    assert result.generated_tokens == sum(r.max_tokens for r in parity_job.requests)
    assert result.details["slots"] == 2 and result.details["warm_up"]["requests"] == 1
    ours = lorafleet_greedy(micro_dir, parity_job)
    for theirs, mine, req in zip([m["output_ids"] for m in result.requests], ours, parity_job.requests):
        # llama.cpp never samples </s> under ignore_eos; lorafleet does and goes on: equal up to it
        upto = mine.index(EOS) if EOS in mine else len(mine)
        assert upto >= 4, f"lorafleet's output {mine} ends too soon for a comparison"
        assert theirs[:upto] == mine[:upto], f"{req.adapter or 'base'} on {req.prompt}"
    outputs = [m["output_ids"] for m in result.requests]
    assert outputs[0] != outputs[1] and outputs[2] != outputs[3]  # the adapter changes what the base says


def test_an_empty_lora_list_is_not_the_base_on_this_server_so_the_base_names_every_adapter_at_zero(
        micro_dir, server, parity_job):
    system = LlamaCpp(threads=1)
    assert system.skip_reason(parity_job) is None
    try:
        system.prepare(parity_job)
        prompt = parity_job.requests[0].prompt

        def tokens(lora):
            body = {**request_body(prompt, 6, None, []), "lora": lora, "stream": False}
            return system.http.post("/completion", json=body).raise_for_status().json()["tokens"]
        base, adapter = tokens([{"id": 0, "scale": 0.0}]), tokens([{"id": 0, "scale": 1.0}])
        assert base != adapter
        assert tokens([]) == adapter  # the server's defaults: every adapter at 1.0
    finally:
        system.close()
