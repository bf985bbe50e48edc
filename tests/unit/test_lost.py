"""Why a lost call's channel broke (``dispatch._lost``), and what ``Session``
tells its caller: a cause only when the daemon gave it. The decision is a
pure function; the session's re-attach loop runs against a fake daemon that
hands over socket pairs, each end closed, refused or held as a sandbox would."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import dispatch._session
from dispatch import Result, Session
from dispatch._lost import Channel, cause, ended, hung_up, refusal
from dispatch.errors import ConnectionLost, RequestFailed, RequestTimeout
from dispatchd import protocol as p
from tests.unit.test_protocol import PROTECTIONS

SID = "a1b2c3"
BUSY = "the session's tool server cannot start a thread for this channel (can't start new thread)"
REPLACED = "the session's sandbox was replaced (its network was switched); the call's processes were ended"
LIVES_ON = ("the call's channel closed, yet the session's sandbox lives on: dispatchd had not replaced it, and a "
            "new channel to it stayed open; the cause is not known")
TOOLS = [p.ToolSchema(name="read_file", description="Read.", parameters={"type": "object"}, risk="read"),
         p.ToolSchema(name="write_file", description="Write.", parameters={"type": "object"}, risk="write")]


def _stopped(waited: float, last: str = "") -> str:
    return (f"its sandbox stopped answering: the call's channel closed, and each channel attached in the {waited:g} s "
            f"since closed at once{last}; dispatchd had not yet seen the sandbox end, and had not replaced it")


# --- the decision ---------------------------------------------------------------


def test_a_higher_sandbox_number_gives_the_daemons_reason() -> None:
    assert cause(1, 2, p.REPLACED_NETWORK, hung_up=False) == REPLACED
    assert cause(1, 3, "its sandbox was moved", hung_up=True) == \
        "the session's sandbox was replaced (its sandbox was moved); the call's processes were ended"  # a word not known here
    assert cause(1, 2, "", hung_up=False) == \
        "the session's sandbox was replaced (dispatchd gave no reason); the call's processes were ended"


def test_the_same_sandbox_closing_new_channels_is_asked_again_until_the_wait_is_over() -> None:
    assert cause(2, 2, p.REPLACED_NETWORK, hung_up=True) is None
    assert cause(2, 2, p.REPLACED_NETWORK, hung_up=True, waited_s=5.0) == _stopped(5)
    assert cause(1, 1, "", hung_up=True, refused=f"busy: {BUSY}", waited_s=5.0) == \
        _stopped(5, f", the last refused (busy: {BUSY})")


def test_the_same_sandbox_holding_a_new_channel_is_not_said_replaced() -> None:
    assert cause(2, 2, p.REPLACED_NETWORK, hung_up=False) == LIVES_ON
    # The allowed twin: one more, and the same reason is the cause.
    assert cause(2, 3, p.REPLACED_NETWORK, hung_up=False) == REPLACED


def test_a_daemon_that_does_not_number_its_sandboxes_is_not_made_to_say_more() -> None:
    assert cause(0, 0, "", hung_up=False) == (
        "the call's channel closed, and a new channel to the session's sandbox stayed open; this dispatchd does not "
        "say whether it had replaced the sandbox meanwhile (a network switch)")
    assert cause(0, 0, "", hung_up=True) is None


def test_an_attach_refused_as_ended_or_a_daemon_gone_says_the_session_is_over() -> None:
    assert ended(RequestFailed("unknown_session", "no such session: 'a1' (it has ended: it was closed)"), None)
    assert ended(ConnectionLost("lost the connection to dispatchd at /s: the peer closed the connection"), None)
    # The twins: no answer in time, another refusal, or a bridge gone (the session may live on over there).
    assert not ended(RequestTimeout("dispatchd at /s did not answer within 30 s"), None)
    assert not ended(RequestFailed("bad_request", "odd"), None)
    assert not ended(ConnectionLost("lost the connection"), "the bridge to far went away")


# --- looking at a new channel ------------------------------------------------------


def test_a_channel_closed_after_a_refusal_is_hung_up_and_says_why_and_keeps_its_bytes() -> None:
    ours, theirs = socket.socketpair()
    p.FrameSocket(theirs).send(p.ErrorReply(id=0, code="busy", message=BUSY))
    theirs.close()
    channel = Channel(ours, 4)
    try:
        assert hung_up(channel, 0.0)
        assert refusal(channel) == f"busy: {BUSY}"
        assert refusal(channel) == f"busy: {BUSY}"  # peeked: still there for a reader
        assert channel._frames.recv(p.channel_reply_decoder) == p.ErrorReply(id=0, code="busy", message=BUSY)
    finally:
        channel.close()


def test_a_held_channel_is_not_hung_up_and_says_nothing() -> None:
    ours, theirs = socket.socketpair()
    channel = Channel(ours, 4)
    try:
        assert not hung_up(channel, 0.05)
        assert refusal(channel) == ""
        theirs.close()  # the twin: closed without a word
        assert hung_up(channel, 0.0)
        assert refusal(channel) == ""
    finally:
        channel.close()
        theirs.close()


# --- the session's loop, against a fake daemon -----------------------------------------


class FakeDaemon:
    """Answers each ``Attach`` with the next of ``answers`` (the last one
    again once they run out): ``(sandbox, replaced, peer)``, the peer end
    "held", "closed" or "refused", "takes" (reads a call, then closes: the
    call is lost in flight) or "answers" (replies to a call, ``ran`` counts
    them); or an exception to raise."""

    call_margin = 1.0

    def __init__(self, *answers: tuple[int, str, str] | Exception) -> None:
        self.answers = list(answers)
        self.attaches = 0
        self.ran = 0
        self.closes = 0
        self.held: list[socket.socket] = []

    def attached(self, sandbox: int, replaced: str, peer: str) -> tuple[p.Attached, int]:
        ours, theirs = socket.socketpair()
        if peer == "refused":
            p.FrameSocket(theirs).send(p.ErrorReply(id=0, code="busy", message=BUSY))
        if peer in ("takes", "answers"):
            threading.Thread(target=self._serve_one, args=(theirs, peer == "answers"), daemon=True).start()
        elif peer == "held":
            self.held.append(theirs)
        else:
            theirs.close()
        info = p.SessionInfo(id=SID, worktree="/wt", policy="default", network="off", created=1.5,
                             protections=PROTECTIONS, sandbox=sandbox, replaced=replaced)
        return p.Attached(id=1, session=info, tools=TOOLS), ours.detach()

    def _serve_one(self, sock: socket.socket, answer: bool) -> None:
        with sock:
            frames = p.FrameSocket(sock)
            call = frames.recv(p.channel_request_decoder)
            if answer and isinstance(call, p.CallTool):
                self.ran += 1
                frames.send(p.ToolReply(id=call.id, success=True, output="ran"))

    def _daemon_request(self, build: Any) -> tuple[Any, int | None]:
        assert isinstance(build(7), p.Attach)
        self.attaches += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return self.attached(*answer)

    def _bridge_gone(self) -> str | None:
        return None

    def close_session(self, session_id: str) -> list[dict[str, Any]]:
        self.closes += 1
        return []

    def session_infos(self) -> list[p.SessionInfo]:
        return []

    def close(self) -> None:
        for sock in self.held:
            sock.close()


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's waits shortened: the same loop, in a fraction of a second."""
    monkeypatch.setattr(dispatch._session, "LOST_WAIT_S", 0.3)
    monkeypatch.setattr(dispatch._session, "HELD_S", 0.05)


