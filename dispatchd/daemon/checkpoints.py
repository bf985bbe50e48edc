"""Checkpoints of a session's worktree, and restoring one (daemon side).

A checkpoint keeps the worktree's files (contents, modes, symlinks as
symlinks, FIFOs) and its git metadata: everything below the worktree,
``.git`` included. A restore puts the worktree back as it was: files changed
since are written back, deleted ones come back, ones created after are
removed, modes and symlinks as they were.

Guarantees:
- **State outside the sandbox.** Checkpoints live in the daemon's state
  directory (``STATE/checkpoints/SESSION/ID``), which no session can see.
- **Complete or absent.** A checkpoint is its manifest, written under a
  temporary name and renamed into place once the copies it names are
  written (and, with the policy's ``limits.fsync``, on the disk); a daemon
  killed half way leaves copies no manifest names and a temporary file,
  removed at the next start (``Store.__init__``). Checkpoints belong to
  their session: they go when it ends, and at the daemon's start (its
  sessions died with it).
- **Only what changed is copied.** The copies are a pool per session: a
  file unchanged since the previous checkpoint (same inode, size, mtime and
  ctime, and not changed within ``RACY_NS`` before that checkpoint began: a
  session can set an mtime, never a ctime) shares that checkpoint's copy,
  at no cost per file; never the live file (a later write would change it
  in place). A new copy is a reflink clone (``FICLONE``: btrfs, XFS) where
  the file system clones, else a copy. A copy goes when the last
  checkpoint that names it goes (``keep``).
- **Git objects by the history keep.** The repository's object files
  (``.git/objects``) are not copied here: they go to the keep the trusted
  baseline already holds (``gitguard.keep_more``, the same reflink / hard
  link / copy, add-only), and a restore puts back, from there, those the
  checkpoint listed and that are gone. Object files made after the
  checkpoint stay (unreachable, git's gc drops them): nothing is lost.
- **Bounded.** The walk is ``treewalk.walk`` (iterative, by descriptor);
  over the policy's ``[checkpoints]`` ``max_files``, ``max_depth`` or
  ``max_bytes`` (bytes copied, not cloned or linked) the checkpoint is
  refused, naming the budget; a directory it cannot read refuses it too
  (a checkpoint that misses files would delete them at a restore).
- **No symlink followed in the worktree.** A restore opens each directory
  below the worktree's descriptor with ``openat2(RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS)`` (``_sys.open_beneath``) and acts relative to it:
  a symlink a session planted (``src -> ~/.ssh``) is removed as a link,
  never written through. Files are written under a temporary name and
  renamed over their place.
- **Quiet sessions only.** The caller pauses the session's tool server first
  (``Pause``: calls that come meanwhile wait); a restore is refused while a
  call is in flight or while a process of the session runs (a background
  job, a process a command left), a checkpoint while a call is in flight.
- **The baseline still rules.** A restore writes ``.git`` like any session
  could; the checks at the session's end compare with the trusted baseline
  taken at open (``baselines.py``), so what a restore brings back that the
  baseline would refuse is moved aside then, as if the session had written it.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

from dispatchd import protocol, treewalk
from dispatchd.confine._sys import open_beneath
from dispatchd.daemon import gitguard
from dispatchd.errors import CheckpointError, SessionError
from dispatchd.policy import Checkpoints as CheckpointPolicy
from dispatchd.protocol import CheckpointInfo
from dispatchd.tempfiles import temp_name

from dispatchd.daemon.lifecycle import Op, State, Verdict
from dispatchd.daemon.session import Session, count_session_processes

log = logging.getLogger("dispatchd.checkpoints")


class SessionManager(Protocol):
    """What a checkpoint asks of the daemon's sessions (``table.SessionTable``)."""

    @property
    def checkpoints(self) -> Store: ...
    def get(self, sid: str) -> Session: ...
    def _admit(self, session: Session, op: Op) -> Verdict: ...
    def _grant_write_lock(self, session: Session, rid: int) -> protocol.OkReply | protocol.ErrorReply: ...

