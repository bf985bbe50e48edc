"""Talking to dispatchd: ``connect``, ``Client``, ``Session``.

Guarantees:
- one ``Client`` (and one ``Session``) may be used from many threads; several
  calls can be in flight on one connection, each matched to its reply by id;
- a tool call goes straight to the session's confined worker over a channel
  the daemon hands over at ``attach`` time: one hop, not two;
- tool calls never raise: a lost sandbox, a closed session or a daemon that
  went away come back as ``Result.failure`` with the reason; daemon requests
  (open, close, network, status) raise ``DispatchError`` subclasses instead;
- every wait is bounded: a daemon request waits ``timeout`` seconds at most
  (``RequestTimeout``), a tool call the tool's own time limit plus
  ``call_margin`` (then a ``Result.failure`` that names the wait);
- nothing is sent to a socket whose directory is not the user's own (not a
  symlink, not writable by others) or whose serving process has another uid
  (``UntrustedSocket``), both checked by descriptor (``dispatchd.paths``);
- a daemon started here (``autostart``) runs ``python -P`` from ``/``: never
  a module of the current directory (a worktree an agent wrote);
- a call given ``on_output`` gets the command's output as it comes, in the
  calling thread (whichever thread reads the channel queues it for the
  caller), before the call returns the same Result it would have without;
- a call interrupted in its caller (``KeyboardInterrupt``, or any exception,
  even one raised by ``on_output``) is cancelled in the sandbox before the
  exception goes on: its processes are ended. ``Session.cancel()`` (from any
  thread) and ``Cancellation.cancel()`` end calls in flight, which then return
  a failure with ``metadata["cancelled"]``.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, cast, overload

import msgspec

from dispatch.errors import (
    ConnectionLost,
    DaemonUnavailable,
    DispatchError,
    NotSent,
    RequestFailed,
    RequestTimeout,
    UntrustedSocket,
)
from dispatch._checkpoints import ClientCheckpoints, SessionCheckpoints  # checkpoint(), restore()
from dispatch._definition import ToolFunc
from dispatch.tools import Definition, Registry, Result
from dispatchd import envnames, paths, protocol
from dispatchd.netmodes import NETWORK_MODES, NetworkMode

_PENDING = object()
# protocol.encode's parts, for request's written-out copy.
_encode = msgspec.msgpack.Encoder().encode
_HEADER = struct.Struct(">I")
# The longest a socket operation blocks at once: waits loop on it up to their
# own deadline, so one connection serves callers with different deadlines.
_TICK_S = 0.2

OutputCallback = Callable[[str, str], None]
# How long a CancelCall may take to send before we give up on it.
_CANCEL_SEND_S = 1.0


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


class _Connection:
    """Frames to one peer with several requests in flight.

    No background thread: whichever caller is waiting becomes the reader
    until its own reply arrives, handing replies for others to them. A lone
    caller therefore reads its reply itself, with no thread switch on the way.
    Each waiting caller sleeps on a condition of its own: a reply (or
    streamed output) wakes the one caller it is for, and a reader that is
    done wakes one other caller to read (waking them all on every reply made
    eight threads on one session spend their time in wake-ups: see
    docs/performance.md).
    """

    def __init__(self, sock: socket.socket, decoder: msgspec.msgpack.Decoder[Any], *, fds: bool = False) -> None:
        # A blocking socket whose recv and send give up after a tick (EAGAIN):
        # waits stay bounded, yet a reply that is there costs no extra poll()
        # (a Python socket timeout polls before every call: +12% on read_file).
        sock.settimeout(None)
        tick = struct.pack("@ll", 0, int(_TICK_S * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tick)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tick)
        self._frames = protocol.FrameSocket(sock, fds=fds)
        self._decoder = decoder
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._reading = False
        self._waiters: dict[int, threading.Condition] = {}  # callers asleep, by request id (share _cond's lock)
        self._replies: dict[int, Any] = {}
        self._outputs: dict[int, list[tuple[str, str]]] = {}  # streamed output waiting for its caller
        self._ids = itertools.count(1)
        self._broken: Exception | None = None

    def request(self, build: Callable[..., msgspec.Struct], timeout: float | None = None,
                on_output: OutputCallback | None = None,
                sent: Callable[[int], None] | None = None, fields: tuple[Any, ...] = ()) -> tuple[Any, int | None]:
        """Send ``build(rid, *fields)`` and wait for its reply, ``timeout`` seconds at most
        (``RequestTimeout``; a reply that comes later is dropped). Raises
        ``NotSent`` (the connection stays usable) when the request cannot be
        encoded or is over the frame limit, ``ConnectionLost`` when the peer is
        gone, ``RequestFailed`` when the peer refused the whole connection
        (busy, stopping, too many channels).

        ``on_output(stream, text)`` gets the ``ToolOutput`` frames of this
        request, in this thread; ``sent(rid)`` is called once it is on the wire.
        ``fields``: the message's other fields, positional after the id, so
        a tool call passes its class (``protocol.CallTool``) and its fields
        instead of a lambda, whose cells cost call_tool ~1,200 instructions."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rid = next(self._ids)
        try:
            # protocol.encode written out (one Python call fewer, ~900 instructions a call).
            payload = _encode(build(rid, *fields))
            if len(payload) > protocol.MAX_FRAME:
                raise protocol.FrameTooLarge(f"frame of {len(payload)} bytes exceeds the {protocol.MAX_FRAME}-byte limit")
            frame = _HEADER.pack(len(payload)) + payload
        except (protocol.FrameTooLarge, TypeError, ValueError, UnicodeError, OverflowError) as exc:
            raise NotSent(str(exc)) from exc
        # _cond's lock, without the Condition's Python-level __enter__; and
        # acquire/release, not ``with``: a lock's __enter__ and __exit__ cost
        # about 800 instructions more, twice a call (here and _read_until).
        lock = self._lock
        lock.acquire()
        try:
            if self._broken is not None:
                raise ConnectionLost(str(self._broken))
            # Nobody reads (a lone caller, the usual case): this caller is the
            # reader from here, and reads its reply as soon as it is sent,
            # without a second trip through the lock in _wait. Nobody can
            # have read its reply or queued its output meanwhile, nor will
            # while it reads: only a caller that waits (_wait) has its entries
            # in _replies and _outputs, which a reader fills for it; the
            # reader's own come straight to it in _read_until (a dict set and
            # pop fewer, ~900 instructions a call).
            reader = not self._reading
            if reader:
                self._reading = True
            else:
                self._replies[rid] = _PENDING
                if on_output is not None:
                    self._outputs[rid] = []
        finally:
            lock.release()
        try:
            # _send's usual case written out (one Python call fewer): the
            # send lock free, and one send takes the whole request.
            send_lock = self._send_lock
            if send_lock.acquire(False):
                try:
                    done = self._frames.sock.send(frame)
                except (BlockingIOError, TimeoutError):  # nothing was sent in this tick
                    done = 0
                except BaseException:
                    send_lock.release()
                    raise
                if done == len(frame):
                    send_lock.release()
                else:
                    self._send(frame, deadline, done)  # the rest, the lock held (_send releases it)
            else:
                self._send(frame, deadline)
        except OSError as exc:
            self._forget(rid)
            refusal = self._refusal()  # a peer that refused the connection closed it after saying why
            self._fail(refusal or exc)
            if refusal is not None:
                raise refusal from exc
            raise ConnectionLost(str(exc)) from exc
        except BaseException:  # RequestTimeout, or an interrupt
            self._forget(rid)
            if reader:
                self._hand_over()
            raise
        try:
            if sent is not None:
                try:
                    sent(rid)
                except BaseException:
                    if reader:
                        self._hand_over()
                    raise
            if reader:
                return self._read_until(rid, deadline, timeout, on_output)
            return self._wait(rid, on_output, deadline, timeout)
        except BaseException:
            self._forget(rid)  # its reply, when it comes, is dropped
            raise

    def _hand_over(self) -> None:
        """Stop reading and wake a waiting caller to read instead."""
        with self._cond:
            self._reading = False
            self._wake_a_reader()

    def _forget(self, rid: int) -> None:
        with self._cond:
            self._replies.pop(rid, None)
            self._outputs.pop(rid, None)

    def send(self, msg: msgspec.Struct) -> None:
        """A message that has no reply (``CancelCall``); best effort, bounded."""
        try:
            self._send(protocol.encode(msg), time.monotonic() + _CANCEL_SEND_S)
        except (OSError, protocol.ProtocolError, RequestTimeout):
            pass

    def _wait(self, rid: int, on_output: OutputCallback | None, deadline: float | None,
              timeout: float | None) -> tuple[Any, int | None]:
        while True:
            chunks: list[tuple[str, str]] = []
            with self._lock:
                mine: threading.Condition | None = None
                try:
                    while True:
                        queued = self._outputs.get(rid)
                        if queued:
                            chunks, self._outputs[rid] = queued, []
                            break
                        if self._replies[rid] is not _PENDING:
                            self._outputs.pop(rid, None)
                            return self._replies.pop(rid)  # type: ignore[no-any-return]
                        if self._broken is not None:
                            if isinstance(self._broken, RequestFailed):
                                raise RequestFailed(self._broken.code, self._broken.message)
                            raise ConnectionLost(str(self._broken))
                        if not self._reading:
                            self._reading = True
                            break
                        if deadline is not None and time.monotonic() >= deadline:
                            raise RequestTimeout(f"no reply within {timeout:g} s")
                        if mine is None:  # made only by a caller that has to wait
                            mine = threading.Condition(self._lock)
                            self._waiters[rid] = mine
                        mine.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                finally:
                    if mine is not None:
                        del self._waiters[rid]
                        if not self._reading:
                            self._wake_a_reader()  # we may have been the one woken to read; pass it on
            if chunks:
                assert on_output is not None
                for stream, text in chunks:
                    on_output(stream, text)
                continue
            return self._read_until(rid, deadline, timeout, on_output)

    def _wake_a_reader(self) -> None:
        """Wake one waiting caller to take over reading (``_cond`` held)."""
        for cond in self._waiters.values():
            cond.notify()
            return

    def _wake(self, rid: int) -> None:
        """Wake the caller of ``rid``, if it sleeps (``_cond`` held)."""
        cond = self._waiters.get(rid)
        if cond is not None:
            cond.notify()

    def _refusal(self) -> RequestFailed | None:
        """The id-0 ``ErrorReply`` a peer left before closing on us, if any."""
        try:
            reply = self._frames.recv(self._decoder)
        except (OSError, protocol.ProtocolError):
            return None
        if isinstance(reply, protocol.ErrorReply) and reply.id == 0:
            return RequestFailed(reply.code, reply.message)
        return None

    def _send(self, frame: bytes, deadline: float | None, done: int = -1) -> None:
        """The whole frame, or ``RequestTimeout`` at the deadline (a frame cut
        in the middle leaves the stream unusable: the connection is failed).
        ``done`` >= 0: the send lock is held already and that much of the
        frame was sent (request's first try)."""
        lock = self._send_lock
        # Free, the usual case: taken without reading the clock.
        if done < 0 and not lock.acquire(False) and not lock.acquire(
                timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise RequestTimeout("could not send within the wait (another request is stuck sending)")
        try:
            sock = self._frames.sock
            if done >= 0:
                sent = done
            else:
                try:
                    sent = sock.send(frame)  # a request is small: one send takes it whole
                except (BlockingIOError, TimeoutError):  # nothing was sent in this tick
                    sent = 0
            if sent == 0 and deadline is not None and time.monotonic() >= deadline:
                raise RequestTimeout("the peer takes nothing (stopped?)") from None
            view = memoryview(frame)[sent:] if sent < len(frame) else None
            while view:
                try:
                    view = view[sock.send(view):]
                except (BlockingIOError, TimeoutError):  # nothing was sent in this tick
                    if deadline is not None and time.monotonic() >= deadline:
                        if len(view) < len(frame):
                            self._fail(ConnectionLost("a request was cut in the middle by its timeout"))
                        raise RequestTimeout("the peer takes nothing (stopped?)") from None
        finally:
            self._send_lock.release()

    def _read_until(self, rid: int, deadline: float | None, timeout: float | None,
                    on_output: OutputCallback | None = None) -> tuple[Any, int | None]:
        frames, decode = self._frames, self._decoder.decode
        try:
            while True:
                try:
                    payload = frames.recv_payload()
                except (BlockingIOError, TimeoutError):  # nothing in this tick; a partial frame stays buffered
                    if deadline is not None and time.monotonic() >= deadline:
                        with self._cond:  # hand the reading over to another waiter, if any
                            self._reading = False
                            self._replies.pop(rid, None)
                            self._wake_a_reader()
                        raise RequestTimeout(f"no reply within {timeout:g} s") from None
                    continue
                if payload is None:
                    raise ConnectionLost("the peer closed the connection")
                try:
                    reply = decode(payload)  # protocol.decode written out: one Python call fewer a reply
                except protocol.DECODE_ERRORS as exc:
                    raise protocol.undecodable(exc) from exc
                # msgspec decodes to the exact types: no isinstance (each twice the cost) on the way
                kind = type(reply)
                if kind is protocol.ToolOutput:
                    if reply.id == rid and on_output is not None:
                        on_output(reply.stream, reply.text)  # the reader is its caller: no queue
                        continue
                    with self._cond:
                        queue = self._outputs.get(reply.id)
                        if queue is not None:
                            queue.append((reply.stream, reply.text))
                            self._wake(reply.id)
                    continue
                fd = frames.take_fd() if kind is protocol.Attached else None
                lock = self._lock
                lock.acquire()  # not ``with``: see request
                try:
                    if reply.id == rid:  # ours, the usual case: straight back to the caller
                        if self._replies:  # empty for a lone caller (see request): no pop to call
                            self._replies.pop(rid, None)
                        if on_output is not None:
                            self._outputs.pop(rid, None)
                        self._reading = False
                        if self._waiters:
                            self._wake_a_reader()
                        return reply, fd
                    if reply.id in self._replies:
                        self._replies[reply.id] = (reply, fd)
                    elif isinstance(reply, protocol.ErrorReply) and reply.id == 0:
                        # Id 0 answers the connection, not a request: busy,
                        # stopping, too many channels, forbidden.
                        raise RequestFailed(reply.code, reply.message)
                    elif fd is not None:
                        os.close(fd)  # the late reply of a request that timed out
                    self._wake(reply.id)
                finally:
                    lock.release()
        except (OSError, protocol.ProtocolError, ConnectionLost, RequestFailed) as exc:
            self._fail(exc)
            with self._cond:
                self._replies.pop(rid, None)
            raise exc if isinstance(exc, (ConnectionLost, RequestFailed)) else ConnectionLost(str(exc)) from exc
        except BaseException:
            # Interrupted (KeyboardInterrupt, or on_output raised): hand the
            # reading over to another waiter, keep the connection.
            with self._cond:
                self._reading = False
                self._wake_a_reader()
            raise

    def _fail(self, exc: Exception) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = exc
            self._reading = False
            for cond in self._waiters.values():
                cond.notify()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def close(self) -> None:
        self._fail(ConnectionLost("closed"))
        try:
            self._frames.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._frames.close()


def _seconds(value: object) -> float | None:
    """A positive number of seconds, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _to_dict(info: protocol.SessionInfo) -> dict[str, Any]:
    return cast(dict[str, Any], msgspec.to_builtins(info))


@overload
def _network_word(network: bool | str) -> NetworkMode: ...
@overload
def _network_word(network: None) -> None: ...
def _network_word(network: bool | str | None) -> NetworkMode | None:
    if network is None:
        return None
    if isinstance(network, bool):
        return "on" if network else "off"
    for mode in NETWORK_MODES:
        if network == mode:
            return mode
    raise ValueError(f"network must be True, False or one of {', '.join(map(repr, NETWORK_MODES))}, not {network!r}")


def _status_dict(info: protocol.SessionInfo) -> dict[str, Any]:
    """``session.status()``: the session's fields, with ``network`` as a dict:
    ``mode``, ``domains`` (under "domains") and ``denied`` (hosts the proxy
    refused, most recent first: ``host``, ``port``, ``count``, ``last``)."""
    d = _to_dict(info)
    d["network"] = {"mode": info.network, "domains": d.pop("domains"), "denied": d.pop("denied")}
    return d


def _domain_list(domains: list[str] | None) -> list[str] | None:
    if domains is None:
        return None
    if isinstance(domains, str):  # "pypi.org" would otherwise be eight one-letter hosts
        raise ValueError(f"domains must be a list of host names, not the string {domains!r}")
    return list(domains)


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


class Session(SessionCheckpoints):
    """An open session: its id, its network, and a ``registry`` of remote tools."""

    def __init__(self, client: Client, info: protocol.SessionInfo, *, owned: bool,
                 attached: tuple[Any, int | None] | None = None) -> None:
        self._client = client
        self._info = info
        self._owned = owned
        self._own_limit: tuple[object, float] = (None, 0.0)  # (limits, the command timeout it gives): _call_wait
        self._lock = threading.Lock()
        self._channel: _Connection | None = None
        self._tools: list[protocol.ToolSchema] = []
        self._schemas: dict[str, protocol.ToolSchema] = {}  # self._tools by name
        self._in_flight: dict[int, _Connection] = {}  # tool calls sent and not answered, by request id
        self._in_flight_lock = threading.Lock()
        # What the checks at its end moved aside or put back (``path``, ``why``), once closed.
        self.protected: list[dict[str, Any]] = []
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
        return _to_dict(self._info)

    def _attach(self, attached: tuple[Any, int | None] | None = None) -> None:
        """A channel to the session's tool server: the one ``attached`` (the
        open's own reply: one round trip) or a new one asked for."""
        reply, fd = attached or self._client._daemon_request(lambda rid: protocol.Attach(id=rid, session=self.id))
        assert isinstance(reply, protocol.Attached) and fd is not None
        self._info, self._tools = reply.session, reply.tools
        self._schemas = {t.name: t for t in reply.tools}
        old, self._channel = self._channel, _Connection(socket.socket(fileno=fd), protocol.channel_reply_decoder)
        if old is not None:
            old.close()

    def _remote_call(self, name: str) -> ToolFunc:
        def run(params: dict[str, Any], context: Any, on_output: OutputCallback | None = None) -> Result:
            if not context:  # the usual call, with no context: no cancellation to look up (~700-1,700 instructions)
                return self.call_tool(name, params, on_output=on_output)
            cancellation = context.get("cancellation") if isinstance(context, dict) else None
            return self.call_tool(name, params, on_output=on_output,
                                  cancellation=cancellation if isinstance(cancellation, Cancellation) else None)

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
        channel = self._channel  # one read (atomic); the lock only when it has to change
        if channel is None or channel._broken is not None:
            with self._lock:
                channel = self._channel
                if channel is None or channel.broken:
                    try:
                        self._attach()  # the sandbox was replaced (network switch)
                    except DispatchError as exc:
                        return Result.failure(f"session {self.id} is not available: {exc}")
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
            return self._lost(name, exc)
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

    def _tracker(self, channel: _Connection, cancellation: Cancellation | None,
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

    def _lost(self, name: str, exc: ConnectionLost) -> Result:
        """The channel broke mid-call: ask the daemon what happened (by attaching
        again, which also serves the next call when the session lives on)."""
        gone = self._client._bridge_gone()
        if gone is not None:  # not the sandbox: the way to it (dispatch._remote)
            return Result._from_wire(False, f"{name}: {gone}; the call's outcome is unknown, and session {self.id} "
                                     "may live on there for its orphan grace: connect again and attach to it by id "
                                     f"(client.session({self.id!r}))", {"lost": True, "bridge_lost": True,
                                                                          "outcome_unknown": True})
        cause = ""
        deadline = time.monotonic() + 5.0
        with self._lock:
            while True:
                try:
                    self._attach()
                except ConnectionLost as lost:
                    cause = f"dispatchd is gone ({lost}); the session ended with it"
                    break
                except DispatchError as err:
                    cause = str(err)
                    break
                # Attached: a new sandbox (a network switch), or the old one
                # not yet seen gone by the daemon (then the new channel hangs
                # up at once): ask again until the daemon knows.
                if not self._channel_hung_up() or time.monotonic() > deadline:
                    cause = ("the session's sandbox was replaced (its network was switched); "
                             "the call's processes were ended")
                    break
                time.sleep(0.05)
        text = f"the sandbox of session {self.id} went away during {name}: {cause}"
        meta: dict[str, Any] = {"lost": True}
        schema = self._schemas.get(name)
        if schema is not None and schema.risk == "write":
            # The new content may have reached the disk before the tool server went.
            text += ("; outcome unknown: the file may hold its old content or the new one (never a mix): "
                     "re-read the file")
            meta["outcome_unknown"] = True
        return Result._from_wire(False, f"{text} ({exc})", meta)

    def _channel_hung_up(self, wait_s: float = 0.1) -> bool:
        channel = self._channel
        if channel is None:
            return True
        poller = select.poll()
        poller.register(channel._frames.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(wait_s * 1000))
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
        word, listed = _network_word(network), _domain_list(domains)
        reply, _ = self._client._daemon_request(lambda rid: protocol.SetNetwork(
            id=rid, session=self.id, network=word, ports=ports, bind_ports=bind_ports,
            domains=listed))
        self._info = reply.session
        with self._lock:
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
        return _to_dict(reply.session)

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
        """Close the session (if this handle opened it), ending its processes."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
        if self._owned:
            self._owned = False
            try:
                self.protected = self._client.close_session(self.id)
            except RequestFailed as exc:
                if exc.code != "unknown_session":
                    raise

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        sock = _connect(socket_path, autostart=autostart, timeout=timeout, started=self) \
            if transport is None else transport.socket
        self._conn = _Connection(sock, protocol.daemon_reply_decoder, fds=True)
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
        word, listed = _network_word(network), _domain_list(domains)
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
        return _to_dict(reply.session)

    def set_network(self, session_id: str, network: bool | str, ports: list[int] | None = None,
                    bind_ports: list[int] | None = None, domains: list[str] | None = None) -> dict[str, Any]:
        word, listed = _network_word(network), _domain_list(domains)
        reply, _ = self._daemon_request(lambda rid: protocol.SetNetwork(
            id=rid, session=session_id, network=word, ports=ports, bind_ports=bind_ports,
            domains=listed))
        return _to_dict(reply.session)

    def session_infos(self) -> list[protocol.SessionInfo]:
        """``list_sessions()`` typed: each session as the protocol carries it,
        its ``protections`` a ``dispatchd.protocol.Protections``."""
        reply, _ = self._daemon_request(lambda rid: protocol.ListSessions(id=rid))
        return list(reply.sessions)

    def list_sessions(self) -> list[dict[str, Any]]:
        return [_to_dict(s) for s in self.session_infos()]

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


def _try_connect(path: str, timeout: float) -> socket.socket | None:
    """A connection to the daemon at ``path``, or None when nothing listens.
    Nothing is sent here; the directory and the peer are checked first."""
    directory, name = os.path.split(path)
    try:
        dirfd = paths.open_socket_dir(directory or ".")
    except FileNotFoundError:
        return None
    except paths.UnsafeDirectory as exc:
        raise UntrustedSocket(f"{exc} (refused before anything was sent)") from exc
    except OSError as exc:
        raise DaemonUnavailable(f"cannot connect to dispatchd at {path}: {exc.strerror}; "
                                f"{paths.what_to_do()}") from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        _connect_within(sock, paths.via_fd(dirfd, name), timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except TimeoutError as exc:
        sock.close()
        raise RequestTimeout(f"dispatchd at {path} did not take the connection within {timeout:g} s "
                             "(stopped, or its backlog is full)") from exc
    except OSError as exc:
        sock.close()
        raise DaemonUnavailable(f"cannot connect to dispatchd at {path}: {exc.strerror}; "
                                f"{paths.what_to_do()}") from exc
    finally:
        os.close(dirfd)
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    problem = paths.peer_problem(uid, pid, os.getuid())
    if problem is not None:
        sock.close()
        raise UntrustedSocket(f"refusing the socket {path}: {problem}, so it is not your dispatchd and nothing "
                              "was sent to it; remove it if you can, or use a socket of your own (--socket, "
                              "$DISPATCH_SOCKET, or set XDG_RUNTIME_DIR)")
    return sock


def _connect_within(sock: socket.socket, address: str, timeout: float) -> None:
    """``sock.connect(address)``, waiting up to ``timeout`` seconds for room in
    the daemon's listen backlog. A Unix socket does not wait there: with a
    timeout set its connect fails at once with EAGAIN while the backlog is
    full (a burst of clients the daemon is still accepting), so try again
    until the deadline; then ``TimeoutError``, as a full wait would give."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the listen backlog stayed full") from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)


