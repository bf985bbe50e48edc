"""A command's Result and the proxy's refusals (``metadata["network_denied"]``):
none is lost to a control loop slow to run.

The daemon sends ``NetworkDenied`` on the control channel before the refused
process hears of it; the call, once its tool returns, waits
(``Control.settle``) until the control loop has recorded every frame on the
channel. Here a real tool server's control loop (``tool_server._control_loop``,
a thread of this process) reads a socketpair whose other end plays the
daemon, and is held at each place it can be found late: before it reads the
frame, with half a frame read, and with the frame read but not yet recorded.
Each hold lasts longer than the old wait (at most 0.1 s while the socket had
unread bytes), which lost the refusal in all three. The twins: an idle
channel does not wait, and a stuck loop is given up on after the bound.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dispatchd import protocol
from dispatchd.fdwait import readable
from dispatchd.tools.base import Outcome
from dispatchd.worker import tool_server
from dispatchd.worker.control import Control
from tests.unit.test_fastread import plan

HOLD_S = 1.0  # how long the loop is held: ten times the old wait
REFUSED = protocol.NetworkDenied(host="notallowed.invalid", port=443,
                                 allow="dispatch network s1 domains --domains example.org,notallowed.invalid")


@dataclass
class Loop:
    """A tool server whose control loop runs on a thread; ``daemon`` is the
    channel's other end. ``hold(name)`` makes the server's method ``name``
    wait, the next time the loop calls it, until ``release`` (``entered`` is
    set once it waits)."""

    server: Any
    daemon: socket.socket
    thread: threading.Thread
    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    def hold(self, name: str) -> None:
        real: Callable[..., None] = getattr(self.server, name)
        armed = [True]

        def held(*args: Any) -> None:
            if armed[0]:
                armed[0] = False
                self.entered.set()
                self.gate.wait(30)
            real(*args)

        setattr(self.server, name, held)

    def release_in(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.gate.set)
        timer.start()
        return timer

    def refused_since(self, started: float) -> Outcome:
        """What a command's Result becomes when its call, begun at
        ``started``, ends now (``Calls._with_denials``)."""
        out: Outcome = self.server._with_denials(Outcome(True, "out\n", None, {}), started)
        return out


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    daemon, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worktree = tmp_path / "wt"
    worktree.mkdir()
    server = tool_server._Server(plan(str(worktree), ["shell_exec"]),
                                 Control(protocol.FrameSocket(theirs, fds=True)))
    thread = threading.Thread(target=tool_server._control_loop, args=(server,), daemon=True)
    thread.start()
    made = Loop(server, daemon, thread)
    try:
        yield made
    finally:
        made.gate.set()
        daemon.close()  # the daemon gone: the loop ends
        thread.join(10)
        assert not thread.is_alive()
        theirs.close()
        if server.ctx.root_fd >= 0:
            os.close(server.ctx.root_fd)
        os.close(server.records_wake)


def _assert_refused(out: Outcome) -> None:
    assert out.metadata["network_denied"] == ["notallowed.invalid:443"]
    assert out.output == ("out\n[network: dispatchd refused notallowed.invalid:443 (not in this session's domains); "
                          "to allow: dispatch network s1 domains --domains example.org,notallowed.invalid]")


def test_a_refusal_the_loop_has_not_read_yet_is_waited_for(loop: Loop) -> None:
    loop.hold("housekeeping")  # what the loop does before it reads: a thread not yet run, in effect
    started = time.monotonic()
    loop.daemon.sendall(protocol.encode(REFUSED))
    assert loop.entered.wait(10)
    loop.release_in(HOLD_S)
    out = loop.refused_since(started)
    _assert_refused(out)
    assert time.monotonic() - started >= HOLD_S * 0.9  # it waited for the loop, not for a time


def test_a_refusal_half_read_is_waited_for(loop: Loop) -> None:
    frame = protocol.encode(REFUSED)
    started = time.monotonic()
    loop.daemon.sendall(frame[:7])  # the header and a little: the loop reads it and waits for the rest
    deadline = time.monotonic() + 10
    while readable(loop.server.control.frames.fileno(), 0) or not loop.server.control.frames.buffered():
        assert time.monotonic() < deadline, "the loop never read the frame's start"
        time.sleep(0.001)
    threading.Timer(HOLD_S, loop.daemon.sendall, args=(frame[7:],)).start()
    _assert_refused(loop.refused_since(started))


def test_a_refusal_read_but_not_yet_recorded_is_waited_for(loop: Loop) -> None:
    loop.hold("note_denied")
    started = time.monotonic()
    loop.daemon.sendall(protocol.encode(REFUSED))
    assert loop.entered.wait(10)  # read: the socket and the buffer are empty, the refusal not yet recorded
    assert not readable(loop.server.control.frames.fileno(), 0) and not loop.server.control.frames.buffered()
    loop.release_in(HOLD_S)
    _assert_refused(loop.refused_since(started))


def test_an_idle_channel_is_not_waited_for_and_the_window_is_the_calls(loop: Loop) -> None:
    """The twin: nothing on the channel, nothing waited for. A refusal
    recorded before a call began is not its own; one during two calls at
    once is both's."""
    before = time.monotonic()
    loop.daemon.sendall(protocol.encode(REFUSED))
    deadline = time.monotonic() + 10
    while not loop.server.denials:
        assert time.monotonic() < deadline, "the loop never recorded the refusal"
        time.sleep(0.001)
    after = time.monotonic()
    out = loop.refused_since(after)
    took = time.monotonic() - after
    assert "network_denied" not in out.metadata and out.output == "out\n"
    assert took < 1.0  # no wait for the loop (the bound is SETTLE_MOST_S)
    first, second = loop.refused_since(before), loop.refused_since(before)
    _assert_refused(first)
    _assert_refused(second)


def test_a_stuck_loop_is_given_up_on_and_an_ended_one_not_waited_for(loop: Loop) -> None:
    loop.hold("note_denied")
    loop.daemon.sendall(protocol.encode(REFUSED))
    assert loop.entered.wait(10)
    started = time.monotonic()
    assert loop.server.control.settle(most_s=0.3) is False
    assert time.monotonic() - started >= 0.3
    loop.gate.set()
    assert loop.server.control.settle(most_s=10) is True
    loop.daemon.close()  # the daemon gone: the loop ends, and the channel reads as readable for good
    loop.thread.join(10)
    started = time.monotonic()
    assert loop.server.control.settle(most_s=10) is True
    assert time.monotonic() - started < 1.0
