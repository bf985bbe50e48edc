"""Putting a worktree back as a checkpoint had it: every directory opened
below the worktree's descriptor without following a symlink, files written
under a temporary name and renamed over their place, git object files
brought back from the keep.
"""

from __future__ import annotations

import errno
import os
import stat

from dispatchd import treewalk
from dispatchd.confine._sys import open_beneath
from dispatchd.durable import fsync_directory
from dispatchd.errors import CheckpointError
from dispatchd.tempfiles import temp_name

from dispatchd.daemon.checkpoints.plan import Entry, Manifest, RestorePlan, _DIR, _OBJECTS, _parent
from dispatchd.daemon.checkpoints.reading import _clone_fd, _copy_path


def _mib(n: int) -> str:
    return f"{n / 1024**2:.0f} MiB" if n >= 1024**2 else f"{n} bytes"


class _Dirs:
    """Directory descriptors below the worktree's, opened with openat2
    (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS): a symlink anywhere on the way is
    refused (ELOOP), never followed. One held at a time besides the root."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.path: bytes | None = None
        self.fd = -1
        self.widened: dict[bytes, int] = {}  # directories given u+rwx for the restore -> their mode before

    def get(self, path: bytes) -> int:
        if path == b"":
            fd = self.root_fd
        elif path == self.path:
            return self.fd
        else:
            self.close()
            fd = self.fd = open_beneath(self.root_fd, os.fsdecode(path), _DIR)
            self.path = path
        if path not in self.widened:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode & stat.S_IRWXU != stat.S_IRWXU:
                os.fchmod(fd, mode | stat.S_IRWXU)  # a directory the session made read-only: the user's, so ours
            self.widened[path] = mode
        return fd

    def set_mode(self, path: bytes, mode: int) -> None:
        fd = self.root_fd if path == b"" else open_beneath(self.root_fd, os.fsdecode(path), _DIR)
        try:
            os.fchmod(fd, mode)
        finally:
            if fd != self.root_fd:
                os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.path = -1, None


def open_root(worktree: str, expect: tuple[int, int] | None) -> int:
    """The worktree's descriptor; with ``expect`` (device, inode), refused
    unless it is that directory: checked on the descriptor every step then
    uses, not on the path, which could change between a check and the open."""
    fd = os.open(worktree, _DIR)
    if expect is not None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != expect:
            os.close(fd)
            raise CheckpointError(f"restore stopped: another directory is at {worktree} now (device {st.st_dev} "
                                  f"inode {st.st_ino}, not {expect[0]} {expect[1]}); nothing was written there",
                                  "restore_failed")
    return fd


def apply_restore(worktree: str, top: str, plan: RestorePlan, fsync_each: bool = False,
                  expect: tuple[int, int] | None = None) -> dict[str, int]:
    """Carry out ``plan`` in ``worktree`` (see ``_Dirs``: by descriptor, no
    symlink followed); with ``expect``, only in that directory (``open_root``)."""
    root_fd = open_root(worktree, expect)
    dirs = _Dirs(root_fd)
    try:
        for e in plan.remove:
            fd = dirs.get(_parent(e.path))
            name = e.path.rpartition(b"/")[2]
            if e.kind == "d":
                left = treewalk.remove_tree_at(fd, name)
                if left.skipped:
                    raise CheckpointError(f"restore stopped half way: {os.fsdecode(e.path)}: not removed: "
                                          f"{left.describe()}; the worktree is partly restored: restore again",
                                          "restore_failed")
            else:
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass
        for e in plan.make:
            fd = dirs.get(_parent(e.path))
            os.mkdir(e.path.rpartition(b"/")[2], 0o700, dir_fd=fd)
        for e in plan.write:
            fd = dirs.get(_parent(e.path))
            _put(fd, e.path.rpartition(b"/")[2], e, top, fsync_each)
        dirs.close()
        # Children first (a directory made read-only is set after what it holds);
        # then those widened on the way that the plan leaves as they are.
        for e in plan.modes:
            dirs.set_mode(e.path, e.mode)
            dirs.widened.pop(e.path, None)
        for path, mode in sorted(dirs.widened.items(), reverse=True):
            if mode & stat.S_IRWXU != stat.S_IRWXU:
                dirs.set_mode(path, mode)
    except OSError as exc:
        where = os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes)) else ""
        # O_NOFOLLOW | O_DIRECTORY on a symlink says ENOTDIR, RESOLVE_NO_SYMLINKS ELOOP: either way, not followed.
        link = exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and bool(where)
                                            and os.path.islink(os.path.join(worktree, where)))
        why = "a symlink on the way (not followed)" if link else exc.strerror
        raise CheckpointError(f"restore stopped half way: {where or 'the worktree'}: {why}; the worktree is partly "
                              "restored: restore again", "restore_failed") from exc
    finally:
        dirs.close()
        os.close(root_fd)
    return {"removed": len(plan.remove), "written": len(plan.write), "made": len(plan.make)}


def _put(fd: int, name: bytes, e: Entry, top: str, fsync: bool) -> None:
    """Write entry ``e`` as ``name`` of directory ``fd``: under a temporary
    name, then renamed over whatever is there (a file or a symlink)."""
    tmp = temp_name(os.fsdecode(name)[:200])  # the sweep's pattern: a restore cut short leaves nothing for good
    if e.kind == "l":
        os.symlink(e.target, tmp, dir_fd=fd)
    elif e.kind == "p":
        os.mkfifo(tmp, e.mode, dir_fd=fd)
        os.chmod(tmp, e.mode, dir_fd=fd)
    else:
        src = os.open(_copy_path(top, e.copy), os.O_RDONLY | os.O_CLOEXEC)
        try:
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
            try:
                _clone_fd(src, dst, e.size, [1 << 62])
                os.fchmod(dst, e.mode)
                os.utime(dst, ns=(e.mtime_ns, e.mtime_ns))
                if fsync:
                    os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
    try:
        os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        os.unlink(tmp, dir_fd=fd)
        raise


def _put_objects(worktree: str, manifest: Manifest, expect: tuple[int, int] | None = None) -> int:
    """The object files the checkpoint listed and that are gone, from the keep."""
    root_fd = open_root(worktree, expect)
    put = 0
    try:
        ofd = open_beneath(root_fd, os.fsdecode(_OBJECTS), _DIR)
        try:
            here: dict[str, set[str]] = {}
            for rel in manifest.objects:
                d, _, name = rel.partition("/")
                if d not in here:
                    try:
                        here[d] = set(os.listdir(f"/proc/self/fd/{ofd}/{d}")) if _is_dir_at(ofd, d) else set()
                    except FileNotFoundError:
                        here[d] = set()
                if name in here[d]:
                    continue
                if not _is_dir_at(ofd, d):
                    try:
                        os.mkdir(d, 0o755, dir_fd=ofd)
                    except FileExistsError:
                        os.unlink(d, dir_fd=ofd)  # not a directory (a session's symlink): git's place
                        os.mkdir(d, 0o755, dir_fd=ofd)
                dfd = os.open(d, _DIR, dir_fd=ofd)
                try:
                    # Without blocking, and only a regular file: what a keep holds is what
                    # history._clone linked, a regular file's inode (never a FIFO to wait on).
                    src = os.open(os.path.join(manifest.keep, d, name),
                                  os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                    try:
                        if not stat.S_ISREG(os.fstat(src).st_mode):
                            continue
                        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      0o444, dir_fd=dfd)
                        try:
                            _clone_fd(src, out, os.fstat(src).st_size, [1 << 62])
                        finally:
                            os.close(out)
                    finally:
                        os.close(src)
                finally:
                    os.close(dfd)
                put += 1
        finally:
            os.close(ofd)
    finally:
        os.close(root_fd)
    return put


def fsync_dirs(worktree: str, paths: set[bytes]) -> None:
    """fsync the directories ``paths`` below ``worktree`` (opened as a
    restore opens them: no symlink followed): the renames in them durable."""
    root_fd = os.open(worktree, _DIR)
    try:
        for path in sorted(paths):
            fd = open_beneath(root_fd, os.fsdecode(path), _DIR) if path else root_fd
            try:
                fsync_directory(".", dir_fd=fd)
            finally:
                if fd != root_fd:
                    os.close(fd)
    finally:
        os.close(root_fd)


def _is_dir_at(fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _syncfs(path: str) -> None:
    """``syncfs(2)`` of the file system holding ``path``: every copy made
    there reaches the disk in one call, instead of an fsync per file."""
    import ctypes

    fd = os.open(path, _DIR)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)
