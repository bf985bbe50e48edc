"""The daemon's own temporaries beside git's files, and how it tells them
(and a killed daemon's) from anyone else's files.

A ref or a kept file is written through a temporary of ours
(``NAME.dispatchd-<16 hex>.lock``, ``reftemp``), which a lock of git's
shares as its second name while it is taken (``lockfile``): a lock found
with two names was a killed daemon's, taken over, swept at the start, and
not named as one left by a session. Neither a link nor a name is proof: a
session can give a lock of the user's running git a second name of that
shape (``ln .git/index.lock .git/index.dispatchd-0123456789abcdef.lock``),
or one it saw a daemon use (an inotify watch on ``refs/heads`` while a
restore wrote there), and the start's sweep then removed the lock of a
``git commit`` whose editor was open. So every temporary the daemon makes is
written down, with its device, inode and path, in a journal of the state
directory (``STATE/temporaries/run-*.log``; no session reaches it):

- ``plan`` (the path, before the temporary is made: a death between its
  making and its ``note`` leaves a file only its path tells as ours),
  ``note`` (before the temporary can get a second name) and ``forget``
  (once its name is gone: removed, or renamed over the file it wrote);
  a plain append, no fsync: a daemon's death loses nothing written (the
  page cache outlives it), and a machine's crash at worst leaves a leftover
  unrecognised, which is then left as the user's (and named by the end);
- ``ours(name, st)``: whether the file ``name`` (a leaf), of ``st``'s
  device and inode, is a temporary of this daemon's or of a killed one's;
- ``use(state_dir)``: at the start, the journals of daemons that are gone
  (their flock free) read, the entries whose file is still there at its
  path with its inode kept (written into this run's journal), and the
  planned paths never noted whose file is there as it was made (a regular
  file of ours, empty, of one name: nothing was written to it, and no
  second name can make a lock of someone else's of it), the rest and the
  old journals dropped; this run's journal flocked for its life.
  Until it is called (a tool of the test suite), this process's own
  temporaries alone are its.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import stat
import threading

_SHAPE = re.compile(r"(.+)\.dispatchd-[0-9a-f]{16}\.lock")
_JOURNALS = "temporaries"
_MAX_JOURNAL = 16 << 20  # a dead run's journal read at most this far (a run writes ~100 bytes a temporary)

_lock = threading.Lock()
_known: dict[tuple[int, int], str] = {}  # (device, inode) -> the temporary's leaf: this run's and dead runs'
_planned: set[str] = set()  # the paths planned and not yet noted nor given up (the journal is kept while any is)
_journal = -1  # this run's journal, appended to (-1: none, outside a daemon)


def make(path: str) -> str:
    """A temporary name beside ``path`` for writing it (nobody can guess it)."""
    return f"{path}.dispatchd-{secrets.token_hex(8)}.lock"


def shaped(name: str) -> str | None:
    """The file ``name`` would be a temporary of, by its shape alone (None: not that shape)."""
    m = _SHAPE.fullmatch(name)
    return m.group(1) if m else None


def plan(dir_fd: int, leaf: str) -> str:
    """The temporary ``leaf``, about to be made in ``dir_fd`` (``O_EXCL``),
    written down by its path, which is returned for ``note`` or ``unplan``."""
    try:
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), leaf)
    except OSError:
        path = leaf  # no path to find it by again: a leftover of it is left as the user's
    with _lock:
        _planned.add(path)
        if _journal >= 0 and os.path.isabs(path):
            _append(f"? {os.fsencode(path).hex()}\n")
    return path


def unplan(path: str) -> None:
    """The temporary planned at ``path`` was not made."""
    with _lock:
        _planned.discard(path)
        if _journal >= 0 and os.path.isabs(path):
            _append(f"x {os.fsencode(path).hex()}\n")


def note(path: str, st: os.stat_result) -> None:
    """The temporary at ``path`` (``plan``'s) just made (``st``: its ``fstat``) written down as ours."""
    key = (st.st_dev, st.st_ino)
    with _lock:
        _planned.discard(path)
        _known[key] = os.path.basename(path)
        if _journal >= 0:
            _append(f"+ {key[0]} {key[1]} {os.fsencode(path).hex()}\n")


def forget(key: tuple[int, int]) -> None:
    """The temporary of ``key`` (device, inode) is gone by that name (removed,
    or renamed over what it wrote): its inode, once free, may be anyone's."""
    with _lock:
        if _known.pop(key, None) is not None and _journal >= 0:
            if _known or _planned:
                _append(f"- {key[0]} {key[1]}\n")
            else:  # nothing of ours left: the journal starts again (a loop of closes grew it 776 KB each)
                try:
                    os.ftruncate(_journal, 0)
                except OSError:
                    _append(f"- {key[0]} {key[1]}\n")


def ours(name: str, st: os.stat_result) -> bool:
    """Whether ``name`` (a leaf, of ``st``) is a temporary this daemon or a killed one made."""
    with _lock:
        return _known.get((st.st_dev, st.st_ino)) == name


def known(st: os.stat_result) -> bool:
    """Whether ``st``'s inode is a temporary's this daemon or a killed one
    made, by whatever name (a lock's second name: ``NAME.lock``)."""
    with _lock:
        return (st.st_dev, st.st_ino) in _known


def _append(line: str) -> None:
    try:
        os.write(_journal, line.encode("ascii"))
    except OSError:
        pass  # a full disk: the temporary is still known to this run; a leftover of it is left as the user's


def use(state_dir: str) -> None:
    """This run's journal in ``state_dir``, the killed runs' leftovers taken
    from theirs (see the module). Raises OSError where the directory cannot
    be written."""
    global _journal
    where = os.path.join(state_dir, _JOURNALS)
    os.makedirs(where, mode=0o700, exist_ok=True)
    dead: dict[tuple[int, int], tuple[str, str]] = {}  # (device, inode) -> (leaf, path)
    planned: set[str] = set()  # paths planned and never noted
    gone: list[str] = []
    for name in sorted(os.listdir(where)):
        if not name.endswith(".log"):
            continue
        try:
            fd = os.open(os.path.join(where, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live daemon's (another on this state directory)
            _replay(os.read(fd, _MAX_JOURNAL), dead, planned)
            gone.append(name)
        finally:
            os.close(fd)
    journal = os.open(os.path.join(where, f"run-{os.getpid()}-{secrets.token_hex(4)}.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(journal, fcntl.LOCK_EX)  # held for this run's life: its journal is no dead run's
    with _lock:
        if _journal >= 0:
            os.close(_journal)
        _journal = journal
        for key, (leaf, path) in dead.items():
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == key:  # still there, the very file: a leftover of ours
                _known[key] = leaf
                _append(f"+ {key[0]} {key[1]} {os.fsencode(path).hex()}\n")
        for path in planned:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            # As O_EXCL made it and nothing since: no write (empty), no second name (one), ours.
            if stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_nlink == 1 and st.st_uid == os.getuid():
                _known[(st.st_dev, st.st_ino)] = os.path.basename(path)
                _append(f"+ {st.st_dev} {st.st_ino} {os.fsencode(path).hex()}\n")
    for name in gone:
        try:
            os.unlink(os.path.join(where, name))
        except OSError:
            pass


def _replay(data: bytes, into: dict[tuple[int, int], tuple[str, str]], planned: set[str]) -> None:
    """A journal's lines, in order, into ``into``: each ``+`` adds, each ``-``
    removes; into ``planned``, each ``?`` adds, the ``+`` or ``x`` of its path removes."""
    for line in data.decode("ascii", "replace").splitlines():
        parts = line.split(" ")
        try:
            if parts[0] in ("?", "x") and len(parts) == 2:
                path = os.fsdecode(bytes.fromhex(parts[1]))
                if parts[0] == "?":
                    planned.add(path)
                else:
                    planned.discard(path)
                continue
            key = (int(parts[1]), int(parts[2]))
            if parts[0] == "+" and len(parts) == 4:
                path = os.fsdecode(bytes.fromhex(parts[3]))
                into[key] = (os.path.basename(path), path)
                planned.discard(path)
            elif parts[0] == "-":
                into.pop(key, None)
        except (IndexError, ValueError):
            continue  # a line cut by the death: its temporary is left as the user's
