"""What a sandbox made ahead takes as its session's plan (``session_init.
_wait_for_session``): the plan it was made with when the daemon sends the
same bytes (the likely session's, planned once), any other decoded and
taken only with the same pool key, the session's descriptors closed when
refused. The sandbox's side over a real socket pair; the daemon's side here."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dispatchd import protocol
from dispatchd.confine.plan import SessionPaths, encode_plan, pool_key
from dispatchd.errors import ConfinementError
from dispatchd.worker import session_init
from tests.unit.test_plan import CODE, RUNTIME, SCRATCH
from tests.unit.test_pool_plan import plan

pytestmark = pytest.mark.process  # a thread, a socket pair and the tool server's warm-up


def _adopt(made_for: Any, sent: bytes, tmp_path: Path) -> tuple[Any, list[int], BaseException | None]:
    """``_wait_for_session`` of ``made_for`` given an AdoptSession of ``sent``
    with a worktree and a channel: what it returned (or raised), and the two
    descriptors as the sandbox got them."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon, worker = protocol.FrameSocket(ours, fds=True), protocol.FrameSocket(theirs, fds=True)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            made_bytes = encode_plan(made_for)  # as the fork server hands it on: the daemon's request's
            out["got"] = session_init._wait_for_session(worker, made_for, made_bytes, session_init._Clock())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert isinstance(daemon.recv(protocol.from_worker_decoder), protocol.WorkerPooled)
        wt = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
        a, b = socket.socketpair()
        try:
            daemon.send(protocol.AdoptSession(plan=sent, channel=True), fds=[wt, b.fileno()])
        finally:
            os.close(wt)
            b.close()
            a.close()
        thread.join(10)
    finally:
        daemon.close()
        worker.close()
    got = out.get("got")
    return (got[0], list(got[1:]), None) if got else (None, [], out.get("error"))


def test_the_same_bytes_are_the_plan_it_was_made_with(tmp_path: Path) -> None:
    made_for = plan(session="s1")
    got, fds, error = _adopt(made_for, encode_plan(made_for), tmp_path)
    assert error is None and got is made_for  # neither decoded nor keyed again
    assert all(os.fstat(fd) for fd in fds) and len(fds) == 2
    for fd in fds:
        os.close(fd)


def test_another_plan_of_the_same_key_is_decoded_and_taken(tmp_path: Path) -> None:
    made_for = plan(session="s1")
    other_wt = SessionPaths(worktree="/srv/other", scratch=SCRATCH, runtime_dirs=[RUNTIME], code=[CODE])
    other = plan(session="s1", paths=other_wt)
    assert pool_key(other) == pool_key(made_for) and encode_plan(other) != encode_plan(made_for)
    got, fds, error = _adopt(made_for, encode_plan(other), tmp_path)
    assert error is None and got is not made_for
    assert msgspec.msgpack.encode(got) == encode_plan(other)
    for fd in fds:
        os.close(fd)


def test_a_plan_of_another_key_is_refused_and_its_descriptors_closed(tmp_path: Path) -> None:
    made_for = plan(session="s1")
    other = plan(session="s1", network="on")
    assert pool_key(other) != pool_key(made_for)
    before = set(os.listdir("/proc/self/fd"))
    got, fds, error = _adopt(made_for, encode_plan(other), tmp_path)
    assert got is None and isinstance(error, ConfinementError)
    assert "not the one this sandbox was made for" in str(error)
    assert set(os.listdir("/proc/self/fd")) <= before  # the worktree's and the channel's, closed
