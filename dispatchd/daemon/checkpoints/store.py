"""The checkpoints of the daemon's sessions on disk: ``Store`` takes,
lists, keeps and restores them, a manifest renamed into place once what it
names is written (complete or absent), and removes what a killed daemon left.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import itertools
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from dispatchd import protocol, treewalk
from dispatchd.durable import fsync_directory
from dispatchd.confine._sys import open_beneath
from dispatchd.daemon import gitguard, leftovers
from dispatchd.errors import CheckpointError, SessionError
from dispatchd.policy import Checkpoints as CheckpointPolicy
from dispatchd.protocol import CheckpointInfo

from dispatchd.daemon.checkpoints import gitplan, gitrefs, journal, keptsize, preimages
from dispatchd.daemon.checkpoints.plan import Entry, Manifest, _DIR, _FANOUT, _FSYNC_EACH, _OBJECTS, _POOL, _TMP, _manifest_decoder, _parent, plan_copies
from dispatchd.daemon.checkpoints.reading import Refused, _budget_words, _clone_fd, _copy_path, _entry, _open_readable, list_tree
from dispatchd.daemon.checkpoints.restoring import (_mib, _put_objects, _syncfs, apply_restore,
                                                    fsync_dirs)

log = logging.getLogger("dispatchd.checkpoints")
_DROPPED_KEPT = 4096  # ended sessions remembered (Store.drop): far more than end within a checkpoint's time


@dataclass
class _Session:
    """A session's checkpoints: its store and one operation at a time."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    # Its checkpoints, oldest first. Only the newest manifest stays in memory
    # (the next checkpoint shares its copies); the others are read from their
    # files when restored, so the daemon holds a few MiB per session, not keep x that.
    infos: list[CheckpointInfo] = field(default_factory=list)
    last: Manifest | None = None
    copies: dict[str, array.array[int]] = field(default_factory=dict)  # checkpoint -> the copies it names
    refs: collections.Counter[int] = field(default_factory=collections.Counter)  # copy -> checkpoints naming it
    count: int = 0
    next_copy: int = 0  # the number of the pool's next copy
    record_fd: int = -1  # the lock of a restore record a failed restore left (``journal``), held while it lives
    record_cid: str = ""  # the checkpoint it names


