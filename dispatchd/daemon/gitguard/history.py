"""A repository's history kept across sessions: the refs the user had, and
every object file, put back when a session deletes or rewinds them.

At a baseline (``record``) the daemon reads the repository's refs (as git
reads them: ``refvalues.py``; no git run) and keeps every object file in
its own state directory (``clones.py``: a reflink clone, a copy of its own
or, for a held pack, a hard link; within a size budget), incrementally.

When the sessions end (``restore``), with their processes gone:
- an object file kept and now missing is put back (a session's ``rm -rf
  .git/objects`` loses nothing); a loose one that a pack index names now
  (git packed it meanwhile: ``packed.py``) is put back too, but not
  reported as deleted by a session; one a session replaced by another file
  is put back, the session's moved aside (``replaced.py``);
- then the refs (``refsback.put_back``): a branch or tag the user had that
  is gone, or no longer leads back to where it was (a fast-forward is kept,
  and said), written back; remote-tracking refs, notes and the stash put
  back however they moved; the branches the sessions had checked out are
  theirs to move (``own``).

An object file rewritten in place (made writable first with ``chmod``) is
found by its ctime and put back from the keep's own bytes
(``replaced.find_rewritten``); a pack the session holds read-only cannot
be; one given a second name is made the repository's own again
(``packlinks.py``). A new pack naming the user's objects at other bytes is
moved aside (``newpacks.py``). The stash list is put back (``stashlog.py``),
and the lines a session cut from the other reflogs (``reflogs.py``,
``reflogsback.py``). What it does not protect: other worktrees' HEADs (the
user's own checkouts there look the same).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import msgspec

from dispatchd import treewalk
from dispatchd.daemon.gitguard import (clones, derived, fs, keepdirs, keeps, leftlocks, newloose, newpacks,
                                       objectdirs, objectstore, packed, packlinks, reflogs, reflogsback, refsback,
                                       reftemp, refvalues, replacerefs, replaced, shadows, shown, stashlog, viewfiles)
from dispatchd.errors import WorktreeError

_log = logging.getLogger("dispatchd.history")

_MAX_OBJECT_FILES = 2_000_000


class History(msgspec.Struct, frozen=True):
    common: str  # the repository's common git directory
    refs: dict[str, str] = {}  # branches and tags at the baseline -> object id
    own: list[str] = []  # branches a session may move (checked out where it works)
    head: str = ""  # the common directory's HEAD, as it was
    keep: str = ""  # where its object files are kept ("" when not kept)
    note: str = ""  # what is not kept, and why
    # Each object directory (fan-out and pack) -> its ctime (ns) at the look,
    # and when the look began: a directory whose ctime is unchanged has the
    # same entries (a session can set an mtime, never a ctime), so only the
    # changed ones, and those changed too close to the look, are listed again.
    stamps: dict[str, int] = {}
    stamped_ns: int = 0
    replaces: dict[str, str] | None = None  # ``git replace`` refs (None: an older record): replacerefs.py
    replaces_packed: list[str] = []
    views: dict[str, str | None] | None = None  # shallow and alternates as they were (viewfiles.py)
    view_stamps: dict[str, list[int] | None] | None = None  # the commit-graph and the like (viewfiles.py)
    pack_links: dict[str, int] | None = None  # each pack file -> its names, the keep's included (packlinks.py)
    shadows: list[str] | None = None  # what stood in front of the refs' short names (shadows.py; None: older)
    stash_log: stashlog.Kept | None = None  # the stash list (stashlog.py; None: not kept, or an older record)
    reflogs: reflogs.Kept | None = None  # the other reflogs (reflogs.py; None: not kept, or an older record)


_RACY_NS = 50_000_000  # a directory changed this close before a look is listed whatever its ctime says
try:  # the coarse clock's tick, which file times follow (1-10 ms); 50 ms where it cannot be asked
    _TICK_NS = max(1_000_000, int(time.clock_getres(5) * 1e9))  # CLOCK_REALTIME_COARSE
except OSError:
    _TICK_NS = _RACY_NS
_STAMPS = ".stamps"  # in a keep: the stamps it was last brought up to date with


def _stamps(objects: str, kept: bool = False) -> dict[str, int]:
    """Each object directory (``objectdirs.is_object_dir``) -> its ctime in
    ns, on every open and close. Each is looked at below a descriptor of
    ``objects`` (no path walked again: a third less time for git's 257
    directories)."""
    try:
        # Never through a symlink: the callers refuse a symlinked objects, and
        # one swapped in after their look is not followed here either.
        opened = keepdirs.open_dir(objects) if kept else os.open(
            objects, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except keepdirs.Unreadable:
        raise
    except OSError:
        return {}
    if opened is None:
        return {}
    fd = opened
    try:
        return objectdirs.ctimes(fd)
    finally:
        os.close(fd)


def _changed(then: dict[str, int], then_ns: int, now: dict[str, int], margin_ns: int = _RACY_NS) -> set[str]:
    """The object directories to list again: new, gone, changed since, or
    changed too close before the look to trust their ctime (``margin_ns``)."""
    if then == now:  # the usual case, compared in C: only the racy ones
        return {d for d, ns in then.items() if not treewalk.settled(ns, then_ns, margin_ns)}
    return {d for d in then.keys() | now.keys()
            if then.get(d) != now.get(d) or not treewalk.settled(then[d], then_ns, margin_ns)}


def _files_in(objects: str, dirs: set[str], kept: bool = False) -> set[str]:
    """The files of ``dirs`` in ``objects``; ``kept``: ``objects`` is a keep,
    whose directories' modes are set back and which raises
    ``keepdirs.Unreadable`` rather than leave one out (what it holds would
    not be put back)."""
    found: set[str] = set()
    for name in dirs:
        try:
            names = keepdirs.listdir(os.path.join(objects, name)) if kept else os.listdir(os.path.join(objects, name))
        except keepdirs.Unreadable:
            raise
        except OSError:
            continue
        found.update(f"{name}/{n}" for n in names if not n.startswith("tmp"))
    return found


def _failed_where(exc: OSError, src: str, folder: str) -> str:
    """Which file putting an object file back failed on, when not its own
    path: its kept copy (read), the directory it goes in (made), another."""
    at = os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes)) else ""
    if not at or at == os.path.join(folder, os.path.basename(src)):
        return ""
    if at == src:
        return f" (its kept copy {src})"
    if folder == at or folder.startswith(at.rstrip("/") + "/"):
        return f" (making the directory {at})"
    return f" (at {at})"


def _said(exc: Exception) -> str:
    """An error as the user reads it: a keep directory's in words, else its repr."""
    return str(exc) if isinstance(exc, keepdirs.Unreadable) else repr(exc)


