"""Hostile input beside running streams (issue 48's figures): while each hostile request or file
is handled, a stream's largest gap between two tokens stays under 3x its median gap (or 2.5 times
its worst outside that time, where the host's own hiccups are larger: `stall_bound`), and the
daemon's memory rises by less than its pool. The inputs are the ones that stalled every stream
before: a config pattern that backtracks for seconds, a 24 MB safetensors header, a declared rank
of 400,000, 1.9M stop_token_ids, bodies of 1.9M JSON values, 1,100 TCP connections that never
finish their headers.

The flood comes from a process of its own, paced over FLOOD_S: on a 2-core host its connects,
run in this process as one burst, took the stream reader's GIL and one of the two cores the
engine's steps use, so the gaps measured the client (steps ran 2.5x slower while the engine's
thread used no more CPU). The daemon still meets all 1,100 at 4,400 a second. The client's CPU
counts as other work, as any process's beside the daemon does; the daemon's accepts stay ours.

Run with -s to see each case's figures (what the README quotes):
    python -m pytest -s tests/server/test_stalls.py
As tests/server/test_hostile.py's eager-load test, on a VM whose host takes its CPUs now and
then, a case run beside more than MAX_OTHER_CORES of other work is held to NOISY_BOUND medians
only; a case that misses its bound runs again, 3 times at most.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import statistics
import struct
import sys
import time
from pathlib import Path

import pytest

from lorafleet.bench import machine
from lorafleet.demo import default_fleet
from lorafleet.demo.skills import held_out_texts
from tests.daemons import POOL, Daemon, free_port
from tests.server.test_hostile import CALM_S, MAX_OTHER_CORES, NOISY_BOUND, STREAM, calm_worst, stall_bound, start_streams

pytestmark = pytest.mark.heavy  # timing: token gaps beside hostile input

POOL_BYTES = int(POOL.rstrip("M")) << 20
STREAMS = 16
FLOOD = 1100
FLOOD_S = 0.25  # opened over this long: 4,400 connections a second
WINDOW_S = 0.5  # gaps and other work are measured over at least this long from the input on
# Gaps past which a window is long: an idle daemon's worst gap in 250 was 2-4.2x its median (the
# host's own hiccups), so a long window is held to its 99th percentile, and its worst to NOISY_BOUND
LONG_WINDOW = 200
SCHED_IDLE = 5  # a process's policy in /proc/PID/stat (field 41)


# the demo base's chat template, looping for good on a message "hang" and amplifying "amp"
NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
AMPLIFY = "{% for i in range(100000) %}{{ messages[0].content * 40 }}{% endfor %}"


def hostile_fleet(root: Path) -> list[str]:
    """The demo fleet, its base's chat template hostile on two messages: `serve`'s arguments."""
    fleet = default_fleet()
    base = root / fleet.name
    shutil.copytree(fleet.model, base)
    original = json.loads((base / "tokenizer_config.json").read_text())["chat_template"]
    (base / "chat_template.jinja").write_text(
        "{% if messages[0].content == 'hang' %}" + NESTED_RANGE + "{% elif messages[0].content == 'amp' %}"
        + AMPLIFY + "{% else %}" + original + "{% endif %}")
    return [str(base), "--served-model-name", fleet.name,
            *(a for name, path in fleet.adapters.items() for a in ("-a", f"{name}={path}"))]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    root = tmp_path_factory.mktemp("stalls")
    model, *args = hostile_fleet(root)
    d = Daemon.start(root, "--host", "127.0.0.1", "--port", str(port), "--api-key", "k", *args, model=Path(model))
    d.port = port
    yield d
    d.kill()


# -- the hostile inputs ---------------------------------------------------------------------------

def upper_copy(root: Path, name: str) -> Path:
    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(default_fleet().adapters["upper"], folder)
    return folder


def with_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return folder


def rewrite_header(folder: Path, change) -> Path:
    """The adapter's safetensors header changed by `change(header)`; data offsets kept."""
    p = folder / "adapter_model.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    end = change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:])
        if end is not None:
            f.truncate(8 + len(text) + end)  # a hole: declared, never written
    return folder


def huge_metadata(header: dict) -> None:
    header["__metadata__"] = {f"k{i}": "v" for i in range(2_000_000)}  # ~24 MB


def declared_rank(rank: int):
    def change(header: dict) -> int:
        key = "base_model.model.model.layers.0.self_attn.k_proj.lora_"
        a, b = header[key + "A.weight"], header[key + "B.weight"]
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        for entry, shape in ((a, [rank, a["shape"][1]]), (b, [b["shape"][0], rank])):
            nbytes = 4 * shape[0] * shape[1]
            entry.update(dtype="F32", shape=shape, data_offsets=[end, end + nbytes])
            end += nbytes
        return end
    return change


