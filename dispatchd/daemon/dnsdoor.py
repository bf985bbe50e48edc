"""One session's door to the DNS relay: its UDP socket and TCP listener on
the session's own loopback, served by a thread of their own.

Guarantees (the relay's, docs in ``dnsrelay``): a query is forwarded only
when ``dnswire.check_query`` passes it, only to the host's resolvers the
relay names, under our own random ID; a reply goes back only from the
server asked, answering the query; ``MAX_IN_FLIGHT`` queries at once (more
answered SERVFAIL), ``MAX_PER_WINDOW`` datagrams and connections taken a
``RATE_WINDOW_S``, ``MAX_TCP`` connections each idle at most ``TCP_IDLE_S``;
an upstream gets ``UPSTREAM_TIMEOUT_S``, a query ``QUERY_DEADLINE_S`` in
all; after ``stop`` nothing more is sent upstream (the send happens under
the door's lock, after a look at ``stopped``). Its queries' last word
(answered, or why not) is its own session's (``warning``): another
session's lookups neither set nor clear it.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Protocol

from dispatchd.daemon.dnshost import HostResolvers, Server, family, recv_exact, sockaddr, why_not
from dispatchd.daemon.dnswire import (
    MAX_QUERY, MAX_REPLY, RCODE_FORMERR, RCODE_SERVFAIL, check_query, error_reply, matches, with_id)

log = logging.getLogger("dispatchd.dns")

MAX_IN_FLIGHT = 32  # per session, UDP and TCP together
MAX_TCP = 8  # TCP connections at once, per session
TCP_IDLE_S = 10.0
# A session's datagrams and connections are taken at most MAX_PER_WINDOW a
# RATE_WINDOW_S (2,000 a second): a session flooding its door holds one of
# the daemon's threads, and the GIL, no more than that.
RATE_WINDOW_S = 0.1
MAX_PER_WINDOW = 200
UPSTREAM_TIMEOUT_S = 2.0  # per resolver: the next is tried after this
QUERY_DEADLINE_S = 4.0  # under glibc's 5 s: the session's library hears our SERVFAIL, not its own timeout


class Relay(Protocol):
    """What a door asks of the relay that made it (``dnsrelay.DnsRelay``)."""

    resolvers: HostResolvers

    def queried(self, problem: str) -> None: ...

    def warning(self, problem: str | None = None) -> str: ...

    def resolve_tcp(self, door: Door, query: bytes) -> bytes | None: ...


class _Pending:
    """A query of a session's on its way over UDP: to which resolver, until when."""

    def __init__(self, query: bytes, peer: tuple[str, int], servers: list[Server], deadline: float) -> None:
        self.query, self.peer, self.servers, self.deadline = query, peer, servers, deadline
        self.sent = with_id(query, secrets.token_bytes(2))  # our own ID on the way; the client's put back
        self.index = 0  # the resolver asked now
        self.sock: socket.socket | None = None
        self.until = deadline
        self.errors: list[str] = []


