"""A ref of the repository, written as git writes one: under git's own lock.

Git changes a ref (a loose ref, ``HEAD``, ``packed-refs``) by creating
``NAME.lock`` with ``O_CREAT | O_EXCL``, reading the ref's value with the
lock held, writing the new value into the lock file and renaming it over
the ref; a second writer's ``O_EXCL`` fails (``cannot lock ref``) until the
first is done. A restore that wrote the ref file directly could land
between a ``git commit``'s read and its rename, or write over the value
that commit had just renamed into place.

Guarantees:
- ``take`` makes ``NAME.lock`` in the ref's directory, reached below the
  repository's descriptor without following a symlink (``open_beneath``;
  missing directories made as git makes them): a temporary name of ours
  (``reftemp.temp_name``'s shape) made ``O_EXCL | O_NOFOLLOW``, then
  hard-linked to ``NAME.lock`` (``link`` fails on an existing name, as
  ``O_EXCL`` does). So a lock a daemon killed mid-restore left has two names
  where git's has one: the restore finished at the next start (no session
  running: ``take_over``) takes it over (and the start's sweep removes a
  pair nobody took over), where it
  used to be left, the branch at the session's commit and the user's git
  refused for good. A lock of one name, held by someone else (the user's
  git), is waited for briefly (``WAIT_S``), then refused, naming it: never
  taken over, never removed;
- what is read with the lock held (``value``) is the ref's value no git
  can change until ``commit`` or ``release``;
- ``commit`` renames the lock file, holding the new value, over the ref:
  the ref holds the old value or the new one, never neither; ``release``
  removes only a lock file this took (device and inode checked).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from dataclasses import dataclass

from dispatchd.confine._sys import open_beneath
from dispatchd.daemon.gitguard import reftemp, refvalues

WAIT_S = 1.0  # a lock of the user's git held longer than this: the ref is left, and said
_STEP_S = 0.02
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_PACKED = 64 * 1024 * 1024


class Busy(Exception):
    """``NAME.lock`` is held by another writer (the user's git) past ``WAIT_S``."""


@dataclass
class Held:
    """A lock this took: ``NAME.lock`` in the directory ``dir_fd``."""

    name: str  # the ref's name below the repository ("refs/heads/main", "HEAD", "packed-refs")
    dir_fd: int
    leaf: str
    ident: tuple[int, int]  # the lock file's device and inode
    second: str = ""  # the lock's other name, ours, removed once the lock is let go or committed

    @property
    def lock_leaf(self) -> str:
        return f"{self.leaf}.lock"


def open_dir(common_fd: int, rel: str, make: bool) -> int:
    """The directory ``rel`` below the repository (``""``: itself), no
    symlink followed; with ``make``, the missing levels made (0755, as git's)."""
    if not rel:
        return os.dup(common_fd)
    try:
        return open_beneath(common_fd, rel, _DIR)
    except FileNotFoundError:
        if not make:
            raise
    fd = os.dup(common_fd)
    try:
        for part in rel.split("/"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            nxt = open_beneath(fd, part, _DIR)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def take(common_fd: int, name: str, wait_s: float = WAIT_S, *, take_over: bool = False) -> Held:
    """``name``'s lock, as git takes it; ``Busy`` when another holds it past ``wait_s``.
    ``take_over``: a lock with a second name is a killed restore's, removed
    and made anew; only where no session runs (a restore finished at a
    start), since a session's process can give a lock the user's git holds
    a second name, and a live restore would then remove the user's lock."""
    rel, _, leaf = name.rpartition("/")
    dir_fd = open_dir(common_fd, rel, make=True)
    deadline = time.monotonic() + wait_s
    second = ""
    try:
        second = os.path.basename(reftemp.temp_name(leaf))
        fd = os.open(second, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        st = os.fstat(fd)
        os.close(fd)
        while True:
            try:
                os.link(second, f"{leaf}.lock", src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                break
            except FileExistsError:
                try:
                    there = os.stat(f"{leaf}.lock", dir_fd=dir_fd, follow_symlinks=False)
                    if take_over and stat.S_ISREG(there.st_mode) and there.st_nlink > 1:  # a killed restore's
                        os.unlink(f"{leaf}.lock", dir_fd=dir_fd)
                        continue
                except FileNotFoundError:
                    continue  # let go meanwhile
                if time.monotonic() >= deadline:
                    raise Busy(f"{name}.lock") from None
                time.sleep(_STEP_S)
    except BaseException:
        if second:
            with contextlib.suppress(OSError):
                os.unlink(second, dir_fd=dir_fd)
        os.close(dir_fd)
        raise
    return Held(name, dir_fd, leaf, (st.st_dev, st.st_ino), second)


def _mine(held: Held) -> bool:
    try:
        st = os.stat(held.lock_leaf, dir_fd=held.dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == held.ident


def release(held: Held) -> None:
    """The lock given up, the ref as it was."""
    try:
        if _mine(held):
            os.unlink(held.lock_leaf, dir_fd=held.dir_fd)
        _drop_second(held)
    finally:
        os.close(held.dir_fd)


def _drop_second(held: Held) -> None:
    if held.second:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(held.second, dir_fd=held.dir_fd)


def commit(held: Held, data: bytes) -> None:
    """The ref holds ``data``: written into the lock file, renamed over the
    ref (which releases the lock, as git's commit of a lock does)."""
    try:
        fd = os.open(held.lock_leaf, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=held.dir_fd)
        try:
            if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != held.ident:
                raise OSError(errno.ESTALE, "the lock file was replaced by another", held.lock_leaf)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(held.lock_leaf, held.leaf, src_dir_fd=held.dir_fd, dst_dir_fd=held.dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            if _mine(held):
                os.unlink(held.lock_leaf, dir_fd=held.dir_fd)
        raise
    finally:
        try:
            _drop_second(held)
        finally:
            os.close(held.dir_fd)


def read_leaf(dir_fd: int, leaf: str, limit: int = 4096) -> bytes | None:
    """A regular file's bytes (at most ``limit``), not through a symlink;
    None when absent; ``OSError`` (ELOOP, EISDIR...) when not a regular file."""
    try:
        fd = os.open(leaf, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", leaf)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def packed_text(common_fd: int) -> str:
    """``packed-refs`` as it is now ("" when absent)."""
    data = read_leaf(common_fd, "packed-refs", _MAX_PACKED)
    return (data or b"").decode("utf-8", "surrogateescape")


def packed_value(text: str, name: str, hexsz: int) -> str | None:
    """``name``'s value in a ``packed-refs`` text, or None."""
    for line in text.split("\n"):
        record = refvalues.packed_record(line, hexsz)
        if record is not None and record[1] == name:
            return record[0]
    return None


def value(common_fd: int, held: Held, hexsz: int) -> str | None:
    """The ref's value as git reads it now, its lock held: the loose file,
    else its ``packed-refs`` record (None: no such ref). Anything but a
    regular file at its name is a value no id equals (git reads no ref there)."""
    try:
        data = read_leaf(held.dir_fd, held.leaf)
    except OSError as exc:
        return f"not a regular file ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    if data is not None:
        return refvalues.parse_loose(data.decode("utf-8", "surrogateescape"))
    if held.name == "HEAD":
        return None
    return packed_value(packed_text(common_fd), held.name, hexsz)


def without(text: str, names: set[str], hexsz: int) -> str:
    """A ``packed-refs`` text without the records of ``names`` (and the
    peeled line ``^ID`` that follows each), the rest as it was, in its order."""
    out: list[str] = []
    dropping = False
    for line in text.split("\n"):
        if line.startswith("^") and dropping:
            continue
        record = refvalues.packed_record(line, hexsz)
        dropping = record is not None and record[1] in names
        if not dropping:
            out.append(line)
    return "\n".join(out)
