"""The client's side of a bridge: ``connect(host="ssh://...")`` and ``host_command``.

Guarantees:
- ``ssh://[USER@]HOST[:PORT]`` runs ``ssh -T -o BatchMode=yes [-p PORT] --
  [USER@]HOST dispatch bridge`` (``$DISPATCH_SSH_COMMAND`` replaces ``ssh``,
  as ``GIT_SSH_COMMAND`` does for git). A user or host that is not plain
  (a leading ``-``, spaces, shell or ssh option characters) is refused
  before anything runs; a socket path for the far side is shell-quoted.
- ``host_command`` is split as a shell would (``shlex``) and run without a
  shell; its stdin and stdout carry the link, its stderr is kept (its last
  lines) to say why it ended.
- The command runs in a session of its own: a Ctrl-C at the terminal reaches
  this process (which cancels the call in the sandbox through the bridge),
  not the bridge. So ssh cannot ask for a password: BatchMode says so at once.
- Nothing is sent on the link before the far side has written the bridge's
  handshake line; anything else it prints first (at most 64 KiB) is reported.
- The rest of the client sees sockets, as with a local daemon: the daemon
  connection is one end of a socket pair, and each session's channel arrives
  on it as a descriptor, as the daemon's own would (``dispatch._mux``).
- When the bridge goes away, ``reason`` says so (its exit status and last
  words) before any stream ends, so the calls that end with it can say why.
"""

from __future__ import annotations

import collections
import os
import re
import select
import shlex
import socket
import subprocess
import threading
import time

from dispatch._mux import HANDSHAKE, Link
from dispatch.errors import DaemonUnavailable

_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]")
_GREETING_LIMIT = 64 * 1024
_STDERR_KEPT = 4096


def ssh_command(url: str, socket_path: str | None = None, *, autostart: bool = True) -> list[str]:
    """The command ``ssh://[USER@]HOST[:PORT]`` stands for (``ValueError`` for a malformed one)."""
    if not url.startswith("ssh://"):
        raise ValueError(f"a host is ssh://[USER@]HOST[:PORT], not {url!r} (--host-command runs any other command)")
    rest = url[len("ssh://"):].rstrip("/")
    user = None
    if "@" in rest:
        user, rest = rest.rsplit("@", 1)
        if not _USER.fullmatch(user):
            raise ValueError(f"the user in {url!r} is not a plain user name")
    port = None
    if rest.startswith("["):
        close = rest.find("]")
        host, tail = rest[:close + 1], rest[close + 1:]
    else:
        host, _, tail = rest.partition(":")
        tail = ":" + tail if tail else ""
    if tail:
        if not tail.startswith(":") or not tail[1:].isdigit() or not 0 < int(tail[1:]) < 65536:
            raise ValueError(f"the port in {url!r} is not a port number")
        port = int(tail[1:])
    if not _HOST.fullmatch(host):
        raise ValueError(f"the host in {url!r} is not a plain host name or address")
    host = host.strip("[]")
    ssh = shlex.split(os.environ.get("DISPATCH_SSH_COMMAND", "") or "ssh")
    argv = [*ssh, "-T", "-o", "BatchMode=yes"]
    if port is not None:
        argv += ["-p", str(port)]
    remote = ["dispatch"]
    if not autostart:
        remote.append("--no-autostart")
    remote.append("bridge")
    if socket_path is not None:
        remote += ["--socket", socket_path]
    # ssh joins the remote words with spaces for the far shell: quote them.
    argv += ["--", f"{user}@{host}" if user else host, " ".join(shlex.quote(w) for w in remote)]
    return argv


