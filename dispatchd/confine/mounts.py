"""The session's view of the filesystem, in its own mount namespace.

Guarantees, once ``apply_mounts`` has returned (user namespaces only):
- every mount is read-only except the worktree, the scratch directory and the
  policy's extra read-write paths, so chmod, utime and xattr changes on files
  outside them fail with EROFS even where Landlock (ABI 7) does not look;
- ``/tmp`` is the session's private scratch ``tmp`` directory and ``/dev/shm``
  a private tmpfs;
- the user's runtime directory (``$XDG_RUNTIME_DIR``: D-Bus, systemd, the
  daemon's socket) is covered by an empty read-only tmpfs;
- the git metadata the user's own git would run (``.git/config``, hooks, a
  linked worktree's pointer files; see ``gitdirs``) is read-only inside the
  writable worktree;
- ``/proc`` is a new procfs of the session's pid namespace: other processes,
  the daemon included, do not exist there;
- nothing propagates back to the host (the whole tree is made private first).
"""

from __future__ import annotations

import os
import stat

import msgspec

from dispatchd.confine import _sys
from dispatchd.errors import ConfinementError



class MountPlan(msgspec.Struct, frozen=True):
    writable: list[str]  # bound onto themselves and kept read-write
    visible: list[str]  # must stay reachable at their path (the worktree, even under /tmp)
    private_tmp: str  # bound over /tmp
    hide: list[str]  # covered by an empty tmpfs
    proc: bool  # mount a fresh /proc (in a new pid namespace)
    read_only: list[str] = []  # inside writable paths, bound read-only over themselves (git metadata)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def plan_mounts(*, writable: list[str], visible: list[str], private_tmp: str, hide: list[str], proc: bool,
                read_only: list[str] | None = None) -> MountPlan:
    keep = sorted(set(visible) | set(writable))
    # Hiding a directory that holds a path the session needs would hide that path too.
    hide = [h for h in hide if not any(_under(k, h) for k in keep + [private_tmp])]
    return MountPlan(writable=list(writable), visible=keep, private_tmp=private_tmp, hide=hide, proc=proc,
                     read_only=list(read_only or []))


def _mount(step: str, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    try:
        _sys.mount(source, target, fstype, flags, data)
    except OSError as exc:
        raise ConfinementError(f"mounts: {step}", exc.errno, target) from exc


def _bind_over_itself(path: str) -> None:
    """Bind ``path`` over itself, through a descriptor opened without following
    a symlink: were the path swapped for a symlink since it was planned (by
    another session on the same worktree), a bind by name would protect the
    symlink's target and leave the path itself writable. Fail closed then."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # gone since it was planned: nothing there for git to run
    except OSError as exc:
        raise ConfinementError("mounts: bind read-only path", exc.errno, path) from exc
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise ConfinementError("mounts: bind read-only path", path=path,
                                   detail="it was replaced by a symlink since the session was planned")
        _mount("bind read-only path", f"/proc/self/fd/{fd}", f"/proc/self/fd/{fd}", None, _sys.MS_BIND)
    finally:
        os.close(fd)


def apply_mounts(plan: MountPlan) -> None:
    _mount("make private", None, "/", None, _sys.MS_REC | _sys.MS_PRIVATE)
    # A worktree may live under /tmp: hold it by an fd, cover /tmp, then bind it
    # back at the same path inside the private /tmp.
    under_tmp = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in plan.visible if _under(p, "/tmp") and os.path.exists(p)}
    try:
        _mount("private /tmp", plan.private_tmp, "/tmp", None, _sys.MS_BIND)
        for path, fd in under_tmp.items():
            os.makedirs(path, exist_ok=True)
            _mount("keep path under /tmp", f"/proc/self/fd/{fd}", path, None, _sys.MS_BIND)
    finally:
        for fd in under_tmp.values():
            os.close(fd)
    for path in plan.writable:
        if os.path.exists(path) and path not in under_tmp:
            _mount("bind writable path", path, path, None, _sys.MS_BIND)
    for path in plan.read_only:
        # A mount of its own on top of the writable one: the recursive read-only
        # pass below covers it, and only the writable mounts are made writable again.
        _bind_over_itself(path)
    for path in plan.hide:
        if os.path.isdir(path):
            _mount("hide", "tmpfs", path, "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV | _sys.MS_NOEXEC, "size=4k,mode=0555")
    if os.path.isdir("/dev/shm"):
        # POSIX shared memory of the session's own, not the host user's.
        _mount("private /dev/shm", "tmpfs", "/dev/shm", "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV, "size=64m,mode=1777")
    if plan.proc:
        _mount("proc", "proc", "/proc", "proc", _sys.MS_NOSUID | _sys.MS_NODEV | _sys.MS_NOEXEC)
    # Everything read-only in one call (mount_setattr, AT_RECURSIVE), then the
    # few writable mounts made writable again: they are our own bind mounts,
    # so no flag of theirs is locked by the parent namespace.
    try:
        _sys.mount_setattr("/", set_=_sys.MOUNT_ATTR_RDONLY, recursive=True)
    except OSError as exc:
        raise ConfinementError("mounts: read-only /", exc.errno, "/") from exc
    for path in ["/tmp", "/dev/shm", *plan.writable]:
        if os.path.isdir(path):
            try:
                _sys.mount_setattr(path, clear=_sys.MOUNT_ATTR_RDONLY)
            except OSError as exc:
                raise ConfinementError("mounts: writable path", exc.errno, path) from exc