class Door:
    """One session's way to the relay: its UDP socket and TCP listener (on
    its own loopback), served by a thread of their own until ``stop``."""

    def __init__(self, relay: Relay, session: str, udp: socket.socket, tcp: socket.socket) -> None:
        self.relay, self.session, self.udp, self.tcp = relay, session, udp, tcp
        self.lock = threading.Lock()
        self.stopped = False
        self.in_flight = 0
        self.conns: set[socket.socket] = set()
        self.queries = 0
        self.failed = 0  # answered SERVFAIL because no resolver answered
        # Its queries' last word: why no resolver answered the last one, ""
        # once one did; None before any (the relay's check at the open stands).
        self.problem: str | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # Read only when select says so, and never waited on: a datagram or a
        # connection gone meanwhile cannot hold the serving thread.
        udp.setblocking(False)
        tcp.setblocking(False)
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"dns-{session}")
        self._thread.start()

    def stop(self) -> None:
        """Nothing more forwarded for this door once this returns; its
        sockets closed (the session's queries are refused by its loopback)."""
        with self.lock:
            if self.stopped:
                return  # ended already: its sockets are closed
            self.stopped = True
            conns = list(self.conns)
            # Under the lock: the serving thread closes the pipe under it, once stopped is set.
            os.write(self._wake_w, b"x")
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def note(self, problem: str) -> None:
        """A query's word, this session's alone ("" once a resolver answered)."""
        with self.lock:
            changed = problem != self.problem
            self.problem = problem
        self.relay.queried(problem)
        if changed:
            if problem:
                log.warning("event=dns_unanswered session=%s why=%s", self.session, problem)
            else:
                log.info("event=dns_answers session=%s", self.session)

    def warning(self) -> str:
        """What the session's status warns of: its own queries' last word,
        else the relay's check (made at its open or switch)."""
        with self.lock:
            problem = self.problem
        return self.relay.warning(problem)

    def take(self) -> bool:
        with self.lock:
            if self.stopped or self.in_flight >= MAX_IN_FLIGHT:
                return False
            self.in_flight += 1
            return True

    def send_if_open(self, send: Callable[[], object]) -> bool:
        """Send a query upstream under the door's lock, unless it has closed:
        a ``stop`` either comes first (nothing sent) or waits for the send."""
        with self.lock:
            if self.stopped:
                return False
            self.queries += 1
            send()
            return True

    def done(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def _serve(self) -> None:
        """The door's loop: the session's datagrams, its connections, and the
        upstream sockets of its queries in flight, in one poll (no hand-off
        to another thread on a query's way; poll, not select: the daemon's
        descriptors may number above 1024)."""
        poller = select.poll()
        udp, tcp = self.udp.fileno(), self.tcp.fileno()
        for fd in (udp, tcp, self._wake_r):
            poller.register(fd, select.POLLIN)
        pending: dict[int, _Pending] = {}
        # The rate bound: at most MAX_PER_WINDOW datagrams read a window; past
        # it the socket is not polled until the window ends, and what the
        # session sends meanwhile waits in (or overflows) its kernel buffer.
        window_end, read, paused = 0.0, 0, False
        try:
            while True:
                soonest = min([p.until for p in pending.values()] + ([window_end] if paused else []), default=None)
                wait_ms = None if soonest is None else max(0, int((soonest - time.monotonic()) * 1000) + 1)
                ready = {fd for fd, _ in poller.poll(wait_ms)}
                if self._wake_r in ready or self.stopped:
                    return
                for fd in ready & pending.keys():
                    self._upstream_readable(poller, pending, fd)
                now = time.monotonic()
                if now >= window_end:
                    window_end, read = now + RATE_WINDOW_S, 0
                    if paused:
                        poller.register(udp, select.POLLIN)
                        poller.register(tcp, select.POLLIN)
                        paused = False
                if not paused:
                    if udp in ready:
                        self._read_udp(poller, pending)
                        read += 1
                    if tcp in ready:
                        self._accept()
                        read += 1
                    if read >= MAX_PER_WINDOW:
                        poller.unregister(udp)
                        poller.unregister(tcp)
                        paused = True
                        log.debug("event=dns_door_paused session=%s", self.session)
                now = time.monotonic()
                for fd, p in list(pending.items()):
                    if p.until <= now:
                        server = p.servers[p.index]
                        p.errors.append(why_not(server, TimeoutError("timed out")))
                        self._drop(poller, pending, fd)
                        p.index += 1
                        self._launch(poller, pending, p)
        except OSError as exc:
            log.warning("event=dns_door_failed session=%s error=%s", self.session, exc)
        finally:
            log.debug("event=dns_door_closed session=%s queries=%d unanswered=%d", self.session, self.queries,
                      self.failed)
            with self.lock:
                self.stopped = True
                for p in pending.values():
                    if p.sock is not None:
                        p.sock.close()
                self.udp.close()
                self.tcp.close()
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _read_udp(self, poller: select.poll, pending: dict[int, _Pending]) -> None:
        try:
            query, peer = self.udp.recvfrom(MAX_QUERY + 1)
        except (BlockingIOError, InterruptedError):
            return
        why = check_query(query)
        if why:
            log.debug("event=dns_refused session=%s why=%s", self.session, why)
            if len(query) >= 12 and not query[2] & 0x80:
                self._send_udp(error_reply(query, RCODE_FORMERR), peer)
            return
        if not self.take():
            self._send_udp(error_reply(query, RCODE_SERVFAIL), peer)
            return
        servers = self.relay.resolvers.servers()
        self._launch(poller, pending, _Pending(query, peer, servers, time.monotonic() + QUERY_DEADLINE_S))

    def _launch(self, poller: select.poll, pending: dict[int, _Pending], p: _Pending) -> None:
        """Send ``p`` to its next resolver (a socket of its own, connected to
        it), or answer SERVFAIL when none is left or its time is up."""
        while p.index < len(p.servers) and time.monotonic() < p.deadline:
            server = p.servers[p.index]
            sock = socket.socket(family(server[0]), socket.SOCK_DGRAM)
            try:
                sock.setblocking(False)
                sock.connect(sockaddr(server))
                sent = self.send_if_open(lambda: sock.send(p.sent))
            except OSError as exc:
                sock.close()
                p.errors.append(why_not(server, exc))
                p.index += 1
                continue
            if not sent:  # the door is closing: nothing goes out
                sock.close()
                self.done()
                return
            p.sock, p.until = sock, min(p.deadline, time.monotonic() + UPSTREAM_TIMEOUT_S)
            pending[sock.fileno()] = p
            poller.register(sock.fileno(), select.POLLIN)
            return
        if p.index < len(p.servers):
            p.errors.append("no answer within the relay's deadline")
        self.note("; ".join(p.errors))
        with self.lock:
            self.failed += 1
        self._send_udp(error_reply(p.query, RCODE_SERVFAIL), p.peer)
        self.done()

    def _upstream_readable(self, poller: select.poll, pending: dict[int, _Pending], fd: int) -> None:
        p = pending[fd]
        assert p.sock is not None
        server = p.servers[p.index]
        try:
            reply = p.sock.recv(MAX_REPLY)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # ECONNREFUSED: nothing listens there; the next one
            p.errors.append(why_not(server, exc))
            self._drop(poller, pending, fd)
            p.index += 1
            self._launch(poller, pending, p)
            return
        if not matches(p.sent, reply):
            return  # not an answer to this query: still waiting
        self._drop(poller, pending, fd)
        self.note("")
        self._send_udp(with_id(reply, p.query[:2]), p.peer)
        self.done()

    @staticmethod
    def _drop(poller: select.poll, pending: dict[int, _Pending], fd: int) -> None:
        p = pending.pop(fd)
        poller.unregister(fd)
        if p.sock is not None:
            p.sock.close()
            p.sock = None

    def _send_udp(self, reply: bytes, peer: tuple[str, int]) -> None:
        try:
            self.udp.sendto(reply, peer)
        except OSError:
            pass  # the session's socket went, or the door closed

    def _accept(self) -> None:
        try:
            conn, _ = self.tcp.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        conn.setblocking(True)  # with timeouts (recv_exact, TCP_IDLE_S)
        with self.lock:
            full = self.stopped or len(self.conns) >= MAX_TCP
            if not full:
                self.conns.add(conn)
        if full:
            conn.close()  # the session's resolver tries again, or UDP
            return
        try:
            threading.Thread(target=self._serve_tcp, args=(conn,), daemon=True, name=f"dns-tcp-{self.session}").start()
        except RuntimeError:  # can't start new thread: this connection closed (the resolver retries), the door stays
            with self.lock:
                self.conns.discard(conn)
            conn.close()

    def _serve_tcp(self, conn: socket.socket) -> None:
        """Queries in turn on one connection (RFC 7766: length-prefixed),
        until it closes or stays idle ``TCP_IDLE_S``."""
        try:
            while True:
                try:
                    (length,) = struct.unpack("!H", recv_exact(conn, 2, time.monotonic() + TCP_IDLE_S))
                    query = recv_exact(conn, length, time.monotonic() + TCP_IDLE_S)
                except (OSError, TimeoutError):
                    return
                why = check_query(query)
                if why:
                    log.debug("event=dns_refused session=%s why=%s", self.session, why)
                    return
                if not self.take():
                    reply: bytes | None = error_reply(query, RCODE_SERVFAIL)
                else:
                    try:
                        reply = self.relay.resolve_tcp(self, query)
                    finally:
                        self.done()
                if reply is None:
                    return
                conn.settimeout(TCP_IDLE_S)
                conn.sendall(struct.pack("!H", len(reply)) + reply)
        except OSError:
            pass
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()
