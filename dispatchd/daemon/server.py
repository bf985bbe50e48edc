"""The daemon's socket: accept, check the peer, speak the protocol, route requests.

Guarantees:
- only peers with the daemon's own uid are served (``SO_PEERCRED``); others
  are refused with an error reply and the connection closed;
- the first message must be a ``Hello`` with our protocol version;
- every request gets exactly one reply with its ``id``; a request we cannot
  decode gets an ``ErrorReply`` (code ``bad_request``) and the connection stays;
- broken framing (garbage length, oversized frame, EOF mid-frame) closes that
  connection only; every other client keeps being served;
- each connection in use has its own thread (blocking I/O: measured faster
  than asyncio for this request/response pattern, and tool calls do not come
  here); one greeted and idle for ``parking.PARK_AFTER_S`` gives its thread
  back and waits, with every other idle one, on one thread (parking.py);
- no client can stop it (a hostile process of the same user included): a
  running out of descriptors or threads in ``accept`` is waited out, never
  fatal; connections over the cap, and all new ones once it is stopping, get
  an ``ErrorReply`` with id 0 (code ``busy`` or ``stopping``) at once; a
  connection may send ``MAX_HELLO_FRAME`` bytes and must greet within
  ``HELLO_TIMEOUT_S`` before it is served, then requests of at most
  ``MAX_REQUEST_FRAME``; a frame over the limit is answered
  (``frame_too_large``) and the connection closed before the payload is read;
- a frame, once its first byte came, must be whole within
  ``FRAME_TIMEOUT_S``: one that is not (stalled, or trickling in) is answered
  (``frame_stalled``, without waiting on the peer), logged
  (``event=frame_stalled``) and its connection closed, its thread and
  buffer let go. Between frames a connection may idle for ever (parked).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dispatchd import __version__, protocol, threads
from dispatchd.daemon import checkpoints
from dispatchd.daemon.parking import PARK_AFTER_S, Parking
from dispatchd.daemon.capacity import OpenFiles
from dispatchd.daemon.sessions import Session, SessionManager
from dispatchd.errors import DispatchdError
from dispatchd.fsnames import shown
from dispatchd.kernel import KernelFeatures
from dispatchd.secretbook import said as _said
from dispatchd.tools import native
from dispatchd.catalogue import schemas_for

log = logging.getLogger("dispatchd.server")

# A client greets at once; a connection that has not within this long is
# dropped, so idle sockets cannot hold slots for ever.
HELLO_TIMEOUT_S = 10.0
# A frame begun must be whole this long after its first byte: a request is at
# most MAX_REQUEST_FRAME (256 KiB), so any sender faster than ~26 KiB/s gets
# it in, and the client writes each request in one go. Without it a
# connection stopped inside a frame held its thread and buffer for ever. A
# multiple of PARK_AFTER_S: a stalled frame's read times out on the deadline.
FRAME_TIMEOUT_S = 10.0
# accept() out of descriptors or threads: wait this long (doubling) before
# trying again, instead of spinning on a backlog we cannot take.
_BACKOFF_S = (0.01, 0.5)
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
SPARES = 8  # descriptors held back to refuse connections with (Server._refuse_with_spares)


@dataclass
class _Conn:
    """One client's connection, served by one thread at a time."""

    frames: protocol.FrameSocket
    conn_id: int
    greeted: bool = False


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
        *,
        max_connections: int = 4096,
        open_files: OpenFiles | None = None,
    ) -> None:
        self.listener = listener
        self.manager = manager
        self.kernel = kernel
        self.socket_path = socket_path
        self.load_policy = load_policy
        self.stopping = threading.Event()
        self.closed = threading.Event()
        self.uid = os.getuid()
        self._conn_ids = itertools.count(1)  # which connection holds which session (lifetimes.py)
        self.max_connections = max_connections
        self.open_files = open_files or OpenFiles(before=0, limit=0, hard=0, note="not raised")  # status says it
        self._count_lock = threading.Lock()
        self.connections = 0
        # The wake-up pipe: stop() writes a byte, so the accept loop sleeps in
        # poll() instead of waking every tenth of a second to look.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # Descriptors held in reserve: out of descriptors, we close them to
        # accept each pending connection and tell it why, instead of leaving it
        # in the backlog where it would wake us again and again
        # (``_refuse_with_spares``). Several: another thread may take a slot
        # the moment one is freed (with one spare that race was lost often
        # enough that most of a burst went unanswered).
        self._spares: list[int] = []
        self._take_spares()
        self.helpers: Callable[[], str] = lambda: ""  # the helper processes' state (daemon/helpers.py)
        # Greeted connections idle this long wait without a thread (parking.py).
        self.park_after_s = PARK_AFTER_S
        self._parking: Parking[_Conn] = Parking(self._resume)

    def stop(self) -> None:
        """Take no new connection (they are told the daemon is stopping). Safe
        in a signal handler."""
        self.stopping.set()
        self._wake()

    def close(self) -> None:
        """End ``refuse_until_closed``: the listener is about to close."""
        self.closed.set()
        self._wake()

    def wakeup_fd(self) -> int:
        """The write end of the wake-up pipe, for ``signal.set_wakeup_fd``."""
        return self._wake_w

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop is awake already

    def serve_forever(self) -> None:
        """Serve until ``stop()``."""
        self._accept_loop(self.stopping, self._start_connection)

    def refuse_until_closed(self) -> None:
        """While stopping: answer every new connection at once, until ``close()``."""
        self._accept_loop(self.closed, lambda conn: self._refuse(
            conn, "stopping", "dispatchd is stopping (it takes no new connections): "
                              "calls in flight are finishing; start it again once it has exited"))

    def _accept_loop(self, until: threading.Event, take: Any) -> None:
        self.listener.setblocking(False)
        poller = select.poll()
        poller.register(self.listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        backoff = _BACKOFF_S[0]
        while not until.is_set():
            poller.poll()
            try:
                while os.read(self._wake_r, 64):
                    pass
            except BlockingIOError:
                pass
            while not until.is_set():
                try:
                    conn, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    break
                except OSError as exc:
                    if until.is_set() or exc.errno == errno.EBADF:
                        return
                    if exc.errno not in _EXHAUSTED:
                        log.warning("event=accept_failed error=%s", exc)
                        time.sleep(backoff)
                        break
                    log.warning("event=accept_exhausted error=%s connections=%s", exc, self.connections)
                    self._refuse_with_spares()
                    time.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_S[1])
                    break
                backoff = _BACKOFF_S[0]
                conn.setblocking(True)
                take(conn)

    def _take_spares(self) -> None:
        while len(self._spares) < SPARES:
            try:
                self._spares.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return  # taken back on a later round

    def _refuse_with_spares(self) -> None:
        """Out of descriptors: give up the spares and, through the descriptors
        they free, take each pending connection, tell it, close it; then take
        the spares back. Clients get an answer at once, not a hang in the
        backlog."""
        if not self._spares:
            self._take_spares()  # what other threads let go of since
            return
        for fd in self._spares:
            os.close(fd)
        self._spares = []
        for _ in range(1024):
            try:
                conn, _ = self.listener.accept()
            except OSError:
                break
            self._refuse(conn, "busy", "dispatchd is out of file descriptors (RLIMIT_NOFILE); "
                                       "close some connections or sessions, or try again shortly")
        self._take_spares()

    @staticmethod
    def _refuse(conn: socket.socket, code: str, message: str) -> None:
        """Answer a connection we will not serve (id 0: it is the connection, not
        a request, that is refused) and close it, never blocking on it."""
        try:
            conn.setblocking(False)
            conn.send(protocol.encode(protocol.ErrorReply(id=0, code=code, message=message)))
        except OSError:
            pass
        finally:
            conn.close()

    def _start_connection(self, conn: socket.socket) -> None:
        with self._count_lock:
            full = self.connections >= self.max_connections
            if not full:
                self.connections += 1
        if full:
            log.warning("event=connection_refused reason=busy connections=%s", self.max_connections)
            self._refuse(conn, "busy", f"dispatchd serves at most {self.max_connections} connections at once "
                                       "and has that many; close some, or raise --max-connections")
            return
        try:
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()
        except RuntimeError as exc:  # can't start new thread: the user's process limit
            self._release()
            log.warning("event=connection_refused reason=threads error=%s", exc)
            self._refuse(conn, "busy", f"dispatchd cannot start a thread for this connection ({exc}); "
                                       "try again shortly")

    def _release(self) -> None:
        with self._count_lock:
            self.connections -= 1

    def _serve_connection(self, conn: socket.socket) -> None:
        c = _Conn(protocol.FrameSocket(conn, max_frame=protocol.MAX_HELLO_FRAME),
                  next(self._conn_ids))  # which sessions it holds (lifetimes.py)
        c.frames.frame_timeout_s = FRAME_TIMEOUT_S
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != self.uid:
                log.warning("event=peer_refused pid=%s uid=%s", pid, uid)
                c.frames.send(protocol.ErrorReply(id=0, code="forbidden",
                                                  message=f"this daemon serves uid {self.uid} only"))
                self._end(c)
                return
            conn.settimeout(HELLO_TIMEOUT_S)  # until greeted
        except OSError as exc:
            log.debug("event=connection_dropped reason=%s", exc)
            self._end(c)
            return
        self._serve(c)

    def _serve(self, c: _Conn) -> None:
        """Serve ``c`` on this thread until it ends, or until it has been idle
        for ``park_after_s`` once greeted: then it is parked (parking.py), and
        its next request is served on a thread of its own."""
        frames = c.frames
        parked = False
        try:
            while True:
                try:
                    req = frames.recv_request(protocol.daemon_request_decoder, frames.send)
                except BlockingIOError:
                    # Greeted, and nothing came for park_after_s (the socket's
                    # SO_RCVTIMEO: no poll on the request's path). Inside a
                    # frame it waits on (until FRAME_TIMEOUT_S: FrameStalled);
                    # between two it is parked (its thread goes) unless no
                    # thread can poll for it.
                    if frames.buffered() or not self._park(c):
                        continue
                    parked = True
                    return
                except protocol.FrameTooLarge as exc:
                    # Answered, then closed: the rest of that frame is never read.
                    log.debug("event=connection_dropped reason=%s", exc)
                    frames.send(protocol.ErrorReply(id=0, code="frame_too_large", message=(
                        f"{exc}{'' if c.greeted else ' before hello'}: the connection is closed")))
                    return
                except protocol.FrameStalled as exc:
                    log.warning("event=frame_stalled conn=%s greeted=%s after_s=%g got=%s want=%s",
                                c.conn_id, c.greeted, exc.after_s, exc.got, exc.want)
                    self._refuse(frames.sock, "frame_stalled", f"{exc}: the connection is closed")
                    return
                if req is None:
                    return
                if not c.greeted:
                    if not isinstance(req, protocol.Hello) or req.version != protocol.PROTOCOL_VERSION:
                        got = f"version {req.version}" if isinstance(req, protocol.Hello) else type(req).__name__
                        frames.send(protocol.ErrorReply(id=req.id, code="bad_version", message=(
                            f"expected hello with protocol version {protocol.PROTOCOL_VERSION}, got {got}")))
                        return
                    c.greeted = True
                    frames.sock.settimeout(None)
                    sec = max(self.park_after_s, 0.001)
                    frames.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                           struct.pack("ll", int(sec), int(sec % 1 * 1e6)))
                    frames.max_frame = protocol.MAX_REQUEST_FRAME
                reply, fds = self._handle(req, c.conn_id)
                try:
                    frames.send(reply, fds=[fd.fileno() for fd in fds])
                except (protocol.Unencodable, protocol.FrameTooLarge) as exc:  # nothing sent: answered, kept
                    frames.send(self._unsendable(req, reply, exc))
                finally:
                    for fd in fds:
                        fd.close()
        except (protocol.ProtocolError, OSError) as exc:
            log.debug("event=connection_dropped reason=%s", exc)
        finally:
            if not parked:
                self._end(c)

    def _park(self, c: _Conn) -> bool:
        try:
            self._parking.park(c, c.frames.fileno())
        except RuntimeError:  # no thread to poll with: this one keeps the connection
            return False
        log.debug("event=connection_parked conn=%s", c.conn_id)
        return True

    def _resume(self, c: _Conn) -> None:
        """A parked connection has a request (or has ended): serve it on a
        thread of its own (RuntimeError when none can be had: it stays parked)."""
        threads.Thread(target=self._serve, args=(c,), daemon=True, name="connection").start()

    def _end(self, c: _Conn) -> None:
        c.frames.close()
        self._release()
        self.manager.holders.release(c.conn_id)  # its sessions may now be orphans

    def _handle(self, req: Any, conn_id: int = 0) -> tuple[Any, list[socket.socket]]:
        rid = req.id
        try:
            if isinstance(req, protocol.Attach) or (isinstance(req, protocol.OpenSession) and req.attach):
                # The one reply that carries an fd: the client's end of a
                # channel straight to the worker, so tool calls make one hop.
                sid = (req.session if isinstance(req, protocol.Attach)
                       else self._open(req, conn_id, attach=True).id)
                try:
                    info, sock, tools = self.manager.attach(sid, holder=conn_id)
                except BaseException:
                    if isinstance(req, protocol.OpenSession):  # opened, not attachable: not left open
                        self._close_quietly(sid)
                    raise
                return protocol.Attached(id=rid, session=info, tools=tools), [sock]
            return self._route(req, conn_id), []
        except DispatchdError as exc:  # names in it as text a reply can carry (fsnames.py)
            return protocol.ErrorReply(id=rid, code=exc.code, message=_said(shown(exc.message))), []
        except RuntimeError as exc:
            if "can't start new thread" not in str(exc):
                log.exception("event=internal_error request=%s", type(req).__name__)
                return protocol.ErrorReply(id=rid, code="internal",
                                           message=_said(shown(f"internal error: {type(exc).__name__}: {exc}"))), []
            # Not a bug: the daemon's own tasks count against the user's process limit.
            log.warning("event=no_thread request=%s error=%s", type(req).__name__, exc)
            return protocol.ErrorReply(id=rid, code="busy", message=(
                f"dispatchd cannot start a thread ({exc}): the user's processes are at the user's limit "
                f"(RLIMIT_NPROC {_nproc()}); end some of the user's processes, or close sessions, and retry")), []
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("event=internal_error request=%s", type(req).__name__)
            return protocol.ErrorReply(id=rid, code="internal",
                                       message=_said(shown(f"internal error: {type(exc).__name__}: {exc}"))), []

    def _unsendable(self, req: Any, reply: Any, exc: protocol.ProtocolError) -> protocol.ErrorReply:
        """The answer to ``req`` when its ``reply`` cannot be encoded (text
        that is not UTF-8 that no report made readable, or a reply over the
        frame's limit: a bug, every report being bounded), and the reply
        itself in the log (cut, as every record is: ``logtext``). A session opened by it is closed: its
        client cannot know its id. One bad string never takes down the
        connection, nor ``status`` for every client with it."""
        name = type(req).__name__
        log.error("event=reply_unencodable request=%s error=%s reply=%s", name, exc, shown(repr(reply))[:100_000])
        closed = ""
        if isinstance(req, protocol.OpenSession) and isinstance(reply, (protocol.SessionReply, protocol.Attached)):
            self._close_quietly(reply.session.id)
            closed = f"; the session it opened ({reply.session.id}) is closed"
        text = getattr(exc, "text", "")
        bad = f" ({shown(text)[:300]})" if text else ""
        return protocol.ErrorReply(id=req.id, code="internal", message=_said(
            f"internal error: the daemon's reply to {name} cannot be sent: {exc}{bad}; what was asked was done"
            f"{closed}, and the daemon's log holds the reply (event=reply_unencodable)"))

    def _open(self, req: protocol.OpenSession, conn_id: int, attach: bool = False) -> Session:
        return self.manager.open(req.worktree, req.policy, req.network, req.ports, req.bind_ports,
                                 detached=req.detached, orphan_grace_s=req.orphan_grace_s, holder=conn_id,
                                 domain_list=req.domains, read_only=req.read_only, env=req.env,
                                 secrets=req.secrets, attach=attach)

    def _close_quietly(self, sid: str) -> None:
        try:
            self.manager.close(sid)
        except DispatchdError:
            pass  # ended already

    def _route(self, req: Any, conn_id: int = 0) -> Any:
        m = self.manager
        if isinstance(req, protocol.Hello):
            return protocol.HelloOk(id=req.id, version=protocol.PROTOCOL_VERSION, daemon_version=__version__)
        if isinstance(req, protocol.OpenSession):
            return protocol.SessionReply(id=req.id, session=self._open(req, conn_id).info())
        if isinstance(req, protocol.CloseSession):
            found = m.close(req.session)
            return protocol.ClosedReply(id=req.id, protected=[protocol.ProtectedItem(path=p.path, why=p.why, time=p.time)
                                                              for p in found])
        if isinstance(req, protocol.ReleaseWriteLock):
            return protocol.SessionReply(id=req.id, session=m.release_write_lock(req.session).info())
        if isinstance(req, protocol.ListSessions):
            return protocol.SessionsReply(id=req.id, sessions=[s.info() for s in m.sessions()])
        if isinstance(req, protocol.SetNetwork):
            return protocol.SessionReply(id=req.id, session=m.set_network(req.session, req.network, req.ports, req.bind_ports,
                                                                             req.domains).info())
        if isinstance(req, protocol.Status):
            return protocol.StatusReply(id=req.id, daemon_version=__version__, pid=os.getpid(), socket=self.socket_path,
                                        kernel=self.kernel, sessions=[s.info() for s in m.sessions()],
                                        daemon=protocol.DaemonReport(
                                            open_files=self.open_files.limit, open_files_note=self.open_files.note,
                                            connections=self.connections, max_connections=self.max_connections,
                                            parked=self._parking.count(),
                                            pool=m.pool.report(), line_loops=native.report(),
                                            helpers=self.helpers(), in_use=m.in_use_table.note,
                                            in_use_shared=m.in_use_table.shared,
                                            before_restore=m.checkpoints.kept_sizes.report()),
                                        protected=[protocol.ProtectedItem(path=p.path, why=p.why, time=p.time)
                                                   for p in m.baselines.recovered + m.restores_at_start]
                                        + [protocol.ProtectedItem(path=root, why=f"NOT checked whole ({why}): sessions "
                                                                  f"on it are refused {m.baselines.taints.until(root)}")
                                           for root, why in list(m.baselines.tainted.items())])
        if isinstance(req, (protocol.TakeCheckpoint, protocol.ListCheckpoints, protocol.RestoreCheckpoint)):
            return checkpoints.handle(m, req)
        if isinstance(req, protocol.ListTools):
            policy = self.load_policy(req.policy)
            return protocol.ToolsReply(id=req.id, tools=[protocol.ToolSchema(**s) for s in schemas_for(policy.tools)])
        return protocol.ErrorReply(id=req.id, code="bad_request", message=f"not a daemon request: {type(req).__name__}")


def _nproc() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,}"
