"""What the daemon does without a thread to be had, where it used to record
a step as done and leave it undone. An end it decides (over memory,
orphaned) is made on the caller's thread (daemon/ending.py ``Ending.end``):
before, it was recorded, its thread failed to start, and the record then
stopped every later end of it; the session ran on, its memory bound off. A
checkpoint before a write refuses the write (checkpoints/requests.py). The
table, ``_finish`` and the channel are stand-ins: the decisions alone."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from dispatchd.daemon import ending, leftovers
from dispatchd.daemon.lifecycle import State


def _ending(finished: list[tuple[str, str, threading.Thread]]) -> Any:
    e: Any = ending.Ending.__new__(ending.Ending)
    e._lock = threading.Lock()
    e._ended = leftovers.EndedSessions()
    e._sessions = {"s1": types.SimpleNamespace(id="s1", state=State.READY)}
    e._finish = lambda session, why, event: finished.append((session.id, why, threading.current_thread()))
    return e


class _Refused(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_an_end_without_a_thread_to_be_had_is_made_here(monkeypatch: pytest.MonkeyPatch) -> None:
    finished: list[tuple[str, str, threading.Thread]] = []
    e = _ending(finished)
    monkeypatch.setattr(ending.threading, "Thread", _Refused)
    e.end("s1", "memory", "over its limit")
    monkeypatch.undo()
    assert [(sid, why) for sid, why, _ in finished] == [("s1", "over its limit")]
    assert finished[0][2] is threading.current_thread()
    assert e._ended.get("s1") == "over its limit"


def test_an_end_is_made_on_a_thread_of_its_own_where_one_is_had() -> None:
    finished: list[tuple[str, str, threading.Thread]] = []
    e = _ending(finished)
    e.end("s1", "memory", "over its limit")
    for t in threading.enumerate():
        if t.name == "end-s1":
            t.join(5)
    assert [(sid, why) for sid, why, _ in finished] == [("s1", "over its limit")]
    assert finished[0][2] is not threading.current_thread()


def test_a_checkpoint_before_a_write_without_a_thread_refuses_the_write_and_the_reader_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Policy before_writes: the checkpoint's thread could not start. Before,
    the RuntimeError ended the session's one control reader unseen."""
    from dispatchd import protocol
    from dispatchd.daemon.checkpoints import requests

    sent: list[Any] = []
    control = types.SimpleNamespace(send=sent.append)
    session = types.SimpleNamespace(id="s1", send_lock=threading.Lock())
    msg = protocol.AcquireWriteLock(id=7, checkpoint=True, tool="write_file")
    monkeypatch.setattr(requests.threading, "Thread", _Refused)
    requests.before_write(None, session, msg, control)  # type: ignore[arg-type]  # returns: no exception
    monkeypatch.undo()
    assert len(sent) == 1 and isinstance(sent[0], protocol.ErrorReply)
    assert (sent[0].id, sent[0].code) == (7, "checkpoint_refused")
    assert sent[0].message.startswith("the checkpoint before this write could not be taken: the daemon cannot "
                                      "start a thread (can't start new thread)")


@pytest.mark.parametrize("recorded", ["worker", "stack", "nothing"])
def test_a_replacement_that_failed_after_its_sandbox_was_recorded_ends_that_sandbox(recorded: str) -> None:
    """A network switch that replaces the sandbox: the old one wound down,
    the new one's worker (or stack) recorded, then a later step failed.
    Before, the session was only discarded: the new sandbox, its stack's way
    out included, ran on unowned."""
    from dispatchd.daemon import switching

    wound: list[str] = []
    s: Any = switching.Switching.__new__(switching.Switching)
    s._ended = leftovers.EndedSessions()
    s._wind_down = lambda session: wound.append(session.id)
    s._discard = lambda session: None
    session = types.SimpleNamespace(id="s1", worker=object() if recorded == "worker" else None,
                                    stack=object() if recorded == "stack" else None, move=lambda event: None)
    s._switch_failed(session, "on", wound_down=True)
    assert wound == ([] if recorded == "nothing" else ["s1"])  # the twin: nothing new, nothing to end
    assert s._ended.get("s1") == "its network could not be switched to on"
