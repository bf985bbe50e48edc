"""Loopback inside a session's own network namespace.

Guarantee: after ``apply_loopback``, the session's namespace has ``lo`` up
(127.0.0.1 and ::1 work, so a test server inside the session answers a client
inside it) and no other interface: nothing outside is reachable.
``open_proxy_listener`` makes, in that namespace, the listening socket whose
connections the daemon's proxy serves (network "domains"): a socket of this
namespace, so no other session or user can reach it.
``links_up`` names the interfaces of this namespace that are up but its
loopback: what the daemon looks for once a session's stack was stopped.

One ioctl (SIOCSIFFLAGS) rather than pyroute2: measured on this machine kind,
0.35 ms against 6-7 ms for pyroute2's ``IPRoute``, which alone would take most
of a session's 10 ms opening budget.
"""

from __future__ import annotations

import fcntl
import socket
import struct

from dispatchd.errors import ConfinementError

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def apply_loopback() -> None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sh14x", b"lo", 0)
            flags = struct.unpack("16sh14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))
    except OSError as exc:
        raise ConfinementError("network: loopback up", exc.errno, "lo") from exc


def links_up() -> list[str]:
    """The interfaces of this process's network namespace that are up, its
    loopback aside. A fallback tunnel the kernel adds to every namespace
    (``sit0`` and the like, where their modules are loaded) is down, and no
    process of a session holds the capability to bring one up: only an
    interface up carries a byte out. Raises ``OSError``."""
    up = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            if name == "lo":
                continue
            try:
                req = struct.pack("16sh14x", name.encode(), 0)
                flags = struct.unpack("16sh14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
            except OSError:  # gone since it was listed
                continue
            if flags & IFF_UP:
                up.append(name)
    return up


def open_proxy_listener(port: int) -> int:
    """A listening TCP socket on 127.0.0.1:``port`` of this namespace; returns its fd
    (close-on-exec, not inheritable: only the descriptor passed to the daemon serves)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfinementError("network: proxy listener", exc.errno, f"127.0.0.1:{port}") from exc
    return sock.detach()
