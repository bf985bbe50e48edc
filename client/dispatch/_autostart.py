"""Finding the daemon, and starting one in the background when none answers.

Guarantees:
- a daemon started here runs ``python -P`` from ``/`` (as isolated as this
  interpreter): never a ``dispatchd`` of the current directory (a worktree an
  agent wrote);
- its output goes to the state directory's ``dispatchd.log`` (made private
  first), or, for a socket other than the default one, ``dispatchd-HASH.log``
  (``log_name``: two daemons would rotate one file under each other), and a
  start that fails says why: its exit status and the log's last line, as
  soon as it exits, or after ``timeout`` seconds at most;
- the socket, found or started, is checked as ``_transport.try_connect``
  checks every socket before anything is sent.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time

from dispatch._transport import try_connect
from dispatch.errors import DaemonUnavailable
from dispatchd import paths

__all__ = ["daemon_socket"]


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


def log_name(path: str) -> str:
    """The log file of the daemon autostarted on ``path``: ``dispatchd.log``
    for the default socket, ``dispatchd-`` and 8 hex digits of the socket's
    path's SHA-256 for any other. Each daemon rotates its own file (at 10
    MiB, renaming it): two on one file would move it from under each other."""
    if path == paths.default_socket_path():
        return "dispatchd.log"
    return f"dispatchd-{hashlib.sha256(os.fsencode(path)).hexdigest()[:8]}.log"


def _start_daemon(path: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``dispatchd`` in the background on ``path``; returns it and its log file.
    From ``/`` and with ``-P``: a ``dispatchd`` package in the caller's
    directory (a worktree an agent wrote) is never what runs."""
    log_dir = paths.state_dir()
    paths.ensure_private_dir(log_dir)
    log_path = os.path.join(log_dir, log_name(path))
    with open(log_path, "ab") as log:
        # The daemon rotates its log (--log-file); stderr stays for what comes
        # before logging starts (a refused start), read back below.
        proc = subprocess.Popen(
            [*_python(), "-m", "dispatchd", "--socket", path, "--log-file", log_path], cwd="/",
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
        )
    return proc, log_path


def daemon_socket(path: str, *, autostart: bool, timeout: float) -> tuple[socket.socket, tuple[int, str] | None]:
    """A trusted connection to the daemon at ``path``, and ``(pid, log path)``
    of the daemon started for it (``autostart``), or None when one answered.
    Raises ``DaemonUnavailable`` saying how to start one, or why the one
    started here did not answer (its exit status, its log's last line)."""
    sock = try_connect(path, timeout)
    if sock is not None:
        return sock, None
    if not autostart:
        systemd = ", or `systemctl --user start dispatchd.socket`" if path == paths.default_socket_path() else ""
        raise DaemonUnavailable(f"no dispatchd is listening on {path} (start it with "
                                f"`dispatchd --socket {path}`, or leave out --no-autostart{systemd})")
    proc, log_path = _start_daemon(path)
    deadline = time.monotonic() + timeout
    exited = None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        sock = try_connect(path, timeout)
        if sock is not None:
            return sock, (proc.pid, log_path)
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