def borrowed(kept: History) -> list[str]:
    """The object stores the user's ``objects/info/alternates`` named at the
    baseline (a shared clone borrows its history from them): the only ones
    an ancestry or an object is asked of besides the repository's own. Never
    the file as it is now: a session's names its own objects, and the end
    puts the user's back (``viewfiles``), which leaves them unreachable."""
    objects = os.path.join(kept.common, "objects")
    return objectstore.alternates(objects, (kept.views or {}).get("objects/info/alternates"))


def keep_for(keep_dir: str, common: str) -> str:
    """The keep of a repository's object files, under the daemon's ``keep_dir``."""
    return os.path.join(keep_dir, hashlib.sha256(os.fsencode(os.path.realpath(common))).hexdigest()[:16])


def keep_more(objects_fd: int, keep: str, common: str, budget: list[int]) -> set[str]:
    """Add the object files of the ``objects`` directory held by
    ``objects_fd`` that the keep lacks, dropping none (a checkpoint's,
    daemon/checkpoints/: what a session deleted stays kept for the end's
    ``restore``); returns every object file present. Each directory is
    opened below ``objects_fd`` with ``O_NOFOLLOW`` and read through its
    descriptor: a symlink a session planted there leads nowhere. ``budget``:
    bytes it may copy (not clone or link), lowered as it goes; over it,
    OSError EFBIG. Leaves the stamps alone: the next ``record`` lists again
    what changed since its own look, these additions included."""
    present: set[str] = set()
    ways = clones.Ways()
    with keeps.hold(keep, common):
        for name in os.listdir(objects_fd):
            if not objectdirs.is_object_dir(name):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=objects_fd)
            except OSError:
                continue  # not a directory (a symlink included): not git's
            try:
                here = {n for n in os.listdir(fd) if not n.startswith("tmp")}
                present.update(f"{name}/{n}" for n in here)
                kept_dir = os.path.join(keep, name)
                try:
                    kept = set(os.listdir(kept_dir))
                except FileNotFoundError:
                    kept = set()
                missing = sorted(here - kept)
                if missing:
                    os.makedirs(kept_dir, mode=0o700, exist_ok=True)
                for n in missing:
                    try:
                        clones.clone(f"/proc/self/fd/{fd}/{n}", os.path.join(kept_dir, n), budget, ways,
                                     own=True)  # a pack too: a link would count as a second name
                    except (FileNotFoundError, FileExistsError):
                        continue  # gone meanwhile (a repack), or kept meanwhile
            finally:
                os.close(fd)
    return present


