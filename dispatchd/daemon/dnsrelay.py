"""The DNS relay of network ``on`` and ``ports``: in the daemon, one door per session.

Guarantees:
- a session reaches it only through its door: a UDP socket and a TCP
  listener on ``RELAY_ADDRESS`` port 53 of the session's own network
  namespace (its own loopback), made there by a child of the fork server
  (``netstack.open_dns_sockets_in``) and handed to the daemon; the door is
  opened with the session's network stack and closed with it
  (``netstack.Stack.stop``), so a session whose network is ``off`` (or
  ``domains``) has no door: a query there is refused by its own loopback
  (ECONNREFUSED), and no other session, nor any other user, can reach it;
- the session's resolv.conf names ``RELAY_ADDRESS`` (``resolv_conf_text``);
- it forwards only what parses as one DNS query (QR clear, opcode QUERY, one
  question) and only to the host's resolvers, as the host's resolv.conf names
  them (re-read when that file, or the file its symlink leads to, changes);
  the session never chooses where a query goes. A reply is passed back only
  when it comes from the server the query was sent to, answers it (our own
  random ID, the same question) and parses as a reply;
- it is bounded: a query of at most ``MAX_QUERY`` bytes, a reply of at most
  65,535, ``MAX_IN_FLIGHT`` queries at once per session (more are answered
  SERVFAIL at once), ``MAX_PER_WINDOW`` datagrams and connections taken a ``RATE_WINDOW_S``, ``MAX_TCP`` TCP connections per session, each idle at
  most ``TCP_IDLE_S``; an upstream gets ``UPSTREAM_TIMEOUT_S``, the next one
  is tried, and a query no resolver answers is answered SERVFAIL within
  ``QUERY_DEADLINE_S``: the session's resolver library fails at once rather
  than waiting for its own timeouts;
- ``stop`` returns once nothing more is forwarded for that door: the
  sockets are closed, and a query read before but not yet sent is dropped
  (the send upstream happens under the door's lock, after a look at
  ``stopped``, which ``stop`` sets under the same lock);
- ``check`` says whether any of the host's resolvers answers (a query for
  the root's NS records; any reply counts): an open or a switch to ``on`` or
  ``ports`` whose DNS would not answer says so (``SessionInfo.warnings``).

``network ports``: the door is on the session's loopback, which the
``ports`` rules let through, so DNS through the relay works whatever ports
are listed; DNS straight to a server (port 53 elsewhere) follows the list
like any other UDP or TCP. The relay relays DNS and nothing else, to the
host's resolvers only: what it adds to ``ports`` is name lookups (and what a
query's name can carry).
"""

from __future__ import annotations

import concurrent.futures
import errno
import ipaddress
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from dispatchd.confine.netstack import DNS_PORT, RELAY_ADDRESS, Stack
from dispatchd.daemon.spawn import SpawnError

log = logging.getLogger("dispatchd.dns")

HOST_RESOLV_CONF = "/etc/resolv.conf"
MAX_QUERY = 4096  # a query: one question and an OPT record fit in far less
MAX_REPLY = 65535
MAX_IN_FLIGHT = 32  # per session, UDP and TCP together
MAX_TCP = 8  # TCP connections at once, per session
POOL_THREADS = 16  # for ``check`` (each resolver at once) and doors made ahead; a door's own thread waits for its queries
TCP_IDLE_S = 10.0
# A session's datagrams and connections are taken at most MAX_PER_WINDOW a
# RATE_WINDOW_S (2,000 a second): a session flooding its door holds one of
# the daemon's threads, and the GIL, no more than that.
RATE_WINDOW_S = 0.1
MAX_PER_WINDOW = 200
UPSTREAM_TIMEOUT_S = 2.0  # per resolver: the next is tried after this
QUERY_DEADLINE_S = 4.0  # under glibc's 5 s: the session's library hears our SERVFAIL, not its own timeout
CHECK_TIMEOUT_S = 1.0
# A check that found no resolver answering stands this long (unless the
# servers change or a query gets through): opens are not each held up by
# CHECK_TIMEOUT_S while the host's resolver is silent.
CHECK_KEEP_S = 5.0
RELOAD_EVERY_S = 1.0  # how often the host's resolv.conf is looked at (stat) at most
MAX_SERVERS = 3  # as glibc (MAXNS)
DEFAULT_SERVER = ("127.0.0.1", 53)  # glibc's, when resolv.conf names none

