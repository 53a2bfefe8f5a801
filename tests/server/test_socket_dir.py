"""The socket's directory: the daemon creates missing levels 0700 and never changes the mode of
one it did not create; an existing directory where someone else could swap the socket is refused."""

from __future__ import annotations

import os
import signal
import stat

import pytest

from lorafleet.errors import ConfigError
from lorafleet.paths import socket_dir
from tests.daemons import Daemon


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_existing_0755_directory_keeps_its_mode(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o755)
    assert socket_dir(d) == d and mode(d) == 0o755


def test_a_sticky_world_writable_directory_is_accepted_and_keeps_its_mode(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    socket_dir(d)
    assert mode(d) == 0o1777


@pytest.mark.parametrize("umask", [0o022, 0o277])
def test_created_directories_are_0700_at_every_level_whatever_the_umask(tmp_path, umask):
    parent = mode(tmp_path)
    old = os.umask(umask)
    try:
        socket_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert mode(tmp_path / "a") == mode(tmp_path / "a" / "b") == 0o700
    assert mode(tmp_path) == parent  # the existing parent is not ours to change


@pytest.mark.parametrize("bits", [0o775, 0o757])
def test_a_group_or_other_writable_directory_without_the_sticky_bit_is_refused(tmp_path, bits):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(bits)
    with pytest.raises(ConfigError, match=f"{d} is writable by others.*--socket or LORAFLEET_SOCKET") as e:
        socket_dir(d)
    assert "\n" not in str(e.value) and mode(d) == bits


def test_a_directory_another_user_owns_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: d.stat().st_uid + 1)
    with pytest.raises(ConfigError, match=f"{d} belongs to another user"):
        socket_dir(d)


def test_a_sticky_directory_root_owns_is_accepted_from_another_user(tmp_path, monkeypatch):
    """Like /tmp: others can create there but not replace our socket."""
    if os.geteuid() != 0:
        pytest.skip("needs a root-owned directory made in the test")
    d = tmp_path / "tmp"
    d.mkdir()
    d.chmod(0o1777)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    socket_dir(d)


def test_the_daemon_leaves_an_existing_socket_directory_as_it_was(tmp_path, chat_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o755)
    d = Daemon.start(tmp_path, model=chat_model_dir)
    try:
        assert mode(run) == 0o755
        assert mode(d.socket) == 0o600
        d.signal(signal.SIGTERM)
        assert d.wait(60) == 0
    finally:
        d.kill()
    assert mode(run) == 0o755