def record(common: str, keep: str, own: list[str], held: frozenset[str] | None = None) -> History:
    """Read the refs and bring the keep of the object files up to date.
    ``held``: the pack files the session holds read-only (``layouts.held_packs``;
    None: all of them); the others are kept as copies of their own."""
    try:
        refs = refsback.read_refs(common, whole=True)
    except refsback.OverBound as exc:  # a baseline of part of them: the rest a session could delete for good
        raise WorktreeError(f"{common}: {exc}, more than dispatchd keeps at a baseline; no session opened "
                            "(remove refs you do not need: git branch -D, git tag -d; and empty directories "
                            "below refs/: find .git/refs -type d -empty -delete)", common) from None
    head = refvalues.read_text(os.path.join(common, "HEAD")) or ""  # a branch not UTF-8 named whole
    stashes, unkept = stashlog.read(common)
    checked_out = [f"logs/{head.strip()[5:]}"] if head.startswith("ref: ") else []  # its reflog kept first
    logs, unlogged = reflogs.record(common, keep, refs, checked_out)
    unkept = "; ".join(filter(None, [unkept, unlogged]))
    replacing = replacerefs.read(common)
    objects = os.path.join(common, "objects")
    note = ""
    stamped_ns = time.time_ns()  # before the look: what changes during it counts as racy
    if not fs.is_dir(objects):
        # A symlink (a session's): its target's two-letter directories would be
        # linked into the keep, and put back into the repository from there.
        return History(common=common, refs=refs, own=sorted(set(own)), head=head, keep="",
                       note="; ".join(filter(None, ["object files not kept: objects is not a directory (a symlink?)",
                                                    unkept])), stash_log=stashes, reflogs=logs,
                       replaces=replacing.loose, replaces_packed=replacing.packed, views=viewfiles.read(common),
                       view_stamps=viewfiles.read_stamps(common), shadows=shadows.present(common, list(refs)))
    stamps = _stamps(objects)
    try:
        with keeps.hold(keep, common):  # named, and spared by a sweep while this works
            index = fs.read_small(os.path.join(keep, _STAMPS), 1 << 20)
            try:
                last = msgspec.json.decode(index or "", type=tuple[dict[str, int], int]) if index else ({}, 0)
            except (msgspec.ValidationError, msgspec.DecodeError):
                last = ({}, 0)
            # An older daemon stamped any two-character directory: only git's are looked at.
            last = ({d: ns for d, ns in last[0].items() if objectdirs.is_object_dir(d)}, last[1])
            # Without a record of the last look, every directory is listed.
            dirs = _changed(last[0], last[1], stamps) if last[0] else set(stamps) | set(_stamps(keep, kept=True))
            present = _files_in(objects, dirs)
            kept = _files_in(keep, dirs, kept=True)
            budget = [clones.COPY_BUDGET]
            # A keep an older daemon made hard-linked the loose objects: copies of their own, once.
            clones.own_loose(keep, budget)
            ways = clones.Ways()
            made: set[str] = set()  # each fan-out directory made once, not once a file
            for rel in sorted(r for r in present - kept if clones.git_reads(r)):
                folder = os.path.dirname(rel)
                if folder not in made:
                    os.makedirs(os.path.join(keep, folder), mode=0o700, exist_ok=True)
                    made.add(folder)
                try:
                    clones.clone(os.path.join(objects, rel), os.path.join(keep, rel), budget, ways,
                                 own=clones.is_loose(rel) or (held is not None and rel[5:] not in held))
                except FileNotFoundError:
                    continue  # git removed it meanwhile (a repack)
            if held is not None:  # a pack kept as a link, not held now (past the bound, degraded mode)
                clones.own_unheld(keep, objects, held, budget)
            for rel in kept - present:  # the user's own gc: theirs to drop
                try:
                    os.unlink(os.path.join(keep, rel))
                except OSError:
                    pass
            if not (last[0] == stamps and not dirs):
                # Written only when it says something new: a keep whose stamps
                # are those of the last look, none of them racy then, is as
                # up to date as that look said (the back-to-back open's case).
                tmp = os.path.join(keep, f"{_STAMPS}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    f.write(msgspec.json.encode((stamps, stamped_ns)))
                os.replace(tmp, os.path.join(keep, _STAMPS))
    except OSError as exc:
        note = f"object files not kept: {exc.strerror}"
        keep = ""
    return History(common=common, refs=refs, own=sorted(set(own)), head=head, keep=keep,
                   note="; ".join(filter(None, [note, unkept])), stash_log=stashes, reflogs=logs,
                   stamps=stamps, stamped_ns=stamped_ns, replaces=replacing.loose,
                   replaces_packed=replacing.packed, views=viewfiles.read(common),
                   view_stamps=viewfiles.read_stamps(common), pack_links=packlinks.links(objects),
                   shadows=shadows.present(common, list(refs)))


def own_unheld_packs(histories: list[History], read_only: list[str]) -> None:
    """A session joins a domain holding read-only the pack files among
    ``read_only`` (its layout's: none without a mount namespace, none of a
    repository below its worktree that is not its own): the keep of each of
    the domain's repositories then owns copies of the packs it does not hold
    (``clones.own_unheld``, within the copy budget), so that one it rewrites
    in place can be put back. The session that made a keep may have held
    them all (full mode, on that repository), and linked them."""
    for kept in histories:
        if not kept.keep:
            continue
        try:
            with keeps.hold(kept.keep, kept.common):
                clones.own_unheld(kept.keep, os.path.join(kept.common, "objects"),
                                  packlinks.held_names(read_only, kept.common), [clones.COPY_BUDGET])
        except OSError as exc:  # fail closed: its rewrite of a linked pack could not be undone
            raise WorktreeError(f"{kept.common}: the keep of its object files cannot be made to own its packs "
                                f"({exc.strerror}); no session opened", kept.common) from exc


def restore(history: History, *, in_place: bool = True) -> tuple[list[tuple[str, str]], list[str]]:
    """Put back what the module says; returns ``(path or ref, why)`` for each
    thing put back, and what could not be (with why). ``in_place``: look for
    object files rewritten in place (an ``fstatat`` each), packs given a
    second name and new packs: False only when no session ran a process
    (none was granted the write lock)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    common = history.common
    if not fs.is_dir(common):
        return done, [f"{common}: the repository's git directory is gone"]
    objects = os.path.join(common, "objects")
    # Nothing read or written through a symlink a session left for a directory (shown.py).
    done, failed = shown.clear(common)
    if failed:
        return done, failed
    now_stamps = _stamps(objects)
    dirs = _changed(history.stamps, history.stamped_ns, now_stamps) if history.stamped_ns else set()
    # What a session did shows in a ctime (it began after the baseline's look), but for
    # a change within the coarse clock's tick of it: only those are looked at for FIFOs
    # and replacements, not every one the keep lists again (changed within 50 ms).
    touched = _changed(history.stamps, history.stamped_ns, now_stamps, _TICK_NS) if history.stamped_ns else set()
    moved, bad = shown.after(common, {d for d in touched if d != "pack"}, history.replaces,
                             history.replaces_packed, history.views)
    done += moved
    failed += bad
    # A pack's bitmap or reverse index a session made or changed (git trusts both): aside before
    # the put-back, which then puts a kept one of the user's back.
    try:
        if history.stamped_ns and in_place:
            aside, bad = derived.clear(objects, history.keep, history.stamped_ns,
                                       set(history.pack_links) if history.pack_links is not None else None)
            failed += bad
            if aside:
                dirs.add("pack")
                done.append((objects, f"{len(aside)} pack bitmaps or reverse indexes made or changed by a "
                                      f"session moved aside (git does without them, and writes them again): "
                                      f"{', '.join(os.path.relpath(a, objects) for a in aside[:5])}"
                                      f"{', ...' if len(aside) > 5 else ''}"))
    except Exception as exc:  # noqa: BLE001 - reported; the rest still runs
        failed.append(f"{objects}: the look at pack bitmaps failed: {exc!r}")
    if history.keep:
        os.makedirs(objects, exist_ok=True)
        # First, before anything is put back: a pack a session gave a second name, the repository's own again.
        try:
            if history.pack_links is not None and in_place:
                unshared, bad = packlinks.unshare(objects, history.keep, history.pack_links,
                                                  lambda src, dst, left: clones.clone(src, dst, left, never_link=True),
                                                  clones.COPY_BUDGET)
                failed += bad
                if unshared:
                    done.append((objects, f"{len(unshared)} pack files with more names than at the baseline "
                                          f"(hard links made meanwhile) given an inode of their own "
                                          f"({', '.join(unshared[:3])})"))
        except Exception as exc:  # noqa: BLE001 - reported; the rest still runs
            failed.append(f"{objects}: the look for packs given another name failed: {exc!r}")
        try:
            if not history.stamped_ns:
                dirs = set(_stamps(history.keep, kept=True))
            missing = sorted(_files_in(history.keep, dirs, kept=True) - _files_in(objects, dirs))
        except keepdirs.Unreadable as exc:  # what it holds cannot be put back: said, never passed over
            missing, failed = [], failed + [f"{objects}: {exc}"]
        # A bitmap or reverse index the repository did not have at the baseline is not put back (a
        # checkpoint kept the session's; derived.clear moved it aside, or the session deleted it).
        baseline = history.pack_links or {}
        missing = [rel for rel in missing if not (rel.startswith("pack/") and rel.endswith(derived.DERIVED)
                                                  and rel[5:] not in baseline)]
        by_git = packed.packed_meanwhile(objects, missing, history.keep)
        ways = clones.Ways()
        put: list[str] = []
        made: set[str] = set()
        for rel in missing:
            src = os.path.join(history.keep, rel)
            folder = os.path.join(objects, os.path.dirname(rel))
            try:
                if folder not in made:
                    # A fan-out or pack directory a session replaced by a symlink
                    # goes aside: put back through it, a file landed outside.
                    if os.path.lexists(folder) and not fs.is_dir(folder):
                        fs.move_aside(folder)
                    os.makedirs(folder, exist_ok=True)
                    made.add(folder)
                # A copy of its own (the keep's file never the repository's again), past the budget a link.
                try:
                    clones.clone(src, os.path.join(objects, rel), [clones.COPY_BUDGET], ways, own=True)
                except PermissionError:  # a kept file a session made 000 (degraded mode): readable again, once
                    if not keepdirs.readable_file(src):
                        raise
                    clones.clone(src, os.path.join(objects, rel), [clones.COPY_BUDGET], ways, own=True)
                put.append(rel)
            except OSError as exc:
                failed.append(f"{os.path.join(objects, rel)}: {exc.strerror}" + _failed_where(exc, src, folder))
        deleted = [rel for rel in put if rel not in by_git]
        if deleted:
            done.append((objects, f"{len(deleted)} object files deleted by a session put back"))
        # Another file at a kept name (``mv -f garbage .git/objects/ab/...``): the kept one put back.
        try:
            swapped = replaced.find(objects, history.keep, touched, history.stamped_ns) if history.stamped_ns else []
        except Exception as exc:  # noqa: BLE001 - reported; the refs are still put back below
            swapped, failed = [], failed + [f"{objects}: the look for replaced files failed: {_said(exc)}"]
        # And a kept object file rewritten in place (chmod first): its own ctime tells.
        try:
            if history.stamped_ns and in_place:
                rewritten, lost, cut = replaced.find_rewritten(objects, history.keep, history.stamped_ns, touched)
                swapped += rewritten
                failed += ([f"{objects}: {cut}"] if cut else []) + [
                    f"{os.path.join(objects, rel)}: rewritten in place by a session, and the keep shares its inode "
                    "(kept past the copy budget): it cannot be put back (git fsck names it)" for rel in lost]
        except Exception as exc:  # noqa: BLE001 - reported; the refs are still put back below
            failed.append(f"{objects}: the look for files rewritten in place failed: {_said(exc)}")
        try:  # a new pack naming the user's objects for other bytes (git reads packs first)
            if in_place:
                verified, bad = newpacks.check(objects, history.keep, borrowed(history),
                    set(history.pack_links) if history.pack_links is not None else None)
                fanout = {d for d in touched if d != "pack"}
                loose, bad_loose = newloose.check(objects, history.keep, borrowed(history),
                    sorted(_files_in(objects, fanout) - _files_in(history.keep, fanout, kept=True)))
                done += verified + loose
                failed += bad + bad_loose
        except Exception as exc:  # noqa: BLE001 - reported; the refs are still put back below
            failed.append(f"{objects}: the look at new packs and loose files failed: {exc!r}")
        aside, bad = replaced.put_back(objects, history.keep, swapped,
                                       lambda src, dst: clones.clone(src, dst, [clones.COPY_BUDGET], ways, own=True))
        failed += bad
        if aside:
            done.append((objects, f"{len(aside)} object files a session replaced put back (its files moved aside: "
                                  f"{', '.join(os.path.relpath(a, objects) for a in aside[:5])}"
                                  f"{', ...' if len(aside) > 5 else ''})"))
        if len(deleted) < len(put):
            _log.info("event=history_packed_meanwhile objects=%s count=%d (loose copies put back)", objects,
                      len(put) - len(deleted))
    try:  # the commit-graph and multi-pack indexes, against the objects as they now are: the user's
        moved, bad = viewfiles.restore_stamped(common, history.view_stamps or {})
        done += moved
        failed += bad
    except Exception as exc:  # noqa: BLE001 - reported; the refs are still put back below
        failed.append(f"{common}: the check of the object indexes failed: {exc!r}")
    there = objectstore.finder(objects, borrowed(history))  # whether a value to keep names an object
    moved, bad = refsback.put_back(common, history.refs, history.own, history.head, history.shadows,
                                   borrowed(history), there)
    listed, unlisted = stashlog.put_back(common, history.stash_log, reftemp.stamp(), history.refs.get("refs/stash"),
                                         there)  # once refs/stash is back
    logged, unlogged = reflogsback.put_back(common, history.reflogs)  # once their refs are back
    return (done + moved + listed + logged + leftlocks.said(common, history.stamped_ns),
            failed + bad + unlisted + unlogged)