_RCODE_SERVFAIL = 2
_RCODE_FORMERR = 1

Server = tuple[str, int]


# --- pure: resolv.conf and DNS messages -----------------------------------------


def parse_resolv_conf(text: str, *, ports: bool = False) -> list[Server]:
    """The nameservers of a resolv.conf, in order, at most ``MAX_SERVERS``
    (glibc reads no more). An entry glibc would not read is skipped. With
    ``ports`` (the daemon's testing option only), ``ADDR:PORT`` and
    ``[V6]:PORT`` are read too: a test's resolver cannot listen on port 53."""
    servers: list[Server] = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != "nameserver":
            continue
        text_addr, port = words[1], DNS_PORT
        if ports and text_addr.startswith("[") and "]:" in text_addr:
            text_addr, _, p = text_addr[1:].partition("]:")
            port = int(p) if p.isdigit() and 0 < int(p) < 65536 else -1
        elif ports and text_addr.count(":") == 1:
            text_addr, _, p = text_addr.partition(":")
            port = int(p) if p.isdigit() and 0 < int(p) < 65536 else -1
        try:
            address = ipaddress.ip_address(text_addr.split("%", 1)[0])
        except ValueError:
            continue
        if port < 0:
            continue
        server = (str(address) + (text_addr[text_addr.index("%"):] if "%" in text_addr else ""), port)
        if server not in servers:
            servers.append(server)
        if len(servers) == MAX_SERVERS:
            break
    return servers or [DEFAULT_SERVER]


def kept_lines(text: str) -> list[str]:
    """What a session's resolv.conf keeps of the host's: its search list
    (the last ``search`` or ``domain`` line, as glibc reads it) and its
    ``ndots``, so that short names resolve inside as they do outside."""
    search, ndots = "", ""
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] in ("search", "domain") and len(words) > 1:
            search = " ".join(["search", *words[1:]])[:1024]
        elif words[0] == "options":
            ndots = next((w for w in words[1:] if w.startswith("ndots:") and w[6:].isdigit()), ndots)
    return ([search] if search else []) + ([f"options {ndots}"] if ndots else [])


def resolv_conf_text(kept: list[str] | None = None) -> str:
    """What a session with the relay reads as its resolv.conf. One attempt:
    the relay answers every query it takes within QUERY_DEADLINE_S (an
    answer, or SERVFAIL when no resolver of the host's answers)."""
    return (f"# dispatchd: the session's DNS relay, on its own loopback; the daemon forwards\n"
            f"# queries to the host's resolvers ({HOST_RESOLV_CONF} outside the session).\n"
            f"nameserver {RELAY_ADDRESS}\n"
            + "".join(line + "\n" for line in kept or [])
            + "options timeout:5 attempts:1\n")


_ROOTS = ("/etc/", "/run/")  # where the file a host's resolv.conf leads to may be bound over


def session_resolv_binds(source: str, host_path: str = HOST_RESOLV_CONF) -> list[str]:
    """``[where, source]``: where in a session's root the relay's resolv.conf
    (``source``) is bound so that the session's ``/etc/resolv.conf`` reads
    it: the host's file itself, or the file its symlinks lead to
    (``/run/systemd/resolve/stub-resolv.conf`` on Ubuntu), which the session
    reaches by the same links (its ``/etc`` is the host's). Empty (nothing
    bound: the session reads the host's file) without ``source``, or when the
    file is not a regular file under ``/etc`` or ``/run``: a bind elsewhere
    could land in a path the session writes. Read at each plan: a link
    changed since the daemon's start is followed."""
    if not source:
        return []
    where = os.path.realpath(host_path)
    if not where.startswith(_ROOTS) or not os.path.isfile(where):
        return []
    return [where, source]


