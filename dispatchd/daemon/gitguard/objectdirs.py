"""git's object directories: which they are, their ctimes, and the names a
keep of them holds, remembered from one look to the next.

Guarantees:
- an object directory is a fan-out one (``fs.FANOUT``) or ``pack``, looked at
  below a descriptor, never through a symbolic link (``ctimes``);
- ``KeptNames.names`` gives every name the keep's object directories hold
  now (but ``.``- and ``tmp``-names: nothing git keeps), as fresh as a
  listing: a directory's listing is reused only while its ctime is the one
  it was listed with, and was settled when it was listed (treewalk's rule:
  every change of a directory's entries sets its ctime, which no process
  can set back, on the file systems of ``treewalk.FINE_CTIME_FS``;
  elsewhere every directory is listed at every look).

Why remember: the end of a session that ran a command stats the repository
file of every kept object (``replaced.find_rewritten``), and listing the
keep's 256 directories for their names was half of it (9 µs a directory on
ext4: 2.4 ms of 4.9 for 3,000 loose objects; a directory's ctime, 0.26 ms
for all of them). The keep is the daemon's: between two sessions' ends its
directories change only where a record kept new objects. The listings are
in memory only, at most ``MAX_NAMES`` names in all (past it, a keep is
listed whole at each look) and ``MAX_KEEPS`` keeps.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs, keepdirs
from dispatchd.tools import native

MAX_NAMES = 500_000  # remembered in all (about 45 bytes a name)
MAX_KEEPS = 16


def is_object_dir(name: str) -> bool:
    """A directory of ``objects`` whose files are git's objects: a fan-out
    one (``fs.FANOUT``) or ``pack``."""
    return name in fs.FANOUT or name == "pack"


def ctimes(fd: int) -> dict[str, int]:
    """Each object directory below ``fd`` (a symbolic link is not followed,
    and is left out) -> its ctime in ns; by the C helper where it is built
    (``tools/_ctimes.c``: the same entries, 0.41 -> 0.26 ms for 256
    directories)."""
    if native.lines is not None:
        return native.lines.subdir_ctimes(fd, 2, ("pack",))
    return ctimes_below(fd)


def ctimes_below(fd: int) -> dict[str, int]:
    """``ctimes`` in Python: the C helper's twin (tests/unit/test_ctimes.py)."""
    found: dict[str, int] = {}
    for name in os.listdir(fd):
        if is_object_dir(name):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                found[name] = st.st_ctime_ns
    return found


class KeptNames:
    """The names a keep's object directories hold (see the module)."""

    def __init__(self, max_names: int = MAX_NAMES, max_keeps: int = MAX_KEEPS) -> None:
        self.max_names = max_names
        self.max_keeps = max_keeps
        self.listed = 0  # directories listed (not taken from memory), for the tests and the bench
        self._lock = threading.Lock()
        # (device, inode) of a keep -> its directory -> (ctime, "dir/name\0" entries, count)
        self._keeps: OrderedDict[tuple[int, int], dict[str, tuple[int, bytes, int]]] = OrderedDict()
        self._count = 0

    def names(self, keep_fd: int, limit: int, where: str = "") -> tuple[bytes, str]:
        """Every ``dir/name`` of the keep's object directories, each ended by
        a NUL byte; and why not all were given ("": all were): past ``limit``
        names, or a directory of the keep ``where`` that could not be
        listed, even with its mode set back (``keepdirs.open_dir``)."""
        look_ns = time.time_ns()  # before the ctimes: a change after it sets a later one
        st = os.fstat(keep_fd)
        key = (st.st_dev, st.st_ino)
        fine = treewalk.fine_local_ctime(keep_fd, st.st_dev)
        with self._lock:
            known = self._keeps.get(key, {}) if fine else {}  # a device number is given again to another file system
        now: dict[str, tuple[int, bytes, int]] = {}
        parts: list[bytes] = []
        count = 0
        why = ""
        for d, ctime in sorted(ctimes(keep_fd).items()):
            entry = known.get(d)
            if entry is None or entry[0] != ctime:
                listed = self._list(keep_fd, d, where)
                if isinstance(listed, str):
                    why = why or listed
                    continue
                entry = (ctime, listed[0], listed[1])
                if fine and treewalk.settled(ctime, look_ns, treewalk.Listings.SETTLE_NS):
                    now[d] = entry
            else:
                now[d] = entry
            count += entry[2]
            if count > limit:
                why = f"more than {limit} kept object files; not all looked at"
                break
            parts.append(entry[1])
        with self._lock:
            self._count -= _total(self._keeps.pop(key, {}))
            if self._count + _total(now) <= self.max_names:
                self._keeps[key] = now  # the most recent last
                self._count += _total(now)
            while len(self._keeps) > self.max_keeps:
                self._count -= _total(self._keeps.popitem(last=False)[1])
        return b"".join(parts), why

    def _list(self, keep_fd: int, d: str, where: str) -> tuple[bytes, int] | str:
        """Directory ``d``'s names as ``dir/name\\0`` entries, and how many;
        why not when it cannot be listed. Refused (a session's chmod), its
        mode is set back and it is listed once more."""
        self.listed += 1
        try:
            sub = keepdirs.open_dir(os.path.join(where, d), below=keep_fd)  # healed: event=state_mode_repaired
        except keepdirs.Unreadable as exc:
            return str(exc)
        if sub is None:
            return b"", 0  # gone, or not a directory: nothing kept there
        try:
            names = [n for n in os.listdir(sub) if not n.startswith((".", "tmp"))]
        except OSError as exc:
            return str(keepdirs.unreadable(os.path.join(where, d), exc))
        finally:
            os.close(sub)
        prefix = os.fsencode(d) + b"/"
        return b"".join(prefix + os.fsencode(n) + b"\0" for n in names), len(names)


def _total(listed: dict[str, tuple[int, bytes, int]]) -> int:
    return sum(entry[2] for entry in listed.values())
