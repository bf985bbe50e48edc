"""``dispatchd install-units`` / ``uninstall-units``: dispatchd as a systemd user service.

Two user units: ``dispatchd.socket`` makes systemd listen on dispatchd's
default socket path (``%t`` is ``$XDG_RUNTIME_DIR``) and start
``dispatchd.service`` on the first connection. They are written into
``$XDG_CONFIG_HOME/systemd/user`` (``~/.config/systemd/user``), with
``ExecStart=`` naming the interpreter that runs this command, as given: a
venv's ``bin/python`` is a symlink, and its target would run without the venv.

The unit texts live here, not in data files, so that any installation of the
package (a wheel, an editable checkout) can write them. ``systemd/`` at the top
of the repository holds the same texts rendered for ``/usr/bin/python3``, for
reading and for packagers; a test keeps the two equal.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

COMMANDS = ("install-units", "uninstall-units")
UNIT_NAMES = ("dispatchd.socket", "dispatchd.service")
NEXT_STEP = "systemctl --user daemon-reload && systemctl --user enable --now dispatchd.socket"

_HEADER = """\
# Written by `dispatchd install-units`, which puts the Python that dispatchd is
# installed for in ExecStart= of dispatchd.service: run it again after moving
# or re-creating that Python (a venv). `dispatchd uninstall-units` removes it.
"""

SOCKET_UNIT = _HEADER + """
[Unit]
Description=dispatchd socket (sandboxed execution for AI coding agents)
Documentation=man:systemd.socket(5)

[Socket]
# The contract's default path, $XDG_RUNTIME_DIR/dispatchd/dispatchd.sock, where
# `dispatch` looks first: a client's connection starts dispatchd.service.
ListenStream=%t/dispatchd/dispatchd.sock
# Only you can connect (the daemon also checks each peer's uid, SO_PEERCRED).
SocketMode=0600
# The dispatchd/ directory systemd creates: private, as the daemon makes it.
DirectoryMode=0700
# No stale socket file once the socket unit stops.
RemoveOnStop=yes

[Install]
WantedBy=sockets.target
"""

SERVICE_UNIT = _HEADER + """
[Unit]
Description=dispatchd (sandboxed execution daemon for AI coding agents)
Documentation=man:systemd.service(5)
# Started by its socket on the first connection.
Requires=dispatchd.socket
After=dispatchd.socket

[Service]
# The daemon sends READY=1 (the sd_notify protocol, no libsystemd) only when it
# can serve: policies loaded, kernel features probed, fork server started,
# socket taken over. STOPPING=1 on the way out.
Type=notify
# Only the daemon itself may say so, never the fork server or a session.
NotifyAccess=main
# -P: the working directory (your home, for a user service) is not put on
# sys.path, so no file there can stand in for dispatchd. --socket repeats
# ListenStream= so that the daemon knows the path it serves (for status, and to
# refuse worktrees that hold it): change both together.
ExecStart={python} -P -m dispatchd --socket %t/dispatchd/dispatchd.sock
# Otherwise the journal would name it after the interpreter.
SyslogIdentifier=dispatchd
Restart=on-failure
# Exit status 2 is a configuration error (a broken policy, a bad option):
# restarting cannot fix it.
RestartPreventExitStatus=2
# SIGTERM to the daemon alone: it ends every session itself (through each
# session's pid namespace) and exits; whatever is left in the cgroup after
# that, a session's stray process included, gets SIGKILL from systemd.
KillMode=mixed
# The daemon gives its sessions 10 s to end; then the SIGKILL above.
TimeoutStopSec=30
# A cgroup subtree the daemon may manage, for per-session cgroups (limits, and
# ending a session with cgroup.kill). Nothing uses it yet.
Delegate=yes

# Hardening. Only what a user manager can apply without namespaces, and only
# what leaves the workers able to confine themselves (user, mount, pid and
# network namespaces, Landlock, seccomp).
# Landlock and seccomp need no_new_privs anyway; each worker sets it again.
NoNewPrivileges=yes
# No personality(2) changes (READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, ...).
LockPersonality=yes
# No realtime scheduling: a session cannot starve the machine with SCHED_FIFO.
RestrictRealtime=yes
# Native system calls only: no i386 or x32 entry, whose numbers the native
# seccomp rules would not match (each session's own filter refuses them too).
SystemCallArchitectures=native
# Left out on purpose:
# - PrivateUsers=, RestrictNamespaces=, and ProtectSystem=, ProtectHome=,
#   PrivateTmp= and the other options that need a mount namespace: in a user
#   unit they put the service in a user namespace of its own, or forbid the
#   namespaces every worker creates.
# - MemoryDenyWriteExecute=: ctypes (libffi closures) needs writable and
#   executable memory, and so does any JIT run inside a session.
# - SystemCallFilter=: workers need mount, unshare, landlock_*, seccomp and
#   more; each session's own seccomp filter, installed last, is what restricts.
# - RestrictAddressFamilies= and RestrictSUIDSGID=: what a session may do is
#   its policy's say; a service-wide rule would overrule it silently.
# - UMask=0077: sessions inherit the umask, so files a command creates in a
#   worktree would be 0600 under systemd and 0644 by hand. The daemon's own
#   files are private regardless (0700 directories, a 0600 socket).
# - CapabilityBoundingSet=: a user manager cannot change it, and the daemon
#   holds no capabilities.

