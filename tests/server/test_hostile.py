"""Hostile input against the real daemon on the demo fleet: a request can fail only itself.

Each hostile request is sent while 10 greedy streams of other clients run on another adapter;
the 10 must finish with the answers they get alone, whatever the hostile one gets (an answer,
or a 4xx naming the problem). Malformed requests answer 4xx and leave their keep-alive
connection usable; a huge body is refused (413) before it is read, while /health stays fast;
an eager load of a 200 MB adapter does not stall running streams.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import socket
import statistics
import threading
import time

import pytest

from lorafleet.bench import machine
from lorafleet.bench.adapters import write_adapter
from lorafleet.demo import default_fleet
from lorafleet.demo.skills import held_out_texts
from tests.daemons import Daemon, sse_events

MAX_PENDING = 1024
STREAM = {"model": "reverse", "max_tokens": 48, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    daemon = Daemon.start(tmp_path_factory.mktemp("hostile"), env={"LORAFLEET_DEBUG_CHECKS": "1"})
    yield daemon
    daemon.kill()


@pytest.fixture(scope="module")
def big_adapter(tmp_path_factory):
    """A 200 MB PEFT adapter for the demo base (rank 3,866 on all seven projections)."""
    return write_adapter(default_fleet().model, tmp_path_factory.mktemp("big") / "big", rank=3866)


# -- 10 streams beside each hostile request -------------------------------------------------------

def stream_bodies():
    return [{**STREAM, "prompt": text} for text in held_out_texts(10)]


@pytest.fixture(scope="module")
def solo_answers(demo):
    with demo.http() as c:
        return [c.post("/v1/completions", json=b).raise_for_status().json()["choices"][0]["text"]
                for b in stream_bodies()]


async def read_stream(http, body) -> tuple[str, str | None, list[float]]:
    """Text, finish_reason and arrival times of one streamed completion."""
    text, reason, times = [], None, []
    async for event in sse_events(http, "/v1/completions", body):
        times.append(time.monotonic())
        text.append(event["choices"][0]["text"])
        reason = event["choices"][0]["finish_reason"] or reason
    return "".join(text), reason, times


async def start_streams(http, bodies, running: int | None = None, within_s: float = 60) -> list:
    """A stream for each body; their tasks, once the engine runs `running` of them (all)."""
    streams = [asyncio.create_task(read_stream(http, b)) for b in bodies]
    deadline = time.monotonic() + within_s
    while demo_running(await http.get("/v1/stats")) < (running or len(bodies)):
        assert time.monotonic() < deadline, "the streams did not start"
        await asyncio.sleep(0.002)
    return streams


def beside_ten_streams(demo, send_hostile):
    """Run 10 streams; once they all produce tokens, `send_hostile(http)`; return both."""
    async def run():
        async with demo.async_http(timeout=120.0) as http:
            started = await start_streams(http, stream_bodies(), running=10)
            hostile = await send_hostile(http)
            return await asyncio.gather(*started), hostile
    return asyncio.run(run())


def demo_running(r) -> int:
    return r.json()["engine"]["num_running"]


def raw_post(path, raw: bytes):
    async def send(http):
        return await http.post(path, content=raw, headers={"Content-Type": "application/json"})
    return send


def json_post(path, body):
    async def send(http):
        return await http.post(path, json=body)
    return send


NESTED = b'{"model": "upper", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = {
    "temperature 1e-300": (json_post("/v1/completions", {"model": "upper", "prompt": "hi", "max_tokens": 5,
                                                          "temperature": 1e-300}), 200, None),
    "temperature 5e-324": (json_post("/v1/completions", {"model": "upper", "prompt": "hi", "max_tokens": 5,
                                                          "temperature": 5e-324}), 200, None),
    "temperature 1e-38, chat": (json_post("/v1/chat/completions", {
        "model": "upper", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "temperature": 1e-38}), 200, None),
    "lone surrogate in the prompt": (raw_post("/v1/completions", b'{"model": "upper", "prompt": "\\ud800"}'),
                                     400, "surrogate"),
    "lone surrogate in chat content": (raw_post("/v1/chat/completions",
                                                b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}'),
                                       400, "surrogate"),
    "lone surrogate in a role": (raw_post("/v1/chat/completions",
                                          b'{"messages": [{"role": "\\ud800", "content": "x"}]}'), 400, "surrogate"),
    "lone surrogate in lora_path": (raw_post("/v1/load_lora_adapter",
                                             b'{"lora_name": "x", "lora_path": "/tmp/\\ud800"}'), 400, "surrogate"),
    "nested 100k levels": (raw_post("/v1/completions", NESTED), 400, "nests deeper"),
    "2,000 prompts": (json_post("/v1/completions", {"model": "upper", "prompt": ["hi"] * 2000, "max_tokens": 1}),
                      400, f"at most {MAX_PENDING}"),
    "65 stop strings": (json_post("/v1/completions", {"prompt": "hi", "stop": ["x"] * 65}), 400, "stop"),
    "logprobs 20 over a 261-token vocabulary": (json_post("/v1/completions", {
        "model": "upper", "prompt": "hi", "max_tokens": 3, "logprobs": 20, "temperature": 1}), 200, None),
    "the largest seed": (json_post("/v1/completions", {"model": "upper", "prompt": "hi", "max_tokens": 3,
                                                        "seed": 2**63 - 1, "temperature": 1}), 200, None),
    "top_k 1e9": (json_post("/v1/completions", {"model": "upper", "prompt": "hi", "max_tokens": 3,
                                                 "top_k": 10**9, "temperature": 1}), 200, None),
    "a missing adapter folder": (json_post("/v1/load_lora_adapter", {"lora_name": "nope", "lora_path": "/nope"}),
                                 400, "missing or unreadable"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_request_fails_only_itself(demo, solo_answers, case):
    send, status, words = HOSTILE[case]
    streams, r = beside_ten_streams(demo, send)
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    assert [(text, reason) for text, reason, _ in streams] == [(a, "length") for a in solo_answers]


def test_an_adapter_larger_than_the_pool_is_refused_for_good_beside_running_streams(demo, solo_answers,
                                                                                 big_adapter):
    streams, r = beside_ten_streams(demo, json_post("/v1/load_lora_adapter",
                                                    {"lora_name": "big", "lora_path": str(big_adapter)}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "adapter_too_large" and "MiB" in err["message"] and "pool holds" in err["message"]
    assert [text for text, _, _ in streams] == solo_answers


# -- one keep-alive connection through every malformed request -------------------------------------

class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("lorafleet", timeout=30)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


MALFORMED = [
    ("/v1/completions", b"{not json"), ("/v1/completions", b"\xff\xfe"), ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"prompt": "\\ud800"}'), ("/v1/completions", NESTED),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc80"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}'),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/completions", json.dumps({"prompt": ["x"] * 2000}).encode()),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1e400}'),
    ("/v1/load_lora_adapter", b'{"lora_name": "x", "lora_path": "\\ud800"}'),
    ("/v1/load_lora_adapter", b'{"lora_name": "../x", "lora_path": "/tmp"}'),
    ("/v1/load_lora_adapter", b'{"lora_name": "x", "lora_path": "/etc"}'),
    ("/v1/unload_lora_adapter", b'{"lora_name": "never-loaded"}'),
]


def test_malformed_requests_get_4xx_and_the_connection_stays_usable(demo):
    conn = UnixHTTPConnection(str(demo.socket))
    try:
        for path, raw in MALFORMED:
            conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            body = json.loads(r.read())
            assert 400 <= r.status < 500, (path, raw[:60], r.status, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert not r.will_close, (path, raw[:60])
        chat = {"messages": [{"role": "user", "content": "echo: ok"}], "max_tokens": 8}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(chat), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"] == "ok"
    finally:
        conn.close()


# -- bodies over the cap ---------------------------------------------------------------------------

def health_ms(demo) -> float:
    with demo.http() as c:
        t0 = time.perf_counter()
        c.get("/health").raise_for_status()
        return (time.perf_counter() - t0) * 1e3


def upload_50_mb(demo, chunked: bool) -> tuple[bytes, float, list[float]]:
    """POST a 50 MB body to the daemon while timing /health calls: (the daemon's reply, seconds
    until it came, every /health call's ms, during the upload and 5 after)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(demo.socket))
    size = 50 << 20
    framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}".encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: lorafleet\r\nContent-Type: application/json\r\n"
                 + framing + b"\r\n\r\n")
    stop = threading.Event()

    def upload():  # the client keeps sending; the daemon must not wait for it
        piece = b"a" * (1 << 20)
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
        try:
            for _ in range(50):
                if stop.is_set():
                    return
                sock.sendall(chunk)
        except OSError:
            pass
    sender = threading.Thread(target=upload, daemon=True)
    t0 = time.monotonic()
    sender.start()
    latencies = []
    try:
        sock.settimeout(1.0)
        reply = b""
        while b"\r\n\r\n" not in reply:
            latencies.append(health_ms(demo))
            got = sock.recv(65536)  # a 1 s timeout; b"" if the daemon closed without answering
            assert got, f"the connection closed after {reply[:200]!r}"
            reply += got
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        sock.close()
        sender.join(10)
    for _ in range(5):
        latencies.append(health_ms(demo))
    return reply, elapsed, latencies


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_is_refused_at_once_without_freezing_the_daemon(demo, chunked):
    """The 413 comes within 1 s and no /health call meanwhile takes 100 ms. A daemon that reads
    or parses the body before refusing it misses both on every upload; a host that takes this
    VM's CPUs for a moment (seen for minutes at a time, see the eager-load test below) can delay
    one call. So the upload runs again, 3 times at most, until one kept both bounds."""
    tries = []
    for _ in range(3):
        reply, elapsed, latencies = upload_50_mb(demo, chunked)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert demo.proc.poll() is None
        tries.append(f"413 after {elapsed:.2f} s, slowest /health {max(latencies):.0f} ms")
        if elapsed < 1.0 and max(latencies) < 100:
            return
    pytest.fail("a 50 MB body held the daemon up on every upload: " + "; ".join(tries))


