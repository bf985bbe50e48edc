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
  missing directories made as git makes them) as ``lockfile`` makes every
  lock of the daemon's: a temporary name of ours made ``O_EXCL |
  O_NOFOLLOW``, then hard-linked to ``NAME.lock`` (``link`` fails on an
  existing name, as ``O_EXCL`` does). So a lock a daemon killed
  mid-restore left has two names where git's has one: the restore finished
  at the next start (no session running: ``take_over``) takes it over (and
  the start's sweep removes a pair nobody took over), where it used to be
  left, the branch at the session's commit and the user's git refused for
  good. A lock of one name, held by someone else (the user's
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

from dispatchd.confine._sys import open_beneath
from dispatchd.daemon.gitguard import lockfile, refvalues

WAIT_S = 1.0  # a lock of the user's git held longer than this: the ref is left, and said
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_PACKED = 64 * 1024 * 1024


class Busy(Exception):
    """``NAME.lock`` is held by another writer (the user's git) past ``WAIT_S``."""


class Held(lockfile.Held):
    """A lock this took: ``NAME.lock`` in the directory ``dir_fd`` (ours,
    closed once the lock is let go or committed)."""

    def __init__(self, name: str, leaf: str, held: lockfile.Held) -> None:
        super().__init__(held.dir_fd, held.lock)
        self.name = name  # the ref's name below the repository ("refs/heads/main", "HEAD", "packed-refs")
        self.leaf = leaf


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
    try:
        # Empty until ``commit`` writes the value. No directory's mode is
        # changed for a restore: one a session made read-only refuses it.
        held = lockfile.take_in(dir_fd, leaf, lockfile.Policy(wait_s, take_over=take_over), lend=False)
    except lockfile.Refused:
        raise Busy(f"{name}.lock") from None
    return Held(name, leaf, held)


def release(held: Held) -> None:
    """The lock given up, the ref as it was."""
    held.release()


def commit(held: Held, data: bytes) -> None:
    """The ref holds ``data``: written into the lock file (durable), renamed
    over the ref (which releases the lock, as git's commit of a lock does)."""
    held.commit(data)


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
