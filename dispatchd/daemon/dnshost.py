"""The host's resolvers, as the host's resolv.conf names them, and asking
one; and the resolv.conf a session with the relay reads.

Guarantees:
- ``parse_resolv_conf`` reads nameservers as glibc does (at most
  ``MAX_SERVERS``; an entry glibc would not read is skipped; none named:
  glibc's default); ``HostResolvers`` re-reads the file when it, or the file
  its symlink leads to, changes, looked at once a ``RELOAD_EVERY_S`` at most,
  and only a regular file, opened without blocking (anything else: glibc's
  default, logged);
- ``ask_udp`` and ``ask_tcp`` send one query to one resolver under our own
  random ID, from a socket of their own connected to it, and return only a
  reply that answers it (``dnswire.matches``), with the asker's ID put back;
  every wait is bounded by the caller's deadline;
- ``session_resolv_binds`` binds the relay's resolv.conf over the host's
  only where that file is a regular file under ``/etc`` or ``/run``.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable

from dispatchd.confine.netstack import DNS_PORT, RELAY_ADDRESS
from dispatchd.daemon.dnswire import MAX_REPLY, matches, with_id
from dispatchd.domains import parse_port

log = logging.getLogger("dispatchd.dns")

HOST_RESOLV_CONF = "/etc/resolv.conf"
RELOAD_EVERY_S = 1.0  # how often the host's resolv.conf is looked at (stat) at most
MAX_SERVERS = 3  # as glibc (MAXNS)
DEFAULT_SERVER = ("127.0.0.1", 53)  # glibc's, when resolv.conf names none

Server = tuple[str, int]


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
            port = parse_port(p) or -1
        elif ports and text_addr.count(":") == 1:
            text_addr, _, p = text_addr.partition(":")
            port = parse_port(p) or -1  # ASCII digits: never int()'s ValueError for a '\u00b9'
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
    the relay answers every query it takes within its deadline (an
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


def read_regular(path: str, most: int = 64 * 1024) -> str:
    """The first ``most`` bytes of the regular file at ``path`` (symlinks
    followed), as text. Opened without blocking and refused unless regular:
    a FIFO or a device bound over the host's resolv.conf would otherwise
    hold the reader, at the daemon's start and at every network-on open,
    for ever. Raises ``OSError`` (EINVAL for another kind of file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.read(fd, most).decode("utf-8", "replace")
    finally:
        os.close(fd)


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
        # Called with new kept lines; False: not taken (tried again at the next look).
        self.on_change: Callable[[list[str]], bool] | None = None

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
                    text = read_regular(self.path)
                    self._servers = parse_resolv_conf(text, ports=self.ports)
                    self._seen = seen
                    kept, self.kept = self.kept, kept_lines(text)
                    if kept != self.kept and self.on_change is not None and not self.on_change(self.kept):
                        # Not written where the sessions read it: the file is
                        # read again at the next look, and the change tried again.
                        self.kept, self._seen = kept, (-1, -1, -1, -1)
                    log.info("event=dns_resolvers path=%s servers=%s", self.path,
                             ",".join(f"{a}:{p}" for a, p in self._servers))
            except OSError as exc:
                # No resolv.conf: glibc's default, as a program on the host would use.
                if self._seen != (0, 0, 0, 0):
                    log.info("event=dns_resolvers path=%s error=%s servers=default", self.path, exc.strerror)
                self._seen, self._servers = (0, 0, 0, 0), [DEFAULT_SERVER]
            return self._servers


def family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def sockaddr(server: Server) -> tuple[str, int] | tuple[str, int, int, int]:
    address, port = server
    if ":" in address:
        info = socket.getaddrinfo(address, port, socket.AF_INET6, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)
        found = info[0][4]  # the scope id of a link-local address, resolved
        assert isinstance(found[0], str) and len(found) == 4
        return found
    return (address, port)


def why_not(server: Server, exc: OSError) -> str:
    """What a resolver did instead of answering, as a warning says it."""
    return f"{server[0]}:{server[1]}: {exc.strerror or exc or 'timed out'}"


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
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
    sent = with_id(query, ident)
    with socket.socket(family(server[0]), socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr(server))
        sock.send(sent)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
            reply = sock.recv(MAX_REPLY)
            if matches(sent, reply):
                return with_id(reply, query[:2])


def ask_tcp(server: Server, query: bytes, deadline: float, gate: Gate) -> bytes | None:
    """One query to one resolver over TCP (a truncated UDP reply's retry);
    None when ``gate`` did not send it."""
    ident = secrets.token_bytes(2)
    sent = with_id(query, ident)
    with socket.socket(family(server[0]), socket.SOCK_STREAM) as sock:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.connect(sockaddr(server))
        # Well under the socket's buffer: sendall returns at once.
        if not gate(lambda: sock.sendall(struct.pack("!H", len(sent)) + sent)):
            return None
        (length,) = struct.unpack("!H", recv_exact(sock, 2, deadline))
        reply = recv_exact(sock, length, deadline)
    if not matches(sent, reply):
        raise ConnectionResetError(errno.EPROTO, "a reply that does not answer the query")
    return with_id(reply, query[:2])