# -- eager loads off the engine thread --------------------------------------------------------------

def load_beside_streams(daemon, name: str, path) -> tuple[float, float, float | None, str]:
    """Load `path` as `name` while 32 streams run: the worst gap between two chunks of a stream
    during the load, in median gaps of that stream; the cores other work kept busy meanwhile
    (other processes, and the hypervisor's other guests); and what the gap was."""
    bodies = [{**STREAM, "max_tokens": 240, "prompt": t} for t in held_out_texts(32)]

    async def run():
        async with daemon.async_http(timeout=120.0) as http:
            streams = await start_streams(http, bodies)
            await asyncio.sleep(CALM_S)
            cpu0, t0 = machine.cpu_seconds((daemon.proc.pid,)), time.monotonic()
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            loaded = (t0, time.monotonic())
            other = machine.other_cores(machine.other_cpu_seconds(cpu0, machine.cpu_seconds((daemon.proc.pid,))),
                                        loaded[1] - t0)
            return r, loaded, other, await asyncio.gather(*streams)
    # The arrival times are taken here: a collection of this process's heap (large after hundreds
    # of tests) could show as a gap in the daemon's stream, so the clock side does not collect.
    gc.collect()
    gc.disable()
    try:
        r, (t0, t1), other, streams = asyncio.run(run())
    finally:
        gc.enable()
    assert r.status_code == 200, r.text
    assert r.json()["adapter"]["tier"] == "device" and r.json()["adapter"]["params"] > 50_000_000
    text, reason, times = streams[0]
    gaps = [(b - a, a - t0) for a, b in zip(times, times[1:])]
    during = [(g, at) for g, at in gaps if -g < at < t1 - t0]
    median = statistics.median(g for g, _ in gaps)
    assert t1 - t0 > 5 * median, "the load was too quick to tell anything"
    assert during, "the stream ended before the load"
    worst = max(during)
    if worst[0] < 3 * median:  # no stall: the stream must have run through the load to tell
        assert len(during) > 10, "the stream ended before the load"
    calm = calm_worst(gaps, t1 - t0) / median
    beside = "other work unknown" if other is None else f"other work on {other:.2f} cores"
    return worst[0] / median, calm, other, (f"gap {worst[0] * 1e3:.0f} ms at {worst[1]:.2f} s of a {t1 - t0:.2f} s "
                                            f"load, median {median * 1e3:.1f} ms, the worst outside the load "
                                            f"{calm:.2f}x, {beside}")


