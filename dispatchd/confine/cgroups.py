"""Per-session cgroups (v2), where the daemon has a delegated subtree.

With a cgroup subtree of its own (systemd's ``Delegate=yes``, or ``--cgroup
PATH``), the daemon gives every session a cgroup, and guarantees:
- every process of the session is in it: the session's first process joins it
  before it forks anything, and a process cannot leave it (the cgroup files
  are read-only to the session: a read-only mount and Landlock); so is its
  network stack, outside the sandbox (worker/stackstart.py);
- the limits the policy sets hold over the whole session, not per process:
  ``pids.max`` (a fork bomb stops there), ``memory.max``, ``cpu.weight`` —
  each where its controller is delegated; ``status`` says which;
- ending the session ends every process in the cgroup (``cgroup.kill``),
  whatever it did to leave the session's process tree, and removes the cgroup.

Layout, under the delegated cgroup BASE (cgroup v2 lets only leaves hold
processes once controllers are enabled for children):

    BASE/daemon          the daemon and its fork server
    BASE/session-ID      one per open session

Where none of this is available, the rlimits of ``limits.py`` still apply (they
apply in every mode) and process-tree tracking ends the session's processes.
``plan_session_cgroup`` and ``choose`` are pure; the rest is the thin apply.
"""

from __future__ import annotations

import errno
import os
import signal
import time

import msgspec

from dispatchd.errors import ConfinementError
from dispatchd.inside import is_below

CONTROLLERS = ("pids", "memory", "cpu")  # what a session's limits use, in this order


class Delegation(msgspec.Struct, frozen=True):
    """The cgroup the daemon manages, found (or not) once at start."""

    path: str = ""  # "" when sessions get no cgroup
    controllers: tuple[str, ...] = ()  # enabled for the sessions' cgroups
    note: str = ""  # why there is none, or which controllers are missing and why

    def describe(self) -> str:
        if not self.path:
            return f"no: {self.note}"
        text = f"in use at {self.path} (controllers: {', '.join(self.controllers) or 'none'})"
        return f"{text}; {self.note}" if self.note else text


class SessionCgroup(msgspec.Struct, frozen=True):
    path: str
    settings: dict[str, str]  # file -> value, written before any process joins


def plan_session_cgroup(delegation: Delegation, session: str, *, max_processes: int, memory_bytes: int,
                        cpu_weight: int) -> SessionCgroup | None:
    if not delegation.path:
        return None
    settings: dict[str, str] = {}
    if "pids" in delegation.controllers:
        settings["pids.max"] = str(max_processes)
    if "memory" in delegation.controllers:
        settings["memory.max"] = str(memory_bytes)
        # No swap either: otherwise memory.max only moves the session's memory
        # to swap, and the machine slows down instead of the session stopping.
        settings["memory.swap.max"] = "0"
    if "cpu" in delegation.controllers:
        settings["cpu.weight"] = str(cpu_weight)
    return SessionCgroup(path=f"{delegation.path}/session-{session}", settings=settings)


def choose(mode: str, *, own: str, mount: str, pid: int, occupants: list[int] | None,
           writable: bool) -> tuple[str, str]:
    """Which cgroup to manage: (path, "") or ("", why not). Pure.

    ``mode`` is "off", "auto" or a path. "auto" takes the daemon's own cgroup
    only when it is delegated (``writable``) and the daemon is alone in it,
    as in a systemd service with ``Delegate=yes``: a shell's cgroup that
    the daemon was merely started from is not the daemon's to rearrange.
    """
    if mode == "off":
        return "", "not used (--cgroup off)"
    if not mount:
        return "", "cgroup v2 is not mounted"
    if mode != "auto":
        path = os.path.normpath(mode)
        if not is_below(path, mount):
            return "", f"{mode} is not inside the cgroup v2 hierarchy at {mount}"
        return path, ""
    if not own:
        return "", "this process is in no cgroup v2"
    path = os.path.normpath(os.path.join(mount, own.lstrip("/")))
    if not writable:
        return "", (f"{path} is not delegated to this user (run dispatchd as its systemd user service, "
                    "which has Delegate=yes, or pass --cgroup with a delegated cgroup)")
    if occupants is None or sorted(occupants) != [pid]:
        return "", (f"{path} holds other processes than the daemon, so it is not the daemon's to divide "
                    "(run dispatchd as its systemd user service, or pass --cgroup)")
    return path, ""


# --- apply -----------------------------------------------------------------


