"""Talking to systemd without libsystemd: readiness, stopping, socket activation.

Both protocols are small, stable and documented (sd_notify(3),
sd_listen_fds(3)); speaking them directly keeps dispatchd free of a C
dependency, and every function here does nothing when systemd is not there,
so the daemon runs the same by hand, under ``systemd-socket-activate`` or
under ``systemd --user``.

- **notify**: one datagram of newline-separated ``KEY=VALUE`` lines sent to
  the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for
  the abstract namespace). ``READY=1`` once the daemon can serve (with
  ``Type=notify`` systemd holds back "started" until then), ``STOPPING=1`` on
  the way out, ``STATUS=…`` for ``systemctl status``.
- **listen fds**: systemd passes listening sockets from fd 3 on; it says how
  many in ``$LISTEN_FDS``, for which process in ``$LISTEN_PID`` (so that a
  child that inherits the environment does not take them for its own), and
  their names in ``$LISTEN_FDNAMES``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

from dispatchd.errors import DispatchdError

log = logging.getLogger("dispatchd.systemd")

SD_LISTEN_FDS_START = 3
LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
NOTIFY_TIMEOUT_S = 2.0  # a datagram to a full queue blocks; never hang the daemon on it


def notify_address(value: str) -> str | None:
    """The ``sendto`` address for a ``$NOTIFY_SOCKET`` value, or None if we
    cannot speak to it. ``@name`` is Linux's abstract namespace (a leading NUL
    byte); anything else must be an absolute path (systemd's own rule). Other
    transports (``vsock:``, systemd 253+) are not needed for a user service."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def notify(*assignments: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``KEY=VALUE`` assignments to systemd in one datagram.

    Returns True if it was sent, False if there is no ``$NOTIFY_SOCKET`` (not
    started by systemd, or not ``Type=notify``) or it could not be reached:
    a failed notification is logged but never stops the daemon.
    ``$NOTIFY_SOCKET`` stays in our environment, as ``sd_notify(0, …)``
    leaves it, because the same process notifies again when it stops; the
    sessions never see it (their environment is built from the policy)."""
    for item in assignments:
        if "=" not in item or "\n" in item:
            raise ValueError(f"not a single KEY=VALUE assignment: {item!r}")
    env = os.environ if env is None else env
    value = env.get("NOTIFY_SOCKET", "")
    if not value:
        return False
    address = notify_address(value)
    if address is None:
        log.warning("event=notify_failed socket=%s error=unsupported NOTIFY_SOCKET address", value)
        return False
    message = "\n".join(assignments).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.settimeout(NOTIFY_TIMEOUT_S)
        sock.sendto(message, address)
    except OSError as exc:
        log.warning("event=notify_failed socket=%s error=%s", value, exc.strerror or exc)
        return False
    finally:
        sock.close()
    log.debug("event=notify %s", " ".join(assignments))
    return True


def parse_listen_fds(env: Mapping[str, str], pid: int) -> list[tuple[int, str]]:
    """The ``(fd, name)`` pairs systemd passed to process ``pid``, from the
    environment alone. Empty when nothing was passed, or passed to another
    process (``$LISTEN_PID`` is someone else: we inherited it). A malformed
    ``$LISTEN_FDS`` or ``$LISTEN_FDNAMES`` meant for us is a ValueError: a
    socket handed over and then silently ignored would leave clients hanging."""
    try:
        listen_pid = int(env.get("LISTEN_PID", ""))
    except ValueError:
        return []
    if listen_pid != pid:
        return []
    raw = env.get("LISTEN_FDS", "")
    if not (raw.isascii() and raw.isdigit()):  # str.isdigit also takes "¹", which int() refuses
        raise ValueError(f"LISTEN_FDS={raw!r} is not a count of file descriptors")
    count = int(raw)
    if count == 0:
        return []
    names = env["LISTEN_FDNAMES"].split(":") if "LISTEN_FDNAMES" in env else ["unknown"] * count
    if len(names) != count:
        raise ValueError(f"LISTEN_FDNAMES names {len(names)} sockets but LISTEN_FDS={count}")
    return [(SD_LISTEN_FDS_START + i, names[i]) for i in range(count)]


def adopt_listener(fd: int, name: str = "unknown") -> socket.socket:
    """Wrap a passed fd as our listening socket, after checking it is one:
    a Unix stream socket in the listening state. Not inherited by what we
    start (``sd_listen_fds`` sets close-on-exec too). Takes the fd over: if it
    is refused, it is closed."""
    try:
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise DispatchdError(f"systemd passed fd {fd} ({name}), which is not a socket: {exc.strerror}") from exc
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        kind = f"{sock.family.name}/{sock.type.name}{'' if listening else ', not listening'}"
        sock.close()
        raise DispatchdError(f"systemd passed fd {fd} ({name}) as {kind}: dispatchd needs a listening "
                             "Unix stream socket (ListenStream=PATH in the .socket unit)")
    return sock


def listen_socket(env: MutableMapping[str, str] | None = None) -> socket.socket | None:
    """The listening socket systemd handed over, or None if there is none.

    The ``LISTEN_*`` variables are removed from the environment in every case
    (as ``sd_listen_fds(1)`` does): they describe this process only, and a
    stale copy must not reach anything we start. dispatchd serves one socket,
    so several passed sockets are an error in the ``.socket`` unit."""
    env = os.environ if env is None else env
    try:
        fds = parse_listen_fds(env, os.getpid())
    except ValueError as exc:
        raise DispatchdError(f"bad socket activation environment: {exc}") from exc
    finally:
        for var in LISTEN_VARS:
            env.pop(var, None)
    if not fds:
        return None
    if len(fds) > 1:
        raise DispatchdError(f"systemd passed {len(fds)} sockets ({', '.join(n for _, n in fds)}); "
                             "dispatchd listens on exactly one")
    return adopt_listener(*fds[0])
