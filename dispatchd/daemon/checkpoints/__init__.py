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
- **A restore cut short is finished.** A restore is recorded on disk before
  it touches the worktree and the record goes once it is done; a daemon
  killed half way leaves it, and the next start finishes the restore before
  it serves, or keeps the record and the checkpoint and says why not
  (``journal``).
- **Nothing of the user's lost.** What the worktree holds as a restore
  begins is kept first (its ``before`` checkpoint), and also as plain files
  past the session, for 7 days (``preimages``); the refs the restore moves
  or deletes are kept under ``refs/dispatchd/displaced/``, each set under
  git's own lock and the value read under it kept before it changes
  (``gitrefs``, ``reflock``), a restore finished at a start included;
  another worktree's state (``.git/worktrees/NAME``) and branch are never
  written (said in ``not_restored``), reflogs are appended to (``gitplan``).
- **The baseline still rules.** A restore writes ``.git`` like any session
  could; the checks at the session's end compare with the trusted baseline
  taken at open (``baselines.py``), so what a restore brings back that the
  baseline would refuse is moved aside then, as if the session had written it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from dispatchd.daemon.checkpoints.journal import finish_all
from dispatchd.daemon.checkpoints.plan import RACY_NS, Entry, Manifest, RestorePlan, plan_copies, plan_restore
from dispatchd.daemon.checkpoints.reading import list_tree, reflinks
from dispatchd.daemon.checkpoints.requests import SessionManager, before_write, handle
from dispatchd.daemon.checkpoints.store import Pauses, Store
from dispatchd.daemon.gitguard.layouts import inspect_git
from dispatchd.daemon.gitguard.parts import common_of
from dispatchd.daemon.inuse import InUse
from dispatchd.inside import is_within

__all__ = ["RACY_NS", "Entry", "Manifest", "Pauses", "RestorePlan", "SessionManager", "Store", "before_write",
           "finish_restores", "handle", "list_tree", "plan_copies", "plan_restore", "reflinks"]


def finish_restores(state_dir: str, in_use: InUse | None = None,
                    checked: list[str] | None = None) -> list[tuple[str, str]]:
    """At the daemon's start, before the trusted baselines are re-checked,
    old checkpoints removed, or anything served: every restore a killed
    daemon cut half way is finished, or kept and logged (``journal``); each
    with its worktree claimed from the user's other daemons
    (``in_use``: one whose session uses it keeps the record for the next
    start). ``checked``: the worktrees a baseline's check will look at next
    (``gitguard.unheld_roots``); a restore elsewhere is not finished: what
    it would write (a checkpoint's config, hooks, ``.envrc``) would then be
    checked by nothing. Returns ``(worktree, what became of it)`` for each, for ``status``."""
    def hold(session: str, worktree: str) -> Callable[[], None] | str:
        if checked is not None and not any(is_within(worktree, root) for root in checked):
            return ("no baseline of it is left to check what the restore would write (its daemon's was "
                    "checked at an earlier start)")
        if in_use is None:
            return lambda: None
        name = f"restore-{session}"
        try:
            # Its repository too: the restore puts back objects from the keep,
            # which another daemon's open of a linked worktree would record anew.
            common = common_of(worktree, inspect_git(worktree, uid=os.getuid()))
        except Exception:  # noqa: BLE001 (a worktree half restored, unreadable: its path alone)
            common = ""
        try:
            other, _ = in_use.claim(name, worktree, common)
        except OSError as exc:
            return f"its use could not be recorded for your other dispatchd daemons ({exc.strerror})"
        if other is not None:
            return f"session {other.session} of another dispatchd (pid {other.pid}) uses {other.worktree}"
        return lambda: in_use.release(name)

    said: list[tuple[str, str]] = []
    for o in finish_all(os.path.join(state_dir, "checkpoints"), hold):
        # Where the files it replaced are: the session's checkpoints go at this start.
        before = f"; what the worktree held before it is kept in {o.before}" if o.before else ""
        if o.why:
            said.append((o.worktree, f"the restore of checkpoint {o.checkpoint}, cut short by a daemon's death, "
                                     f"was not finished: {o.why}; the worktree is left as it was found and the "
                                     f"checkpoint kept in {o.kept} (each start tries again; remove that directory "
                                     f"to give up){before}"))
        else:
            said.append((o.worktree, f"the restore of checkpoint {o.checkpoint}, cut short by a daemon's death, "
                                     f"was finished{before}"))
    return said