class Store:
    """Every session's checkpoints, under ``STATE/checkpoints``."""

    def __init__(self, state_dir: str, keep_dir: str) -> None:
        self.root = os.path.join(state_dir, "checkpoints")
        self.keep_dir = keep_dir
        # What restores replaced, kept past their sessions (``preimages``); the expired swept now,
        # then hourly as restores keep more (and when the budget would refuse one).
        self.before_dir = os.path.join(state_dir, preimages.DIR)
        self.sweeps = preimages.Sweeps(self.before_dir)
        try:
            self.sweeps.now()
        except OSError as exc:  # a sweep never stops a start: what it could not look at waits for the next
            log.error("event=before_restore_not_swept path=%s error=%r", self.before_dir, str(exc))
        self.kept_sizes = keptsize.KeptSizes(self.before_dir)  # their total, within one budget
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        # Sessions dropped, the most recent last: a checkpoint asked before
        # the end (policy before_writes, on a thread of its own) that comes
        # after it finds its session gone, rather than making its store anew
        # (a whole copy of the worktree left until the next start).
        self._dropped: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.pauses = Pauses()
        # Where a done restore's record removal is made durable: at once, or
        # after the reply (the daemon's ``afterwards.later``).
        self.later: Callable[[Callable[[], None]], None] = lambda job: job()
        # Checkpoints of a daemon that died belong to sessions that died with
        # it; one half made is absent by construction (a temporary name). Spared:
        # a session's whose restore could not be finished (``journal``: kept,
        # and tried again at the next start), and a live daemon's sessions on
        # the same state directory (their lock is held: ``leftovers``).
        locks = leftovers.locks_dir(os.path.join(state_dir, "sessions"))
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            names = []
        for name in names:
            top = os.path.join(self.root, name)
            if journal.kept(top) or journal.live(locks, name):
                continue
            left = treewalk.remove_tree(top)
            if left.skipped:
                log.warning("event=checkpoints_left why=%r", left.describe())
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _of(self, sid: str) -> _Session:
        with self._lock:
            if sid in self._dropped:
                raise SessionError(f"session {sid} has ended: its checkpoints are gone", sid)
            return self._sessions.setdefault(sid, _Session())

    def lock(self, sid: str) -> threading.Lock:
        return self._of(sid).lock

    def infos(self, sid: str) -> list[CheckpointInfo]:
        with self._lock:
            s = self._sessions.get(sid)
            return list(s.infos) if s else []

    def drop(self, sid: str) -> None:
        """The session ended: its checkpoints go (waits for one being taken),
        and none is taken for it after this."""
        with self._lock:
            s = self._sessions.get(sid)
            self._dropped[sid] = None
            while len(self._dropped) > _DROPPED_KEPT:
                self._dropped.popitem(last=False)
        if s is None:
            return
        with s.lock:
            with self._lock:
                self._sessions.pop(sid, None)
            # A restore record a failed restore left goes too: the session that
            # was told "restore again" is gone, and finishing it at a later start
            # could overwrite what was written since.
            treewalk.remove_tree(os.path.join(self.root, sid))
            if s.record_fd >= 0:
                os.close(s.record_fd)
                s.record_fd = -1

    # --- take --------------------------------------------------------------------

    def take(self, sid: str, worktree: str, policy: CheckpointPolicy, label: str = "", fsync: bool = True,
             spare: str = "") -> CheckpointInfo:
        """A checkpoint of ``worktree`` now; the caller holds ``lock(sid)`` and
        has paused the session. Refused (``Refused``) over a budget. With
        ``fsync`` (the policy's ``limits.fsync``) it is on the disk when this
        returns, not only complete for the daemon. ``spare``: a checkpoint
        the policy's ``keep`` does not forget to make room (a restore's)."""
        s = self._of(sid)
        started_ns = time.time_ns()
        entries, has_objects = list_tree(worktree, policy)
        previous = s.last
        shared = plan_copies(entries, previous)
        s.count += 1
        cid = f"c{s.count:04d}-{secrets.token_hex(4)}"
        top = os.path.join(self.root, sid)
        made: list[int] = []  # copies this checkpoint added to the pool
        to_copy = sum(1 for e in entries if e.kind == "f") - len(shared)
        # Many copies: one syncfs at the end; a few: an fsync each (a syncfs
        # would also flush what everyone else has written on that file system).
        each = fsync and to_copy <= _FSYNC_EACH
        try:
            os.makedirs(top, mode=0o700, exist_ok=True)  # each level its own mode: makedirs gives 0700 to the last alone
            os.makedirs(os.path.join(top, _POOL), mode=0o700, exist_ok=True)
            budget = [policy.max_bytes]
            out, objects, keep = self._fill(s, top, worktree, entries, shared, made, budget, has_objects, each)
            info = CheckpointInfo(id=cid, created=time.time(), label=label, entries=len(out),
                                  copied_bytes=policy.max_bytes - budget[0], objects=len(objects))
            manifest = Manifest(info=info, started_ns=started_ns, entries=out, objects=sorted(objects), keep=keep)
            if fsync and not each:
                _syncfs(top)  # the copies reach the disk before the manifest says they are there
            tmp = os.path.join(top, f"{_TMP}{cid}")
            with open(tmp, "wb") as f:
                f.write(msgspec.msgpack.encode(manifest))
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.rename(tmp, os.path.join(top, cid))  # complete from here; absent before
            if fsync:
                fsync_directory(top)
        except BaseException as exc:
            for n in made:
                with contextlib.suppress(OSError):
                    os.unlink(_copy_path(top, n))
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(top, f"{_TMP}{cid}"))
            if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
                raise Refused(f"checkpoint refused: it would copy more than {_mib(policy.max_bytes)} "
                              f"({_budget_words('max_bytes')}; reflink clones and links are not counted)") from exc
            if isinstance(exc, OSError):  # a full disk above all: a refusal that says so, not an internal error
                raise Refused(f"checkpoint refused: {_failed_at(exc, top)}; what it had copied is removed, "
                              "the worktree is untouched") from exc
            raise
        named = array.array("q", sorted({e.copy for e in out if e.copy >= 0}))
        with self._lock:
            s.infos.append(info)
            s.last = manifest
            s.copies[cid] = named
            s.refs.update(named)
        if len(s.infos) > policy.keep:
            self._forget_oldest(s, top, len(s.infos) - policy.keep, spare)
        log.info("event=checkpoint session=%s checkpoint=%s entries=%s copied=%s copied_bytes=%s objects=%s",
                 sid, cid, info.entries, len(made), info.copied_bytes, info.objects)
        return info

    def _forget_oldest(self, s: _Session, top: str, n: int, spare: str = "") -> None:
        """The ``n`` oldest checkpoints go (never ``spare``), and the copies no other one names."""
        with self._lock:
            # Never the one a restore record names (a failed restore's): its
            # manifest and copies stay while the record may be finished.
            named = s.record_cid if s.record_fd >= 0 else ""
            gone = [i for i in s.infos[:-1] if i.id not in (named, spare)][:n]  # never the newest (the next one shares it)
            s.infos = [i for i in s.infos if i not in gone]
        for info in gone:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(top, info.id))
            for copy in s.copies.pop(info.id, array.array("q")):
                s.refs[copy] -= 1
                if s.refs[copy] <= 0:
                    del s.refs[copy]
                    with contextlib.suppress(OSError):
                        os.unlink(_copy_path(top, copy))

    def _fill(self, s: _Session, top: str, worktree: str, entries: list[Entry], shared: dict[bytes, int],
              made: list[int], budget: list[int], has_objects: bool, fsync_each: bool
              ) -> tuple[list[Entry], set[str], str]:
        """The entries as kept: each file's copy, shared with the previous
        checkpoint (unchanged) or new in the pool (cloned or copied)."""
        out: list[Entry] = []
        root_fd = os.open(worktree, _DIR)
        objects: set[str] = set()
        keep = ""
        try:
            parent_fd, parent = root_fd, b""
            for e in entries:
                if e.kind != "f":
                    out.append(e)
                    continue
                old = shared.get(e.path)
                if old is not None:
                    out.append(msgspec.structs.replace(e, copy=old))
                    continue
                d = _parent(e.path)
                if d != parent:
                    if parent_fd != root_fd:
                        os.close(parent_fd)
                    parent_fd = open_beneath(root_fd, os.fsdecode(d), _DIR) if d else root_fd
                    parent = d
                try:
                    src = _open_readable(e.path.rpartition(b"/")[2], parent_fd)
                except FileNotFoundError:
                    continue  # gone since the listing (a process of the session): absent from this checkpoint
                try:
                    st = os.fstat(src)
                    if not stat.S_ISREG(st.st_mode):
                        continue  # replaced meanwhile by something else: not a file of this checkpoint
                    n = s.next_copy
                    s.next_copy += 1
                    if n % _FANOUT == 0 or n == 0 or not made:
                        os.makedirs(os.path.dirname(_copy_path(top, n)), mode=0o700, exist_ok=True)
                    dfd = os.open(_copy_path(top, n), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
                    made.append(n)
                    try:
                        _clone_fd(src, dfd, st.st_size, budget)
                        if fsync_each:
                            os.fsync(dfd)
                    finally:
                        os.close(dfd)
                    # As it was copied: a change during the copy is caught next time by its ctime.
                    found = _entry(e.path, st)
                    assert found is not None
                    out.append(msgspec.structs.replace(found, copy=n))
                finally:
                    os.close(src)
            if parent_fd != root_fd:
                os.close(parent_fd)
            if has_objects:
                common = os.path.join(worktree, ".git")
                keep = gitguard.keep_for(self.keep_dir, common)
                ofd = open_beneath(root_fd, os.fsdecode(_OBJECTS), _DIR)
                try:
                    objects = gitguard.keep_more(ofd, keep, common, budget)
                finally:
                    os.close(ofd)
        finally:
            os.close(root_fd)
        return out, objects, keep

    # --- restore -----------------------------------------------------------------

    def find(self, sid: str, cid: str) -> Manifest:
        """Checkpoint ``cid`` of session ``sid``, its manifest read from its file."""
        with self._lock:
            s = self._sessions.get(sid)
            known = [i.id for i in s.infos] if s else []
            last = s.last if s else None
        if cid not in known:
            raise CheckpointError(f"no such checkpoint: {cid!r} (session {sid} has: {', '.join(known) or 'none'})",
                                  "unknown_checkpoint")
        if last is not None and last.info.id == cid:
            return last
        with open(os.path.join(self.root, sid, cid), "rb") as f:
            return _manifest_decoder.decode(f.read())

    def keep_before(self, sid: str, worktree: str, before: str, restored: str, fsync: bool = True
                    ) -> tuple[str, protocol.BeforeRestoreReport | None]:
        """Checkpoint ``before`` (what the worktree holds as the restore of
        ``restored`` begins) kept as plain files past the session
        (``preimages``); returns its directory and the total kept there with
        it (for the reply). Refused (``Refused``) when it
        cannot be made or would take all that is kept there over its budget
        (``keptsize``): the restore then loses nothing, it does not run."""
        manifest = self.find(sid, before)
        try:
            return preimages.keep(self.before_dir, os.path.join(self.root, sid), manifest, worktree, sid, restored,
                                  fsync, self.kept_sizes, self.sweeps)
        except OSError as exc:
            raise Refused(f"checkpoint refused: it could not be kept past the session in {self.before_dir} "
                          f"({exc.strerror})") from exc

    def restore(self, sid: str, worktree: str, cid: str, policy: CheckpointPolicy, fsync: bool = True,
                kept: str = "", borrowed: list[str] | None = None, before: str = ""
                ) -> tuple[dict[str, int], list[str], list[str]]:
        """Put ``worktree`` back as checkpoint ``cid`` saw it; the caller holds
        ``lock(sid)`` and has made sure nothing of the session runs. ``kept``:
        where what it holds now is kept (``keep_before``), for the record
        and for a restore that stops half way to name; ``before``: the
        checkpoint of it (a restore that stops names it when it is not kept);
        ``borrowed``: the object stores the repository's alternates named at
        its baseline (``Baselines.borrowed``), where a moved ref's ancestry is
        asked too.
        Returns what it changed, the refs it kept in the repository at
        ``.git`` (the values it replaced: ``gitrefs``) and the refs it left
        as they are, each with why (another worktree's branch, a lock the
        user's git held)."""
        manifest = self.find(sid, cid)
        started_ns = time.time_ns()
        refs = journal.read_refs(worktree)  # before anything moves (the record's; each is read again under its lock)
        now, _ = list_tree(worktree, policy, "restore")
        plan = gitplan.plan_files(manifest.entries, now)
        each = fsync and len(plan.write) <= _FSYNC_EACH
        top = os.path.join(self.root, sid)
        # On disk before the worktree is touched: a daemon killed from here on
        # leaves it, and the next start finishes the restore (``journal``).
        root = os.stat(worktree)
        record = journal.Record(session=sid, checkpoint=cid, worktree=worktree, dev=root.st_dev, ino=root.st_ino,
                                started_ns=started_ns, max_files=policy.max_files, max_depth=policy.max_depth,
                                fsync=fsync, pid=os.getpid(), refs=refs, kept=kept,
                                borrowed=borrowed or [], stamp=gitguard.displaced_stamp(), refs_under_lock=True)
        s = self._of(sid)
        try:
            fd = journal.begin(top, record)
        except OSError as exc:  # nothing touched yet: refused, saying why
            raise CheckpointError(f"restore refused: its record could not be written in {top}: {exc.strerror} "
                                  "(a restore cut short could not be finished without it)", "restore_failed") from exc
        if s.record_fd >= 0:
            os.close(s.record_fd)  # the one a failed restore left: replaced by the rename
        s.record_fd, s.record_cid = fd, cid
        # A failure from here leaves the record (and its lock, held while the
        # session lives): "restore again" replaces it, a restart finishes it.
        ident = (root.st_dev, root.st_ino)  # the directory the record names, and no other
        try:
            done = apply_restore(worktree, top, plan, fsync_each=each, expect=ident)
            done["objects"] = _put_objects(worktree, manifest, ident) if manifest.objects else 0
            moved = gitrefs.restore_from(worktree, ident, top, manifest, now, record.stamp, borrowed or [])
            journal.log_refs(sid, worktree, moved)
            if fsync and (not each or done["objects"] or plan.remove or plan.make or moved.moved):
                _syncfs(worktree)
            elif fsync and plan.write:
                # Each file was fsynced; their renames too before the record goes.
                fsync_dirs(worktree, {_parent(e.path) for e in plan.write})
        except (CheckpointError, OSError) as exc:  # stopped half way: where what was there is, said
            said = exc.message if isinstance(exc, CheckpointError) else (
                f"restore stopped half way: {_failed_at(exc, worktree)}; the worktree is partly restored: restore again")
            raise CheckpointError(f"{said}; {_before_words(kept, before)}", "restore_failed") from exc
        s.record_fd = -1
        journal.done(top, fd, self._sync_removal if fsync else None)
        log.info("event=checkpoint_restored session=%s checkpoint=%s removed=%s written=%s made=%s objects=%s "
                 "displaced=%s left=%s", sid, cid, done["removed"], done["written"], done["made"], done["objects"],
                 len(moved.kept), len(moved.left))
        return done, moved.kept, moved.left


    def _sync_removal(self, top: str) -> None:
        def run() -> None:
            with contextlib.suppress(FileNotFoundError):  # the session ended meanwhile: its directory went
                fsync_directory(top)
        self.later(run)


def _failed_at(exc: OSError, where: str) -> str:
    """``PATH: why (ENAME)`` of an error on the way: its own path, else ``where``."""
    path = os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes)) else where
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{path}: {exc.strerror or exc}" + (f" ({name})" if name else "")


def _before_words(kept: str, before: str) -> str:
    """Where what a worktree held as a restore began is, for a restore that stopped half way."""
    if kept:
        return f"what it held before this restore is kept in {kept}"
    if before:
        return f"what it held before this restore is checkpoint {before} of this session (restore it to undo)"
    return "what it held before this restore was not kept (force)"


class Pauses:
    """Pause requests sent to workers and their answers (``Paused``), by id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list[protocol.Paused]]] = {}

    def ask(self) -> tuple[int, threading.Event, list[protocol.Paused]]:
        rid = next(self._ids)
        waiting: tuple[threading.Event, list[protocol.Paused]] = (threading.Event(), [])
        with self._lock:
            self._waiting[rid] = waiting
        return rid, *waiting

    def forget(self, rid: int) -> None:
        with self._lock:
            self._waiting.pop(rid, None)

    def answer(self, msg: protocol.Paused) -> None:
        """From the session's control channel (``SessionManager._watch``)."""
        with self._lock:
            waiting = self._waiting.pop(msg.id, None)
        if waiting is not None:
            waiting[1].append(msg)
            waiting[0].set()
