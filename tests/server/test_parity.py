"""The daemon is the engine behind HTTP: the same requests give the same tokens and text as
`lorafleet.Engine` in-process (greedy, and seeded sampling), whatever adapter they name."""

from __future__ import annotations

import pytest

from tests.daemons import POOL

REQUESTS = [  # (model, prompt, sampling)
    ("base", "hello world", dict(temperature=0.0)),
    ("attn-r3", "the quick brown fox", dict(temperature=0.0)),
    ("all-r8", [1, 7, 42, 99, 3], dict(temperature=0.0)),
    ("mlp-r24", "naïve café", dict(temperature=0.8, top_p=0.9, seed=7)),
    ("rslora-r16", "ça va?", dict(temperature=1.0, seed=11)),
    ("down-r1", [5, 6, 7], dict(temperature=1.3, top_k=20, seed=3)),
]


@pytest.fixture(scope="module")
def engine(chat_model_dir, adapter_dirs):
    from lorafleet import Engine

    eng = Engine(chat_model_dir, device="cpu", pool_bytes=64 << 20)
    for name, path in adapter_dirs.items():
        eng.load_adapter(name, path)
    yield eng
    if hasattr(eng, "close"):
        eng.close()


def expected(engine, prompt, sampling, model, max_tokens=10):
    from lorafleet import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0, **sampling)
    return engine.generate([prompt], params, adapters=[None if model == "base" else model])[0]


@pytest.mark.parametrize("model,prompt,sampling", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_completions_equal_the_engines(served, engine, model, prompt, sampling):
    want = expected(engine, prompt, sampling, model)
    with served.http() as c:
        got = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 10,
                                              "ignore_eos": True, "logprobs": 0, **sampling}).json()
    choice = got["choices"][0]
    assert choice["text"] == want.text
    tok_lps = choice["logprobs"]["token_logprobs"]
    assert tok_lps == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-4)


def test_chat_equals_the_engine_on_the_rendered_template(served, engine):
    messages = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello there"}]
    ids = engine.tokenizer.apply_chat_template(messages, tokenize=True)
    want = expected(engine, ids, dict(temperature=0.7, seed=5), "all-r8", max_tokens=12)
    with served.http() as c:
        got = c.post("/v1/chat/completions", json={"model": "all-r8", "messages": messages, "max_tokens": 12,
                                                   "temperature": 0.7, "seed": 5, "ignore_eos": True}).json()
    assert got["choices"][0]["message"]["content"] == want.text
    assert got["usage"]["prompt_tokens"] == len(ids)


def test_batched_prompts_answer_in_order(served, engine):
    prompts = ["one", "two two", [9, 8, 7]]
    with served.http() as c:
        got = c.post("/v1/completions", json={"model": "attn-r3", "prompt": prompts, "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True}).json()
    texts = [ch["text"] for ch in sorted(got["choices"], key=lambda ch: ch["index"])]
    assert texts == [expected(engine, p, dict(temperature=0.0), "attn-r3", 4).text for p in prompts]


def test_the_pool_size_matches(served, engine):
    """The comparison above is like for like: the daemon's pool is the engine's."""
    assert POOL == "64M"
    assert served.stats()["engine"]["pool"]["total_pages"] == engine.pool.num_pages


@pytest.fixture(scope="module")
def served_async(chat_model_dir, adapter_dirs, tmp_path_factory):
    """A daemon reading each step's tokens after launching the next (`--async-decode on`)."""
    from tests.daemons import chat_daemon

    with chat_daemon(tmp_path_factory.mktemp("d-async"), chat_model_dir, adapter_dirs, "--async-decode", "on") as d:
        yield d


def test_a_daemon_reading_steps_late_streams_the_engines_tokens(served_async, engine):
    """Every request of REQUESTS at once, streamed, from the async daemon: each one's text and
    logprobs are the in-process engine's (which reads each step at once)."""
    import asyncio

    from tests.daemons import sse_events

    async def one(http, model, prompt, sampling):
        body = {"model": model, "prompt": prompt, "max_tokens": 10, "ignore_eos": True, "logprobs": 0,
                "stream": True, **sampling}
        chunks = [e async for e in sse_events(http, "/v1/completions", body)]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        lps = [lp for c in chunks for lp in (c["choices"][0].get("logprobs") or {}).get("token_logprobs", [])]
        return text, lps

    async def all_at_once():
        async with served_async.async_http() as http:
            return await asyncio.gather(*(one(http, *r) for r in REQUESTS))

    for (model, prompt, sampling), (text, lps) in zip(REQUESTS, asyncio.run(all_at_once())):
        want = expected(engine, prompt, sampling, model)
        assert text == want.text, model
        assert lps == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-4)