RACY_NS = 50_000_000  # a file changed this close before a checkpoint began is copied again
_FICLONE = 0x40049409
_POOL = "pool"  # the session's copies, each shared by every checkpoint it is unchanged in
_FANOUT = 4096  # copies per directory of the pool
_FSYNC_EACH = 256  # up to this many files copied or written: an fsync each; more: one syncfs
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OBJECTS = b".git/objects"  # the repository's object files: kept by gitguard's history, not here
_TMP = ".tmp-"

Kind = Literal["f", "d", "l", "p"]


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One name below the worktree (``path`` relative, ``/``-separated, b"" the
    root), as a checkpoint saw it or as it is now."""

    path: bytes
    kind: Kind  # file, directory, symlink, FIFO
    mode: int = 0  # permission bits
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    dev: int = 0
    ino: int = 0
    target: bytes = b""  # a symlink's
    copy: int = -1  # a file's copy in the session's pool (pool/N//FANOUT/N), -1: none


class Manifest(msgspec.Struct, frozen=True):
    info: CheckpointInfo
    started_ns: int  # when its walk began (for RACY_NS)
    entries: list[Entry]
    objects: list[str] = []  # the repository's object files ("ab/cdef...", "pack/..."), kept by gitguard's history
    keep: str = ""  # where they are kept


_manifest_decoder = msgspec.msgpack.Decoder(Manifest)


# --- pure plans ---------------------------------------------------------------


def _same_file(a: Entry, b: Entry) -> bool:
    return (a.kind == b.kind == "f" and a.dev == b.dev and a.ino == b.ino and a.size == b.size
            and a.mtime_ns == b.mtime_ns and a.ctime_ns == b.ctime_ns)


def plan_copies(now: list[Entry], previous: Manifest | None) -> dict[bytes, int]:
    """For each file of ``now`` unchanged since ``previous``: its copy there
    (to hard-link). The others are cloned or copied from the worktree."""
    if previous is None:
        return {}
    before = {e.path: e for e in previous.entries if e.kind == "f" and e.copy >= 0}
    links: dict[bytes, int] = {}
    for e in now:
        old = before.get(e.path)
        if old is not None and e.kind == "f" and _same_file(e, old) and previous.started_ns - e.ctime_ns >= RACY_NS:
            links[e.path] = old.copy
    return links


@dataclass
class RestorePlan:
    """What a restore does, in order: remove (a directory with what it holds),
    make directories (parents first), write files, links and FIFOs, then set
    directory modes (children first: a read-only one is set last)."""

    remove: list[Entry] = field(default_factory=list)
    make: list[Entry] = field(default_factory=list)
    write: list[Entry] = field(default_factory=list)
    modes: list[Entry] = field(default_factory=list)


def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


def plan_restore(saved: list[Entry], now: list[Entry]) -> RestorePlan:
    """From what the checkpoint saw and what is there now. A name whose kind
    changed is removed and made again; a file whose identity changed
    (``_same_file``) is written again; a symlink whose target changed too."""
    plan = RestorePlan()
    want = {e.path: e for e in saved}
    have = {e.path: e for e in now}
    removed: set[bytes] = set()

    def inside_removed(path: bytes) -> bool:
        p = path
        while p:
            if p in removed:
                return True
            p = _parent(p)
        return False

    for e in sorted(now, key=lambda e: e.path):  # parents first
        if e.path == b"" or inside_removed(_parent(e.path)):
            continue  # the root stays; what a removed directory holds goes with it
        w = want.get(e.path)
        if w is None or w.kind != e.kind:
            plan.remove.append(e)
            removed.add(e.path)

    for w in sorted(saved, key=lambda e: e.path):
        h = have.get(w.path)
        fresh = h is None or h.kind != w.kind or inside_removed(w.path)
        if w.kind == "d":
            if fresh and w.path != b"":
                plan.make.append(w)
            if fresh or h is None or h.mode != w.mode:
                plan.modes.append(w)
        elif w.kind == "f":
            if fresh or h is None or not _same_file(h, w) or h.mode != w.mode:
                plan.write.append(w)
        elif w.kind == "l":
            if fresh or h is None or h.target != w.target:
                plan.write.append(w)
        elif fresh or h is None or h.mode != w.mode:
            plan.write.append(w)
    plan.modes.sort(key=lambda e: e.path, reverse=True)
    return plan


# --- walking the worktree -------------------------------------------------------


def _entry(path: bytes, st: os.stat_result, target: bytes = b"") -> Entry | None:
    mode = st.st_mode
    kind: Kind
    if stat.S_ISREG(mode):
        kind = "f"
    elif stat.S_ISDIR(mode):
        kind = "d"
    elif stat.S_ISLNK(mode):
        kind = "l"
    elif stat.S_ISFIFO(mode):
        kind = "p"
    else:
        return None  # sockets, devices: neither kept nor removed
    return Entry(path=path, kind=kind, mode=stat.S_IMODE(mode), size=st.st_size if kind == "f" else 0,
                 mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, dev=st.st_dev, ino=st.st_ino, target=target)


def Refused(message: str) -> CheckpointError:  # noqa: N802 (reads as the error it makes)
    return CheckpointError(message, "checkpoint_refused")


def _budget_words(what: str) -> str:
    return f"the policy's [checkpoints] {what}"


def _is_object_dir(name: bytes) -> bool:
    """A directory of ``.git/objects`` that holds object files (``ab``, ``pack``)."""
    return name == b"pack" or (len(name) == 2 and all(c in b"0123456789abcdef" for c in name))


def list_tree(root: str, policy: CheckpointPolicy, verb: str = "checkpoint") -> tuple[list[Entry], bool]:
    """Every entry below ``root``, but the object files of the repository at
    its root (``.git/objects/ab/...``, ``.git/objects/pack/...``: kept by
    gitguard's history, never removed); and whether that repository's ``objects``
    is a directory. Refused (``verb`` says what) over the policy's budgets,
    or when a directory cannot be read."""
    budget = treewalk.Budget(max_entries=policy.max_files, max_depth=policy.max_depth)
    entries: list[Entry] = []
    paths: dict[int, bytes] = {}  # descriptors the walk yielded -> their path (valid while open)
    expected: list[bytes] = []
    seen: set[bytes] = set()
    root_b = os.fsencode(root)

    def prune(name: bytes, fd: int) -> bool:
        if paths[fd] == _OBJECTS and _is_object_dir(name):
            return True
        expected.append(paths[fd] + b"/" + name if paths[fd] else name)
        return False

    for dirpath, files, fd in treewalk.walk(root, budget, prune):
        rel = os.path.relpath(dirpath, root_b) if dirpath != root_b else b""
        rel = b"" if rel == b"." else rel
        paths[fd] = rel
        seen.add(rel)
        made = _entry(rel, os.fstat(fd))
        if made is not None:
            entries.append(made)
        for name in files:
            path = rel + b"/" + name if rel else name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                target = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else b""
            except FileNotFoundError:
                continue
            made = _entry(path, st, os.fsencode(target) if isinstance(target, str) else target)
            if made is not None:
                entries.append(made)
    if budget.over:
        raise Refused(f"{verb} refused: the worktree has more than {policy.max_files} entries "
                      f"({_budget_words('max_files')})")
    if any("levels" in s for s in budget.skipped):
        raise Refused(f"{verb} refused: the worktree is deeper than {policy.max_depth} levels "
                      f"({_budget_words('max_depth')})")
    missed = [p for p in expected if p not in seen]
    if missed:
        why = "a checkpoint without it would delete it at a restore" if verb == "checkpoint" else \
            "what it holds cannot be compared; make it readable"
        raise Refused(f"{verb} refused: {os.fsdecode(missed[0])}: a directory that cannot be read ({why})")
    return entries, _OBJECTS in seen


# --- copying ---------------------------------------------------------------------


def _copy_path(top: str, n: int) -> str:
    """Copy ``n`` in the pool of the session whose checkpoints are in ``top``."""
    return os.path.join(top, _POOL, str(n // _FANOUT), str(n))


def _clone_fd(src: int, dst: int, size: int, budget: list[int]) -> bool:
    """``dst`` as ``src``'s contents; True when it was cloned (no byte copied)."""
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return True
    except OSError:
        pass
    if size > budget[0]:
        raise OSError(errno.EFBIG, "over the copy budget")
    budget[0] -= size
    offset = 0
    while offset < size:  # no further: a file that grows meanwhile is kept as it was when looked at
        n = os.copy_file_range(src, dst, min(size - offset, 1 << 30), offset, offset)
        if n == 0:
            break  # it shrank meanwhile
        offset += n
    return False


def reflinks(store: str, worktree: str) -> bool:
    """Whether copies between ``worktree`` and ``store`` are reflink clones:
    the same file system, and one that clones (probed in ``store``)."""
    try:
        if os.stat(store).st_dev != os.stat(worktree).st_dev:
            return False
        a = os.open(store, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        os.write(a, b"x")
        b = os.open(store, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.ioctl(b, _FICLONE, a)
            return True
        except OSError:
            return False
        finally:
            os.close(b)
    finally:
        os.close(a)


def _open_readable(name: bytes, dir_fd: int) -> int:
    """Open a worktree file to read it, without following a symlink; a file
    the session made unreadable gets its owner's read right for the open and
    its mode back after (it is the user's, so the daemon's)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            mode = stat.S_IMODE(os.fstat(pfd).st_mode)
            os.chmod(f"/proc/self/fd/{pfd}", mode | stat.S_IRUSR)
            try:
                return os.open(f"/proc/self/fd/{pfd}", flags & ~os.O_NOFOLLOW)
            finally:
                os.chmod(f"/proc/self/fd/{pfd}", mode)
        finally:
            os.close(pfd)


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


class Store:
    """Every session's checkpoints, under ``STATE/checkpoints``."""

    def __init__(self, state_dir: str, keep_dir: str) -> None:
        self.root = os.path.join(state_dir, "checkpoints")
        self.keep_dir = keep_dir
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self.pauses = Pauses()
        # Checkpoints of a daemon that died belong to sessions that died with
        # it; one half made is absent by construction (a temporary name).
        if os.path.isdir(self.root):
            left = treewalk.remove_tree(self.root)
            if left.skipped:
                log.warning("event=checkpoints_left why=%r", left.describe())
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _of(self, sid: str) -> _Session:
        with self._lock:
            return self._sessions.setdefault(sid, _Session())

    def lock(self, sid: str) -> threading.Lock:
        return self._of(sid).lock

    def infos(self, sid: str) -> list[CheckpointInfo]:
        with self._lock:
            s = self._sessions.get(sid)
            return list(s.infos) if s else []

    def drop(self, sid: str) -> None:
        """The session ended: its checkpoints go (waits for one being taken)."""
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            return
        with s.lock:
            with self._lock:
                self._sessions.pop(sid, None)
            treewalk.remove_tree(os.path.join(self.root, sid))

    # --- take --------------------------------------------------------------------

    def take(self, sid: str, worktree: str, policy: CheckpointPolicy, label: str = "", fsync: bool = True
             ) -> CheckpointInfo:
        """A checkpoint of ``worktree`` now; the caller holds ``lock(sid)`` and
        has paused the session. Refused (``Refused``) over a budget. With
        ``fsync`` (the policy's ``limits.fsync``) it is on the disk when this
        returns, not only complete for the daemon."""
        s = self._of(sid)
        started_ns = time.time_ns()
        entries, has_objects = list_tree(worktree, policy)
        previous = s.last
        shared = plan_copies(entries, previous)
        s.count += 1
        cid = f"c{s.count:04d}-{secrets.token_hex(4)}"
        top = os.path.join(self.root, sid)
        os.makedirs(os.path.join(top, _POOL), mode=0o700, exist_ok=True)
        made: list[int] = []  # copies this checkpoint added to the pool
        to_copy = sum(1 for e in entries if e.kind == "f") - len(shared)
        # Many copies: one syncfs at the end; a few: an fsync each (a syncfs
        # would also flush what everyone else has written on that file system).
        each = fsync and to_copy <= _FSYNC_EACH
        try:
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
                _fsync_dir(top)
        except BaseException as exc:
            for n in made:
                with contextlib.suppress(OSError):
                    os.unlink(_copy_path(top, n))
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(top, f"{_TMP}{cid}"))
            if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
                raise Refused(f"checkpoint refused: it would copy more than {_mib(policy.max_bytes)} "
                              f"({_budget_words('max_bytes')}; reflink clones and links are not counted)") from exc
            raise
        named = array.array("q", sorted({e.copy for e in out if e.copy >= 0}))
        with self._lock:
            s.infos.append(info)
            s.last = manifest
            s.copies[cid] = named
            s.refs.update(named)
        if len(s.infos) > policy.keep:
            self._forget_oldest(s, top, len(s.infos) - policy.keep)
        log.info("event=checkpoint session=%s checkpoint=%s entries=%s copied=%s copied_bytes=%s objects=%s",
                 sid, cid, info.entries, len(made), info.copied_bytes, info.objects)
        return info

    def _forget_oldest(self, s: _Session, top: str, n: int) -> None:
        """The ``n`` oldest checkpoints go, and the copies no other one names."""
        with self._lock:
            gone, s.infos = s.infos[:n], s.infos[n:]
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
                keep = gitguard.keep_for(self.keep_dir, os.path.join(worktree, ".git"))
                ofd = open_beneath(root_fd, os.fsdecode(_OBJECTS), _DIR)
                try:
                    objects = gitguard.keep_more(ofd, keep, budget)
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

    def restore(self, sid: str, worktree: str, cid: str, policy: CheckpointPolicy, fsync: bool = True
                ) -> dict[str, int]:
        """Put ``worktree`` back as checkpoint ``cid`` saw it; the caller holds
        ``lock(sid)`` and has made sure nothing of the session runs."""
        manifest = self.find(sid, cid)
        now, _ = list_tree(worktree, policy, "restore")
        plan = plan_restore(manifest.entries, now)
        each = fsync and len(plan.write) <= _FSYNC_EACH
        done = apply_restore(worktree, os.path.join(self.root, sid), plan, fsync_each=each)
        done["objects"] = _put_objects(worktree, manifest) if manifest.objects else 0
        if fsync and (not each or done["objects"] or plan.remove or plan.make):
            _syncfs(worktree)
        log.info("event=checkpoint_restored session=%s checkpoint=%s removed=%s written=%s made=%s objects=%s",
                 sid, cid, done["removed"], done["written"], done["made"], done["objects"])
        return done


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


def apply_restore(worktree: str, top: str, plan: RestorePlan, fsync_each: bool = False) -> dict[str, int]:
    """Carry out ``plan`` in ``worktree`` (see ``_Dirs``: by descriptor, no
    symlink followed)."""
    root_fd = os.open(worktree, _DIR)
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
        why = "a symlink on the way (not followed)" if exc.errno == errno.ELOOP else exc.strerror
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


def _put_objects(worktree: str, manifest: Manifest) -> int:
    """The object files the checkpoint listed and that are gone, from the keep."""
    root_fd = os.open(worktree, _DIR)
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
                    src = os.open(os.path.join(manifest.keep, d, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
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


def _is_dir_at(fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, _DIR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


# --- the session's side: pause it, check it is quiet, answer requests -------------

_PAUSE_TIMEOUT_S = 10.0


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


@contextlib.contextmanager
def _quiet(manager: SessionManager, session: Session, verb: str) -> Iterator[None]:
    """The session held still for a checkpoint or a restore (``verb``): its
    lock held (no close, network switch, wake or attach meanwhile), its tool
    server paused (calls that come wait), nothing in flight; for a restore,
    no process of the session either. Refused otherwise, saying what runs."""
    with session.lock:
        manager._admit(session, Op.CHECKPOINT)  # closing or closed: refused, as any request is
        control = session.control
        if session.state is State.ASLEEP or control is None:
            if verb == "restore":
                _take_write_lock(manager, session)
            yield  # asleep: no process of it runs, and none starts while we hold its lock
            return
        rid, done, answer = manager.checkpoints.pauses.ask()
        try:
            with session.send_lock:
                control.send(protocol.Pause(id=rid))
        except OSError as exc:
            manager.checkpoints.pauses.forget(rid)
            raise SessionError(f"session {session.id} has ended", session.id) from exc
        if not done.wait(_PAUSE_TIMEOUT_S):
            manager.checkpoints.pauses.forget(rid)
            raise CheckpointError(f"{verb} refused: session {session.id}'s tool server did not answer within "
                                  f"{_PAUSE_TIMEOUT_S:g} s; try again", "session_busy")
        if answer[0].busy:
            raise CheckpointError(f"{verb} refused: session {session.id} has {answer[0].busy}; wait for it to "
                                  f"return (or end it: session.cancel()) and {verb} again", "session_busy")
        try:
            if verb == "restore":
                _take_write_lock(manager, session)
                running = _processes(session)
                if running:
                    raise CheckpointError(
                        f"restore refused: session {session.id} has {running} process(es) running (a background "
                        "job, or a process a command left); they could write into the worktree while it is "
                        "restored: stop them (job_stop) and restore again", "session_busy")
            yield
        finally:
            try:
                with session.send_lock:
                    control.send(protocol.Resume())
            except OSError:
                pass  # the worker is gone: nothing waits


def _take_write_lock(manager: SessionManager, session: Session) -> None:
    """A restore writes the worktree: only a session that may write it, and
    holds (or now takes) its write lock, one writer per worktree."""
    if session.policy.filesystem.worktree == "read-only":
        raise CheckpointError(f"restore refused: session {session.id}'s policy ({session.policy.name}) keeps the "
                              "worktree read-only", "checkpoint_refused")
    reply = manager._grant_write_lock(session, 0)
    if isinstance(reply, protocol.ErrorReply):
        raise CheckpointError(f"restore refused: {reply.message}", reply.code)


def _processes(session: Session) -> int:
    return count_session_processes(session)


def handle(manager: SessionManager, req: protocol.TakeCheckpoint | protocol.ListCheckpoints
           | protocol.RestoreCheckpoint) -> protocol.CheckpointReply | protocol.CheckpointsReply | protocol.RestoredReply:
    """The daemon's answer to a client's checkpoint request (``server.py``)."""
    session = manager.get(req.session)
    store = manager.checkpoints
    if isinstance(req, protocol.ListCheckpoints):
        return protocol.CheckpointsReply(id=req.id, checkpoints=store.infos(session.id))
    policy = session.policy.checkpoints
    if isinstance(req, protocol.TakeCheckpoint):
        with _quiet(manager, session, "checkpoint"), store.lock(session.id):
            info = store.take(session.id, session.worktree, policy, req.label, fsync=session.policy.limits.fsync)
        return protocol.CheckpointReply(id=req.id, checkpoint=info)
    store.find(session.id, req.checkpoint)  # an unknown id is refused before anything is paused
    with _quiet(manager, session, "restore"), store.lock(session.id):
        done = store.restore(session.id, session.worktree, req.checkpoint, policy, fsync=session.policy.limits.fsync)
    return protocol.RestoredReply(id=req.id, checkpoint=req.checkpoint, **done)


def before_write(manager: SessionManager, session: Session, msg: protocol.AcquireWriteLock,
                 control: protocol.FrameSocket) -> None:
    """Policy ``[checkpoints] before_writes``: the write lock, then a
    checkpoint labelled with the tool, then the answer; on a thread of its own
    (the session's control channel is read meanwhile). A checkpoint refused
    refuses the call: the user asked for none to run without one."""
    def run() -> None:
        reply: protocol.OkReply | protocol.ErrorReply = manager._grant_write_lock(session, msg.id)
        if isinstance(reply, protocol.OkReply):
            try:
                with manager.checkpoints.lock(session.id):
                    manager.checkpoints.take(session.id, session.worktree, session.policy.checkpoints,
                                             f"before {msg.tool}" if msg.tool else "before a write",
                                             fsync=session.policy.limits.fsync)
            except (CheckpointError, OSError) as exc:
                why = exc.message if isinstance(exc, CheckpointError) else f"checkpoint failed: {exc}"
                reply = protocol.ErrorReply(id=msg.id, code="checkpoint_refused",
                                            message=f"{why} (the policy takes one before every write)")
        try:
            with session.send_lock:
                control.send(reply)
        except OSError:
            pass  # the session ended meanwhile

    threading.Thread(target=run, daemon=True, name="checkpoint").start()