def question_end(msg: bytes) -> int:
    """The offset after the one question of a DNS message (its name, type
    and class); raises ValueError when it is not one well-formed question.
    Names in a question are never compressed (a pointer is refused)."""
    if len(msg) < 12:
        raise ValueError("shorter than a DNS header")
    if struct.unpack_from("!H", msg, 4)[0] != 1:
        raise ValueError("not exactly one question")
    pos, total = 12, 0
    while True:
        if pos >= len(msg):
            raise ValueError("question name runs past the message")
        length = msg[pos]
        if length & 0xC0:
            raise ValueError("compressed or extended label in a question")
        pos += 1 + length
        total += 1 + length
        if total > 255:
            raise ValueError("question name longer than 255 bytes")
        if length == 0:
            break
    if pos + 4 > len(msg):
        raise ValueError("question without type and class")
    return pos + 4


def check_query(msg: bytes) -> str:
    """"" when ``msg`` is a DNS query the relay forwards, else why not."""
    if len(msg) > MAX_QUERY:
        return f"a query of {len(msg)} bytes (at most {MAX_QUERY})"
    try:
        question_end(msg)
    except ValueError as exc:
        return str(exc)
    flags = msg[2]
    if flags & 0x80:
        return "a reply, not a query"
    if (flags >> 3) & 0x0F != 0:
        return "not a standard query (opcode)"
    return ""


def error_reply(query: bytes, rcode: int) -> bytes:
    """A reply to ``query`` (its ID, flags' RD, its question) with ``rcode``
    and no records; the header alone when the question does not parse."""
    try:
        end = question_end(query)
    except ValueError:
        end = 12
    rd = query[2] & 0x01 if len(query) > 2 else 0
    header = struct.pack("!HBBHHHH", struct.unpack_from("!H", query)[0] if len(query) >= 2 else 0,
                         0x80 | rd, 0x80 | rcode, 1 if end > 12 else 0, 0, 0, 0)
    return header + query[12:end]


def matches(query: bytes, reply: bytes) -> bool:
    """Does ``reply`` answer ``query``: a reply, with its ID and its question?"""
    if len(reply) < 12 or not reply[2] & 0x80 or reply[:2] != query[:2]:
        return False
    try:
        end = question_end(query)
    except ValueError:
        return False
    return reply[12:end].lower() == query[12:end].lower()  # 0x20 case randomisation by a resolver is allowed


def _with_id(msg: bytes, ident: bytes) -> bytes:
    return ident + msg[2:]


# --- the host's resolvers ------------------------------------------------------


class HostResolvers:
    """The servers the host's resolv.conf names, re-read when it changes (the
    file a symlink leads to included: ``os.stat`` follows it)."""

    def __init__(self, path: str = HOST_RESOLV_CONF, *, ports: bool = False) -> None:
        self.path = path
        self.ports = ports
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int, int] | None = None
        self._servers: list[Server] = [DEFAULT_SERVER]
        self.kept: list[str] = []  # kept_lines of the file
        self._looked = 0.0
        self.on_change: Callable[[list[str]], None] | None = None  # called with new kept lines

    def servers(self) -> list[Server]:
        now = time.monotonic()
        with self._lock:
            if self._seen is not None and now - self._looked < RELOAD_EVERY_S:
                return self._servers
            self._looked = now
            try:
                st = os.stat(self.path)
                seen = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
                if seen != self._seen:
                    with open(self.path, encoding="utf-8", errors="replace") as f:
                        text = f.read(64 * 1024)
                    self._servers = parse_resolv_conf(text, ports=self.ports)
                    self._seen = seen
                    kept, self.kept = self.kept, kept_lines(text)
                    if kept != self.kept and self.on_change is not None:
                        self.on_change(self.kept)
                    log.info("event=dns_resolvers path=%s servers=%s", self.path,
                             ",".join(f"{a}:{p}" for a, p in self._servers))
            except OSError as exc:
                # No resolv.conf: glibc's default, as a program on the host would use.
                if self._seen != (0, 0, 0, 0):
                    log.info("event=dns_resolvers path=%s error=%s servers=default", self.path, exc.strerror)
                self._seen, self._servers = (0, 0, 0, 0), [DEFAULT_SERVER]
            return self._servers


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _sockaddr(server: Server) -> tuple[str, int] | tuple[str, int, int, int]:
    address, port = server
    if ":" in address:
        info = socket.getaddrinfo(address, port, socket.AF_INET6, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)
        found = info[0][4]  # the scope id of a link-local address, resolved
        assert isinstance(found[0], str) and len(found) == 4
        return found
    return (address, port)