def _python() -> list[str]:
    """This interpreter, never importing from the current directory (``-P``),
    and as isolated as we were ourselves."""
    flags = ["-P"]
    if sys.flags.isolated:
        flags.append("-I")
    else:
        flags += ["-E"] if sys.flags.ignore_environment else []
        flags += ["-s"] if sys.flags.no_user_site else []
    return [sys.executable, *flags]


def _start_daemon(path: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``dispatchd`` in the background on ``path``; returns it and its log file.
    From ``/`` and with ``-P``: a ``dispatchd`` package in the caller's
    directory (a worktree an agent wrote) is never what runs."""
    log_dir = paths.state_dir()
    paths.ensure_private_dir(log_dir)
    log_path = os.path.join(log_dir, "dispatchd.log")
    with open(log_path, "ab") as log:
        # The daemon rotates its log (--log-file); stderr stays for what comes
        # before logging starts (a refused start), read back below.
        proc = subprocess.Popen(
            [*_python(), "-m", "dispatchd", "--socket", path, "--log-file", log_path], cwd="/",
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
        )
    return proc, log_path


def _connect(path: str, *, autostart: bool, timeout: float, started: Client | None = None) -> socket.socket:
    sock = _try_connect(path, timeout)
    if sock is not None:
        return sock
    if not autostart:
        systemd = ", or `systemctl --user start dispatchd.socket`" if path == paths.default_socket_path() else ""
        raise DaemonUnavailable(f"no dispatchd is listening on {path} (start it with "
                                f"`dispatchd --socket {path}`, or leave out --no-autostart{systemd})")
    proc, log_path = _start_daemon(path)
    if started is not None:
        started.started_daemon = (proc.pid, log_path)
    deadline = time.monotonic() + timeout
    exited = None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        sock = _try_connect(path, timeout)
        if sock is not None:
            return sock
        exited = proc.poll()
        if exited is not None:
            break  # it will not answer: say why now, not after the timeout
    tail = ""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines() if ln.strip()]
            tail = f" (its log says: {lines[-1]})" if lines else ""
    except OSError:
        pass
    if exited is not None:
        raise DaemonUnavailable(f"started dispatchd on {path} but it exited with status {exited}{tail}")
    raise DaemonUnavailable(f"started dispatchd on {path} but it did not answer within {timeout:.0f} s{tail}")


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
