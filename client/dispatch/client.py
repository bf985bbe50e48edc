"""Talking to dispatchd: ``connect``, ``Client`` (and ``Session``, ``Cancellation``).

The client is three layers, each a module of its own:
``_transport`` (a trusted socket, frames, several requests in flight),
``_autostart`` (finding the daemon, starting one), and the API: ``Client``
here, ``Session`` and ``Cancellation`` in ``_session`` (named here too).

Guarantees:
- one ``Client`` (and one ``Session``) may be used from many threads; several
  calls can be in flight on one connection, each matched to its reply by id;
- daemon requests (open, close, network, status) raise ``DispatchError``
  subclasses; each waits ``timeout`` seconds at most (``RequestTimeout``);
  tool calls never raise (``_session`` says how they fail);
- nothing is sent to a socket whose directory is not the user's own or whose
  serving process has another uid (``UntrustedSocket``; ``_transport``);
- a daemon started here (``autostart``) runs ``python -P`` from ``/``: never
  a module of the current directory (``_autostart``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import msgspec

from dispatch._autostart import daemon_socket
from dispatch._checkpoints import ClientCheckpoints  # checkpoint(), checkpoints(), restore() by session id
from dispatch._netargs import domain_list, network_word
from dispatch._session import Cancellation, Session, info_dict
from dispatch._transport import Connection
from dispatch.errors import ConnectionLost, DaemonUnavailable, DispatchError, RequestFailed, RequestTimeout
from dispatchd import envnames, paths, protocol

__all__ = ["Cancellation", "Client", "Session", "connect"]


class Client(ClientCheckpoints):
    """A connection to the daemon. ``timeout``: how long to wait for the
    daemon (to start, when autostarting, and to answer each request);
    ``call_margin``: how long past a tool call's own time limit to wait for
    its reply."""

    def __init__(self, socket_path: str, *, autostart: bool = False, timeout: float = 30.0,
                 call_margin: float = 30.0, transport: Any = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.call_margin = call_margin
        self.started_daemon: tuple[int, str] | None = None
        """``(pid, log path)`` of the daemon this client started in the background, if it did."""
        # A bridge to a daemon elsewhere (dispatch._remote.Remote): its socket
        # stands in for the daemon's, and its reason says why it went away.
        self._transport = transport
        if transport is None:
            sock, self.started_daemon = daemon_socket(socket_path, autostart=autostart, timeout=timeout)
        else:
            sock = transport.socket
        self._conn = Connection(sock, protocol.daemon_reply_decoder, fds=True)
        try:
            reply, _ = self._daemon_request(
                lambda rid: protocol.Hello(id=rid, version=protocol.PROTOCOL_VERSION, client="dispatch"))
        except BaseException:
            self._conn.close()
            raise
        if isinstance(reply, protocol.ErrorReply):
            self._conn.close()
            raise RequestFailed(reply.code, reply.message)
        self.daemon_version = reply.daemon_version

    def _daemon_request(self, build: Callable[[int], msgspec.Struct]) -> tuple[Any, int | None]:
        try:
            reply, fd = self._conn.request(build, timeout=self.timeout)
        except RequestTimeout as exc:
            raise RequestTimeout(f"dispatchd at {self.socket_path} did not answer within {self.timeout:g} s "
                                 f"({exc}): it is stopped, hung or overloaded (connect(timeout=...) sets the wait)"
                                 ) from exc
        except ConnectionLost as exc:
            raise ConnectionLost(f"lost the connection to dispatchd at {self.socket_path}: "
                                 f"{self._bridge_gone() or exc}") from exc
        if isinstance(reply, protocol.ErrorReply):
            raise RequestFailed(reply.code, reply.message)
        return reply, fd

    def _bridge_gone(self) -> str | None:
        """Why the bridge to a remote daemon went away, if it did (None locally)."""
        return None if self._transport is None else self._transport.reason

    def open_session(self, worktree: str, policy: str = "default", network: bool | str | None = None,
                     ports: list[int] | None = None, bind_ports: list[int] | None = None,
                     domains: list[str] | None = None, *,
                     detached: bool = False, orphan_grace_s: float | None = None,
                     read_only: list[str] | None = None, env: dict[str, str] | None = None,
                     secrets: dict[str, str] | None = None) -> Session:
        """Open a session on ``worktree``. It ends when closed, when idle, and
        when every connection holding it (this client, and clients that
        attached to it) has gone for the policy's ``orphan_grace_s`` (or the
        shorter ``orphan_grace_s`` given here); ``detached=True`` keeps it
        open with nobody holding it, until it is closed or ends idle.
        ``network="domains"`` with ``domains=[...]``: only those hosts, through
        the daemon's proxy (docs/network.md).
        ``read_only``: extra paths the session may read (toolchains outside
        the system directories: ``~/.cargo``, ``~/.rustup``); the daemon refuses
        any that is or holds credentials, the home directory, or its own files.
        ``env``: variables for every command of the session; ``secrets``: the
        same, whose values never come back (each occurrence in a result or
        streamed output reads ``[secret NAME]``), nor reach the daemon's log or
        status (docs/agents-features.md). Refused names (``LD_*``, ``HOME``,
        ``TMPDIR``, ``DISPATCH_*``, the proxy variables) raise ``ValueError``."""
        word, listed = network_word(network), domain_list(domains)
        user_env = envnames.check_env(env)
        hidden = envnames.check_secrets(secrets, user_env)
        path = os.path.abspath(os.fspath(worktree))
        extra = [os.path.abspath(os.path.expanduser(os.fspath(p))) for p in read_only or []]
        # Opened and attached in one round trip: the reply carries the channel.
        reply, fd = self._daemon_request(lambda rid: protocol.OpenSession(
            id=rid, worktree=path, policy=policy, network=word, ports=ports, bind_ports=bind_ports,
            domains=listed, detached=detached, orphan_grace_s=orphan_grace_s, read_only=extra, attach=True,
            env=user_env, secrets=hidden))
        try:
            return Session(self, reply.session, owned=True, attached=(reply, fd))
        except BaseException:
            # Opened but not attachable (its worker ended at once): do not leave it open.
            try:
                self.close_session(reply.session.id)
            except DispatchError:
                pass
            raise

    def session(self, session_id: str) -> Session:
        """Attach to a session opened elsewhere (closing it here does not end it)."""
        for info in self.session_infos():
            if info.id == session_id:
                return Session(self, info, owned=False)
        # Not listed: asked by its id, the daemon says why (an ended session's
        # reason, which it keeps a while), raised from here.
        self._daemon_request(lambda rid: protocol.ListCheckpoints(id=rid, session=session_id))
        for info in self.session_infos():  # opened meanwhile: its id was never refused
            if info.id == session_id:
                return Session(self, info, owned=False)
        raise RequestFailed("unknown_session", f"no such session: {session_id!r}")

    def close_session(self, session_id: str) -> list[dict[str, Any]]:
        """Close a session; returns what the checks at its end moved aside or
        put back (``path``, ``why``): files the user's git or other tools
        would have run, refs and object files."""
        reply, _ = self._daemon_request(lambda rid: protocol.CloseSession(id=rid, session=session_id))
        return [msgspec.to_builtins(p) for p in getattr(reply, "protected", [])]

    def release_write_lock(self, session_id: str) -> dict[str, Any]:
        """``Session.release_write_lock`` for a session known by id."""
        reply, _ = self._daemon_request(lambda rid: protocol.ReleaseWriteLock(id=rid, session=session_id))
        return info_dict(reply.session)

    def set_network(self, session_id: str, network: bool | str, ports: list[int] | None = None,
                    bind_ports: list[int] | None = None, domains: list[str] | None = None) -> dict[str, Any]:
        word, listed = network_word(network), domain_list(domains)
        reply, _ = self._daemon_request(lambda rid: protocol.SetNetwork(
            id=rid, session=session_id, network=word, ports=ports, bind_ports=bind_ports,
            domains=listed))
        return info_dict(reply.session)

    def session_infos(self) -> list[protocol.SessionInfo]:
        """``list_sessions()`` typed: each session as the protocol carries it,
        its ``protections`` a ``dispatchd.protocol.Protections``."""
        reply, _ = self._daemon_request(lambda rid: protocol.ListSessions(id=rid))
        return list(reply.sessions)

    def list_sessions(self) -> list[dict[str, Any]]:
        return [info_dict(s) for s in self.session_infos()]

    def status_reply(self) -> protocol.StatusReply:
        """``status()`` typed: the daemon's reply as the protocol carries it
        (``kernel`` a ``KernelFeatures``, each session's ``protections`` a
        ``Protections``, from ``dispatchd.protocol``)."""
        reply, _ = self._daemon_request(lambda rid: protocol.Status(id=rid))
        return cast(protocol.StatusReply, reply)

    def status(self) -> dict[str, Any]:
        """The daemon's version, pid, socket, kernel features and sessions
        (without the protocol's own fields, ``op`` and ``id``)."""
        status: dict[str, Any] = msgspec.to_builtins(self.status_reply())
        status.pop("op", None)
        status.pop("id", None)
        return status

    def tools(self, policy: str = "default") -> list[dict[str, Any]]:
        reply, _ = self._daemon_request(lambda rid: protocol.ListTools(id=rid, policy=policy))
        # The schemas as a model takes them; the risk and slowness stay ours.
        return [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in reply.tools]

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(socket: str | None = None, *, autostart: bool = False, timeout: float = 30.0,
            call_margin: float = 30.0, host: str | None = None, host_command: str | None = None) -> Client:
    """Connect to the daemon at ``socket`` (default: the contract's path order).
    ``timeout`` bounds every wait for the daemon (its start, each request:
    ``RequestTimeout``); a tool call waits its own limit plus ``call_margin``.

    ``host="ssh://[USER@]HOST[:PORT]"`` (default ``$DISPATCH_HOST``): the
    daemon of that user on that host, through ``ssh HOST dispatch bridge``
    (``socket`` then names the socket there); ``host_command``: any command
    whose stdio carries ``dispatch bridge`` (docs/remote.md)."""
    if host is None and host_command is None:
        host = os.environ.get("DISPATCH_HOST") or None
    if host is None and host_command is None:
        return Client(paths.resolve_socket_path(socket), autostart=autostart, timeout=timeout,
                      call_margin=call_margin)
    return _remote_client(host, host_command, socket, autostart=autostart, timeout=timeout, call_margin=call_margin)


def _remote_client(host: str | None, host_command: str | None, socket_path: str | None, *, autostart: bool,
                   timeout: float, call_margin: float) -> Client:
    from dispatch import _remote

    remote = _remote.open_remote(host, host_command, socket_path, autostart=autostart, timeout=timeout)
    try:
        return Client(remote.label, timeout=timeout, call_margin=call_margin, transport=remote)
    except ConnectionLost as exc:  # the bridge answered, then could not reach its daemon
        remote.socket.close()
        raise DaemonUnavailable(remote.reason or str(exc)) from exc
    except BaseException:
        remote.socket.close()
        raise