def _why(server: Server, exc: OSError) -> str:
    """What a resolver did instead of answering, as a warning says it."""
    return f"{server[0]}:{server[1]}: {exc.strerror or exc or 'timed out'}"


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(errno.ECONNRESET, "closed before a whole reply")
        buf += chunk
    return bytes(buf)


Gate = Callable[[Callable[[], object]], bool]  # runs the send unless the door has closed; False if it had


def ask_udp(server: Server, query: bytes, deadline: float) -> bytes:
    """One query to one resolver over UDP, waited for (``DnsRelay.check``),
    from a socket of its own connected to it (only its datagrams are read);
    our own random ID on the way."""
    ident = secrets.token_bytes(2)
    sent = _with_id(query, ident)
    with socket.socket(_family(server[0]), socket.SOCK_DGRAM) as sock:
        sock.connect(_sockaddr(server))
        sock.send(sent)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
            reply = sock.recv(MAX_REPLY)
            if matches(sent, reply):
                return _with_id(reply, query[:2])


def ask_tcp(server: Server, query: bytes, deadline: float, gate: Gate) -> bytes | None:
    """One query to one resolver over TCP (a truncated UDP reply's retry);
    None when ``gate`` did not send it."""
    ident = secrets.token_bytes(2)
    sent = _with_id(query, ident)
    with socket.socket(_family(server[0]), socket.SOCK_STREAM) as sock:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.connect(_sockaddr(server))
        # Well under the socket's buffer: sendall returns at once.
        if not gate(lambda: sock.sendall(struct.pack("!H", len(sent)) + sent)):
            return None
        (length,) = struct.unpack("!H", _recv_exact(sock, 2, deadline))
        reply = _recv_exact(sock, length, deadline)
    if not matches(sent, reply):
        raise ConnectionResetError(errno.EPROTO, "a reply that does not answer the query")
    return _with_id(reply, query[:2])


# --- the relay -------------------------------------------------------------------


class _Pending:
    """A query of a session's on its way over UDP: to which resolver, until when."""

    def __init__(self, query: bytes, peer: tuple[str, int], servers: list[Server], deadline: float) -> None:
        self.query, self.peer, self.servers, self.deadline = query, peer, servers, deadline
        self.sent = _with_id(query, secrets.token_bytes(2))  # our own ID on the way; the client's put back
        self.index = 0  # the resolver asked now
        self.sock: socket.socket | None = None
        self.until = deadline
        self.errors: list[str] = []


class Door:
    """One session's way to the relay: its UDP socket and TCP listener (on
    its own loopback), served by a thread of their own until ``stop``."""

    def __init__(self, relay: DnsRelay, session: str, udp: socket.socket, tcp: socket.socket) -> None:
        self.relay, self.session, self.udp, self.tcp = relay, session, udp, tcp
        self.lock = threading.Lock()
        self.stopped = False
        self.in_flight = 0
        self.conns: set[socket.socket] = set()
        self.queries = 0
        self.failed = 0  # answered SERVFAIL because no resolver answered
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
                        p.errors.append(_why(server, TimeoutError("timed out")))
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
                self._send_udp(error_reply(query, _RCODE_FORMERR), peer)
            return
        if not self.take():
            self._send_udp(error_reply(query, _RCODE_SERVFAIL), peer)
            return
        servers = self.relay.resolvers.servers()
        self._launch(poller, pending, _Pending(query, peer, servers, time.monotonic() + QUERY_DEADLINE_S))

    def _launch(self, poller: select.poll, pending: dict[int, _Pending], p: _Pending) -> None:
        """Send ``p`` to its next resolver (a socket of its own, connected to
        it), or answer SERVFAIL when none is left or its time is up."""
        while p.index < len(p.servers) and time.monotonic() < p.deadline:
            server = p.servers[p.index]
            sock = socket.socket(_family(server[0]), socket.SOCK_DGRAM)
            try:
                sock.setblocking(False)
                sock.connect(_sockaddr(server))
                sent = self.send_if_open(lambda: sock.send(p.sent))
            except OSError as exc:
                sock.close()
                p.errors.append(_why(server, exc))
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
        self.relay.note("; ".join(p.errors))
        with self.lock:
            self.failed += 1
        self._send_udp(error_reply(p.query, _RCODE_SERVFAIL), p.peer)
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
            p.errors.append(_why(server, exc))
            self._drop(poller, pending, fd)
            p.index += 1
            self._launch(poller, pending, p)
            return
        if not matches(p.sent, reply):
            return  # not an answer to this query: still waiting
        self._drop(poller, pending, fd)
        self.relay.note("")
        self._send_udp(_with_id(reply, p.query[:2]), p.peer)
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
        conn.setblocking(True)  # with timeouts (_recv_exact, TCP_IDLE_S)
        with self.lock:
            full = self.stopped or len(self.conns) >= MAX_TCP
            if not full:
                self.conns.add(conn)
        if full:
            conn.close()  # the session's resolver tries again, or UDP
            return
        threading.Thread(target=self._serve_tcp, args=(conn,), daemon=True, name=f"dns-tcp-{self.session}").start()

    def _serve_tcp(self, conn: socket.socket) -> None:
        """Queries in turn on one connection (RFC 7766: length-prefixed),
        until it closes or stays idle ``TCP_IDLE_S``."""
        try:
            while True:
                try:
                    (length,) = struct.unpack("!H", _recv_exact(conn, 2, time.monotonic() + TCP_IDLE_S))
                    query = _recv_exact(conn, length, time.monotonic() + TCP_IDLE_S)
                except (OSError, TimeoutError):
                    return
                why = check_query(query)
                if why:
                    log.debug("event=dns_refused session=%s why=%s", self.session, why)
                    return
                if not self.take():
                    reply: bytes | None = error_reply(query, _RCODE_SERVFAIL)
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