MAX_OTHER_CORES = 0.1  # beside more other work, a load's gaps are the host's as much as ours
NOISY_BOUND = 10       # gaps, in medians, beside more: still far below a load on the engine thread
# The same streams' worst gap outside the input's window is the host's own noise (1.5-3.4x its
# median beside these tests' requests), and handling any request, a quick 400 included, adds a gap
# of 3-5x within it; a fixed 3x bound failed on the noisier VMs. So a gap within the window may
# reach CALM_FACTOR times the worst outside it, never past NOISY_BOUND: work on the engine thread or
# under the GIL left gaps of 20-800 medians.
CALM_S = 0.4           # the streams run this long before the input: the first part of that noise
CALM_FACTOR = 2.5


def calm_worst(gaps: list[tuple[float, float]], window: float) -> float:
    """The worst of `gaps` (length, start from the input on) outside the input's `window`: those
    ending at most CALM_S before it, or starting after it; the stream's last two (its end) left out."""
    return max((g for g, at in gaps[:-2] if -CALM_S <= at <= -g or at >= window), default=0.0)


def stall_bound(calm: float, quiet: bool) -> float:
    """The most a gap within the input's window may be, in medians, given the worst outside it."""
    return min(NOISY_BOUND, max(3.0, CALM_FACTOR * calm)) if quiet else NOISY_BOUND