@contextlib.contextmanager
def _opened(*answers: tuple[int, str, str] | Exception, owned: bool = False) -> Iterator[tuple[Session, FakeDaemon]]:
    """A session handle attached as its open would, to the first of
    ``answers`` (the daemon answers later attaches with the rest)."""
    daemon = FakeDaemon(*answers)
    reply, fd = daemon._daemon_request(lambda rid: p.Attach(id=rid, session=SID))
    session = Session(daemon, reply.session, owned=owned, attached=(reply, fd))
    try:
        yield session, daemon
    finally:
        session.close()
        daemon.close()


def _lose_a_call(*answers: tuple[int, str, str] | Exception, tool: str = "read_file") -> tuple[Result, FakeDaemon]:
    """A session attached to sandbox 1 whose channel is closed under its
    call (the request read, no reply); the daemon then answers each attach
    with ``answers``."""
    with _opened((1, "", "takes"), *answers) as (session, daemon):
        return session.registry.get(tool).call({"path": "a.txt"}), daemon


def test_a_call_lost_to_a_switch_says_the_switch(fast: None) -> None:
    result, daemon = _lose_a_call((2, p.REPLACED_NETWORK, "held"))
    assert result.error == f"the sandbox of session {SID} went away during read_file: {REPLACED} " \
                           f"(the peer closed the connection)", result.error
    assert dict(result.metadata) == {"lost": True}
    assert daemon.attaches == 2  # the open's, and one: the daemon's number says it at once


def test_a_call_that_never_reached_the_sandbox_is_sent_once_to_the_new_one(fast: None) -> None:
    """Its channel had closed before it (a broken pipe: another client's
    switch replaced the sandbox): attached again, sent once, run once. The
    twin above: a call lost in flight is not sent again."""
    with _opened((1, "", "closed"), (2, p.REPLACED_NETWORK, "answers")) as (session, daemon):
        result = session.registry.get("read_file").call({"path": "a.txt"})
        assert (result.is_success, result.output) == (True, "ran"), result
        assert (daemon.attaches, daemon.ran) == (2, 1)
    # Sent again once only: the new channel closed too, and the call is
    # said lost (the attach after it finds sandbox 3).
    with _opened((1, "", "closed"), (2, p.REPLACED_NETWORK, "closed"), (3, p.REPLACED_NETWORK, "held")) \
            as (session, daemon):
        result = session.registry.get("read_file").call({"path": "a.txt"})
        assert result.error == f"the sandbox of session {SID} went away during read_file: {REPLACED} " \
                               "([Errno 32] Broken pipe)", result.error
        assert (daemon.attaches, daemon.ran) == (3, 0)