MakeDoor = Callable[[int, int], tuple[socket.socket, socket.socket]]


class DoorAhead:
    """A session's door being made (``DnsRelay.door_ahead``), with copies of
    its namespace descriptors: the session's own may be closed meanwhile (a
    stack that did not start) and are never reused under the request."""

    def __init__(self, relay: DnsRelay, session: str, namespaces: tuple[int, int], make: MakeDoor) -> None:
        self.relay, self.session = relay, session
        userns, netns = os.dup(namespaces[0]), os.dup(namespaces[1])

        def run() -> tuple[socket.socket, socket.socket]:
            try:
                return make(userns, netns)
            finally:
                os.close(userns)
                os.close(netns)

        try:
            self._made = relay._pool.submit(run)
        except BaseException:
            os.close(userns)
            os.close(netns)
            raise

    def open_with(self, stack: Stack) -> None:
        """Serve the door, closed with ``stack``; the stack's warning follows
        the relay's. Not made: the session opens all the same, and its
        warning says why."""
        started = time.perf_counter()
        try:
            udp, tcp = self._made.result()
        except (SpawnError, OSError) as exc:
            log.warning("event=dns_door_failed session=%s error=%s", self.session, exc)
            why = f"DNS does not answer: the relay's door could not be made in the session's namespace ({exc})"
            stack.warning = lambda: why
            return
        door = self.relay.open_door(self.session, udp, tcp)
        stack.with_it.append(door.stop)
        stack.warning = self.relay.warning
        log.debug("event=dns_door_opened session=%s waited_ms=%.2f", self.session,
                  (time.perf_counter() - started) * 1000)

    def discard(self) -> None:
        """The stack did not start: the door's sockets closed once made."""
        def close(made: concurrent.futures.Future[tuple[socket.socket, socket.socket]]) -> None:
            if not made.cancelled() and made.exception() is None:
                for sock in made.result():
                    sock.close()

        self._made.add_done_callback(close)


