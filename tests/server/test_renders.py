"""The render pool (`server/renders.py`) and its processes (`model/template_worker.py`): chats
render as the tokenizer renders them in-process; a hung template is refused, leaves the slots
to the chats behind it, and its process ends; the zygote signals only its own children."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafleet.errors import InvalidRequestError
from lorafleet.model import chat_template
from lorafleet.model.template_worker import KILL, PID
from lorafleet.model.tokenizer import Tokenizer
from lorafleet.server import renders

HANG = ("{% if messages[0].content == 'hang' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% else %}<{{ messages[0].content }}>{% endif %}")


def variables(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def alive(pid: int) -> bool:
    """Running or sleeping: not gone, not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_chat_renders_as_the_tokenizer_renders_it_in_process(chat_model_dir):
    tokenizer = Tokenizer.from_pretrained(chat_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 😀 <b>"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]

    async def run():
        text = await renders.pool().render(tokenizer.chat_template, tokenizer.chat_variables(messages), 1 << 20)
        renders.pool().close()
        return text
    assert asyncio.run(run()) == tokenizer.apply_chat_template(messages)


def test_bounds_and_failures_come_back_as_the_render_names_them():
    async def run():
        pool = renders.pool()
        out = []
        for template, text, max_chars in (("{{ 'x' * 100 }}", "a", 50), ("{{ raise_exception('no') }}", "a", None),
                                          ("{% for %}", "a", None), ("{{ messages[0].content }}", "fine", None)):
            try:
                out.append(await pool.render(template, variables(text), max_chars))
            except InvalidRequestError as e:
                out.append(str(e))
        pool.close()
        return out
    repetition, refused, broken, fine = asyncio.run(run())
    assert "repetition" in repetition and "100" in repetition
    assert refused == "chat template: no"
    assert "does not compile" in broken
    assert fine == "fine"


def test_hung_renders_are_refused_and_free_their_slots_for_the_chats_behind_them(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 0.5)
    finished = []

    async def one(pool, text):
        try:
            result = await pool.render(HANG, variables(text), 1000)
        except InvalidRequestError as e:
            result = str(e)
        finished.append(text)
        return result

    async def run():
        pool = renders.pool()
        hung = [asyncio.create_task(one(pool, "hang")) for _ in range(2 * renders.RENDER_PROCS)]
        while pool.slow < len(hung):  # every hung render past SLOW_CPU_S: none holds a slot
            await asyncio.sleep(0.01)
        normal = await asyncio.gather(*(one(pool, f"hi {i}") for i in range(renders.RENDER_PROCS)))
        results = await asyncio.gather(*hung)
        pool.close()
        return normal, results
    normal, results = asyncio.run(run())
    assert normal == [f"<hi {i}>" for i in range(renders.RENDER_PROCS)]
    assert all("took over 0.5 s" in r for r in results), results
    assert sorted(finished[:renders.RENDER_PROCS]) == [f"hi {i}" for i in range(renders.RENDER_PROCS)]  # before any hung one


def test_a_render_whose_client_hangs_up_ends_with_its_process():
    async def run():
        pool = renders.pool()
        task = asyncio.create_task(pool.render(HANG, variables("hang"), 1000))
        while pool.slow < 1:
            await asyncio.sleep(0.01)
        pids = [int(p) for p in Path(f"/proc/{pool._zygote._proc.pid}/task/{pool._zygote._proc.pid}/children")
                .read_text().split()]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        pool.close()
        return pids
    pids = asyncio.run(run())
    assert len(pids) == 1 and not alive(pids[0])  # killed, not left to spin to its deadline


def test_the_zygote_signals_only_its_own_children():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        async def run():
            pool = renders.pool()
            assert await pool.render("{{ 1 }}", {}, None) == "1"  # the zygote is up
            zygote = pool._zygote
            for pid in (other.pid, 0, -1, 1):
                zygote._control.sendall(KILL + PID.pack(pid))
            assert await pool.render("{{ 2 }}", {}, None) == "2"  # it took the commands and still forks
            pool.close()
        asyncio.run(run())
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
