"""dispatchd.threads: a thread whose start does not wait for it to run."""

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
