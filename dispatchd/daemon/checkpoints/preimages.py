"""What a worktree held just before a restore, kept past its session.

A restore removes what was made since its checkpoint, and not all of that
is the session's: a file the user wrote by hand beside it (an ``.env``,
notes) is removed too. The restore's ``before`` checkpoint keeps it, but a
session's checkpoints go when it ends. So each ``before`` is also kept here,
as plain files, where the user finds it without the daemon:

    STATE/before-restore/TIME-SESSION-CHECKPOINT/
        about.json    the worktree, the session, the checkpoint restored, when, until when
        worktree/     every file, directory and symlink the worktree held (FIFOs left out)

Guarantees:
- **Complete or absent.** Made under ``.tmp-NAME`` and renamed into place
  (with the policy's ``limits.fsync``, on the disk first) before the restore
  touches the worktree: a daemon killed during the restore leaves it whole.
- **No second copy of the bytes.** A file is a hard link to its copy in the
  session's pool (a file of its own, never the live one: ``store``), so it
  is read-only (0400) and costs a directory entry; it outlives the pool. A
  link refused (another file system, a link count at its limit) is a copy.
- **Nowhere a session looks.** In the daemon's state directory (0700),
  which no sandbox binds. Directories are 0700 here whatever their mode in
  the worktree (one a session made 000 would keep out the user and the sweep).
- **Kept for ``RETENTION_S`` (7 days)**, by time alone: a count would let a
  session push the user's file out by restoring again and again. Swept
  (``sweep``: what is older goes, and what a killed daemon left half made,
  ``.tmp-``, after a day) at the daemon's start, then as new ones are kept
  at most once an hour (``Sweeps``, ``SWEEP_EVERY_S``: a sweep reads every
  kept one's ``about.json``, a restore need not), and whenever the budget
  would refuse one: an expired one never refuses a restore. A sweep that
  cannot list the directory (after its mode is set back: ``statemodes``)
  raises; at the start it is logged and the start goes on.
- **Within one budget, never by eviction.** All of them together stay
  within ``keptsize``'s budget: one that would take them over it is removed
  before it is renamed into place and refused (the restore with it, unless
  forced); nothing kept is removed to make room.
- git's object files are not here (a checkpoint keeps none: the history
  keep does); a restore never removes one, and the refs it moves are kept
  in the repository (``gitguard.keep_moved_refs``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable

import msgspec

from dispatchd import treewalk
from dispatchd.durable import fsync_directory
from dispatchd.protocol import BeforeRestoreReport
from dispatchd.statemodes import retried

from dispatchd.daemon.checkpoints.keptsize import KeptSizes
from dispatchd.daemon.checkpoints.plan import Manifest
from dispatchd.daemon.checkpoints.reading import _copy_path
from dispatchd.daemon.checkpoints.restoring import _syncfs

log = logging.getLogger("dispatchd.checkpoints")

DIR = "before-restore"  # in the daemon's state directory
TREE = "worktree"
ABOUT = "about.json"
RETENTION_S = 7 * 86400
_TMP = ".tmp-"
_TMP_AFTER_S = 86400  # a half-made one older than this was left by a killed daemon
_LINK_REFUSED = (errno.EXDEV, errno.EMLINK, errno.EPERM)
SWEEP_EVERY_S = 3600.0  # as new ones are kept: one expired lingers an hour at most past its 7 days


class About(msgspec.Struct, frozen=True, kw_only=True):
    """``about.json``: what the kept files are."""

    worktree: str
    session: str
    restored: str  # the checkpoint the restore put back
    before: str  # the session's checkpoint of the same files (gone with the session)
    created: float  # seconds since the epoch
    expires: float


class Sweeps:
    """When ``sweep`` runs: ``now`` (the daemon's start; the budget about to
    refuse), else ``if_due`` (a new one kept) when the last sweep is
    ``SWEEP_EVERY_S`` old. ``clock``: monotonic seconds (a test's own)."""

    def __init__(self, kept_dir: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.kept_dir = kept_dir
        self._clock = clock
        self._lock = threading.Lock()  # one sweep at a time; a restore that waited for it finds it done
        self._last: float | None = None  # when the last sweep that listed the directory began

    def now(self) -> list[str]:
        """Swept; the paths removed."""
        with self._lock:
            return self._run()

    def if_due(self) -> list[str]:
        """Swept if the last sweep is an hour old (or none listed the directory yet)."""
        with self._lock:
            if self._last is not None and self._clock() - self._last < SWEEP_EVERY_S:
                return []
            return self._run()

    def _run(self) -> list[str]:
        began = self._clock()
        gone = sweep(self.kept_dir)
        self._last = began
        return gone


def keep(kept_dir: str, top: str, manifest: Manifest, worktree: str, session: str, restored: str,
         fsync: bool = True, sizes: KeptSizes | None = None, sweeps: Sweeps | None = None
         ) -> tuple[str, BeforeRestoreReport | None]:
    """``manifest`` (a ``before`` checkpoint of the session whose pool is in
    ``top``) as plain files under ``kept_dir``; returns its directory and
    the total ``sizes`` admitted with it (None without ``sizes``). Raises
    OSError when it cannot be made, ``Refused`` when it would take what
    ``sizes`` counts over its budget, the expired ones swept first (nothing
    is left of it then). ``sweeps``: the expired ones swept when due."""
    # Made or reached with the modes on its way set back (a session's chmod 000: statemodes.py).
    retried(lambda: os.makedirs(kept_dir, mode=0o700, exist_ok=True), kept_dir, None)
    if sweeps is not None:
        sweeps.if_due()
    now = time.time()
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}-{session}-{manifest.info.id}"
    tmp, final = os.path.join(kept_dir, _TMP + name), os.path.join(kept_dir, name)
    try:
        os.mkdir(tmp, 0o700)
        tree = os.fsencode(os.path.join(tmp, TREE))
        os.mkdir(tree, 0o700)
        for e in sorted(manifest.entries, key=lambda e: e.path):  # parents first
            if not e.path:
                continue
            dst = os.path.join(tree, e.path)
            if e.kind == "d":
                os.mkdir(dst, 0o700)
            elif e.kind == "l":
                os.symlink(e.target, dst)
            elif e.kind == "f" and e.copy >= 0:
                src = os.fsencode(_copy_path(top, e.copy))
                try:
                    os.link(src, dst, follow_symlinks=False)
                except OSError as exc:
                    if exc.errno not in _LINK_REFUSED:
                        raise
                    shutil.copyfile(src, dst, follow_symlinks=False)
                    os.chmod(dst, 0o400)
            # A FIFO holds no bytes (and one would stall a `grep -r` of this directory).
        about = About(worktree=worktree, session=session, restored=restored, before=manifest.info.id,
                      created=now, expires=now + RETENTION_S)
        with open(os.path.join(tmp, ABOUT), "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(about)) + b"\n")
        # Measured as made (directories, links, copies where a link was refused), renamed only if it fits.
        admit: contextlib.AbstractContextManager[BeforeRestoreReport | None] = contextlib.nullcontext()
        if sizes is not None:  # over the budget, the expired ones swept before it refuses
            admit = sizes.admitting(tmp, name, sweeps.now if sweeps is not None else None)
        with admit as total:
            if fsync:
                _syncfs(tmp)  # the links on the disk before the name says they are all there
            os.rename(tmp, final)
        if fsync:
            fsync_directory(kept_dir)
    except BaseException:
        treewalk.remove_tree(tmp)
        raise
    log.info("event=before_restore_kept session=%s checkpoint=%s kept=%s", session, manifest.info.id, final)
    return final, total


def sweep(kept_dir: str, now: float | None = None) -> list[str]:
    """Remove what is older than ``RETENTION_S`` (by its ``about.json``, else
    its directory's mtime), and a half-made one a day old; returns their paths."""
    now = time.time() if now is None else now
    try:
        names = sorted(retried(lambda: os.listdir(kept_dir), kept_dir, None))  # its mode set back (statemodes.py)
    except FileNotFoundError:
        return []
    gone: list[str] = []
    for name in names:
        path = os.path.join(kept_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            continue  # not ours
        if name.startswith(_TMP):
            expired = now - st.st_mtime > _TMP_AFTER_S
        else:
            created = st.st_mtime
            with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
                with open(os.path.join(path, ABOUT), "rb") as f:
                    created = msgspec.json.decode(f.read(1 << 16), type=About).created
            expired = now - created > RETENTION_S
        if expired:
            left = treewalk.remove_tree(path)
            if left.skipped:
                log.warning("event=before_restore_left path=%s why=%r", path, left.describe())
            else:
                log.info("event=before_restore_expired path=%s", path)
                gone.append(path)
    return gone