@pytest.mark.heavy  # timing beside a 200 MB load
def test_an_eager_200_mb_load_does_not_stall_running_streams(tmp_path_factory, big_adapter):
    """No gap between two chunks of a stream during the load exceeds stall_bound: 3 median gaps,
    or CALM_FACTOR times the worst gap of the same stream outside the load where the host's own hiccups are
    larger. On a virtual machine whose host takes its CPUs now and then, for minutes at a time
    (seen here, on 2 cores: the hypervisor took 0.17-0.82 cores during some loads, with gaps of
    2.1-6.4 medians; beside at most 0.15 cores, at most 2.4), a load beside more than
    MAX_OTHER_CORES of other work is held to NOISY_BOUND medians only. The adapter is loaded again
    under a new name, up to 4 times, until one load ran alone within its bound: a stall the load
    causes repeats, noise does not. A load on the engine thread leaves a gap of the whole load
    (here 0.9 s, 45 medians), which fails every bound."""
    daemon = Daemon.start(tmp_path_factory.mktemp("eager"), "--pool-bytes", "512M")
    try:
        runs = []
        for attempt in range(4):
            ratio, calm, other, what = load_beside_streams(daemon, f"big-{attempt}", big_adapter)
            quiet = other is not None and other <= MAX_OTHER_CORES
            runs.append((ratio < stall_bound(calm, quiet), what))
            if runs[-1][0] and quiet:
                break
            with daemon.http() as c:
                c.post("/v1/unload_lora_adapter", json={"lora_name": f"big-{attempt}"}).raise_for_status()
        assert any(ok for ok, _ in runs), "the load stalled the streams every time: " + "; ".join(w for _, w in runs)
    finally:
        daemon.kill()


# -- streamed text adds up, however a request ends --------------------------------------------------

@pytest.mark.parametrize("extra, reason", [
    ({}, "stop"),                                   # the end-of-turn token
    ({"stop": ["o w", "zzzz"]}, "stop"),            # a stop string, held back while it could match
    ({"stop": ["o w"], "include_stop_str_in_output": True}, "stop"),
    ({"max_tokens": 7}, "length"),
    ({"max_tokens": 200, "ignore_eos": True}, "length"),  # up to the end of the context
], ids=["stop-token", "stop-string", "stop-string-kept", "max-tokens", "context"])
def test_streamed_deltas_add_up_to_the_whole_answer(demo, extra, reason):
    body = {"messages": [{"role": "user", "content": "echo: hello world"}], "max_tokens": 40, **extra}
    with demo.http() as c:
        whole = c.post("/v1/chat/completions", json=body).raise_for_status().json()["choices"][0]
        deltas, reasons = [], []
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    deltas.append(choice["delta"].get("content") or "")
                    reasons.append(choice["finish_reason"])
    assert whole["finish_reason"] == reason and reasons[-1] == reason
    assert "".join(deltas) == whole["message"]["content"] and whole["message"]["content"]


def test_an_adapter_that_fails_to_load_ends_its_stream_with_an_error_event(demo, tmp_path):
    import shutil
    shutil.copytree(default_fleet().adapters["upper"], tmp_path / "vanishing")
    with demo.http() as c:
        c.post("/v1/load_lora_adapter", json={"lora_name": "vanishing", "lora_path": str(tmp_path / "vanishing"),
                                               "lazy": True}).raise_for_status()
        (tmp_path / "vanishing" / "adapter_model.safetensors").unlink()
        events = []
        with c.stream("POST", "/v1/completions", json={"model": "vanishing", "prompt": "hi", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "invalid_adapter" and "adapter_model.safetensors" in err["message"]
    assert not any("choices" in e for e in events[:-1])


def test_adapter_refusals_echo_nothing_from_the_files(demo, tmp_path):
    import shutil
    folder = tmp_path / "secret"
    shutil.copytree(default_fleet().adapters["upper"], folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "r": "TOPSECRET"}))
    answers = []
    with demo.http() as c:
        for path in (folder, tmp_path / "absent", folder / "adapter_config.json"):
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": str(path)})
            assert r.status_code == 400
            answers.append(r.json()["error"]["message"])
    assert "TOPSECRET" not in answers[0] and "r: must be a positive integer" in answers[0]
    assert answers[1].replace(str(tmp_path / "absent"), "P") == answers[2].replace(str(folder / "adapter_config.json"), "P")
