"""dispatchd.threads: a thread whose start does not wait for it to run; a component's one thread started once."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from dispatchd import threads


def test_the_target_runs_once_on_a_thread_of_its_own() -> None:
    ran: list[int] = []
    done = threading.Event()

    def target() -> None:
        ran.append(threading.get_ident())
        done.set()

    t = threads.Thread(target=target, daemon=True)
    t.start()
    assert done.wait(5)
    assert ran == [t.ident] and ran[0] != threading.get_ident()


@pytest.mark.process
def test_a_forked_child_starts_threads_although_the_parent_held_threadings_lock_at_the_fork() -> None:
    """A fork's child gets a new ``_active_limbo_lock`` (threading's at-fork
    hook); one taken at import is the parent's, held for good in the child if
    another thread of the parent held it at the fork (the tool server's
    channels hung there)."""
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with threading._active_limbo_lock:  # type: ignore[attr-defined]
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    try:
        pid = os.fork()
        if pid == 0:  # the child: start a thread that answers on a socket pair
            code = 1
            try:
                a, b = socket.socketpair()
                threads.Thread(target=lambda: b.send(b"ran"), daemon=True).start()
                a.settimeout(5)
                code = 0 if a.recv(3) == b"ran" else 2
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the child's thread never started (threading's lock of the parent, held at the fork)")


def test_a_component_s_thread_is_started_once_and_a_refused_start_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runs = threading.Semaphore(0)
    once = threads.Once(runs.release, "a-component")
    real = threading.Thread

    class Refused(real):  # type: ignore[valid-type,misc]
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading, "Thread", Refused)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        once.start()
    assert once.thread is None  # not recorded as started
    monkeypatch.setattr(threading, "Thread", real)
    once.start()  # the twin: a thread to be had
    once.start()
    assert runs.acquire(timeout=5) and once.thread is not None and once.thread.name == "a-component"
    assert not runs.acquire(timeout=0.2)  # one thread, not two
