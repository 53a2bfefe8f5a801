"""What a client or an adapter file can make expensive is bounded, and done off the engine thread
and the event loop (issue 48): every list a request carries has a cap, large bodies are decoded
on a worker, a lazy registration's checks run on a worker, min_p is honoured and chat's echo
refused; over TCP a connection that never finishes its headers is closed, and connections past
the cap are refused while Unix-socket clients keep being served."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading

import pytest

from lorafleet.demo import default_fleet
from lorafleet.server import protocol
from tests.daemons import Daemon, free_port
from tests.fixtures import demo_in_process


@pytest.fixture(scope="module")
def server():
    s = demo_in_process()
    yield s
    s.close()


def post(server, path: str, body) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, out = asyncio.run(server.call("POST", path, raw))
    return status, json.loads(out)


@pytest.mark.parametrize("field, value, words", [
    ("stop_token_ids", list(range(protocol.MAX_STOP_TOKEN_IDS + 1)), "at most 1024 ids"),
    ("stop", ["x"] * (protocol.MAX_STOP_STRINGS + 1), "at most 64 strings"),
])
def test_every_list_of_a_request_has_a_cap(server, field, value, words):
    status, body = post(server, "/v1/completions", {"prompt": "hi", field: value})
    assert status == 400 and body["error"]["param"] == field and words in body["error"]["message"]


def test_chat_messages_have_a_cap(server):
    messages = [{"role": "user", "content": "x"}] * (protocol.MAX_MESSAGES + 1)
    status, body = post(server, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and body["error"]["param"] == "messages" and "at most 4096" in body["error"]["message"]


def test_a_body_of_too_many_values_is_refused_before_it_is_parsed(server, monkeypatch):
    parsed = []
    real = json.loads
    monkeypatch.setattr(protocol.json, "loads", lambda raw, *a, **k: parsed.append(len(raw)) or real(raw, *a, **k))
    raw = json.dumps({"prompt": "hi", "junk": [1] * (protocol.MAX_JSON_ITEMS + 1)}).encode()
    status, body = post(server, "/v1/completions", raw)
    assert status == 400 and "262144 JSON values" in body["error"]["message"]
    assert not any(n == len(raw) for n in parsed)


def test_a_string_longer_than_any_context_text_is_refused_before_the_body_is_parsed(server, monkeypatch):
    parsed = []
    real = json.loads
    monkeypatch.setattr(protocol.json, "loads", lambda raw, *a, **k: parsed.append(len(raw)) or real(raw, *a, **k))
    bound = 256 * protocol.ANY_TOKEN_BYTES  # the demo base's context, 256 tokens
    raw = json.dumps({"model": "upper", "prompt": "word " * (protocol.ESCAPE_RATIO * bound // 5 + 1)}).encode()
    status, body = post(server, "/v1/completions", raw)
    assert status == 400 and f"holds at most {bound:,} bytes of text" in body["error"]["message"], body
    assert not any(n == len(raw) for n in parsed)


@pytest.mark.parametrize("value, longest", [
    ({"a": "x" * 100, "b": "yy"}, 100),
    ({"p": 'ab\\"c' * 50}, len(json.dumps('ab\\"c' * 50)) - 2),  # escaped quotes are inside the string
    ({"p": "q\\" * 30, "r": "z"}, 90),                         # a backslash run before the closing quote
    ({"ids": list(range(100_000))}, 3),                           # numbers are no string, however many
    ({"p": "é" * 10}, 60),                                        # as json.dumps escapes it: \u00e9
])
def test_the_longest_string_is_measured_without_parsing(value, longest):
    assert protocol._longest_string(json.dumps(value).encode()) == longest


def test_text_within_the_bound_passes_however_it_is_escaped():
    bound = 4096
    for text in ("é" * (bound // 2), "\n" * bound, "a" * bound):  # 2 bytes a character, 1, 1: `bound` bytes
        raw = json.dumps({"prompt": text}).encode()
        assert protocol.decode_body(raw, bound)["prompt"] == text
    with pytest.raises(Exception, match="bytes of text or more"):
        protocol.decode_body(json.dumps({"prompt": "a" * (protocol.ESCAPE_RATIO * bound + 1)}).encode(), bound)


def test_large_bodies_are_decoded_on_a_worker_thread_small_ones_inline(server, monkeypatch):
    threads = []
    real = protocol.decode_body

    def decode(raw, *args):
        threads.append(threading.current_thread().name)
        return real(raw, *args)
    monkeypatch.setattr("lorafleet.server.completions.decode_body", decode)
    small = {"model": "upper", "prompt": "hi", "max_tokens": 1}
    large = {**small, "junk": ["x" * 64] * 2000}  # ~140 KB, ignored
    assert post(server, "/v1/completions", small)[0] == 200
    assert post(server, "/v1/completions", large)[0] == 200
    loop_thread, worker = threads
    assert worker != loop_thread and len(json.dumps(large)) > protocol.DECODE_ON_WORKER


def test_min_p_is_honoured(server):
    """With min_p 1, only the most likely token survives: at any temperature the answer is the
    greedy one."""
    body = {"model": "upper", "prompt": "hello there", "max_tokens": 12, "ignore_eos": True}
    status, greedy = post(server, "/v1/completions", {**body, "temperature": 0})
    assert status == 200
    for seed in (1, 2):
        status, hot = post(server, "/v1/completions", {**body, "temperature": 5, "min_p": 1.0, "seed": seed})
        assert status == 200 and hot["choices"][0]["text"] == greedy["choices"][0]["text"]
    status, body = post(server, "/v1/completions", {"prompt": "hi", "min_p": 1.5})
    assert status == 400 and body["error"]["param"] == "min_p"


def test_echo_is_refused_on_chat_as_on_completions(server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}),
                       ("/v1/completions", {"prompt": "hi", "echo": True})):
        status, out = post(server, path, body)
        assert status == 400 and out["error"]["param"] == "echo"


def test_a_lazy_registration_checks_the_files_off_the_engine_thread(server, tmp_path, monkeypatch):
    from lorafleet.adapters import peft_config

    threads = []
    real = peft_config.Matcher.__call__

    def matching(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(peft_config.Matcher, "__call__", matching)
    folder = tmp_path / "regex"
    shutil.copytree(default_fleet().adapters["upper"], folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["target_modules"] = r".*\.(q_proj|v_proj)"
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "rx", "lora_path": str(folder), "lazy": True})
    assert status in (200, 400), body  # registered, or refused for its tensors: either way checked
    assert threads and "lorafleet-engine" not in threads
    cfg["target_modules"] = r"(.*?)*?.*?q.*?_.*?x"  # backtracks for seconds on one name
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "rx2", "lora_path": str(folder), "lazy": True})
    assert status == 400 and "takes too long" in body["error"]["message"]


# -- TCP: a header timeout and a connection cap ------------------------------------------------------


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory):
    port = free_port()
    daemon = Daemon.start(tmp_path_factory.mktemp("tcp"), "--host", "127.0.0.1", "--port", str(port),
                          "--api-key", "k", "--header-timeout", "1", "--max-tcp-connections", "4")
    daemon.port = port
    yield daemon
    daemon.kill()


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_that_never_finishes_its_headers_is_closed(tcp_daemon):
    half = socket.create_connection(("127.0.0.1", tcp_daemon.port))
    silent = socket.create_connection(("127.0.0.1", tcp_daemon.port))
    try:
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        assert closed_by_peer(half, within=15) and closed_by_peer(silent, within=15)
    finally:
        half.close()
        silent.close()
    with socket.create_connection(("127.0.0.1", tcp_daemon.port)) as ok:  # a whole request is answered
        ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert ok.recv(64).startswith(b"HTTP/1.1 200")


def test_tcp_connections_past_the_cap_are_closed_and_the_unix_socket_still_serves(tcp_daemon):
    held = [socket.create_connection(("127.0.0.1", tcp_daemon.port)) for _ in range(4)]
    try:
        for s in held:  # each answered, so counted open before the fifth comes (and kept past the header timeout)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(15)
            assert s.recv(64).startswith(b"HTTP/1.1 200")
        extra = socket.create_connection(("127.0.0.1", tcp_daemon.port))
        try:
            assert closed_by_peer(extra, within=5)
        finally:
            extra.close()
        with tcp_daemon.http() as c:
            assert c.get("/health").status_code == 200
    finally:
        for s in held:
            s.close()
    assert "refused: 4 open" in tcp_daemon.log()
