"""The OpenAI-compatible API as clients meet it: the official `openai` client and curl, over the
daemon's Unix socket."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from tests.daemons import Daemon


def test_openai_client_completes_text_and_token_prompts(served):
    client = served.openai()
    out = client.completions.create(model="base", prompt="hello world", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.model == "base"
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens >= 2
    by_ids = client.completions.create(model="all-r8", prompt=[1, 5, 9, 14], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 4 and by_ids.model == "all-r8"


def test_openai_client_streams_completions(served):
    client = served.openai()
    whole = client.completions.create(model="attn-r3", prompt="the quick brown", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="attn-r3", prompt="the quick brown", max_tokens=8,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_client_chats_and_streams_chat(served):
    client = served.openai()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="mlp-r24", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="mlp-r24", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 == whole.usage.completion_tokens


def test_seeded_sampling_repeats_and_logprobs_are_reported(served):
    client = served.openai()
    kw = dict(model="rslora-r16", prompt="hello", max_tokens=6, temperature=1.0, top_p=0.9, seed=1234,
              logprobs=2, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert all(len(top) >= 2 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """`lorafleet serve` with no MODEL: the bundled demo fleet, whose base answers "echo: TEXT" with
    TEXT, so a test knows what text is generated."""
    daemon = Daemon.start(tmp_path_factory.mktemp("echo"))
    yield daemon
    daemon.kill()


def test_stop_strings_cut_the_text_whole_and_streamed(echo):
    client = echo.openai()

    def ask(**kw):
        return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "echo: hello world"}],
                                              max_tokens=20, temperature=0, **kw)
    assert ask().choices[0].message.content == "hello world"  # holds the stop string below
    cut = ask(stop=["zzz", "o w"]).choices[0]
    assert (cut.message.content, cut.finish_reason) == ("hell", "stop")
    chunks = list(ask(stop=["o w"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hell"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_lists_the_base_and_adapters(served):
    ids = [m.id for m in served.openai().models.list().data]
    assert ids[0] == "base" and {"attn-r3", "all-r8", "mlp-r24", "rslora-r16", "down-r1"} <= set(ids)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_over_the_unix_socket(served):
    def curl(*args):
        out = subprocess.run(["curl", "-sS", "--unix-socket", str(served.socket), *args],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout
    assert json.loads(curl("http://lorafleet/health"))["status"] == "ok"
    body = json.dumps({"model": "down-r1", "prompt": "hi", "max_tokens": 3, "stream": True})
    events = curl("-H", "Content-Type: application/json", "-d", body, "http://lorafleet/v1/completions")
    lines = [line for line in events.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "text_completion"


def test_metrics_speak_vllms_names(served):
    with served.http() as c:
        text = c.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "lorafleet_pool_pages"):
        assert f"\n{name}{{" in text, name
    info = next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    capacity = served.stats()["engine"]["lora_capacity"]  # the pool at the median adapter size
    assert capacity["basis"] == "resident" and capacity["max_adapters"] > 256
    assert f'max_lora="{capacity["max_adapters"]}"' in info and 'running_lora_adapters=""' in info


def test_lora_requests_info_names_running_adapters(served):
    """While requests of an adapter run, its name is in running_lora_adapters."""
    import threading

    done = threading.Event()

    def long_request():
        with served.http() as c:
            c.post("/v1/completions", json={"model": "all-r8", "prompt": "hi", "max_tokens": 300,
                                            "ignore_eos": True})
        done.set()
    t = threading.Thread(target=long_request)
    t.start()
    seen, deadline = False, time.monotonic() + 60
    with served.http() as c:
        while not done.is_set() and not seen:
            assert time.monotonic() < deadline, "the 300-token request neither showed in /metrics nor ended in 60s"
            info = [line for line in c.get("/metrics").text.splitlines() if line.startswith("vllm:lora_requests_info{")]
            seen = any('running_lora_adapters="all-r8"' in line for line in info)
    t.join(60)
    assert seen


def test_a_lazily_registered_adapter_loads_on_first_use(served, adapter_dirs):
    with served.http() as c:
        reg = c.post("/v1/load_lora_adapter", json={"lora_name": "lazy-one", "lora_path": str(adapter_dirs["down-r1"]),
                                                    "lazy": True})
        assert reg.status_code == 200, reg.text
        out = c.post("/v1/completions", json={"model": "lazy-one", "prompt": "hi", "max_tokens": 3, "temperature": 0,
                                              "ignore_eos": True}).json()
        eager = c.post("/v1/completions", json={"model": "down-r1", "prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                "ignore_eos": True}).json()
        assert out["choices"][0]["text"] == eager["choices"][0]["text"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "lazy-one"}).status_code == 200


def test_usage_reports_the_prefix_caches_tokens_and_the_cache_resets(served):
    client = served.openai()
    prompt = [5 + (i * 7) % 200 for i in range(40)]  # token ids: two full blocks and a tail
    with served.http() as c:
        assert c.post("/reset_prefix_cache").raise_for_status().json()["object"] == "prefix_cache"

    def cached():
        out = client.completions.create(model="all-r8", prompt=prompt, max_tokens=2, temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() == 32  # the two full blocks the first request computed, under the same adapter
    with served.http() as c:
        metrics = c.get("/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 32
    with served.http() as c:
        assert c.post("/reset_prefix_cache").raise_for_status().json()["pages_freed"] >= 2
    assert cached() == 0
