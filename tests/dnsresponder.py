"""A tiny DNS responder on the host's loopback, for the DNS relay's tests and
its benchmark (bench/dns.py): UDP and TCP on 127.0.0.1, one port of its own.
``NAME`` answers ``ADDRESS`` (TEST-NET-1: never connected to); its other
types NOERROR with no record; ``SILENT`` is never answered (a zone whose
servers do not answer); every other name NXDOMAIN."""

from __future__ import annotations

import socket
import struct
import threading

from tests.listeners import accepted

NAME, ADDRESS = "testname.example", "192.0.2.55"
SILENT = "silent.example"


def _name(query: bytes) -> str:
    end, labels = 12, []
    while query[end]:
        labels.append(query[end + 1 : end + 1 + query[end]].decode().lower())
        end += 1 + query[end]
    return ".".join(labels)


def _answer(query: bytes) -> bytes:
    """A reply to ``query``: an A record for NAME, NOERROR with nothing for
    its other types, NXDOMAIN for any other name."""
    end = 12
    labels = []
    while query[end]:
        labels.append(query[end + 1 : end + 1 + query[end]].decode().lower())
        end += 1 + query[end]
    qtype = struct.unpack_from("!H", query, end + 1)[0]
    question = query[12 : end + 5]
    name = ".".join(labels)
    if name != NAME:
        return query[:2] + struct.pack("!BBHHHH", 0x81, 0x83, 1, 0, 0, 0) + question
    if qtype != 1:
        return query[:2] + struct.pack("!BBHHHH", 0x81, 0x80, 1, 0, 0, 0) + question
    record = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(ADDRESS)
    return query[:2] + struct.pack("!BBHHHH", 0x81, 0x80, 1, 1, 0, 0) + question + record


class Responder:
    """UDP and TCP on 127.0.0.1, the same port."""

    def __init__(self) -> None:
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", self.port))
        self.tcp.listen(8)
        self.udp_queries = 0
        self.tcp_queries = 0
        for target in (self._udp, self._tcp):
            threading.Thread(target=target, daemon=True).start()

    def stop(self) -> None:
        """Nothing listens on its port any more: a datagram gets "port unreachable"."""
        for sock in (self.udp, self.tcp):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _udp(self) -> None:
        try:
            while True:
                query, peer = self.udp.recvfrom(4096)
                if not query:
                    return  # shut down
                self.udp_queries += 1
                if _name(query) != SILENT:
                    self.udp.sendto(_answer(query), peer)
        except OSError:
            return  # stopped

    def _tcp(self) -> None:
        for conn in accepted(self.tcp):
            with conn:
                conn.settimeout(5)
                try:
                    (length,) = struct.unpack("!H", conn.recv(2, socket.MSG_WAITALL))
                    query = conn.recv(length, socket.MSG_WAITALL)
                except (OSError, struct.error):
                    continue
                self.tcp_queries += 1
                if _name(query) == SILENT:
                    continue
                reply = _answer(query)
                try:
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
                except OSError:
                    continue
