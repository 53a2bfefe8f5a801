"""Issue 62: a prompt or a chat template that would cost the daemon time or memory fails its own
request, fast, with a 400 naming the bound; other chats keep answering and the daemon still stops.

Prompts longer than the context could hold are refused before they are encoded; chat templates
render within a time and an output bound (`model/chat_template.py`), on render threads of their
own (`server/renders.py`)."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from lorafleet.errors import InvalidRequestError
from lorafleet.model import chat_template
from lorafleet.model.tokenizer import Tokenizer
from lorafleet.server import protocol
from tests.daemons import Daemon

FOUR_MB = "word " * 800_000
NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
AMPLIFY = "{% for i in range(100000) %}{{ messages[0].content * 40 }}{% endfor %}"


def chat(text: str = "hello", **extra) -> dict:
    return {"model": "base", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


@pytest.fixture
def tokenizer(chat_model_dir):
    return Tokenizer.from_pretrained(chat_model_dir)


def with_template(tokenizer: Tokenizer, source: str) -> Tokenizer:
    tokenizer._template = chat_template.compile_template(source, "test")
    return tokenizer


# -- bounds, without a daemon -------------------------------------------------------------------

def test_a_prompt_longer_than_the_context_can_hold_is_refused_unencoded(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, *a, **k: calls.append(a) or [1])
    gen = protocol.parse_completion({"model": "base", "prompt": FOUR_MB}, "base")
    with pytest.raises(InvalidRequestError) as e:
        protocol.tokenize(gen, tokenizer, 512)
    bound = tokenizer.max_text_bytes(512)
    assert f"{len(FOUR_MB):,} bytes" in str(e.value) and f"{bound:,} bytes" in str(e.value)
    assert calls == []
    protocol.tokenize(protocol.parse_completion({"model": "base", "prompt": "hi"}, "base"), tokenizer, 512)
    assert len(calls) == 1


def test_the_bound_covers_the_longest_token(tokenizer):
    assert tokenizer.max_token_bytes >= max(len(t.encode()) for t in tokenizer._backend.get_vocab())
    assert tokenizer.max_token_bytes >= 64


def test_a_template_amplifying_a_short_chat_is_refused_at_the_bound(tokenizer):
    gen = protocol.parse_chat(chat("x" * 100), "base")
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="more than this request's context can hold"):
        protocol.tokenize(gen, with_template(tokenizer, AMPLIFY), 512)
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("source, message", [
    ("{{ 'x' * 1000000000 }}", "repetition"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "concatenation"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "concatenation"),
    ("{{ 'x'|center(1000000000) }}", "passed 1,000,000,000"),
    ("{{ 'x'.ljust(1000000000) }}", "passed 1,000,000,000"),
    ("{{ 2 ** 100000000 }}", "power"),
])
def test_operations_that_would_allocate_past_the_bound_are_refused_before(tokenizer, source, message):
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match=message):
        with_template(tokenizer, source).apply_chat_template([{"role": "user", "content": "hi"}], max_chars=32768)
    assert time.monotonic() - start < 1


def test_a_template_that_loops_without_writing_is_stopped_at_the_deadline(tokenizer, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 0.3)
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="took over 0.3 s"):
        with_template(tokenizer, NESTED_RANGE).apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 2
    time.sleep(0.4)  # no late timeout lands on this thread once the render has ended
    assert tokenizer.encode("hi")


def test_real_templates_render_as_before(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = chat_template._jinja_env().from_string(tokenizer.chat_template).render(
        messages=messages, add_generation_prompt=True, **tokenizer._special, tools=None, documents=None)
    assert tokenizer.apply_chat_template(messages) == expected


# -- the daemon ---------------------------------------------------------------------------------

@pytest.fixture
def hostile_model(chat_model_dir, tmp_path):
    """The chat model, its template looping for good on a message "hang" and amplifying "amp"."""
    folder = tmp_path / "model"
    shutil.copytree(chat_model_dir, folder)
    original = Tokenizer.from_pretrained(chat_model_dir).chat_template
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0].content == 'hang' %}" + NESTED_RANGE +
        "{% elif messages[0].content == 'amp' %}" + AMPLIFY + "{% else %}" + original + "{% endif %}")
    return folder


@pytest.mark.heavy
def test_hostile_chats_fail_alone_and_the_daemon_still_answers_and_stops(hostile_model, tmp_path):
    daemon = Daemon.start(tmp_path / "d", "--served-model-name", "base", model=hostile_model)
    try:
        async def timed(http, body):
            start = time.monotonic()
            r = await http.post("/v1/chat/completions", json=body)
            return r, time.monotonic() - start

        async def run():
            async with daemon.async_http(timeout=60) as http:
                hostile = [asyncio.create_task(timed(http, chat("hang"))) for _ in range(8)]
                deadline = time.monotonic() + 30  # the eight admitted (their renders under way) before the others come
                while (await http.get("/v1/stats")).json()["server"]["pending"] < 8:
                    assert time.monotonic() < deadline, "the hung chats were not admitted"
                    await asyncio.sleep(0.005)
                normal = await asyncio.gather(*(timed(http, chat(f"hi {i}")) for i in range(10)))
                return await asyncio.gather(*hostile), normal

        hostile, normal = asyncio.run(run())
        for r, _ in hostile:
            assert r.status_code == 400 and "took over" in r.json()["error"]["message"], r.text
        # each hung render stops at RENDER_TIMEOUT_S of CPU; they share the cores at the lowest priority
        assert max(s for _, s in hostile) < 8 * chat_template.RENDER_TIMEOUT_S + 2
        assert [r.status_code for r, _ in normal] == [200] * 10
        # a chat behind them waits for none: a render past SLOW_CPU_S frees its slot
        assert max(s for _, s in normal) < 1, [round(s, 2) for _, s in normal]
        with daemon.http() as c:
            r = c.post("/v1/chat/completions", json=chat("amp"))
            assert r.status_code == 400 and "context can hold" in r.json()["error"]["message"], r.text
            start = time.monotonic()
            r = c.post("/v1/completions", json={"model": "base", "prompt": FOUR_MB, "max_tokens": 1})
            # longer than any tokenizer's text for the context: refused before the body is parsed
            assert r.status_code == 400 and "a string in the request body" in r.json()["error"]["message"], r.text
            assert time.monotonic() - start < 2
            r = c.post("/v1/chat/completions", json=chat(FOUR_MB[:1_000_000]))
            assert r.status_code == 400 and "context can hold" in r.json()["error"]["message"], r.text
        # a render still running when the daemon is told to stop does not hold it
        with daemon.http(timeout=1) as c:
            with pytest.raises(Exception):
                c.post("/v1/chat/completions", json=chat("hang"))
        daemon.signal()
        assert daemon.wait(30) is not None
    finally:
        daemon.kill()
