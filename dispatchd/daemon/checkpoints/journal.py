"""A restore in progress, recorded on disk, and finished at the next start.

A restore rewrites the worktree file by file; a daemon killed half way
(SIGKILL, the OOM killer, power loss) would leave it between two states, and
the checkpoint that could complete it would go with the dead daemon's
sessions. So:

- **Recorded before the worktree is touched.** ``begin`` writes
  ``STATE/checkpoints/SESSION/restoring`` (``Record``: the worktree's path,
  the device and inode of its root, the session, the checkpoint, when the
  restore began, the bounds of its walk and the policy's ``limits.fsync``)
  under a temporary name, fsynced, renamed into place, the directory
  fsynced (with ``limits.fsync``; without it, as durable as the rest of the
  session's checkpoints). The daemon holds an ``flock`` on the record for as
  long as it may still act on it (the session's life): another daemon on the
  same state directory leaves it alone.
- **Removed once the restore is done** (``done``). A restore that fails half
  way (``restore_failed``) leaves it: "restore again" replaces it, and a
  restart finishes it. The session's end removes it with its checkpoints.
- **Finished at the start, before anything serves** (``finish_all``, called
  before the trusted baselines are re-checked and before old checkpoints
  are removed): the restore runs again against the worktree as it is now
  (the plan compares the worktree with the manifest, so a second run
  completes the first), then the record goes.
- **Nothing of the user's lost.** The record holds the repository's refs
  as they were before (``refs``) and where the worktree's files as they
  were are kept (``kept``, ``preimages``): a finish keeps the refs it
  moves as the restore would have (``keep_refs``), under the names the cut
  run used (the record's ``stamp``: a restore finished twice keeps them
  once), and the start's removal of the session's checkpoints leaves
  those files.
- **Never a guess.** It is not finished, and nothing in the worktree is
  removed or written, when: the path is gone, is a symlink, or is another
  directory (another device or inode); the checkpoint's manifest cannot be
  read; a file in the worktree was changed after the restore began and is
  not what the restore wrote (``changed_since``: someone worked there since
  the daemon died). Then the record and the session's checkpoints stay, the
  reason is logged (``event=restore_unfinished``) at every start, and the
  daemon starts anyway. A restore that stops half way while finishing (a
  symlink planted on the way: the no-follow rules of any restore) keeps them
  too.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable

import msgspec

from dispatchd import flocks, recordjson
from dispatchd.daemon import gitguard
from dispatchd.durable import fsync_directory
from dispatchd.errors import CheckpointError
from dispatchd.logtext import Bounded
from dispatchd.policy import Checkpoints as CheckpointPolicy
from dispatchd.tempfiles import TEMP_NAME

from dispatchd.daemon.checkpoints import gitplan, gitrefs
from dispatchd.daemon.checkpoints.plan import Entry, Manifest, _manifest_decoder
from dispatchd.daemon.checkpoints.reading import list_tree
from dispatchd.daemon.checkpoints.restoring import _put_objects, _syncfs, apply_restore, open_root

log = logging.getLogger("dispatchd.checkpoints")

RECORD = "restoring"  # in STATE/checkpoints/SESSION/, beside the manifests ("cNNNN-...") and the pool
_TMP_PREFIX = ".restoring.tmp-"
_VERSION = 1
_STAMP = re.compile(r"[0-9]{8}T[0-9]{6}")  # gitguard.displaced_stamp's shape: a name part, nothing more


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """A restore in progress: which worktree (its path, and the device and
    inode of its root, to recognise it), which session and checkpoint."""

    version: int = _VERSION
    session: str
    checkpoint: str
    worktree: str
    dev: int
    ino: int
    started_ns: int  # before the restore looked at the worktree (for ``changed_since``)
    max_files: int
    max_depth: int
    fsync: bool = True
    pid: int = 0  # the daemon that began it (for the log)
    refs: dict[str, str] = {}  # the repository's refs before (``read_refs``), for ``keep_refs``
    # The object stores its alternates named at the baseline (``Baselines.borrowed``), for ``keep_refs``.
    borrowed: list[str] = []
    kept: str = ""  # where the worktree's files as they were are kept (``preimages``), for the log and status
    # The TIME of the names the moved refs are kept under (refs/dispatchd/displaced/TIME/NAME), chosen
    # once, before anything is kept: a run finished after a death writes the very names the cut run wrote
    # (it removes them first, as made after the checkpoint). "": a record of a daemon before it (a new one).
    stamp: str = ""
    # Whether the restore keeps each value it replaces as it sets the ref, under git's lock (``gitrefs``);
    # False: a record of a daemon before that, whose cut run wrote refs as files: its finish also keeps
    # the refs moved since ``refs`` (``keep_refs``), as that daemon would have.
    refs_under_lock: bool = False


def encode(record: Record) -> bytes:
    """``record`` as its file holds it: ref names that are not UTF-8 kept whole (``dispatchd.recordjson``)."""
    return recordjson.encode(record)


def decode(data: bytes) -> Record:
    """The record in ``data``; ValueError when it is not one this version reads."""
    try:
        record = recordjson.decode(data, Record)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a restore record: {exc}") from exc
    if record.version != _VERSION:
        raise ValueError(f"a restore record of version {record.version}; this daemon reads {_VERSION}")
    if not record.session or "/" in record.session or record.session in (".", ".."):
        raise ValueError(f"a restore record naming no valid session: {record.session!r}")
    if not record.checkpoint or "/" in record.checkpoint or record.checkpoint.startswith("."):
        raise ValueError(f"a restore record naming no valid checkpoint: {record.checkpoint!r}")
    if not os.path.isabs(record.worktree):
        raise ValueError(f"a restore record naming a relative worktree: {record.worktree!r}")
    if record.stamp and not _STAMP.fullmatch(record.stamp):  # it becomes part of a ref's path
        raise ValueError(f"a restore record naming no valid time for its displaced refs: {record.stamp!r}")
    return record


class Outcome(msgspec.Struct, frozen=True):
    """What a start did with one restore a dead daemon left (``status``
    shows it until the daemon stops)."""

    session: str
    worktree: str  # "?" when its record could not be read
    checkpoint: str
    kept: str  # the session's checkpoint directory: kept while the restore is unfinished
    why: str = ""  # why it was not finished; "" once it was
    before: str = ""  # where what the worktree held before the restore is kept (``preimages``), if it is


_MAX_RECORD = 64 * 1024 * 1024  # its refs included (a repository's 100,000 tags fit)


def read_record(fd: int) -> bytes:
    """The whole record ``fd`` holds (from its start), at most ``_MAX_RECORD`` bytes."""
    parts: list[bytes] = []
    at = 0
    while at < _MAX_RECORD:
        chunk = os.pread(fd, min(1 << 20, _MAX_RECORD - at), at)
        if not chunk:
            break
        parts.append(chunk)
        at += len(chunk)
    return b"".join(parts)


def _common(worktree: str) -> str | None:
    """The repository at the worktree's root (``.git``, a directory: what a
    checkpoint keeps and a restore writes back), or None."""
    common = os.path.join(worktree, ".git")
    try:
        return common if stat.S_ISDIR(os.lstat(common).st_mode) else None
    except OSError:
        return None


def read_refs(worktree: str) -> dict[str, str]:
    """The refs of the repository at the worktree's root before a restore
    (``gitguard.read_all_refs``): what ``keep_refs`` compares with after."""
    common = _common(worktree)
    if common is None:
        return {}
    try:
        return gitguard.read_all_refs(common)
    except OSError as exc:
        log.warning("event=restore_refs_unread worktree=%s error=%s", worktree, exc)
        return {}


def keep_refs(worktree: str, refs: dict[str, str], session: str, borrowed: list[str], stamp: str = "") -> list[str]:
    """After a restore: each ref of ``refs`` it deleted or moved other than
    forward kept under ``refs/dispatchd/displaced/STAMP/`` (``gitguard.keep_moved_refs``,
    as the end keeps a session's moves: forward as the repository's objects
    and the baseline's alternates, ``borrowed``, tell; ``stamp`` "": now);
    the names written."""
    common = _common(worktree)
    if common is None or not refs:
        return []
    kept, failed = gitguard.keep_moved_refs(common, refs, borrowed, stamp)
    said = Bounded()  # a session can make thousands of refs: the log keeps the first few and the count
    for name in kept:
        said.say(log, "event=restore_ref_kept session=%s worktree=%s ref=%s", session, worktree, name)
    said.end(log, "refs kept, not logged one by one; the restore's reply lists them (displaced)")
    for why in failed:
        log.error("event=restore_ref_not_kept session=%s worktree=%s why=%r", session, worktree, why)
    return kept


def log_refs(session: str, worktree: str, done: gitrefs.RefsDone) -> None:
    """The refs a restore kept (a few and the count) and each it left, logged."""
    said = Bounded()
    for name in done.kept:
        said.say(log, "event=restore_ref_kept session=%s worktree=%s ref=%s", session, worktree, name)
    said.end(log, "refs kept, not logged one by one; the restore's reply lists them (displaced)")
    left = Bounded()
    for why in done.left:
        left.say(log, "event=restore_ref_left session=%s worktree=%s why=%r", session, worktree, why)
    left.end(log, "refs left, not logged one by one; the restore's reply lists them (not_restored)")


def recognise(record: Record, st: os.stat_result) -> str | None:
    """None when ``st`` (the worktree path's ``lstat``) is the worktree the
    record names; else why not."""
    if stat.S_ISLNK(st.st_mode):
        return "the worktree's path is now a symlink (not followed)"
    if not stat.S_ISDIR(st.st_mode):
        return "the worktree's path is no longer a directory"
    if (st.st_dev, st.st_ino) != (record.dev, record.ino):
        return (f"another directory is at the worktree's path (device {st.st_dev} inode {st.st_ino}, "
                f"the restore began on device {record.dev} inode {record.ino})")
    return None


def _looks_restored(h: Entry, w: Entry) -> bool:
    """Whether ``h`` (now) is what a restore writes for ``w`` (saved): the
    same kind and, for a file, size, mtime (a restore sets it) and mode."""
    if h.kind != w.kind:
        return False
    if h.kind == "f":
        return h.size == w.size and h.mtime_ns == w.mtime_ns and h.mode == w.mode
    if h.kind == "l":
        return h.target == w.target
    return h.mode == w.mode


_OUR_LOCK = re.compile(rb"(.+)\.dispatchd-[0-9a-f]{16}\.lock", re.DOTALL)  # ournames' shape, by path


def changed_since(saved: list[Entry], now: list[Entry], started_ns: int) -> list[bytes]:
    """Names (not directories) changed after ``started_ns`` that are not what
    the restore writes: someone else's work since, which finishing the
    restore would overwrite or delete. A directory's ctime moves when the
    restore adds or removes in it, so directories are judged by what they
    hold; the restore's own temporary files (``tempfiles`` names) and a
    killed daemon's locks of git's files (its ``.dispatchd-<hex>.lock``
    temporaries and the ``NAME.lock`` beside one) are not someone's work."""
    want = {e.path: e for e in saved}
    found: list[bytes] = []
    # The killed daemon's own locks of git's files: its temporaries
    # (``NAME.dispatchd-<hex>.lock``) and the ``NAME.lock`` beside one,
    # which the finished restore takes over (two names) or leaves (one).
    ours = {m.group(1) for h in now if (m := _OUR_LOCK.fullmatch(h.path))}
    for h in now:
        if h.kind == "d" or h.ctime_ns < started_ns:
            continue
        if not gitplan.by_files(h):
            # Refs (set under git's lock, the value replaced kept), the kept values, reflogs
            # (appended to), other worktrees' state (never written): no one's work is lost there.
            continue
        if TEMP_NAME.match(h.path.rpartition(b"/")[2]):
            continue
        if _OUR_LOCK.fullmatch(h.path) or h.path.endswith(b".lock") and h.path[:-5] in ours:
            continue
        w = want.get(h.path)
        if w is None or not _looks_restored(h, w):
            found.append(h.path)
    return sorted(found)


# --- on disk -------------------------------------------------------------------


def begin(top: str, record: Record) -> int:
    """Write ``record`` as ``top/restoring`` (replacing one a failed restore
    left): temporary name, fsync, rename, fsync of the directory (with the
    record's ``fsync``). Returns the descriptor holding its ``flock``."""
    tmp = os.path.join(top, f"{_TMP_PREFIX}{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held before anyone can see the name
        data = encode(record)
        os.write(fd, data)
        if record.fsync:
            os.fsync(fd)
        os.rename(tmp, os.path.join(top, RECORD))
        if record.fsync:
            fsync_directory(top)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def done(top: str, fd: int, sync: Callable[[str], None] | None) -> None:
    """The restore is complete: its record goes (if it is still the one
    ``fd`` holds), then its lock; ``sync`` (with ``limits.fsync``) makes the
    removal durable, perhaps after the reply (``afterwards.fsync_dir``): a
    machine that crashes before brings the record back, and the next start
    finds the worktree restored already (or changed since: then kept)."""
    try:
        path = os.path.join(top, RECORD)
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path, follow_symlinks=False)
            mine = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
                if sync is not None:
                    sync(top)
    finally:
        os.close(fd)


def _take(path: str) -> int | None:
    """The record at ``path``, locked; None when a live daemon holds it or it
    went meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.stat(path, follow_symlinks=False)  # still the record: not one removed while we waited
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            raise FileNotFoundError(path)
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def pending(root: str) -> list[str]:
    """Sessions under ``root`` (``STATE/checkpoints``) with a restore record."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [n for n in names if os.path.lexists(os.path.join(root, n, RECORD))]


Hold = Callable[[str, str], Callable[[], None] | str]


def finish_all(root: str, hold: Hold | None = None) -> list[Outcome]:
    """At the daemon's start, before anything serves: every restore a dead
    daemon left is finished, its record removed. Returns what became of
    each (a reason logged for each left unfinished). Never raises for a
    record: a worktree's state never stops a daemon. ``hold(session,
    worktree)``: the worktree claimed from the user's other daemons while the restore runs (a release to call after), or why not
    (another daemon's session uses it: the record is kept for the next
    start, as for any worktree changed since)."""
    outcomes: list[Outcome] = []
    for sid in pending(root):
        top = os.path.join(root, sid)
        try:
            fd = _take(os.path.join(top, RECORD))
        except OSError as exc:
            outcomes.append(_unfinished(top, None, f"the record cannot be opened: {exc.strerror}"))
            continue
        if fd is None:
            continue  # a live daemon's restore, or already gone
        held: Callable[[], None] | str | None = None
        if hold is not None:
            try:
                peek = decode(read_record(fd))
            except (OSError, ValueError):
                pass  # _finish says why
            else:
                held = hold(peek.session, peek.worktree)
                if isinstance(held, str):
                    os.close(fd)
                    outcomes.append(_unfinished(top, peek, held))
                    continue
        try:
            outcomes.append(_finish(top, fd))
        except Exception as exc:  # noqa: BLE001 (logged; the start goes on)
            outcomes.append(_unfinished(top, None, f"unexpected: {exc!r}"))
        finally:
            if callable(held):
                held()
    return outcomes


def _finish(top: str, fd: int) -> Outcome:
    """The restore ``fd``'s record names, run again: done and its record
    removed, or why not (logged)."""
    try:
        try:
            record = decode(read_record(fd))
        except (OSError, ValueError) as exc:
            return _unfinished(top, None, f"the record cannot be read: {exc}")
        t0 = time.monotonic()
        log.warning("event=restore_resume session=%s checkpoint=%s worktree=%s pid=%s", record.session,
                    record.checkpoint, record.worktree, record.pid)
        try:
            st = os.lstat(record.worktree)
        except FileNotFoundError:
            return _unfinished(top, record, "the worktree is gone")
        except OSError as exc:
            return _unfinished(top, record, f"the worktree cannot be looked at: {exc.strerror}")
        why = recognise(record, st)
        if why is not None:
            return _unfinished(top, record, why)
        try:
            with open(os.path.join(top, record.checkpoint), "rb") as f:
                manifest: Manifest = _manifest_decoder.decode(f.read())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _unfinished(top, record, f"the checkpoint's manifest cannot be read: {exc}")
        policy = CheckpointPolicy(max_files=record.max_files, max_depth=record.max_depth)
        ident = (record.dev, record.ino)
        root_fd = -1
        try:
            # Listed through a descriptor proven to be the recorded worktree,
            # as the restore below is applied: the plan is made from the very
            # directory it is carried out in, not from one swapped in meanwhile.
            root_fd = open_root(record.worktree, ident)
            now, _ = list_tree(record.worktree, policy, "restore", root_fd=root_fd)
            later = changed_since(manifest.entries, now, record.started_ns)
            later += [n.encode("utf-8", "surrogateescape") for n in gitrefs.moved_since(record.worktree, ident, top,
                                                                                           manifest, record.refs)]
            if later:
                more = f" and {len(later) - 1} more" if len(later) > 1 else ""
                return _unfinished(top, record, f"{os.fsdecode(later[0])}{more} changed after the restore began "
                                   "(not by it): finishing it would overwrite that work")
            # The same guards as any restore: each directory opened below the
            # worktree's descriptor, no symlink followed (ELOOP stops it).
            if recognise(record, os.lstat(record.worktree)) is not None:
                return _unfinished(top, record, "the worktree's path changed while it was compared")
            plan = gitplan.plan_files(manifest.entries, now)
            done_ = apply_restore(record.worktree, top, plan, fsync_each=False, expect=ident)
            done_["objects"] = _put_objects(record.worktree, manifest, ident) if manifest.objects else 0
            # At a start: no session runs, so a lock with two names is a killed restore's (reflock.take).
            moved = gitrefs.restore_from(record.worktree, ident, top, manifest, now, record.stamp or
                                         gitguard.displaced_stamp(), record.borrowed, take_over=True)
            log_refs(record.session, record.worktree, moved)
            displaced = moved.kept
            if not record.refs_under_lock:
                displaced += keep_refs(record.worktree, record.refs, record.session, record.borrowed, record.stamp)
            if record.fsync:
                _syncfs(record.worktree)
        except CheckpointError as exc:
            return _unfinished(top, record, exc.message)
        except OSError as exc:
            return _unfinished(top, record, f"{exc.filename or 'the worktree'}: {exc.strerror}")
        finally:
            if root_fd >= 0:
                os.close(root_fd)
        path = os.path.join(top, RECORD)
        os.unlink(path)
        if record.fsync:
            with contextlib.suppress(OSError):
                fsync_directory(top)
        log.warning("event=restore_finished session=%s checkpoint=%s worktree=%s removed=%s written=%s made=%s "
                    "objects=%s displaced=%s before=%s seconds=%.2f", record.session, record.checkpoint,
                    record.worktree, done_["removed"], done_["written"], done_["made"], done_["objects"],
                    len(displaced), record.kept or "-", time.monotonic() - t0)
        return Outcome(record.session, record.worktree, record.checkpoint, top, before=record.kept)
    finally:
        os.close(fd)


def _unfinished(top: str, record: Record | None, why: str) -> Outcome:
    """Logged loudly; the record and the session's checkpoints stay (the
    start's removal of old checkpoints spares them), and the next start
    tries again."""
    log.error("event=restore_unfinished session=%s checkpoint=%s worktree=%s why=%r kept=%s "
              "(the worktree is left as it is; the next start tries again; remove the kept directory to give up)",
              record.session if record else os.path.basename(top), record.checkpoint if record else "?",
              record.worktree if record else "?", why, top)
    return Outcome(record.session if record else os.path.basename(top), record.worktree if record else "?",
                   record.checkpoint if record else "?", top, why, before=record.kept if record else "")


def kept(top: str) -> bool:
    """Whether ``top`` (a session's checkpoints) holds a restore record: kept at the start."""
    return os.path.lexists(os.path.join(top, RECORD))


def live(locks_dir: str, sid: str) -> bool:
    """Whether a live daemon holds session ``sid``'s lock (``leftovers.ScratchLocks``)."""
    return flocks.held(os.path.join(locks_dir, f"{sid}.lock"))
