"""A bridge process whose link cannot be set up is ended, never left running
unowned (client/dispatch/_remote.py ``Remote``): before, a thread that
could not start (the caller at its process limit) left it running."""

from __future__ import annotations

import subprocess
import threading
from typing import Any

import pytest

from dispatch import _remote

pytestmark = pytest.mark.process


class _Refused(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def _started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    made: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real(*args, **kwargs)
        made.append(proc)
        return proc

    monkeypatch.setattr(_remote.subprocess, "Popen", popen)
    return made


def test_a_bridge_whose_thread_cannot_start_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _started(monkeypatch)
    monkeypatch.setattr(_remote.threading, "Thread", _Refused)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        _remote.Remote(["/bin/sleep", "30"], "test", 5.0)
    monkeypatch.undo()
    assert len(made) == 1 and made[0].returncode is not None  # ended and reaped


def test_a_bridge_that_never_answers_the_handshake_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _started(monkeypatch)  # the twin: the path that was already covered, with its threads
    with pytest.raises(_remote.DaemonUnavailable):
        _remote.Remote(["/bin/sh", "-c", "exit 3"], "test", 5.0)
    monkeypatch.undo()
    assert len(made) == 1 and made[0].returncode is not None
