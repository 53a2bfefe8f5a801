"""What the TUI tests share: the recorded stats stream (`record_stream.py`) and sources that
stand in for a daemon."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import pytest

from lorafleet.errors import DaemonUnreachableError

STREAM = Path(__file__).parent / "data" / "stream.json"


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the Pilot runs on asyncio


@pytest.fixture(scope="session")
def stream() -> list[dict]:
    return json.loads(STREAM.read_text())


class Source:
    """A daemon stand-in for the app's poller: answers `script`'s snapshots in turn (None in
    the script: unreachable), then keeps answering the last one. Thread-safe; counts calls."""

    def __init__(self, script: list[dict | None]):
        self.script = [copy.deepcopy(s) for s in script]
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> dict:
        with self.lock:
            item = self.script[min(self.calls, len(self.script) - 1)]
            self.calls += 1
        if item is None:
            raise DaemonUnreachableError("no lorafleet daemon is running on /tmp/test.sock")
        return item


def text_of(widget) -> str:
    """What a widget shows, as plain text."""
    return str(widget.render())


async def until(pilot, condition, timeout: float = 10.0, what: str = "the condition") -> None:
    """Let the app run until `condition()` holds; fail past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout:g}s"
        await pilot.pause(0.05)
