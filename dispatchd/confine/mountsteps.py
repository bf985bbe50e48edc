"""The steps every mount of the session's view is made of, each by
descriptor: a source opened without following a symlink on the way
(``open_nofollow``), a mount point reached or made below the new root one
component at a time, a symlink there failing the step (``mount_point``), a bind
from descriptor to descriptor (``bind``, ``bind_over_itself``). Any failure
is a ``ConfinementError`` naming the step and the path: the session is
refused, never given a view other than its plan.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Literal

from dispatchd.confine import _sys
from dispatchd.errors import ConfinementError


def mount(step: str, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    try:
        _sys.mount(source, target, fstype, flags, data)
    except OSError as exc:
        raise ConfinementError(f"mounts: {step}", exc.errno, target) from exc


def fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def open_nofollow(path: str, step: str, host_fd: int = -1) -> int | None:
    """An O_PATH descriptor of ``path``, resolved without following a symlink
    on the way (``openat2`` ``RESOLVE_NO_SYMLINKS``: one call); a symlink as the
    last component is returned itself. None when it does not exist.
    ``host_fd``: the host's root held by descriptor (``_hold_host``), ``path``
    taken below it and never above."""
    try:
        if host_fd >= 0:
            return _sys.open_no_symlinks(path.lstrip("/") or ".", host_fd, beneath=True)
        return _sys.open_no_symlinks(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        detail = ("a symlink in its path; bind sources are resolved by the daemon and never followed here"
                  if exc.errno == errno.ELOOP else "")
        raise ConfinementError(f"mounts: {step}", exc.errno, path, detail) from exc


def _mount_point_fast(root_fd: int, path: str, kind: Literal["dir", "file"] | None) -> int | None:
    """The common cases in a few calls: the path is there already, or only its
    last component is missing (made here). None: walk it (``mount_point``)."""
    rel = path.strip("/")
    try:
        return _sys.open_no_symlinks(rel, root_fd)
    except OSError as exc:
        if exc.errno != errno.ENOENT or kind is None:
            return None
    parent, _, name = rel.rpartition("/")
    try:
        pfd = _sys.open_no_symlinks(parent, root_fd) if parent else os.dup(root_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISDIR(os.fstat(pfd).st_mode):
            return None
        if kind == "file":
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=pfd))
        else:
            os.mkdir(name, 0o755, dir_fd=pfd)
        return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    except OSError:
        return None
    finally:
        os.close(pfd)


def mount_point(root_fd: int, path: str, kind: Literal["dir", "file"] | None) -> int | None:
    """An O_PATH descriptor of ``path`` below ``root_fd``, making missing
    components (directories; the last one ``kind``) unless ``kind`` is None.
    A symlink on the way fails the step: the new root must hold none we did
    not make, and a bind is never aimed through one."""
    fd = _mount_point_fast(root_fd, path, kind)
    if fd is not None:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfinementError("mounts: bind", path=path,
                                   detail="it was replaced by a symlink since the session was planned")
        return fd
    fd = os.dup(root_fd)
    parts = [p for p in path.split("/") if p]
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if kind is None:
                    return None
                if last and kind == "file":
                    os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     0o644, dir_fd=fd))
                else:
                    os.mkdir(name, 0o755, dir_fd=fd)
                nxt = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise ConfinementError("mounts: bind", path=path,
                                       detail="it was replaced by a symlink since the session was planned")
        out, fd = fd, -1
        return out
    except OSError as exc:
        raise ConfinementError("mounts: mount point", exc.errno, path) from exc
    finally:
        if fd >= 0:
            os.close(fd)


def bind(src_fd: int, root_fd: int, path: str) -> None:
    st = os.fstat(src_fd)
    if stat.S_ISLNK(st.st_mode):
        # /bin -> usr/bin: the same link in the new root (its target is bound, or absent).
        target = os.readlink("", dir_fd=src_fd)  # the link itself (O_PATH | O_NOFOLLOW), wherever it is seen
        parent = os.dup(root_fd) if os.path.dirname(path) == "/" else mount_point(root_fd, os.path.dirname(path), "dir")
        assert parent is not None
        try:
            os.symlink(target, os.path.basename(path), dir_fd=parent)
        except FileExistsError:
            pass
        finally:
            os.close(parent)
        return
    tgt = mount_point(root_fd, path, "dir" if stat.S_ISDIR(st.st_mode) else "file")
    assert tgt is not None
    try:
        mount("bind", fd_path(src_fd), fd_path(tgt), None, _sys.MS_BIND | _sys.MS_REC)
    finally:
        os.close(tgt)


def bind_over_itself(root_fd: int, path: str) -> None:
    """Git metadata inside the writable worktree, bound read-only over itself,
    through a descriptor opened without following a symlink: were the path
    swapped for a symlink since it was planned (by another session on the same
    worktree), a bind by name would protect the symlink's target and leave the
    path itself writable. Fail closed then; absent, nothing to protect."""
    fd = mount_point(root_fd, path, None)
    if fd is None:
        return  # gone since it was planned: nothing there for git to run
    try:
        mount("bind read-only path", fd_path(fd), fd_path(fd), None, _sys.MS_BIND)
    finally:
        os.close(fd)


def mount_in(dir_fd: int, name: str, step: str, fstype: str, flags: int, data: str) -> None:
    """A new directory ``name`` in ``dir_fd`` with a fresh ``fstype`` mounted
    on it (a private ``/dev/shm``, the session's own devpts)."""
    os.mkdir(name, 0o755, dir_fd=dir_fd)
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        mount(step, fstype, fd_path(fd), fstype, flags, data)
    finally:
        os.close(fd)