def test_a_call_lost_by_a_sandbox_not_yet_seen_gone_is_not_said_switched(fast: None) -> None:
    result, daemon = _lose_a_call((1, "", "closed"))
    assert result.error == f"the sandbox of session {SID} went away during read_file: {_stopped(0.3)} " \
                           f"(the peer closed the connection)", result.error
    assert "switched" not in result.error and "replaced (" not in result.error
    assert daemon.attaches > 2  # asked again while the new channels closed at once


def test_a_call_lost_to_a_busy_sandbox_says_what_it_answered(fast: None) -> None:
    result, _ = _lose_a_call((1, "", "refused"))
    assert result.error == f"the sandbox of session {SID} went away during read_file: " \
                           f"{_stopped(0.3, f', the last refused (busy: {BUSY})')} (the peer closed the connection)"


def test_a_session_that_ends_meanwhile_is_said_ended(fast: None) -> None:
    ended = RequestFailed("unknown_session", f"no such session: '{SID}' (it has ended: its tool server was killed "
                                             "by signal 9 (SIGKILL))")
    result, daemon = _lose_a_call((1, "", "closed"), (1, "", "closed"), ended)
    assert result.error == f"the sandbox of session {SID} went away during read_file: no such session: '{SID}' (it " \
                           "has ended: its tool server was killed by signal 9 (SIGKILL)) (the peer closed the connection)"
    assert dict(result.metadata) == {"lost": True, "session_ended": str(ended)}
    assert daemon.attaches == 4


def test_a_session_found_over_says_so_on_each_call_and_is_not_closed_again(fast: None) -> None:
    gone = RequestFailed("unknown_session", f"no such session: '{SID}' (it has ended: it was closed)")
    with _opened((1, "", "takes"), gone, owned=True) as (session, daemon):
        first = session.registry.get("read_file").call({"path": "a.txt"})
        assert dict(first.metadata) == {"lost": True, "session_ended": str(gone)}
        again = session.registry.get("read_file").call({"path": "a.txt"})  # its channel broken: attached first
        assert again.error == f"session {SID} is not available: {gone}"
        assert dict(again.metadata) == {"session_ended": str(gone)}
        session.close()
        assert daemon.closes == 0  # nothing left to close, and the daemon may be gone
    # The twin: an owned session not found over is closed by its handle.
    with _opened((1, "", "held"), owned=True) as (session, daemon):
        session.close()
        assert daemon.closes == 1


def test_a_daemon_gone_says_the_session_ended_with_it_and_a_timeout_does_not(fast: None) -> None:
    result, _ = _lose_a_call(ConnectionLost("lost the connection to dispatchd at /s: the peer closed the connection"))
    why = "dispatchd is gone (lost the connection to dispatchd at /s: the peer closed the connection); the " \
          "session ended with it"
    assert result.error == f"the sandbox of session {SID} went away during read_file: {why} (the peer closed the " \
                           "connection)"
    assert dict(result.metadata) == {"lost": True, "session_ended": why}
    result, _ = _lose_a_call(RequestTimeout("dispatchd at /s did not answer within 30 s"))
    assert dict(result.metadata) == {"lost": True}


def test_a_sandbox_that_lives_on_is_said_so(fast: None) -> None:
    result, _ = _lose_a_call((1, "", "held"))
    assert result.error == f"the sandbox of session {SID} went away during read_file: {LIVES_ON} " \
                           f"(the peer closed the connection)"


def test_a_write_lost_keeps_its_outcome_unknown(fast: None) -> None:
    result, _ = _lose_a_call((2, p.REPLACED_NETWORK, "held"), tool="write_file")
    assert result.error == (f"the sandbox of session {SID} went away during write_file: {REPLACED}; outcome "
                            "unknown: the file may hold its old content or the new one (never a mix): re-read the "
                            "file (the peer closed the connection)")
    assert dict(result.metadata) == {"lost": True, "outcome_unknown": True}


def test_a_call_that_broke_beside_one_already_reattached_attaches_no_more(fast: None) -> None:
    with _opened((1, "", "held"), (2, p.REPLACED_NETWORK, "held")) as (session, daemon):
        old = session._channel
        assert old is not None and old.sandbox == 1
        session._attach()  # another call's loss attached again first: sandbox 2
        result = session._lost("read_file", ConnectionLost("the peer closed the connection"), old)
        assert result.error == f"the sandbox of session {SID} went away during read_file: {REPLACED} " \
                               "(the peer closed the connection)"
        assert daemon.attaches == 2


def test_a_handle_closed_under_its_call_does_not_blame_the_sandbox(fast: None) -> None:
    with _opened((1, "", "held")) as (session, daemon):
        old = session._channel
        assert old is not None
        session.close()
        result = session._lost("read_file", ConnectionLost("closed"), old)
        assert result.error == f"read_file: this handle of session {SID} was closed: close() or detach() ran " \
                               "meanwhile (closed)"
        assert daemon.attaches == 1
