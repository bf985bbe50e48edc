"""A call whose sandbox goes away under it says why, in the daemon's words
(``dispatch._lost``): a network switch that replaced the sandbox is named as
the cause, and only then; a tool server killed from outside, which the
daemon did not replace, is never said switched. Both modes: in degraded mode
every switch replaces the sandbox, in full mode one to or from "domains" does;
a channel cut while its sandbox runs on is said to be just that."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, shell, wait_until
from tests.integration.test_lifetimes import _tool_server

# A switch that replaces the sandbox, per mode: (network, domains).
REPLACING = {"full": ("domains", ["example.com"]), "degraded": ("on", None)}


@pytest.fixture(scope="module", params=["full", "degraded"])
def mode_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Daemon]]:
    extra = ("--no-user-namespaces",) if request.param == "degraded" else ()
    d = Daemon(tmp_path_factory.mktemp(f"lost-{request.param}"), *extra)
    try:
        yield request.param, d
    finally:
        assert d.stop() == 0, d.log()


def _in_flight(session: dispatch.Session, worktree: Path) -> tuple[threading.Thread, list[dispatch.Result]]:
    """A ``sleep 60`` call, seen started (its marker file written)."""
    marker = worktree / "started"
    marker.unlink(missing_ok=True)
    results: list[dispatch.Result] = []
    call = threading.Thread(target=lambda: results.append(shell(session, "touch started; exec sleep 60", timeout=90)))
    call.start()
    assert wait_until(marker.exists), "the call never started"
    return call, results


def test_a_call_in_flight_when_a_switch_replaces_the_sandbox_names_the_switch(
        mode_daemon: tuple[str, Daemon], worktree: Path) -> None:
    mode, d = mode_daemon
    network, domains = REPLACING[mode]
    with d.connect() as client, d.connect() as other, client.open_session(str(worktree)) as s:
        assert (s.info["sandbox"], s.info["replaced"]) == (1, "")
        call, results = _in_flight(s, worktree)
        assert "the sandbox was replaced" in other.set_network(s.id, network, domains=domains)["note"]
        call.join(60)
        (lost,) = results
        assert lost.error.startswith(
            f"the sandbox of session {s.id} went away during shell_exec: the session's sandbox was replaced (its "
            "network was switched); the call's processes were ended ("), lost.error
        assert dict(lost.metadata) == {"lost": True}
        assert (s.info["sandbox"], s.info["replaced"]) == (2, "its network was switched")
        # The twin: the same handle calls on, served by the new sandbox.
        assert shell(s, "echo again").metadata["stdout"] == "again\n"
        if mode == "full":
            # A switch made in place loses no call, and the number stays.
            call, results = _in_flight(s, worktree)
            assert "changed in place" in other.set_network(s.id, "domains", domains=["example.org"])["note"]
            s.cancel()  # ends the call in the sandbox: it answers, over the channel it came on
            call.join(60)
            assert results[0].metadata["cancelled"] is True, results[0]
            assert (s.status()["sandbox"], s.status()["replaced"]) == (2, "its network was switched")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_call_made_after_another_clients_switch_runs_once_in_the_new_sandbox(
        mode_daemon: tuple[str, Daemon], worktree: Path) -> None:
    """Its request never reached the old sandbox (its channel had closed: a
    broken pipe), so it is sent once to the new one: it runs, once. The twin,
    a call in flight through such a switch, is lost (the test above)."""
    mode, d = mode_daemon
    network, domains = REPLACING[mode]
    runs = worktree / "runs"
    runs.unlink(missing_ok=True)
    with d.connect() as client, d.connect() as other, client.open_session(str(worktree)) as s:
        first = shell(s, "echo run >> runs; echo ok")
        assert first.metadata["stdout"] == "ok\n", first
        old = d.worker_pid(s.id)
        assert "the sandbox was replaced" in other.set_network(s.id, network, domains=domains)["note"]
        assert wait_until(lambda: _gone(old)), "the old sandbox lives on"
        after = shell(s, "echo run >> runs; echo ok")
        assert after.is_success and after.metadata["stdout"] == "ok\n", after
        assert "lost" not in after.metadata
        assert runs.read_text() == "run\nrun\n"  # the call ran once, in the new sandbox
        assert (s.info["sandbox"], s.info["replaced"]) == (2, "its network was switched")


def test_a_call_whose_tool_server_is_killed_is_not_said_switched(mode_daemon: tuple[str, Daemon],
                                                                  worktree: Path) -> None:
    mode, d = mode_daemon
    with d.connect() as client:
        s = client.open_session(str(worktree))
        assert shell(s, "true").is_success
        server = _tool_server(d)
        call, results = _in_flight(s, worktree)
        os.kill(server, signal.SIGKILL)
        call.join(60)
        (lost,) = results
        killed = re.escape("its tool server was killed by signal 9 (SIGKILL)" +
                           (" from outside the session" if mode == "full" else ""))
        # The daemon's reason, as it ended the session (before or after the
        # client's attach reached it); on a machine so loaded that the daemon
        # had not seen the end 5 s later, that is what the call says instead.
        causes = (rf"no such session: '{s.id}' \(it has ended: {killed}\)", rf"session {s.id} has ended: {killed}",
                  re.escape("its sandbox stopped answering: the call's channel closed, and each channel attached "
                            "in the 5 s since closed at once; dispatchd had not yet seen the sandbox end, and had "
                            "not replaced it"))
        assert re.fullmatch(rf"the sandbox of session {s.id} went away during shell_exec: ({'|'.join(causes)}) "
                            r"\(.+\)", lost.error), lost.error
        assert "switched" not in lost.error and "replaced (" not in lost.error
        # The session is over, and the metadata says why, when the daemon said so.
        ended = {"session_ended": lost.metadata.get("session_ended", "")} if "has ended" in lost.error else {}
        assert dict(lost.metadata) == {"lost": True, **ended}
        assert not ended or re.fullmatch(f"{causes[0]}|{causes[1]}", ended["session_ended"]), ended
        s.detach()


def test_a_call_whose_channel_breaks_while_its_sandbox_lives_on_is_not_said_switched(
        mode_daemon: tuple[str, Daemon], worktree: Path) -> None:
    """The channel cut from this side (as a sandbox's end of it would, with
    the sandbox still running): the daemon still numbers the same sandbox,
    which takes the new channel and serves the next call."""
    _, d = mode_daemon
    with d.connect() as client, client.open_session(str(worktree)) as s:
        call, results = _in_flight(s, worktree)
        channel = s._channel
        assert channel is not None
        channel._frames.sock.shutdown(socket.SHUT_RDWR)
        call.join(60)
        (lost,) = results
        assert lost.error.startswith(
            f"the sandbox of session {s.id} went away during shell_exec: the call's channel closed, yet the "
            "session's sandbox lives on: dispatchd had not replaced it, and a new channel to it stayed open; the "
            "cause is not known ("), lost.error
        assert dict(lost.metadata) == {"lost": True}
        assert (s.info["sandbox"], s.info["replaced"]) == (1, "")
        # The twin: served by the same sandbox over the new channel.
        assert shell(s, "echo again").metadata["stdout"] == "again\n"