BACKTRACKING = r"(?:[\w.]|[\w.]){0,26}!"  # the issue's: ~4.5 s a module name under `re`


def load(name: str, path: Path, lazy: bool):
    async def send(http):
        return [await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), "lazy": lazy})]
    return send


def twice(path: str, raw: bytes):
    async def send(http):
        return list(await asyncio.gather(*(http.post(path, content=raw, headers={"Content-Type": "application/json"})
                                           for _ in range(2))))
    return send


FLOOD_CLIENT = """
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this side needs FLOOD sockets too
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * {n})), hard))
socks = []
start = time.monotonic()
for i in range({n}):
    time.sleep(max(0.0, start + i * {every} - time.monotonic()))
    try:
        s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
        s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\n")  # half the headers
        socks.append(s)
    except OSError:  # refused or reset past the cap: what the flood meets
        pass
print(len(socks), flush=True)
sys.stdin.read()  # held until the test has its answer
"""


def flood(port: int):
    """FLOOD half-sent connections from a process of their own: the hostile client's CPU is other
    work, not the stream reader's (in this process, its connects also took the reader's GIL)."""
    async def send(http):
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FLOOD_CLIENT.format(n=FLOOD, port=port, every=FLOOD_S / FLOOD),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        try:
            held = int(await client.stdout.readline())
            assert held > 0, "no connection of the flood was accepted"
            r = await http.get("/health")  # the Unix socket, while the flood holds TCP
        finally:
            client.stdin.close()
            await client.wait()
        return [r]
    return send


def at_once(path: str, body: dict, n: int):
    """`n` posts of `body`, encoded before the streams start (encoding holds this process's GIL)."""
    raw = json.dumps(body).encode()

    async def send(http):
        return list(await asyncio.gather(*(http.post(path, content=raw, headers={"Content-Type": "application/json"})
                                           for _ in range(n))))
    return send


def chat(text: str) -> dict:
    return {"model": default_fleet().name, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def big_tokenizer(root: Path) -> Path:
    """An adapter with added tokens whose tokenizer.json is padded to 61 MB (the issue's case), over
    the cap on what an adapter's tokenizer may take."""
    from tests.engine.test_heads import vocab_adapter

    folder = vocab_adapter(default_fleet().model, root / "big-tokenizer")
    with open(folder / "tokenizer.json", "a") as f:
        f.write(" " * (61_000_000 - f.tell()))
    return folder


TOKENIZER_CASE = "61 MB tokenizer.json, eager"


def cases(root: Path, port: int, case: str) -> dict:
    if case == TOKENIZER_CASE:  # an adapter trained for it: built only where it is used
        big_tokenizer(root)
    compact = {"separators": (",", ":")}  # 2 bytes a value: 3.8 MB, under the 4 MiB body cap
    ids = json.dumps({"model": "upper", "prompt": "hi", "stop_token_ids": [0] * 1_900_000}, **compact).encode()
    junk = json.dumps({"model": "upper", "prompt": "hi", "ignored": [0] * 1_900_000}, **compact).encode()
    return {
        "backtracking target_modules, lazy": (load("r1", with_config(upper_copy(root, "r1"),
                                                                     target_modules=BACKTRACKING), True), 400),
        "backtracking target_modules, eager": (load("r2", root / "r1", False), 400),
        "24 MB header, lazy": (load("h1", rewrite_header(upper_copy(root, "h1"), huge_metadata), True), 400),
        "24 MB header, eager": (load("h2", root / "h1", False), 400),
        "rank 400,000 declared, eager": (load("k1", rewrite_header(upper_copy(root, "k1"), declared_rank(400_000)),
                                              False), 400),
        "1.9M stop_token_ids, twice": (twice("/v1/completions", ids), 400),
        "1.9M ignored JSON values, twice": (twice("/v1/completions", junk), 400),
        f"{FLOOD} half-sent TCP connections": (flood(port), 200),
        TOKENIZER_CASE: (load("t1", root / "big-tokenizer", False), 400),
        "4 MB prompt, four at once": (at_once("/v1/completions", {"model": "upper", "prompt": "word " * 800_000}, 4),
                                      400),
        "a template looping for good, eight at once": (at_once("/v1/chat/completions", chat("hang"), 8), 400),
        "a template writing 4M characters, four at once": (at_once("/v1/chat/completions", chat("amp"), 4), 400),
    }


# -- the measurement ---------------------------------------------------------------------------------

def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def ours(pid: int) -> tuple[int, ...]:
    """The daemon and its render processes, but those at SCHED_IDLE: a slow render takes only what
    no other thread wants, as any idle-priority process beside the daemon would, and such
    processes, inside the daemon or not, leave a stream's worst gap at 4-6.6x its median on a 2-core
    VM (the host's wake-ups), so they count as other work."""
    def idle(p: int) -> bool:
        try:
            return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[38]) == SCHED_IDLE
        except (OSError, ValueError, IndexError):
            return True
    return tuple(p for p in machine.process_tree(pid) if not idle(p))


