"""The filtering proxy of network ``domains``: one per session, in the daemon.

Guarantees:
- it serves only connections accepted on the listener the session's worker
  made on the loopback of the session's own network namespace (handed over
  with ``WorkerReady``): no other session, and no other user, can reach it;
- a request is relayed only while the session's mode is ``domains`` and only
  to a host and port its rules allow (``dispatchd.domains.allowed``);
  anything else gets an HTTP error whose status line and body say why, and a
  refused host is counted for ``status()`` (the last ``MAX_DENIED``);
- it connects only to addresses ``relayable`` allows (never the host's
  loopback, link-local, unspecified or multicast addresses) that are not
  the machine's own (``localaddr.is_local``: its interfaces' addresses reach
  the services of its loopback), resolving names itself: the session needs
  no resolver and never learns other addresses;
- hostile input is bounded: a request head of at most ``MAX_HEAD`` bytes read
  within ``HEAD_TIMEOUT_S``, at most ``MAX_CONNECTIONS`` at once per session
  (more get 503 at once), a relay idle for ``IDLE_TIMEOUT_S`` is closed;
- ``configure`` applies a new mode or list at once: connections to hosts it
  no longer allows are closed before it returns; ``stop`` closes the listener
  and every connection (nothing relayed after a switch or the end).

What it speaks: HTTP CONNECT (what pip, npm, git and curl use for https://),
and plain HTTP requests in absolute form (``GET http://host/path``), sent on
with ``Connection: close`` and the ``Host`` header set to the URL's host. It
never looks inside a tunnel: TLS (SNI, ECH) is between the client and the
host it named, which is the one the proxy checked and connected to.

A small threaded proxy written for this rather than a library: see
docs/architecture.md, "Dependencies, and why".
"""

from __future__ import annotations

import collections
import json
import logging
import selectors
import shlex
import socket
import threading
import time
from collections.abc import Callable

from dispatchd.daemon.localaddr import is_local
from dispatchd.daemon.proxyhead import HttpError, Request, parse_head, response, shown
from dispatchd.domains import Rule, allowed, describe, is_ip_literal, normalise_host, relayable
from dispatchd.netmodes import NetworkMode

log = logging.getLogger("dispatchd.proxy")

MAX_HEAD = 16 * 1024  # request line and headers
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0
MAX_CONNECTIONS = 64  # per session, at once
MAX_DENIED = 20
_BUF = 64 * 1024


Resolver = Callable[[str, int], list[tuple[str, bool]]]


def system_resolver(overrides: dict[str, list[str]] | None = None) -> Resolver:
    """Resolve a host to (address, exempt) pairs; ``exempt`` marks an address
    from ``overrides`` (the daemon's testing option), relayed even on loopback."""
    table = {normalise_host(k): list(v) for k, v in (overrides or {}).items()}

    def resolve(host: str, port: int) -> list[tuple[str, bool]]:
        if host in table:
            return [(a, True) for a in table[host]]
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        seen: list[tuple[str, bool]] = []
        for *_, addr in infos:
            if (str(addr[0]), False) not in seen:
                seen.append((str(addr[0]), False))
        return seen

    return resolve


