"""A channel the tool server cannot start a thread for (the session's, or
all sessions', process limit) waits for one a while instead of being
refused at once: a woken session's first request comes with its channel
(worker/tool_server.py, ``feed_starved``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dispatchd.worker import tool_server


class _Channel:
    def __init__(self) -> None:
        self.refused: tuple[str, str] | None = None

    def refuse(self, code: str, message: str) -> None:
        self.refused = (code, message)


class _Server:
    def __init__(self, threads_to_be_had: int) -> None:
        self.threads_to_be_had = threads_to_be_had
        self.started: list[Any] = []
        self.closed: list[Any] = []
        self.starved: list[tuple[Any, float]] = []

    def _start_reader(self, channel: Any) -> bool:
        if self.threads_to_be_had <= 0:
            return False
        self.threads_to_be_had -= 1
        self.started.append(channel)
        return True

    def channel_closed(self, channel: Any) -> None:
        self.closed.append(channel)


def test_a_starved_channel_is_served_once_a_thread_is_to_be_had_and_refused_only_past_its_wait() -> None:
    server = _Server(threads_to_be_had=0)
    waiting, late = _Channel(), _Channel()
    server.starved = [(waiting, time.monotonic() + 30), (late, time.monotonic() - 1)]
    tool_server._Server.feed_starved(server)  # type: ignore[arg-type]
    # Within its wait: kept, neither served nor refused; past it: refused with what to do.
    assert [c for c, _ in server.starved] == [waiting] and waiting.refused is None
    assert late.refused is not None and late.refused[0] == "busy" and "stop some (job_stop) and retry" in late.refused[1]
    assert server.closed == [late]
    server.threads_to_be_had = 1  # the twin: a thread to be had at the next look
    tool_server._Server.feed_starved(server)  # type: ignore[arg-type]
    assert server.started == [waiting] and server.starved == [] and waiting.refused is None


def test_the_first_writes_sweep_runs_in_the_callers_thread_when_no_other_can_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    swept: list[tuple[str, Any]] = []
    monkeypatch.setattr(tool_server, "sweep_temp_files", lambda root, in_flight: swept.append((root, in_flight)))

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    tool_server._sweep_beside("/work/tree")  # before: the RuntimeError closed the channel
    assert [root for root, _ in swept] == ["/work/tree"]


def test_the_first_writes_sweep_runs_on_its_own_thread_when_one_can_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The twin: the caller does not wait for the sweep when a thread is to be had.
    threads: list[str] = []
    done = threading.Event()
    monkeypatch.setattr(tool_server, "sweep_temp_files",
                        lambda root, in_flight: (threads.append(threading.current_thread().name), done.set()))
    tool_server._sweep_beside("/work/tree")
    assert done.wait(5) and threads == ["sweep"]
