"""dispatch._autostart.log_name: a daemon autostarted on its own socket logs
to a file of its own (each daemon rotates its log by renaming it: two on one
file moved it from under each other); the default socket's is dispatchd.log."""

from __future__ import annotations

import pytest

from dispatch._autostart import log_name
from dispatchd import paths


def test_the_default_socket_s_daemon_logs_to_dispatchd_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.delenv("DISPATCH_SOCKET", raising=False)
    assert paths.default_socket_path() == "/run/user/1000/dispatchd/dispatchd.sock"
    assert log_name("/run/user/1000/dispatchd/dispatchd.sock") == "dispatchd.log"


def test_each_other_socket_s_daemon_logs_to_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.delenv("DISPATCH_SOCKET", raising=False)
    # sha256(b"/tmp/a.sock") and sha256(b"/tmp/b.sock"), their first 8 hex digits
    assert log_name("/tmp/a.sock") == "dispatchd-7a411c15.log"
    assert log_name("/tmp/b.sock") == "dispatchd-11b9f038.log"