class DnsRelay:
    """The relay of every session: the host's resolvers and their last known
    state (``problem``, ``warning``, ``check``); each session's door serves
    its own queries (``Door``)."""

    def __init__(self, resolv_conf: str = HOST_RESOLV_CONF, *, ports: bool = False) -> None:
        self.resolvers = HostResolvers(resolv_conf, ports=ports)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="dns")
        self._lock = threading.Lock()
        self._problem = ""  # why no resolver answered the last query or check; "" once one did
        self._checked: tuple[float, list[Server]] | None = None  # when a check found a problem, and of which servers

    def session_file(self, state_dir: str) -> str:
        """The resolv.conf sessions bind (in the daemon's state directory,
        written now, atomically); its real path. When the host's search list
        changes it is rewritten in place (a bind holds the inode), so that
        sessions open already read the new one."""
        path = os.path.join(os.path.realpath(state_dir), "dns-resolv.conf")
        tmp = path + ".tmp"
        self.resolvers.servers()  # read the host's file
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(resolv_conf_text(self.resolvers.kept))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)

        def rewrite(kept: list[str]) -> None:
            try:
                with open(path, "r+", encoding="utf-8") as f:
                    f.write(resolv_conf_text(kept))
                    f.truncate()
            except OSError as exc:
                log.warning("event=dns_resolv_conf_rewrite_failed path=%s error=%s", path, exc.strerror)

        self.resolvers.on_change = rewrite
        return path

    def door_ahead(self, session: str, namespaces: tuple[int, int], make: MakeDoor) -> DoorAhead:
        """Have ``make`` (the fork server's ``dns_sockets``) make a session's
        door in its ``namespaces`` on a thread of the relay's, while the
        caller starts its stack (the fork server is free again once pasta is
        launched, and pasta takes ~90 ms to report ready)."""
        return DoorAhead(self, session, namespaces, make)

    def open_door(self, session: str, udp: socket.socket, tcp: socket.socket) -> Door:
        return Door(self, session, udp, tcp)

    def problem(self) -> str:
        """"" when the last query or check got a reply; else what went wrong."""
        with self._lock:
            return self._problem

    def note(self, problem: str, servers: list[Server] | None = None) -> None:
        with self._lock:
            changed = problem != self._problem
            self._problem = problem
            self._checked = (time.monotonic(), servers) if problem and servers is not None else None
        if changed:
            if problem:
                log.warning("event=dns_unanswered why=%s", problem)
            else:
                log.info("event=dns_answers")

    def warning(self) -> str:
        """The text a session's status carries while DNS does not answer."""
        problem = self.problem()
        return (f"DNS does not answer: no resolver of the host's answers ({problem}); names will not resolve "
                f"in this session (lookups fail at once) until one does") if problem else ""

    def check(self, session: str = "") -> str:
        """Ask every resolver of the host's, at once, for the root's NS
        records; any reply counts. Returns ``warning()`` after. A problem
        found less than ``CHECK_KEEP_S`` ago, with the same servers, stands."""
        started = time.perf_counter()
        warning = self._check()
        log.debug("event=dns_checked session=%s ms=%.2f answers=%d", session, (time.perf_counter() - started) * 1000,
                  not warning)
        return warning

    def _check(self) -> str:
        servers = self.resolvers.servers()
        with self._lock:
            kept = self._checked
        if kept is not None and kept[1] == servers and time.monotonic() - kept[0] < CHECK_KEEP_S:
            return self.warning()
        query = struct.pack("!HHHHHH", 0, 0x0100, 1, 0, 0, 0) + b"\x00" + struct.pack("!HH", 2, 1)
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        futures = {self._pool.submit(ask_udp, s, query, deadline): s for s in servers}
        errors = []
        for fut in concurrent.futures.as_completed(futures):
            server = futures[fut]
            try:
                fut.result()
                self.note("")
                return ""
            except (OSError, TimeoutError) as exc:
                errors.append(_why(server, exc))
        self.note("; ".join(errors), servers)
        return self.warning()

    def resolve_tcp(self, door: Door, query: bytes) -> bytes | None:
        """The reply to a query a session sent over TCP (the retry of a
        truncated reply; rare, so a thread of its own waits): the first
        resolver's that answers, over TCP, else SERVFAIL; None when the door
        closed meanwhile (nothing is sent after ``Door.stop``). UDP queries
        are the door's own loop's (``Door._launch``)."""
        deadline = time.monotonic() + QUERY_DEADLINE_S
        errors = []
        for server in self.resolvers.servers():
            until = min(deadline, time.monotonic() + UPSTREAM_TIMEOUT_S)
            try:
                reply = ask_tcp(server, query, until, door.send_if_open)
            except (OSError, TimeoutError) as exc:
                errors.append(_why(server, exc))
                continue
            if reply is None:
                return None  # the door closed: nothing sent
            self.note("")
            return reply
        self.note("; ".join(errors))
        with door.lock:
            door.failed += 1
        return error_reply(query, _RCODE_SERVFAIL)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
