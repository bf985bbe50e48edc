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

Replacing makes a new inode: hard links to the old file keep the old content,
and the file ends up owned by the worker's user.
"""

from __future__ import annotations

import errno
import os
import stat
import threading

from dispatchd.durable import fsync_directory
from dispatchd.tempfiles import TEMP_NAME, temp_name

__all__ = ["atomic_write", "TEMP_NAME", "in_flight"]  # TEMP_NAME: tempfiles.py's, for the sweep's callers

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


def atomic_write(target: str, data: bytes, *, fsync: bool, exclusive: bool = False, dir_fd: int | None = None) -> None:
    """Write ``data`` to ``target`` (absolute, symlink-free) atomically; with
    ``dir_fd``, ``target`` is a name in the directory ``dir_fd`` holds.

    Raises ``IsADirectoryError`` when ``target`` is a directory,
    ``FileExistsError`` with ``exclusive`` when it exists, and whatever
    ``OSError`` the writing met.
    """
    directory, name = ("", target) if dir_fd is not None else os.path.split(target)
    mode = None
    if not exclusive:
        try:
            st = os.stat(target, follow_symlinks=False, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
            mode = stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)
    tmp, fd = _create_temp(directory, name, dir_fd)
    key = os.fsencode(os.path.basename(tmp))
    published = False
    try:
        try:
            _write_all(fd, data)
            if mode is not None:
                os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
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
