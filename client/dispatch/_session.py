"""A session seen from the client: ``Session``, its remote tools, and ``Cancellation``.

Guarantees:
- one ``Session`` may be used from many threads; a tool call goes straight
  to the session's confined worker over a channel the daemon hands over at
  ``attach`` time: one hop, not two;
- tool calls never raise: a lost sandbox, a closed session or a daemon that
  went away come back as ``Result.failure`` with the reason (and, once the
  session is over, that reason in ``metadata["session_ended"]``); daemon requests
  (close, network, status) raise ``DispatchError`` subclasses instead;
- a tool call waits the tool's own time limit plus the client's
  ``call_margin`` at most (then a ``Result.failure`` that names the wait);
- a call given ``on_output`` gets the command's output as it comes, in the
  calling thread, before the call returns the same Result it would have without;
- a call interrupted in its caller (``KeyboardInterrupt``, or any exception,
  even one raised by ``on_output``) is cancelled in the sandbox before the
  exception goes on: its processes are ended. ``Session.cancel()`` (from any
  thread) and ``Cancellation.cancel()`` end calls in flight, which then return
  a failure with ``metadata["cancelled"]``.

A ``Session`` talks to the daemon through what ``DaemonLink`` names (a
``dispatch.Client`` is one), so this module needs nothing of the client's.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Protocol, cast

import msgspec

from dispatch._checkpoints import SessionCheckpoints  # checkpoint(), checkpoints(), restore()
from dispatch._definition import ToolFunc
from dispatch._endreport import log_end
from dispatch._lost import HELD_S, LOST_WAIT_S, Channel, cause, ended, hung_up, refusal
from dispatch._netargs import domain_list, network_word
from dispatch._transport import Connection, NotWritten, OutputCallback
from dispatch.errors import ConnectionLost, DispatchError, NotSent, RequestFailed, RequestTimeout
from dispatch.tools import Definition, Registry, Result
from dispatchd import protocol

__all__ = ["Cancellation", "DaemonLink", "Session", "info_dict"]


class Cancellation:
    """A handle that cancels one tool call (or the calls it is given to) from any thread.

    Pass it in the call's context, ``defn.call(params, {"cancellation": c})``
    or ``registry.call(name, params, {"cancellation": c})``; ``c.cancel()``
    ends the call in the sandbox (its Result: a failure with
    ``metadata["cancelled"]``). Cancelling before the call starts cancels
    it as soon as it is sent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._hooks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def _bind(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self._cancelled:
                self._hooks.append(hook)
                return
        hook()


def _seconds(value: object) -> float | None:
    """A positive number of seconds, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def info_dict(info: protocol.SessionInfo) -> dict[str, Any]:
    return cast(dict[str, Any], msgspec.to_builtins(info))


def _status_dict(info: protocol.SessionInfo) -> dict[str, Any]:
    """``session.status()``: the session's fields, with ``network`` as a dict:
    ``mode``, ``domains`` (under "domains") and ``denied`` (hosts the proxy
    refused, most recent first: ``host``, ``port``, ``count``, ``last``)."""
    d = info_dict(info)
    d["network"] = {"mode": info.network, "domains": d.pop("domains"), "denied": d.pop("denied")}
    return d


def _unbound(params: dict[str, Any], context: Any) -> Result:
    return Result.failure("a session's tool with no session")  # never called: each session binds its own


# The daemon's tools, checked as Definitions (their schemas and validators):
# the last list seen, since each open and attach of a policy lists the same.
_CHECKED: tuple[list[protocol.ToolSchema], list[Definition]] = ([], [])
_CHECKED_LOCK = threading.Lock()


def _checked_tools(tools: list[protocol.ToolSchema]) -> list[Definition]:
    """One Definition per tool (its function a placeholder: ``_with_func``
    gives each session's its own), checked once per distinct list."""
    global _CHECKED
    with _CHECKED_LOCK:
        seen, checked = _CHECKED
    if seen == tools:  # structs compare by value
        return checked
    checked = [Definition(t.name, t.description, t.parameters, _unbound, risk=t.risk) for t in tools]
    with _CHECKED_LOCK:
        _CHECKED = (list(tools), checked)
    return checked


class DaemonLink(Protocol):
    """What a ``Session`` asks of the client that made it (``dispatch.Client``)."""

    call_margin: float

    def _daemon_request(self, build: Callable[[int], msgspec.Struct]) -> tuple[Any, int | None]: ...

    def _bridge_gone(self) -> str | None: ...

    def close_session(self, session_id: str) -> list[dict[str, Any]]: ...

    def session_infos(self) -> list[protocol.SessionInfo]: ...


class Session(SessionCheckpoints):
    """An open session: its id, its network, and a ``registry`` of remote tools."""

    def __init__(self, client: DaemonLink, info: protocol.SessionInfo, *, owned: bool,
                 attached: tuple[Any, int | None] | None = None) -> None:
        self._client = client
        self._info = info
        self._owned = owned
        self._own_limit: tuple[object, float] = (None, 0.0)  # (limits, the command timeout it gives): _call_wait
        self._lock = threading.Lock()
        self._channel: Channel | None = None
        self._tools: list[protocol.ToolSchema] = []
        self._schemas: dict[str, protocol.ToolSchema] = {}  # self._tools by name
        self._in_flight: dict[int, Connection] = {}  # tool calls sent and not answered, by request id
        self._in_flight_lock = threading.Lock()
        # What the checks at its end moved aside or put back (``path``, ``why``), once closed.
        self.protected: list[dict[str, Any]] = []
        self._ended: str | None = None  # why the session is over, once a call found it so (``_lost.ended``)
        self._attach(attached)
        # The policy's budget: longer results reach a model in part (retrieve_output has the rest).
        self.registry = Registry((checked._with_func(self._remote_call(checked.name))
                                  for checked in _checked_tools(self._tools)),
                                 output_budget=self._info.limits.get("model_output_bytes"))

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def network(self) -> bool:
        """True when the session reaches outside itself ("on", "ports", or "domains")."""
        return self._info.network != "off"

    @property
    def network_mode(self) -> str:
        """"off", "on", "ports" or "domains"."""
        return self._info.network

    @property
    def info(self) -> dict[str, Any]:
        return info_dict(self._info)

    def _attach(self, attached: tuple[Any, int | None] | None = None) -> None:
        """A channel to the session's tool server: the one ``attached`` (the
        open's own reply: one round trip) or a new one asked for."""
        reply, fd = attached or self._client._daemon_request(lambda rid: protocol.Attach(id=rid, session=self.id))
        assert isinstance(reply, protocol.Attached) and fd is not None
        self._info, self._tools = reply.session, reply.tools
        self._schemas = {t.name: t for t in reply.tools}
        old, self._channel = self._channel, Channel(socket.socket(fileno=fd), reply.session.sandbox)
        if old is not None:
            old.close()

    def _remote_call(self, name: str) -> ToolFunc:
        def run(params: dict[str, Any], context: Any, on_output: OutputCallback | None = None) -> Result:
            if not context:  # the usual call, with no context: no cancellation to look up (~700-1,700 instructions)
                return self._call(name, params, on_output, None)
            cancellation = context.get("cancellation") if isinstance(context, dict) else None
            return self._call(name, params, on_output,
                              cancellation if isinstance(cancellation, Cancellation) else None)

        run.streams_output = True  # type: ignore[attr-defined]  # Definition.call passes on_output
        return run

    def cancel(self) -> int:
        """End this session's tool calls in flight made through this handle
        (from any thread): each returns a failure with ``metadata["cancelled"]``
        once its processes are gone. Returns how many were cancelled; later
        calls are not affected."""
        with self._in_flight_lock:
            calls = list(self._in_flight.items())
        for rid, channel in calls:
            channel.send(protocol.CancelCall(id=rid))
        return len(calls)

    def call_tool(self, name: str, params: dict[str, Any], *, on_output: OutputCallback | None = None,
                  cancellation: Cancellation | None = None) -> Result:
        """Run a tool in the sandbox without client-side validation (the worker
        validates too). ``registry.get(name).call(params)`` is the usual way.

        ``on_output(stream, text)`` gets output as it comes (shell_exec);
        ``cancellation`` can end the call from another thread. An exception
        in this thread while waiting (``KeyboardInterrupt``) cancels the call
        in the sandbox, then goes on."""
        return self._call(name, params, on_output, cancellation)

    def _call(self, name: str, params: dict[str, Any], on_output: OutputCallback | None,
              cancellation: Cancellation | None, again: bool = True) -> Result:
        """``call_tool``, its arguments positional: what a registry's call
        runs (keyword arguments cost a Python call about 400 instructions more).
        ``again``: a call whose request never reached the sandbox (its channel
        had closed: another client's switch replaced the sandbox) is sent
        once more, to the sandbox attached now; one that was sent and then
        lost is not (it may have run: ``_lost`` says why it went)."""
        channel = self._channel  # one read (atomic); the lock only when it has to change
        if channel is None or channel._broken is not None:
            with self._lock:
                channel = self._channel
                if channel is None or channel.broken:
                    try:
                        self._attach()  # closed by a sandbox replaced, or gone with a lost call
                    except DispatchError as exc:
                        meta = {"session_ended": self._over(str(exc))} if ended(exc, self._client._bridge_gone()) else {}
                        return Result.failure(f"session {self.id} is not available: {exc}", meta)
                    channel = self._channel
        assert channel is not None
        cached = self._own_limit  # _call_wait's usual answer, without the call
        if cached[0] is self._info.limits and "timeout" not in params and "wait" not in params:
            own = cached[1]
            wait = own + self._client.call_margin
        else:
            own, wait = self._call_wait(params)
        sent: list[int] = []
        # The tools the worker runs on a thread of their own ("slow" in their
        # schema), which a cancel can end: only their calls are tracked for
        # Session.cancel (the others take microseconds).
        schema = self._schemas.get(name)
        on_sent: Callable[[int], None] | None = None
        if (schema is not None and schema.slow) or cancellation is not None:
            on_sent = self._tracker(channel, cancellation, sent)
        try:
            # The class and its fields, not a lambda: a closure here made
            # cells of name, params and on_output on every call (~1,200 instructions).
            reply, _ = channel.request(protocol.CallTool, wait, on_output, on_sent,
                                       (name, params, on_output is not None))
        except RequestTimeout:
            return Result.failure(
                f"{name}: no reply from the sandbox of session {self.id} within {wait:g} s (the call's own limit of "
                f"{own:g} s plus a margin of {self._client.call_margin:g} s): its tool server is stopped or "
                "overloaded; the call may still finish, so its outcome is unknown", {"client_timeout_s": wait})
        except RequestFailed as exc:
            return Result.failure(f"{name}: {exc.message}", {"refused": exc.code})
        except ConnectionLost as exc:
            if again and isinstance(exc, NotWritten) and self._client._bridge_gone() is None \
                    and self._attached_again(channel):
                return self._call(name, params, on_output, cancellation, False)  # nothing of it ran
            return self._lost(name, exc, channel)
        except NotSent as exc:
            return Result.failure(f"{name}: the arguments cannot be sent: {exc}")
        except BaseException:
            # Interrupted here (KeyboardInterrupt, on_output raised): end the
            # call in the sandbox too, so nothing of it runs on.
            for rid in sent:
                channel.send(protocol.CancelCall(id=rid))
            raise
        finally:
            if sent:
                with self._in_flight_lock:
                    for rid in sent:
                        self._in_flight.pop(rid, None)
        if type(reply) is protocol.ErrorReply:
            return Result.failure(f"{name}: {reply.message}")
        if reply.success:
            # Result._from_wire(True, ...) written out (see there): one Python
            # call fewer (about 1,100 instructions a call).
            result = object.__new__(Result)
            fields = result.__dict__
            fields["is_success"] = True
            fields["output"] = reply.output or ""
            fields["error"] = None
            fields["metadata"] = MappingProxyType(reply.metadata)
            return result
        return Result._from_wire(False, reply.error or "failed", reply.metadata)

    def _attached_again(self, channel: Channel) -> bool:
        """After ``channel`` failed: a new channel to the session's sandbox,
        unless this handle was closed or the session has ended (``_lost``
        then asks, and says what the daemon said)."""
        with self._lock:
            now = self._channel
            if now is None:
                return False
            if now is channel or now.broken:
                try:
                    self._attach()
                except DispatchError:
                    return False
            return True

    def _tracker(self, channel: Connection, cancellation: Cancellation | None,
                 sent: list[int]) -> Callable[[int], None]:
        """``call_tool``'s ``on_sent`` for a call that can be cancelled. A
        method, not a closure of call_tool: the variables a nested function
        uses are made cells on every call of the function holding them, and
        most calls (read_file, every fast tool) track nothing."""

        def on_sent(rid: int) -> None:
            sent.append(rid)
            with self._in_flight_lock:
                self._in_flight[rid] = channel
            if cancellation is not None:
                cancellation._bind(lambda: channel.send(protocol.CancelCall(id=rid)))

        return on_sent

    def _lost(self, name: str, exc: ConnectionLost, channel: Channel) -> Result:
        """``channel`` broke mid-call: ask the daemon what happened (by
        attaching again, which also serves the next call when the session
        lives on), and say what it said (``dispatch._lost``)."""
        gone = self._client._bridge_gone()
        if gone is not None:  # not the sandbox: the way to it (dispatch._remote)
            return Result._from_wire(False, f"{name}: {gone}; the call's outcome is unknown, and session {self.id} "
                                     "may live on there for its orphan grace: connect again and attach to it by id "
                                     f"(client.session({self.id!r}))", {"lost": True, "bridge_lost": True,
                                                                          "outcome_unknown": True})
        deadline = time.monotonic() + LOST_WAIT_S
        text = f"the sandbox of session {self.id} went away during {name}"
        meta: dict[str, Any] = {"lost": True}
        with self._lock:
            why: str | None = None
            now = self._channel
            if now is None:  # close() or detach() of this handle, from another thread: not the sandbox
                text, why = f"{name}: this handle of session {self.id} was closed", "close() or detach() ran meanwhile"
            elif now is not channel and now.sandbox > channel.sandbox and not now.broken:
                # Attached again already, by a call that broke beside this one: no new channel needed.
                why = cause(channel.sandbox, now.sandbox, self._info.replaced, hung_up=False)
            while why is None:
                try:
                    self._attach()
                except DispatchError as err:  # the session ended (the daemon says why), or no answer
                    why = f"dispatchd is gone ({err}); the session ended with it" \
                        if isinstance(err, ConnectionLost) else str(err)
                    if ended(err, None):
                        meta["session_ended"] = self._over(why)
                    break
                now = self._channel
                assert now is not None
                same = now.sandbox <= channel.sandbox
                closed = same and hung_up(now, HELD_S)
                late = time.monotonic() > deadline
                why = cause(channel.sandbox, now.sandbox, self._info.replaced, hung_up=closed,
                            refused=refusal(now) if closed and late else "", waited_s=LOST_WAIT_S if late else None)
                if why is None:
                    time.sleep(0.05)
        text = f"{text}: {why}"
        schema = self._schemas.get(name)
        if schema is not None and schema.risk == "write":
            # The new content may have reached the disk before the tool server went.
            text += ("; outcome unknown: the file may hold its old content or the new one (never a mix): "
                     "re-read the file")
            meta["outcome_unknown"] = True
        return Result._from_wire(False, f"{text} ({exc})", meta)

    def _over(self, why: str) -> str:
        """Note that the session is over (``why``), and return ``why``."""
        self._ended = why
        return why

    def _call_wait(self, params: dict[str, Any]) -> tuple[float, float]:
        """(the call's own time limit, how long to wait for its reply): a
        command's ``timeout`` (capped by the policy), else the policy's command
        timeout; plus any ``wait`` it asks for; plus the client's margin."""
        limits = self._info.limits
        cached = self._own_limit
        if cached[0] is limits:  # the policy's limit, read once per session info
            own = cached[1]
        else:
            own = _seconds(limits.get("command_timeout_s")) or 120.0
            self._own_limit = (limits, own)
        asked, wait = params.get("timeout"), params.get("wait")
        if asked is not None and (asked := _seconds(asked)) is not None:
            own = min(asked, _seconds(limits.get("max_command_timeout_s")) or asked)
        if wait is not None:
            own += _seconds(wait) or 0.0
        return own, own + self._client.call_margin

    def set_network(self, network: bool | str, ports: list[int] | None = None,
                    bind_ports: list[int] | None = None, domains: list[str] | None = None) -> bool:
        """Switch the network: ``True``/``"on"``, ``False``/``"off"``, ``"ports"``
        (TCP only to ``ports``, binding only ``bind_ports``; default: the policy's),
        or ``"domains"`` (only the hosts in ``domains``, e.g. ``["pypi.org",
        "*.pythonhosted.org"]``, through the daemon's proxy; default: the policy's).
        When this returns, no byte the session writes goes out under the old
        setting. In full mode, between off, on and ports, the switch happens in
        place, the session's processes kept (its way out stopped, or its rules
        changed); to or from "domains", and in degraded mode, the sandbox is
        replaced and its processes ended; from "domains" to "domains" only the
        list changes, and connections to hosts no longer listed are closed.
        ``status()["note"]`` says which, and what was cut."""
        word, listed = network_word(network), domain_list(domains)
        reply, _ = self._client._daemon_request(lambda rid: protocol.SetNetwork(
            id=rid, session=self.id, network=word, ports=ports, bind_ports=bind_ports,
            domains=listed))
        self._info = reply.session
        with self._lock:
            # Switched in place, a call another thread runs on this channel goes on: a new one only for a
            # sandbox replaced, or none held (or a daemon numbering no sandbox, 0: it cannot tell which).
            channel = self._channel
            if channel is None or channel.broken or not channel.sandbox or channel.sandbox != reply.session.sandbox:
                self._attach()
        return self.network

    @property
    def writes(self) -> bool:
        """Whether the session held its worktree's write lock when last heard of
        (``status()`` asks afresh)."""
        return self._info.writes

    def release_write_lock(self) -> dict[str, Any]:
        """Give back the worktree's write lock without closing the session, so
        another session may write; this one asks again at its next write.
        Call it once your writes have returned: a process left running in the
        background may still write. Returns the session's info."""
        reply, _ = self._client._daemon_request(
            lambda rid: protocol.ReleaseWriteLock(id=rid, session=self.id))
        self._info = reply.session
        return info_dict(reply.session)

    def status(self) -> dict[str, Any]:
        """The session as the daemon sees it, with the protections in force."""
        for info in self._client.session_infos():
            if info.id == self.id:
                self._info = info
                return _status_dict(info)
        raise RequestFailed("unknown_session", f"session {self.id} is closed")

    def detach(self) -> None:
        """Drop this handle's channel and leave the session open (for others to
        attach to by id)."""
        self._owned = False
        self.close()

    def close(self) -> None:
        """Close the session (if this handle opened it), ending its processes.
        What the checks at its end found is kept in ``protected`` and said on
        the ``dispatch`` logger (``_endreport``)."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
        if self._owned:
            self._owned = False
            try:
                if self._ended is None:  # else nothing is left to close (and the daemon may be gone)
                    self.protected = self._client.close_session(self.id)
            except RequestFailed as exc:
                if exc.code != "unknown_session":
                    self._owned = True  # not closed: a retry closes it
                    raise
            except BaseException:
                self._owned = True
                raise
            log_end(self.id, self.protected)  # else unsaid in `with client.open_session(...)`

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