def own_cgroup() -> str:
    """The v2 path of this process's cgroup, "" if none."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            return next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), "")
    except OSError:
        return ""


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def _delegated(path: str) -> bool:
    return all(os.access(p, os.W_OK) for p in (path, f"{path}/cgroup.procs", f"{path}/cgroup.subtree_control"))


def delegate(mode: str, mount: str) -> Delegation:
    """Take the cgroup ``mode`` names (see ``choose``): move this process into
    BASE/daemon and enable the controllers it can for the sessions. Call
    before any thread or child exists, so that all of the daemon moves.

    "auto" falls back to no cgroup, with the reason; an explicit path that
    cannot be used raises ``ConfinementError`` (the user asked for it).
    """
    own = own_cgroup()
    occupants: list[int] | None = None
    writable = False
    if mode == "auto" and mount and own:
        base = os.path.join(mount, own.lstrip("/"))
        writable = _delegated(base)
        try:
            occupants = [int(p) for p in _read(f"{base}/cgroup.procs").split()]
        except OSError:
            occupants = None
    path, why = choose(mode, own=own, mount=mount, pid=os.getpid(), occupants=occupants, writable=writable)
    if not path:
        if mode not in ("auto", "off"):
            raise ConfinementError("cgroup", path=mode, detail=why)
        return Delegation(note=why)
    try:
        os.makedirs(f"{path}/daemon", exist_ok=True)
        _write(f"{path}/daemon/cgroup.procs", "0")
        have = _read(f"{path}/cgroup.controllers").split()
    except OSError as exc:
        if mode == "auto":
            return Delegation(note=f"cannot use {path}: {exc.strerror}")
        raise ConfinementError("cgroup", exc.errno or 0, exc.filename or path) from exc
    stale = _remove_stale(path)
    enabled, refused = [], []
    for controller in CONTROLLERS:
        if controller not in have:
            continue
        try:
            _write(f"{path}/cgroup.subtree_control", f"+{controller}")
            enabled.append(controller)
        except OSError as exc:
            refused.append(f"{controller} ({exc.strerror})")
    missing = [c for c in CONTROLLERS if c not in have]
    notes = []
    if missing:
        notes.append(f"controllers {', '.join(missing)} are not available in {path} (it offers: "
                     f"{', '.join(have) or 'none'}), so their limits are rlimits")
    if refused:
        notes.append(f"enabling {', '.join(refused)} was refused")
    if stale:
        notes.append(f"removed {stale} cgroup(s) left by a daemon that did not stop cleanly")
    return Delegation(path=path, controllers=tuple(enabled), note="; ".join(notes))


def _remove_stale(base: str) -> int:
    """The session cgroups of a daemon that was killed: its workers died with
    it, but their (empty) cgroups stay until someone removes them."""
    count = 0
    for entry in os.listdir(base):
        if entry.startswith("session-") and os.path.isdir(f"{base}/{entry}"):
            try:
                remove(f"{base}/{entry}", timeout_s=1.0)
                count += 1
            except OSError:
                pass
    return count


OPTIONAL = ("memory.swap.max",)  # absent where the kernel accounts no swap (swapaccount=0, no swap support)


def create(cgroup: SessionCgroup) -> None:
    """Make the session's cgroup with its limits in force (the daemon, before
    spawning). On failure nothing is left behind."""
    try:
        os.mkdir(cgroup.path, 0o755)
    except OSError as exc:
        raise ConfinementError("cgroup", exc.errno or 0, cgroup.path) from exc
    try:
        for name, value in cgroup.settings.items():
            try:
                _write(f"{cgroup.path}/{name}", value)
            except FileNotFoundError:
                if name not in OPTIONAL:
                    raise
    except OSError as exc:
        try:
            os.rmdir(cgroup.path)
        except OSError:
            pass
        raise ConfinementError("cgroup", exc.errno or 0, exc.filename or cgroup.path) from exc


def apply_cgroup(path: str) -> None:
    """Move the calling process into the cgroup (the session's first step)."""
    try:
        _write(f"{path}/cgroup.procs", "0")
    except OSError as exc:
        raise ConfinementError("cgroup", exc.errno or 0, f"{path}/cgroup.procs") from exc


def populated(path: str) -> bool:
    try:
        for line in _read(f"{path}/cgroup.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "populated":
                return value.strip() != "0"
    except FileNotFoundError:
        return False
    return True


def kill(path: str, timeout_s: float = 5.0) -> bool:
    """End every process in the cgroup; True once it is empty (or gone)."""
    deadline = time.monotonic() + timeout_s
    while populated(path):
        try:
            _write(f"{path}/cgroup.kill", "1")  # Linux 5.14+: atomic, children forked meanwhile included
        except FileNotFoundError:
            return True  # the cgroup itself is gone
        except OSError:
            # No cgroup.kill in this kernel: kill what is listed, until nothing is.
            try:
                pids = _read(f"{path}/cgroup.procs").split()
            except FileNotFoundError:
                return True
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def remove(path: str, timeout_s: float = 5.0) -> None:
    """End the session's processes and remove its cgroup. Raises OSError if it cannot."""
    kill(path, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            # EBUSY until the last killed process is reaped by its parent.
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