class _Conn:
    def __init__(self, client: socket.socket, host: str = "", port: int = 0) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.host, self.port = host, port
        self.cut_off = False  # set under the proxy's lock: nothing more may be relayed

    def cut(self) -> None:
        """From another thread: wake the relay, which then closes both."""
        for sock in (self.client, self.upstream):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class SessionProxy:
    """The proxy of one session. Outlives sandbox replacements (its denied
    counts are the session's); serves one listener at a time."""

    def __init__(self, session: str, resolver: Resolver) -> None:
        self.session = session
        self.resolve = resolver
        self.mode: NetworkMode = "off"
        self.rules: tuple[Rule, ...] = ()
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._listener: socket.socket | None = None
        self._denied: collections.OrderedDict[tuple[str, int], list[float]] = collections.OrderedDict()
        # Told of each refusal (host, port, the command that allows it) before
        # the refused process gets its answer: the session's calls carry it.
        self.on_deny: Callable[[str, int, str], None] | None = None

    # --- control, from the session manager --------------------------------

    def configure(self, mode: NetworkMode, rules: tuple[Rule, ...]) -> int:
        """Apply a mode and list; close connections they no longer allow.
        Returns how many were closed."""
        with self._lock:
            self.mode, self.rules = mode, rules
            gone = [c for c in self._conns
                    if c.host and (mode != "domains" or not allowed(rules, c.host, c.port))]
            for conn in gone:
                conn.cut_off = True
        for conn in gone:
            conn.cut()
        return len(gone)

    def serve(self, listener: socket.socket) -> None:
        """Serve connections accepted on ``listener`` (a socket of the session's namespace)."""
        self.stop()
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name=f"proxy-{self.session}").start()

    def stop(self) -> None:
        """Close the listener and every connection (the sandbox is going)."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns = list(self._conns)
            for conn in conns:
                conn.cut_off = True
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); the accept thread closes it
            except OSError:
                pass
        for conn in conns:
            conn.cut()

    def denied(self) -> list[tuple[str, int, int, float]]:
        """(host, port, count, last) of the last refused hosts, most recent first."""
        with self._lock:
            return [(h, p, int(c), last) for (h, p), (c, last) in reversed(self._denied.items())]

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # --- serving ------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        try:
            while True:
                try:
                    client, _ = listener.accept()
                except OSError:
                    return  # stopped
                with self._lock:
                    if self._listener is not listener:
                        client.close()
                        return
                    full = len(self._conns) >= MAX_CONNECTIONS
                    conn = None if full else _Conn(client)
                    if conn is not None:
                        self._conns.add(conn)
                if conn is None:
                    self._refuse_fast(client)
                    continue
                try:
                    threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
                except RuntimeError:  # can't start new thread: this one refused, the listener serves on
                    with self._lock:
                        self._conns.discard(conn)
                    self._refuse_fast(client)
        finally:
            listener.close()

    @staticmethod
    def _refuse_fast(client: socket.socket) -> None:
        try:
            client.settimeout(1.0)
            client.sendall(response(503, "Service Unavailable", (
                f"dispatchd proxy: this session already has {MAX_CONNECTIONS} connections open through the "
                "proxy; close some and retry\n")))
        except OSError:
            pass
        client.close()

    def _serve(self, conn: _Conn) -> None:
        client = conn.client
        try:
            client.settimeout(HEAD_TIMEOUT_S)
            try:
                head, rest = self._read_head(client)
                req = parse_head(head)
                upstream = self._open(conn, req)
            except (HttpError, ValueError) as exc:
                # A ValueError no check foresaw is a bad request still: answered, never a dead thread.
                err = exc if isinstance(exc, HttpError) else HttpError(
                    400, "Bad Request", f"dispatchd proxy: {shown(str(exc))}\n")
                client.sendall(response(err.status, err.reason, err.body, err.headers))
                _linger(client)
                return
            with self._lock:
                conn.upstream = upstream
                if conn.cut_off:  # configured away or stopped while we connected
                    return
            if req.tunnel:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.sendall(req.upstream_head())
            if rest:
                upstream.sendall(rest)
            self._relay(client, upstream)
        except OSError:
            pass  # either side went away, or ``cut``
        finally:
            with self._lock:
                self._conns.discard(conn)
            for sock in (client, conn.upstream):
                if sock is not None:
                    sock.close()

    @staticmethod
    def _read_head(client: socket.socket) -> tuple[bytes, bytes]:
        buf = bytearray()
        deadline = time.monotonic() + HEAD_TIMEOUT_S
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                return bytes(buf[:end]), bytes(buf[end + 4 :])
            if len(buf) > MAX_HEAD:
                raise HttpError(431, "Request Header Fields Too Large",
                                f"dispatchd proxy: a request head is at most {MAX_HEAD} bytes\n")
            left = deadline - time.monotonic()
            if left <= 0:
                raise HttpError(408, "Request Timeout", "dispatchd proxy: the request head took too long\n")
            client.settimeout(left)
            try:
                data = client.recv(MAX_HEAD + 4 - len(buf) + 1)
            except TimeoutError:
                raise HttpError(408, "Request Timeout", "dispatchd proxy: the request head took too long\n") from None
            if not data:
                raise OSError("closed before a whole request head")
            buf += data

    def _open(self, conn: _Conn, req: Request) -> socket.socket:
        with self._lock:
            # Decided and recorded under one lock: a ``configure`` after this
            # sees the connection's host and cuts it if no longer allowed.
            mode, rules = self.mode, self.rules
            ok = mode == "domains" and allowed(rules, req.host, req.port)
            if ok:
                conn.host, conn.port = req.host, req.port
        if mode != "domains":
            raise HttpError(403, f"Forbidden by dispatchd: network is not in domains mode ({mode})", (
                f"dispatchd: this session's network is {mode!r}, not in domains mode: the proxy relays "
                f"nothing. Switch with: {shlex.join(['dispatch', 'network', self.session, 'domains'])} "
                "--domains HOST,...\n"))
        if not ok:
            self._deny(req.host, req.port, rules)
            raise HttpError(403, f"Forbidden by dispatchd: {req.host} is not in this session's domains",
                            self._denied_body(req.host, req.port, rules),
                            {"X-Dispatchd-Denied": f"{req.host}:{req.port}"})
        try:
            found = [(req.host, False)] if is_ip_literal(req.host) else self.resolve(req.host, req.port)
        except (OSError, UnicodeError) as exc:
            raise HttpError(502, "Bad Gateway", f"dispatchd proxy: cannot resolve {req.host}: {exc}\n") from None
        # The machine's own addresses (eth0's, docker0's) too: every service
        # listening on 0.0.0.0 answers there as on its loopback.
        usable = [a for a, exempt in found if exempt or (relayable(a) and not is_local(a))]
        if not usable:
            raise HttpError(502, "Bad Gateway", (
                f"dispatchd proxy: {req.host} resolves only to addresses the proxy never relays to "
                f"({', '.join(a for a, _ in found) or 'none'}: loopback, link-local, unspecified or this "
                "machine's own)\n"))
        errors = []
        for address in usable:
            try:
                upstream = socket.create_connection((address, req.port), timeout=CONNECT_TIMEOUT_S)
            except OSError as exc:
                errors.append(f"{address}: {exc.strerror or exc}")
                continue
            log.debug("event=proxy_connect session=%s host=%s port=%s address=%s", self.session,
                      req.host, req.port, address)
            return upstream
        raise HttpError(502, "Bad Gateway",
                        f"dispatchd proxy: cannot connect to {req.host}:{req.port} ({'; '.join(errors)})\n")

    def _deny(self, host: str, port: int, rules: tuple[Rule, ...] = ()) -> None:
        log.info("event=proxy_denied session=%s host=%s port=%s", self.session, host, port)
        if self.on_deny is not None:
            try:
                self.on_deny(host, port, self.allow_command(host, port, rules))
            except Exception:  # telling the calls is a courtesy: the refusal stands
                log.exception("event=proxy_deny_report_failed session=%s", self.session)
        with self._lock:
            entry = self._denied.pop((host, port), [0, 0.0])
            entry[0] += 1
            entry[1] = time.time()
            self._denied[(host, port)] = entry
            while len(self._denied) > MAX_DENIED:
                self._denied.popitem(last=False)

    @staticmethod
    def _wanted(host: str, port: int) -> str:
        """The list's entry for ``host:port`` (an IPv6 address in brackets, its port after them)."""
        spelled = f"[{host}]" if ":" in host else host
        return spelled if port in (80, 443) else f"{spelled}:{port}"

    def allow_command(self, host: str, port: int, rules: tuple[Rule, ...]) -> str:
        """The command that allows ``host:port`` besides what ``rules`` allow,
        each word quoted for a shell (a wildcard's ``*``, a bracket)."""
        wanted = ",".join(describe(rules) + [self._wanted(host, port)])
        return shlex.join(["dispatch", "network", self.session, "domains", "--domains", wanted])

    def _denied_body(self, host: str, port: int, rules: tuple[Rule, ...]) -> str:
        listed = describe(rules)
        wanted = self._wanted(host, port)
        return (f"dispatchd: this session's network is in mode \"domains\", and {host} (port {port}) "
                f"is not in its list.\n"
                f"Allowed: {', '.join(listed) or 'nothing yet'}\n"
                f"To allow it: {self.allow_command(host, port, rules)}\n"
                f"  (Python: session.set_network(\"domains\", domains=[..., {json.dumps(wanted)}]); "
                f"or add it to the policy's network.domains)\n")

    @staticmethod
    def _relay(a: socket.socket, b: socket.socket) -> None:
        """Copy both ways until both directions are closed, or nothing moves for
        ``IDLE_TIMEOUT_S``. A half-close is passed on (shutdown SHUT_WR)."""
        a.settimeout(IDLE_TIMEOUT_S)
        b.settimeout(IDLE_TIMEOUT_S)
        peer = {a: b, b: a}
        open_reads = {a, b}
        with selectors.DefaultSelector() as sel:
            for s in open_reads:
                sel.register(s, selectors.EVENT_READ)
            while open_reads:
                ready = sel.select(IDLE_TIMEOUT_S)
                if not ready:
                    return  # idle
                for key, _ in ready:
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(_BUF)
                    if data:
                        peer[src].sendall(data)
                        continue
                    sel.unregister(src)
                    open_reads.discard(src)
                    try:
                        peer[src].shutdown(socket.SHUT_WR)
                    except OSError:
                        return


def _linger(client: socket.socket) -> None:
    """After an error reply: end our side and read what the client was still
    sending (a little, briefly), so closing does not reset the connection
    before the client has read why."""
    try:
        client.shutdown(socket.SHUT_WR)
        drained, deadline = 0, time.monotonic() + 1.0
        while drained < MAX_HEAD * 4 and (left := deadline - time.monotonic()) > 0:
            client.settimeout(left)
            data = client.recv(_BUF)
            if not data:
                return
            drained += len(data)
    except OSError:
        pass
