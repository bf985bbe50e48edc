"""Replace or create a file so that readers see the old content or the new, never half.

Guarantees of ``atomic_write``:
- The data goes to a temporary file in the target's directory (same file
  system, so the final step is a rename), created with ``O_EXCL`` under a
  name like ``.NAME.dispatchd-1a2b3c4d.tmp``.
- Replacing keeps the old file's permission bits (setuid and setgid dropped,
  as the kernel drops them when someone writes to such a file); a new file
  gets ``0o666`` less the umask, like any ``open(..., "w")``.
- ``exclusive=True`` publishes with ``link(2)``, which fails with ``EEXIST``
  atomically when the target appeared in the meantime: nothing is overwritten.
- With ``fsync=True`` the data, then the directory entry, reach the disk
  before the function returns.
- On any error the temporary file is removed and the target is untouched.
- With ``dir_fd`` (the target's directory, held open) every step names the
  file relative to that descriptor: nothing is looked up by path again, so
  a directory of the path swapped for a symlink meanwhile cannot send the
  write elsewhere.

- Replacing copies the old file's extended attributes (``user.*``, its ACL)
  that its owner may set; others (``security.*``) are left to the kernel.
- Only a regular file is replaced: a FIFO, socket or device at the name is
  refused (``NotRegular``), never turned into a file; and only one its owner
  may write (a file made read-only, ``chmod a-w``, is refused with EACCES,
  as ``open`` for writing would refuse it).
- With ``expect`` (the file's ``stat`` before the caller read it), a file
  that changed since (another process wrote it: its inode, size, mtime or
  ctime differ) is not replaced (``ChangedMeanwhile``), so an edit never
  lands over a write it did not see. The check is just before the rename:
  a write in the microseconds between them is still lost.

Replacing makes a new inode: hard links to the old file keep the old content,
a process that holds the old file open goes on writing to it, and the file
ends up owned by the worker's user.
"""

from __future__ import annotations

import errno
import os
import stat
import threading

from dispatchd.durable import fsync_directory
from dispatchd.tempfiles import TEMP_NAME, temp_name

__all__ = ["ChangedMeanwhile", "NotRegular", "atomic_write", "TEMP_NAME", "in_flight"]  # TEMP_NAME: tempfiles.py's


class NotRegular(Exception):
    """The target is not a regular file (``kind``: "FIFO", "socket", "device")."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class ChangedMeanwhile(Exception):
    """The target changed after the caller read it (``atomic_write(expect=)``)."""


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """The same inode with the same size and times: unchanged, as far as the kernel says."""
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == \
        (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns)

# Names of the temporary files this process is writing now, registered before
# they exist (the random part makes a name unique): a sweep skips them.
_in_flight: set[bytes] = set()
_in_flight_lock = threading.Lock()


def in_flight() -> frozenset[bytes]:
    """The names of the temporary files this process is writing at this moment."""
    with _in_flight_lock:
        return frozenset(_in_flight)

# NAME_MAX is 255 on every Linux file system we care about; the prefix, the
# suffix and the random part take 25 of those.
_MAX_STEM = 200
_TEMP_ATTEMPTS = 16


def _create_temp(directory: str, name: str, dir_fd: int | None) -> tuple[str, int]:
    stem = name[:_MAX_STEM]
    for _ in range(_TEMP_ATTEMPTS):
        tmp = temp_name(stem) if dir_fd is not None else os.path.join(directory, temp_name(stem))
        key = os.fsencode(os.path.basename(tmp))
        with _in_flight_lock:
            _in_flight.add(key)
        try:
            # O_NOFOLLOW: a symlink planted under the temp name is refused,
            # not written through.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                         dir_fd=dir_fd)
        except BaseException as exc:
            with _in_flight_lock:
                _in_flight.discard(key)
            if isinstance(exc, FileExistsError):
                continue
            raise
        return tmp, fd
    raise FileExistsError(errno.EEXIST, "could not pick an unused temporary name", directory)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def atomic_write(target: str, data: bytes, *, fsync: bool, exclusive: bool = False, dir_fd: int | None = None,
                 expect: os.stat_result | None = None) -> None:
    """Write ``data`` to ``target`` (absolute, symlink-free) atomically; with
    ``dir_fd``, ``target`` is a name in the directory ``dir_fd`` holds.

    Raises ``IsADirectoryError`` when ``target`` is a directory,
    ``NotRegular`` when it is another kind of file, ``FileExistsError`` with
    ``exclusive`` when it exists, ``ChangedMeanwhile`` when it is not
    ``expect`` (see the module), and whatever ``OSError`` the writing met.
    """
    directory, name = ("", target) if dir_fd is not None else os.path.split(target)
    mode = None
    old: os.stat_result | None = None
    if not exclusive:
        try:
            old = os.stat(target, follow_symlinks=False, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(old.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
            if not stat.S_ISREG(old.st_mode):
                raise NotRegular(_KINDS.get(stat.S_IFMT(old.st_mode), "special file"))
            if not old.st_mode & stat.S_IWUSR:
                raise PermissionError(errno.EACCES, f"the file is read-only (mode {stat.S_IMODE(old.st_mode):04o}); "
                                      "make it writable first (chmod u+w) if it should change", target)
            mode = stat.S_IMODE(old.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)
    if expect is not None and (old is None or not same_file(old, expect)):
        raise ChangedMeanwhile()
    tmp, fd = _create_temp(directory, name, dir_fd)
    key = os.fsencode(os.path.basename(tmp))
    published = False
    try:
        try:
            _write_all(fd, data)
            if mode is not None:
                os.fchmod(fd, mode)
                _copy_xattrs(target, dir_fd, fd)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if expect is not None:
            now = os.stat(target, follow_symlinks=False, dir_fd=dir_fd)
            if not same_file(now, expect):
                raise ChangedMeanwhile()
        if exclusive:
            os.link(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        else:
            os.replace(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        published = True
    finally:
        # After os.replace the temp name is gone; after os.link it is a
        # second name for the new file and must go too. A failure here must
        # not hide the error that got us here, nor undo a finished create.
        if not published or exclusive:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        with _in_flight_lock:
            _in_flight.discard(key)
    if fsync:
        fsync_directory(directory, dir_fd)


_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket", stat.S_IFCHR: "device", stat.S_IFBLK: "device",
          stat.S_IFLNK: "symlink"}


def _copy_xattrs(target: str, dir_fd: int | None, to_fd: int) -> None:
    """The old file's extended attributes onto the new one, those its owner
    may set (``user.*``, an ACL); the rest, and a file system without them,
    are left as they are."""
    try:
        src = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        names = os.listxattr(src)
        for attr in names:
            try:
                os.setxattr(to_fd, attr, os.getxattr(src, attr))
            except OSError:
                continue  # security.*, trusted.*: not the owner's to set
    except OSError:
        pass  # no extended attributes here
    finally:
        os.close(src)