[Install]
Also=dispatchd.socket
"""


def exec_quote(word: str) -> str:
    """``word`` as one argument of a unit's ``ExecStart=`` (systemd.service(5),
    "Command lines"): ``%`` would start a specifier, ``$`` a variable, and
    whitespace, quotes or a backslash need double quotes and C escapes."""
    if any(ord(c) < 0x20 or c == "\x7f" for c in word):
        raise ValueError(f"cannot put a control character in a unit file: {word!r}")
    escaped = word.replace("%", "%%").replace("$", "$$")
    if word and not any(c in word for c in " \t\"'\\;"):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(python: str) -> dict[str, str]:
    """The two unit files, by name, for the interpreter ``python`` (absolute)."""
    if not os.path.isabs(python):
        raise ValueError(f"ExecStart= needs an absolute interpreter path, not {python!r}")
    return dict(zip(UNIT_NAMES, (SOCKET_UNIT, SERVICE_UNIT.format(python=exec_quote(python))), strict=True))


def user_unit_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where systemd looks for a user's own units: ``$XDG_CONFIG_HOME/systemd/user``,
    ``~/.config/systemd/user`` when it is unset or not absolute (XDG's rule)."""
    env = os.environ if env is None else env
    config = env.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(config):
        config = os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "systemd" / "user"


def _import_problem(python: str) -> str | None:
    """Why systemd could not start ``python -P -m dispatchd``, if it could not:
    typically this command ran from a checkout (the current directory on
    sys.path) with a Python dispatchd is not installed for."""
    import dispatchd

    ours = os.path.dirname(os.path.abspath(dispatchd.__file__))
    probe = subprocess.run([python, "-P", "-c", "import dispatchd, os; print(os.path.dirname(dispatchd.__file__))"],
                           cwd="/", stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    found = probe.stdout.strip()
    if probe.returncode != 0:
        return f"{python} cannot import dispatchd outside this directory: install it first (pip install .)"
    if os.path.realpath(found) != os.path.realpath(ours):
        return f"{python} imports dispatchd from {found}, not from {ours}"
    return None


def _write(path: Path, text: str) -> None:
    """Atomically, mode 0644 (unit files are configuration, not secrets)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def install(directory: Path, python: str) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render(python).items():
        _write(directory / name, text)
        written.append(directory / name)
    return written


def uninstall(directory: Path) -> list[Path]:
    """Remove the unit files and the links ``systemctl --user enable`` left
    beside them (``*.wants/dispatchd.*``), which would dangle otherwise."""
    removed = []
    for link in sorted(directory.glob("*.wants/dispatchd.*")):
        if link.name in UNIT_NAMES and link.is_symlink():
            link.unlink()
            removed.append(link)
    for name in UNIT_NAMES:
        path = directory / name
        if path.exists() or path.is_symlink():
            path.unlink()
            removed.append(path)
    return removed


def main(argv: list[str]) -> int:
    """``dispatchd install-units [--dry-run]`` or ``dispatchd uninstall-units``."""
    command, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"dispatchd {command}", description=(
        "Write dispatchd's systemd user units (dispatchd.socket, dispatchd.service) for this Python."
        if command == "install-units" else "Remove dispatchd's systemd user units."))
    if command == "install-units":
        p.add_argument("--dry-run", action="store_true", help="print the unit files and where they would go; write nothing")
    args = p.parse_args(rest)
    if os.geteuid() == 0:
        print(f"dispatchd: refusing to {command} as root: dispatchd runs as your own user, "
              "from your user units (run this command as yourself).", file=sys.stderr)
        return 2
    directory = user_unit_dir()
    if command == "uninstall-units":
        for path in uninstall(directory):
            print(f"removed {path}")
        print("next: systemctl --user stop dispatchd.socket dispatchd.service; systemctl --user daemon-reload")
        return 0
    python = sys.executable
    if not python:
        print("dispatchd: cannot tell which Python runs this command (sys.executable is empty)", file=sys.stderr)
        return 1
    problem = _import_problem(python)
    if args.dry_run:
        for name, text in render(python).items():
            print(f"# {directory / name}\n{text}")
        if problem:
            print(f"dispatchd: warning: {problem}", file=sys.stderr)
        return 0
    if problem:
        print(f"dispatchd: {problem}", file=sys.stderr)
        return 1
    for path in install(directory, python):
        print(f"wrote {path}")
    print(f"next: {NEXT_STEP}")
    return 0
