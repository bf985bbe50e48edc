"""dispatchd/daemon/afterwards.py: what a close leaves for after its reply,
with real processes and descriptors."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from dispatchd.daemon import afterwards


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_jobs_run_in_order_and_drain_waits_for_them() -> None:
    ran: list[int] = []
    gate = threading.Event()
    afterwards.later(gate.wait)  # holds the thread: what follows waits its turn
    for i in range(5):
        afterwards.later(lambda i=i: ran.append(i))
    assert ran == []
    gate.set()
    assert afterwards.drain(10)
    assert ran == [0, 1, 2, 3, 4]


def test_a_job_that_raises_is_logged_and_the_next_runs(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def bad() -> None:
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="dispatchd.afterwards"):
        afterwards.later(bad)
        afterwards.later(lambda: ran.append("next"))
        assert afterwards.drain(10)
    assert ran == ["next"]
    assert "event=afterwards_failed error=ValueError('boom')" in caplog.text


@pytest.mark.process
def test_reap_waits_for_the_killed_process_then_closes_its_pidfd() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        afterwards.reap(pidfd, 5.0)
        assert afterwards.drain(10)
        assert not _is_open(pidfd)
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.process
def test_a_process_still_alive_is_not_waited_for_forever(caplog: pytest.LogCaptureFixture) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        with caplog.at_level(logging.WARNING, logger="dispatchd.afterwards"):
            afterwards.reap(pidfd, 0.05)  # never killed: the wait times out, the pidfd is closed anyway
            assert afterwards.drain(10)
        assert "event=exit_not_seen" in caplog.text
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_fsync_dir_of_a_missing_directory_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    afterwards.fsync_dir(str(tmp_path))  # allowed: an existing directory
    with caplog.at_level(logging.ERROR, logger="dispatchd.afterwards"):
        afterwards.fsync_dir(str(tmp_path / "gone"))
        assert afterwards.drain(10)
    assert "event=afterwards_failed error=FileNotFoundError(2, 'No such file or directory')" in caplog.text


def _no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread can start (the user's process limit reached), the afterwards thread not started yet."""
    monkeypatch.setattr(afterwards, "_started", False)

    class NoThread(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(afterwards.threading, "Thread", NoThread)


def test_a_job_given_where_no_thread_can_start_runs_at_once(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The user's process limit reached: the thread's start raised, and the
    clean-up that gave the job (a failed open's) skipped every later step,
    its claim on the worktree left until a restart. The job runs at once
    now; the twin: with a thread, it runs on it (the tests above)."""
    _no_thread(monkeypatch)
    ran: list[str] = []
    with caplog.at_level(logging.WARNING, logger="dispatchd"):
        afterwards.later(lambda: ran.append("here"))
    assert ran == ["here"] and not afterwards._started
    assert "event=afterwards_inline why=\"can't start new thread\"" in caplog.text


def test_an_inline_job_that_fails_or_gives_another_is_logged_and_runs_it(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Inline, a failing job's exception reached the caller (a close's
    clean-up), and a job giving one of its own waited on the start's lock
    for good. The twin: on the thread, the same jobs (the tests above)."""
    _no_thread(monkeypatch)
    ran: list[str] = []

    def gives_another() -> None:
        afterwards.later(lambda: ran.append("inner"))
        raise ValueError("the job's own failure")

    with caplog.at_level(logging.WARNING, logger="dispatchd"):
        afterwards.later(gives_another)
    assert ran == ["inner"] and "event=afterwards_failed error=ValueError(\"the job's own failure\")" in caplog.text
