"""dispatchd/daemon/beside.py: a call on a thread of its own beside the caller's."""

from __future__ import annotations

import threading

import pytest

from dispatchd.daemon.beside import Beside


def test_runs_beside_the_caller_and_result_waits_for_it() -> None:
    started, go = threading.Event(), threading.Event()
    seen: list[str] = []

    def fn() -> None:
        started.set()
        go.wait(10)
        seen.append(threading.current_thread().name)

    b = Beside(fn)
    assert started.wait(10)  # running while the caller goes on
    assert seen == []
    go.set()
    b.result()
    assert seen == ["beside"]
    assert b.ms > 0


def test_result_raises_what_it_raised_and_wait_does_not() -> None:
    def fn() -> None:
        raise KeyboardInterrupt  # a BaseException too

    b = Beside(fn)
    b.wait()
    with pytest.raises(KeyboardInterrupt):
        b.result()


def test_ok_result_is_none() -> None:
    assert Beside(lambda: None).result() is None
