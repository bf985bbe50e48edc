"""The daemon's answer to a request whose reply cannot be encoded
(daemon/server.py, protocol/frames.py ``Unencodable``): an error reply that
says which request and why, the reply in the log, and the connection kept.
Before, the connection was dropped (the client saw it lost), and a report
every ``status`` carries took ``status`` down for every client with it.

The daemon makes every name it reports readable where it is recorded
(fsnames.py; tests/integration/test_names_not_utf8.py drives those with a
real daemon); this is the net under a place that would not, driven here
through the server's own loop on a socket pair."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import pytest

from dispatchd import protocol
from dispatchd.daemon.server import Server


class _Holders:
    def release(self, conn_id: int) -> None:
        pass


class _Manager:
    holders = _Holders()


class _ReportingServer(Server):
    """``status`` answers with a report naming ``bad\\xff`` as Python reads it."""

    def _route(self, req: Any, conn_id: int = 0) -> Any:
        if isinstance(req, protocol.Status):
            return protocol.ClosedReply(id=req.id, protected=[protocol.ProtectedItem(path=self.path, why="moved")])
        return super()._route(req, conn_id)

    path = ""


@pytest.mark.parametrize(("path", "answered"), [("/w/bad\udcff/.envrc", False), ("/w/caf\u00e9/.envrc", True)],
                         ids=["not-utf8", "utf8"])
def test_a_reply_that_cannot_be_encoded_is_answered_and_the_connection_kept(
        caplog: pytest.LogCaptureFixture, path: str, answered: bool) -> None:
    ours, theirs = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX)
    server = _ReportingServer(listener, _Manager(), None, "/run/d.sock", None)  # type: ignore[arg-type]
    server.path = path
    server.park_after_s = 60.0
    with caplog.at_level(logging.ERROR, logger="dispatchd.server"):
        served = threading.Thread(target=server._serve_connection, args=(theirs,), daemon=True)
        served.start()
        client = protocol.FrameSocket(ours)
        client.send(protocol.Hello(id=1, version=protocol.PROTOCOL_VERSION))
        assert isinstance(client.recv(protocol.daemon_reply_decoder), protocol.HelloOk)
        client.send(protocol.Status(id=2))
        reply = client.recv(protocol.daemon_reply_decoder)
        if answered:  # the twin: sent as it is
            assert isinstance(reply, protocol.ClosedReply) and reply.protected[0].path == path
        else:
            assert reply == protocol.ErrorReply(id=2, code="internal", message=(
                "internal error: the daemon's reply to Status cannot be sent: ClosedReply: text that is not UTF-8 "
                "(surrogates not allowed) (/w/bad\\xff/.envrc); what was asked was done, and the daemon's log "
                "holds the reply (event=reply_unencodable)"))
            [line] = [r.getMessage() for r in caplog.records if "event=reply_unencodable" in r.getMessage()]
            assert line.startswith("event=reply_unencodable request=Status error=ClosedReply: text that is not "
                                   "UTF-8 (surrogates not allowed) reply=ClosedReply(id=2, protected=[")
            assert "'/w/bad\\udcff/.envrc'" in line  # its repr: every character, escaped
        client.send(protocol.Hello(id=3, version=protocol.PROTOCOL_VERSION))  # the same connection serves on
        again = client.recv(protocol.daemon_reply_decoder)
        assert isinstance(again, protocol.HelloOk) and again.id == 3
    ours.close()
    served.join(10)
    listener.close()


def test_a_reply_over_the_frame_limit_is_answered_and_the_connection_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply past ``MAX_FRAME`` (a report unbounded by a bug) closed the
    connection, every ``status`` with it: it is answered with an error
    instead, and the connection serves on. (The limit is lowered here: a
    real one is 64 MiB.)"""
    monkeypatch.setattr(protocol.frames, "MAX_FRAME", 4096)
    ours, theirs = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX)
    server = _ReportingServer(listener, _Manager(), None, "/run/d.sock", None)  # type: ignore[arg-type]
    server.path, server.park_after_s = "/w/" + "x" * 8000, 60.0
    served = threading.Thread(target=server._serve_connection, args=(theirs,), daemon=True)
    served.start()
    try:
        reply = _hello_then_status(protocol.FrameSocket(ours))
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "internal"
        assert reply.message.startswith("internal error: the daemon's reply to Status cannot be sent: frame of ")
        assert "-byte limit; what was asked was done" in reply.message
    finally:
        ours.close()
        served.join(10)
        listener.close()


def _hello_then_status(client: protocol.FrameSocket) -> Any:
    """A client's hello, a status (the reply returned), then a second hello
    the same connection must still answer."""
    client.send(protocol.Hello(id=1, version=protocol.PROTOCOL_VERSION))
    assert isinstance(client.recv(protocol.daemon_reply_decoder), protocol.HelloOk)
    client.send(protocol.Status(id=2))
    reply = client.recv(protocol.daemon_reply_decoder)
    client.send(protocol.Hello(id=3, version=protocol.PROTOCOL_VERSION))
    again = client.recv(protocol.daemon_reply_decoder)
    assert isinstance(again, protocol.HelloOk) and again.id == 3
    return reply


class _ThreadlessServer(Server):
    """``status`` meets the user's process limit (a thread it cannot start), or a bug."""

    error = RuntimeError("can't start new thread")

    def _route(self, req: Any, conn_id: int = 0) -> Any:
        if isinstance(req, protocol.Status):
            raise self.error
        return super()._route(req, conn_id)


@pytest.mark.parametrize(("error", "code"), [(RuntimeError("can't start new thread"), "busy"),
                                             (RuntimeError("dictionary changed size"), "internal")],
                         ids=["no-thread", "a-bug"])
def test_a_thread_the_daemon_cannot_start_is_said_as_the_users_limit_not_a_bug(error: RuntimeError,
                                                                                code: str) -> None:
    server = _ThreadlessServer(socket.socket(socket.AF_UNIX), _Manager(), None, "/run/d.sock", None)  # type: ignore[arg-type]
    server.error = error
    reply, _ = server._handle(protocol.Status(id=3))
    assert isinstance(reply, protocol.ErrorReply) and reply.code == code, reply
    if code == "busy":
        assert reply.message.startswith("dispatchd cannot start a thread (can't start new thread): the user's "
                                        "processes are at the user's limit (RLIMIT_NPROC "), reply.message
    else:
        assert reply.message == "internal error: RuntimeError: dictionary changed size"