def beside_streams(daemon, send) -> tuple[list, float, float, float | None, float, str]:
    """Run STREAMS streams; once all produce tokens, `send(http)`. Returns its answers, the worst
    gap of a stream in the WINDOW_S (or more, while it is handled) from the input on, in median
    gaps, the cores other work kept busy meanwhile, the rise of the daemon's RSS, and what the
    gap was, and the worst gap outside that window, in medians too (the host's own noise)."""
    bodies = [{**STREAM, "max_tokens": 240, "prompt": t} for t in held_out_texts(STREAMS)]

    async def run():
        async with daemon.async_http(timeout=120.0) as http:
            streams = await start_streams(http, bodies)
            await asyncio.sleep(CALM_S)
            rss0 = rss(daemon.proc.pid)
            tree0 = ours(daemon.proc.pid)
            cpu0, t0 = machine.cpu_seconds(tree0), time.monotonic()
            answers = await send(http)
            handled = time.monotonic() - t0
            await asyncio.sleep(max(0.0, WINDOW_S - handled))  # a window the kernel's CPU accounting can see
            t1 = time.monotonic()
            tree1 = tuple(p for p in dict.fromkeys(tree0 + ours(daemon.proc.pid)) if Path(f"/proc/{p}").exists())
            cpu1 = machine.cpu_seconds(tree1)
            other = machine.other_cores(machine.other_cpu_seconds(cpu0, cpu1), t1 - t0)
            rise = rss(daemon.proc.pid) - rss0
            return answers, (t0, t1, handled), other, rise, await asyncio.gather(*streams)
    gc.collect()
    gc.disable()  # a collection of this process's heap would show as a gap in the daemon's stream
    try:
        answers, (t0, t1, handled), other, rise, streams = asyncio.run(run())
    finally:
        gc.enable()
    _, _, times = streams[0]
    gaps = [(b - a, a - t0) for a, b in zip(times, times[1:])]
    median = statistics.median(g for g, _ in gaps)
    during = [(g, at) for g, at in gaps if -g < at < t1 - t0] or [(0.0, 0.0)]
    worst = max(during)
    ratio = worst[0] / median
    calm = calm_worst(gaps, t1 - t0) / median
    what = (f"worst gap {worst[0] * 1e3:.0f} ms in the {(t1 - t0) * 1e3:.0f} ms from the input on (handled in "
            f"{handled * 1e3:.0f} ms; {len(during)} gaps), median {median * 1e3:.1f} ms ({ratio:.2f}x)")
    if len(during) > LONG_WINDOW:  # the host's own hiccups: the bound holds the 99th percentile, the worst NOISY_BOUND
        p99 = sorted(g for g, _ in during)[int(0.99 * len(during))] / median
        what += f", 99th percentile {p99:.2f}x"
        ratio = max(p99, ratio * 3 / NOISY_BOUND)
    what += (f", the worst outside it {calm:.2f}x, RSS {rise / 2**20:+.1f} MiB, "
             + ("other work unknown" if other is None else f"other work on {other:.2f} cores"))
    return answers, ratio, calm, other, rise, what


@pytest.mark.parametrize("case", ["backtracking target_modules, lazy", "backtracking target_modules, eager",
                                  "24 MB header, lazy", "24 MB header, eager", "rank 400,000 declared, eager",
                                  "1.9M stop_token_ids, twice", "1.9M ignored JSON values, twice",
                                  f"{FLOOD} half-sent TCP connections", TOKENIZER_CASE, "4 MB prompt, four at once",
                                  "a template looping for good, eight at once",
                                  "a template writing 4M characters, four at once"])
def test_hostile_input_does_not_stall_the_streams_beside_it(daemon, tmp_path, case):
    """One run within the bound passes; a stall caused by the input repeats, noise does not, so a
    miss runs the case again, 3 times at most."""
    send, status = cases(tmp_path, daemon.port, case)[case]
    runs = []
    for _ in range(3):
        answers, ratio, calm, other, rise, what = beside_streams(daemon, send)
        assert all(r.status_code == status for r in answers), [r.text[:300] for r in answers]
        print(f"\n{case}: {what}")
        assert rise < POOL_BYTES, f"the daemon's memory rose by more than its pool: {what}"
        quiet = other is not None and other <= MAX_OTHER_CORES
        runs.append(what)
        if ratio < stall_bound(calm, quiet):
            return
    pytest.fail(f"{case} stalled the streams in every run: " + "; ".join(runs))