class Remote:
    """A bridge process and the pump that carries its link (a thread)."""

    def __init__(self, argv: list[str], label: str, timeout: float) -> None:
        self.label = label
        self.argv = argv
        self.reason: str | None = None
        """Set when the bridge went away under us: what to tell the caller."""
        self._stderr: collections.deque[bytes] = collections.deque()
        self._stderr_size = 0
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True, close_fds=True)
        except OSError as exc:
            raise DaemonUnavailable(f"cannot run the bridge command {shlex.join(argv)}: {exc.strerror or exc}") from exc
        assert self._proc.stdin is not None and self._proc.stdout is not None and self._proc.stderr is not None
        # Whatever fails from here (the handshake, a thread that cannot
        # start), the bridge process is ended, never left running unowned.
        try:
            self._stderr_thread = threading.Thread(target=self._keep_stderr, name="dispatch-bridge-stderr",
                                                   daemon=True)
            self._stderr_thread.start()
            self._handshake(timeout)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.socket = theirs
            """The client's end of the daemon connection."""
            self._link = Link(self._proc.stdout.fileno(), self._proc.stdin.fileno(), ours, bridge=False,
                              on_end=self._ended)
            self._thread = threading.Thread(target=self._pump, name="dispatch-bridge-link", daemon=True)
            self._thread.start()
        except BaseException:
            self._kill()
            raise

    def _keep_stderr(self) -> None:
        assert self._proc.stderr is not None
        fd = self._proc.stderr.fileno()
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                return
            if not data:
                return
            self._stderr.append(data)
            self._stderr_size += len(data)
            while self._stderr_size > _STDERR_KEPT and len(self._stderr) > 1:
                self._stderr_size -= len(self._stderr.popleft())

    def said(self) -> str:
        """The last line the bridge command wrote on stderr, if any."""
        lines = [ln.strip() for ln in b"".join(self._stderr).decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def _handshake(self, timeout: float) -> None:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        seen = bytearray()
        line = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonUnavailable(f"the bridge command {shlex.join(self.argv)} did not answer within "
                                        f"{timeout:g} s{self._words(seen)}")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            byte = os.read(fd, 1)
            if not byte:
                status = self._status(wait=2.0)
                raise DaemonUnavailable(f"the bridge command {shlex.join(self.argv)} ended before it answered "
                                        f"({status}){self._words(seen)}")
            line += byte
            if byte == b"\n":
                if bytes(line) == HANDSHAKE:
                    return
                seen += line
                line = bytearray()
            if len(seen) + len(line) > _GREETING_LIMIT:
                raise DaemonUnavailable(f"the bridge command {shlex.join(self.argv)} printed "
                                        f"{_GREETING_LIMIT} bytes that are not a dispatch bridge's handshake"
                                        f"{self._words(seen)}")

    def _words(self, printed: bytes | bytearray) -> str:
        parts = []
        said = self.said()
        if said:
            parts.append(f"it said: {said}")
        if printed:
            parts.append(f"it printed: {bytes(printed[:200]).decode('utf-8', 'replace').strip()!r}")
        return (": " + "; ".join(parts)) if parts else ""

    def _status(self, wait: float) -> str:
        try:
            code = self._proc.wait(wait)
        except subprocess.TimeoutExpired:
            return "still running"
        self._stderr_thread.join(1.0)  # its last words
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit status {code}"

    def _ended(self, reason: str | None) -> None:
        if reason is None:
            return
        status = self._status(wait=2.0)
        said = self.said()
        self.reason = (f"the bridge to {self.label} went away ({reason}; {status}"
                       f"{'; it said: ' + said if said else ''})")

    def _pump(self) -> None:
        try:
            self._link.run()
        finally:
            self._kill(grace=5.0)

    def _kill(self, grace: float = 0.0) -> None:
        """Close our ends of its pipes (the bridge sees its input end and
        exits), and wait for it; kill it if it is still there after ``grace``."""
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._stderr_thread.ident is not None:  # started (it may not have been: no thread to be had)
            self._stderr_thread.join(1.0)
        if self._proc.stderr is not None:
            self._proc.stderr.close()

    @property
    def pid(self) -> int:
        """The bridge command's process id (here, not on the far host)."""
        return self._proc.pid


def open_remote(host: str | None, host_command: str | None, socket_path: str | None, *,
                autostart: bool, timeout: float) -> Remote:
    """A running bridge: ``host`` (ssh://) or ``host_command`` (any command)."""
    if host is not None and host_command is not None:
        raise ValueError("give a host or a host command, not both")
    if host_command is not None:
        argv = shlex.split(host_command)
        if not argv:
            raise ValueError("the host command is empty")
        return Remote(argv, host_command, timeout)
    assert host is not None
    return Remote(ssh_command(host, socket_path, autostart=autostart), host, timeout)
