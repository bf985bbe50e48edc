"""The escape core, as the portability tests check it in every mode a kernel
can give: the home directory unreadable, writes outside the worktree refused,
network off reaching nothing outside; each beside its allowed twin (the
worktree read and written, the listener reached from outside)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import dispatch
from tests.conftest import probe, shell

# Why each is refused, in a root of the session's own (full) and with
# Landlock and seccomp alone (degraded). The home directory's path exists,
# empty and read-only, in a full session's root where dispatchd's code lies
# below it (the test user's venv).
READ = {True: "No such file or directory", False: "Permission denied"}
WRITE = {True: "Read-only file system", False: "Permission denied"}
CONNECT = {True: "error 111", False: "error 1"}  # the session's own loopback; no IPv4 socket at all (seccomp)


def assert_escape_core(session: dispatch.Session, worktree: Path, *, full: bool) -> None:
    secret = Path.home() / f".dispatchd-core-secret-{os.getpid()}"
    secret.write_text("kept out\n")
    planted = Path.home() / f"planted-core-{os.getpid()}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        assert shell(session, "cat README.md && echo ok > written.txt").metadata["stdout"] == "hello\nworld\n"
        assert (worktree / "written.txt").read_text() == "ok\n"
        assert shell(session, f"cat {secret}").metadata["stderr"] == f"cat: {secret}: {READ[full]}\n"
        r = shell(session, f"echo x > {planted}")
        assert r.metadata["stderr"] == f"/bin/bash: line 1: {planted}: {WRITE[full]}\n" and not planted.exists()
        code = ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
                "except OSError as e:\n    print('error', e.errno)\n")
        assert probe(session, code) == CONNECT[full]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from outside
    finally:
        listener.close()
        secret.unlink()
