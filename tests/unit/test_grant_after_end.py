"""SessionTable._grant_write_lock against a session's end: a grant that
comes after the end released the session's locks (a checkpoint's grant runs
on a thread of its own) is given back, never left to hold the worktree; one
that comes before it, or while the session is still being opened, stands.
The table is a stand-in (its lock, its sessions, the write locks): the rule
is pure."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dispatchd import protocol
from dispatchd.daemon.lifecycle import State
from dispatchd.daemon.table import SessionTable
from dispatchd.daemon.writelock import WriteLocks


class _Baselines:
    @staticmethod
    def durable(sid: str) -> None:
        return None

    @staticmethod
    def writing(sid: str) -> None:
        return None


def _grant(state: State, in_table: bool) -> tuple[object, WriteLocks]:
    session = SimpleNamespace(id="s1", worktree="/home/u/wt", state=state, writes=False, created=0.0)
    table = SimpleNamespace(baselines=_Baselines(), write_locks=WriteLocks(), _lock=threading.Lock(),
                            _sessions={"s1": session} if in_table else {})
    return SessionTable._grant_write_lock(table, session, 7), table.write_locks  # type: ignore[arg-type]


@pytest.mark.parametrize("state", [State.CLOSING, State.CLOSED])
def test_a_grant_after_the_end_took_the_session_out_is_given_back(state: State) -> None:
    reply, locks = _grant(state, in_table=False)
    assert reply == protocol.ErrorReply(id=7, code="session_ended",
                                        message="the worktree /home/u/wt: session s1 has ended")
    assert not locks.holds("s1")


@pytest.mark.parametrize(("state", "in_table"), [
    (State.READY, True),
    (State.OPENING, False),  # its watch serves its first calls before the open puts it in the table
    (State.CLOSING, True),  # its end has not released yet: it will, after its sweep under the lock
], ids=["ready", "being_opened", "closing_before_its_release"])
def test_a_grant_before_the_end_stands(state: State, in_table: bool) -> None:
    reply, locks = _grant(state, in_table)
    assert isinstance(reply, protocol.WriteLockGranted) and reply.id == 7
    assert locks.holds("s1")
