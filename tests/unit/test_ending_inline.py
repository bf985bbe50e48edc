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


@pytest.mark.parametrize("watch_runs", [False, True])
def test_a_session_is_not_let_sleep_while_the_sleepers_watch_cannot_start(watch_runs: bool) -> None:
    """``MaySleep`` answered ``StayAwake`` (asked again at its next idle
    time) while the one watch over sleeping sessions cannot start: no
    session sleeps unwatched. The twin: with the watch running it is let
    sleep (``Sleep`` sent; the hand-over itself is the integration suite's)."""
    from dispatchd import protocol
    from dispatchd.daemon import napping

    sent: list[Any] = []

    class Control:
        sock = types.SimpleNamespace(settimeout=lambda s: None)

        def send(self, msg: Any) -> None:
            sent.append(msg)

        def recv(self, decoder: Any) -> None:
            raise OSError("the stand-in has nothing to hand over")

        def close(self) -> None:
            pass

    control = Control()
    n: Any = napping.Napping.__new__(napping.Napping)
    n.accepting = True
    n.sleepers = types.SimpleNamespace(ensure=lambda: watch_runs)
    n._finish = lambda session, why, event: None
    worker = types.SimpleNamespace(kill=lambda: None)
    session = types.SimpleNamespace(
        id="s1", lock=threading.Lock(), send_lock=threading.Lock(), added=0, state=State.READY, control=control,
        kit=[3], worker=worker, plan=object(), wakes=0,
        policy=types.SimpleNamespace(limits=types.SimpleNamespace(max_wakes=1000)),
        drop_watch=lambda: None, ended=threading.Event())
    n._sleep(session, control, 0)
    assert not session.lock.locked()
    if watch_runs:
        assert isinstance(sent[0], protocol.Sleep)
    else:
        assert sent == [protocol.StayAwake(for_good=False)] and session.control is control
