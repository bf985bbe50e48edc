"""``dispatch bridge``: this user's daemon, carried over stdin and stdout.

Run on the host where the sessions live (by ``ssh HOST dispatch bridge``, or
any command a client gives as ``--host-command``), it connects to the user's
own daemon as any client does, and carries the daemon connection and every
session channel the daemon hands it over its stdio (``dispatch._mux``).

Guarantees:
- The daemon is reached as by a local client: the socket's directory and the
  serving process are checked (``UntrustedSocket``), and the daemon checks
  the bridge (a process of its own user) as it checks any client. The bridge
  adds no authority: whoever drives its stdio can do what that user's local
  ``dispatch`` can, no more; ssh (or the command) decides who that is.
- Nothing but the link is written on stdout: the first line is the
  handshake (``dispatch._linkwire.HANDSHAKE``), then link frames. Anything else
  this process would print goes to stderr (fd 1 is pointed there).
- When it cannot reach the daemon, it says why on the link (an ``ERROR``
  frame after the handshake) and on stderr, and exits 2.
- It exits when every stream has ended (0), or when the far side has gone
  (1, its stdin closed): the daemon then sees its client go, as it would
  for a local one (its sessions live on for their orphan grace).
"""

from __future__ import annotations

import os
import sys

from dispatch import _linkwire, _mux
from dispatch._autostart import daemon_socket
from dispatch.errors import DispatchError
from dispatchd import paths


def serve(socket_path: str | None = None, *, autostart: bool = True, timeout: float = 30.0) -> int:
    """Bridge stdin/stdout to the daemon at ``socket_path`` until done; the exit status."""
    # The link keeps its own descriptors; fd 0 and 1 go elsewhere, so nothing
    # printed by accident (a warning, a library) lands inside a frame.
    link_in, link_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    path = paths.resolve_socket_path(socket_path)
    try:
        sock, _ = daemon_socket(path, autostart=autostart, timeout=timeout)
    except DispatchError as exc:
        refusal = _linkwire.frame(0, _linkwire.ERROR, f"dispatch bridge: {exc}".encode())
        _write_all(link_out, _linkwire.HANDSHAKE + refusal)
        print(f"dispatch bridge: {exc}", file=sys.stderr)
        return 2
    _write_all(link_out, _linkwire.HANDSHAKE)
    reason = _mux.Link(link_in, link_out, sock, bridge=True).run()
    if reason is not None:
        print(f"dispatch bridge: {reason}", file=sys.stderr)
        return 1
    return 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BrokenPipeError:
            return
