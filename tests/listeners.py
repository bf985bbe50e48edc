"""Sockets a thread of the test serves, outside every sandbox, until closed:
what a session reaches (or must not reach) on the host."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator


class Served:
    """``sock``, served by a daemon thread that calls ``serve_once`` until
    ``close``. The socket's timeout lets the thread see ``close`` in time."""

    def __init__(self, sock: socket.socket, timeout: float = 0.2) -> None:
        self.sock = sock
        sock.settimeout(timeout)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def serve_once(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_once()
            except OSError:  # a timeout (then look at the stop flag again), or a client gone
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


class Greeter(Served):
    """A TCP listener on the host's loopback that greets every client with
    "hello" and counts them."""

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        self.port = sock.getsockname()[1]
        self.accepted = 0
        super().__init__(sock, 0.1)

    def serve_once(self) -> None:
        conn, _ = self.sock.accept()
        self.accepted += 1
        with conn:
            conn.sendall(b"hello\n")


def accepted(server: socket.socket) -> Iterator[socket.socket]:
    """Each connection ``server`` accepts, until it is closed (an accept that
    fails: the serving thread's loop ends with it)."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        yield conn
