"""The daemon's socket: accept, check the peer, speak the protocol, route requests.

Guarantees:
- only peers with the daemon's own uid are served (``SO_PEERCRED``); others
  are refused with an error reply and the connection closed;
- the first message must be a ``Hello`` with our protocol version;
- every request gets exactly one reply with its ``id``; a request we cannot
  decode gets an ``ErrorReply`` (code ``bad_request``) and the connection stays;
- broken framing (garbage length, oversized frame, EOF mid-frame) closes that
  connection only; every other client keeps being served;
- each connection has its own thread (blocking I/O: measured faster than
  asyncio for this request/response pattern, and tool calls do not come here).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Any

from dispatchd import __version__, protocol
from dispatchd.daemon.sessions import SessionManager
from dispatchd.errors import DispatchdError
from dispatchd.kernel import KernelFeatures
from dispatchd.tools.spec import schemas_for

log = logging.getLogger("dispatchd.server")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class Server:
    def __init__(
        self,
        listener: socket.socket,
        manager: SessionManager,
        kernel: KernelFeatures,
        socket_path: str,
        load_policy: Any,
    ) -> None:
        self.listener = listener
        self.manager = manager
        self.kernel = kernel
        self.socket_path = socket_path
        self.load_policy = load_policy
        self.stopping = threading.Event()
        self.uid = os.getuid()

    def serve_forever(self) -> None:
        self.listener.settimeout(0.1)  # to notice ``stopping`` promptly
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            conn.settimeout(None)
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()

    def _serve_connection(self, conn: socket.socket) -> None:
        frames = protocol.FrameSocket(conn)
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != self.uid:
                log.warning("event=peer_refused pid=%s uid=%s", pid, uid)
                frames.send(protocol.ErrorReply(id=0, code="forbidden",
                                                message=f"this daemon serves uid {self.uid} only"))
                return
            greeted = False
            while True:
                payload = frames.recv_payload()
                if payload is None:
                    return
                try:
                    req = protocol.decode(protocol.daemon_request_decoder, payload)
                except protocol.ProtocolError as exc:
                    frames.send(protocol.ErrorReply(id=protocol.request_id_of(payload), code="bad_request", message=str(exc)))
                    continue
                if not greeted:
                    if not isinstance(req, protocol.Hello) or req.version != protocol.PROTOCOL_VERSION:
                        got = f"version {req.version}" if isinstance(req, protocol.Hello) else type(req).__name__
                        frames.send(protocol.ErrorReply(id=req.id, code="bad_version", message=(
                            f"expected hello with protocol version {protocol.PROTOCOL_VERSION}, got {got}")))
                        return
                    greeted = True
                reply, fds = self._handle(req)
                try:
                    frames.send(reply, fds=[fd.fileno() for fd in fds])
                finally:
                    for fd in fds:
                        fd.close()
        except (protocol.ProtocolError, OSError) as exc:
            log.debug("event=connection_dropped reason=%s", exc)
        finally:
            frames.close()

    def _handle(self, req: Any) -> tuple[Any, list[socket.socket]]:
        rid = req.id
        try:
            if isinstance(req, protocol.Attach):
                # The one reply that carries an fd: the client's end of a
                # channel straight to the worker, so tool calls make one hop.
                session, sock, tools = self.manager.attach(req.session)
                return protocol.Attached(id=rid, session=session.info(), tools=tools), [sock]
            return self._route(req), []
        except DispatchdError as exc:
            return protocol.ErrorReply(id=rid, code=exc.code, message=exc.message), []
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("event=internal_error request=%s", type(req).__name__)
            return protocol.ErrorReply(id=rid, code="internal", message=f"internal error: {type(exc).__name__}: {exc}"), []

    def _route(self, req: Any) -> Any:
        m = self.manager
        if isinstance(req, protocol.Hello):
            return protocol.HelloOk(id=req.id, version=protocol.PROTOCOL_VERSION, daemon_version=__version__)
        if isinstance(req, protocol.OpenSession):
            return protocol.SessionReply(id=req.id, session=m.open(req.worktree, req.policy, req.network, req.ports, req.bind_ports).info())
        if isinstance(req, protocol.CloseSession):
            m.close(req.session)
            return protocol.OkReply(id=req.id)
        if isinstance(req, protocol.ReleaseWriteLock):
            return protocol.SessionReply(id=req.id, session=m.release_write_lock(req.session).info())
        if isinstance(req, protocol.ListSessions):
            return protocol.SessionsReply(id=req.id, sessions=[s.info() for s in m.list()])
        if isinstance(req, protocol.SetNetwork):
            return protocol.SessionReply(id=req.id, session=m.set_network(req.session, req.network, req.ports, req.bind_ports).info())
        if isinstance(req, protocol.Status):
            return protocol.StatusReply(id=req.id, daemon_version=__version__, pid=os.getpid(), socket=self.socket_path,
                                        kernel=self.kernel.to_dict(), sessions=[s.info() for s in m.list()])
        if isinstance(req, protocol.ListTools):
            policy = self.load_policy(req.policy)
            return protocol.ToolsReply(id=req.id, tools=[protocol.ToolSchema(**s) for s in schemas_for(policy.tools)])
        return protocol.ErrorReply(id=req.id, code="bad_request", message=f"not a daemon request: {type(req).__name__}")

