"""Refs a session made to stand in front of the user's branches and tags
when the user names them short, taken out at the end.

Git resolves a short name ``X`` by looking, in order, at ``$GIT_DIR/X``,
``refs/X``, ``refs/tags/X``, ``refs/heads/X`` (then the remotes): a file
``.git/v1.0`` holding a commit of the session's was what the user's ``git
show v1.0`` showed, the user's tag untouched (git warns the name is
ambiguous, unless the session also hid the tag from git's binary search of
a ``packed-refs`` out of order: ``refvalues.packed_out_of_order``). So for
each of the user's branches and tags, the names in front of it are looked
at (``in_front``): the top-level entry of the git directory (and of each
linked worktree's) the short name begins with, ``refs/X``, and for a branch
``refs/tags/X``; loose ones and ``packed-refs`` records.

``present`` records which of them exist at the baseline (the user's own:
a tag and a branch of one name, say), and at the end ``clear`` moves aside
(renamed beside, never deleted) each loose one that is new, and takes each
new ``packed-refs`` record out (``replacerefs.drop_packed``: kept in a file
beside). A top-level name git itself uses (``objects``, ``refs``, ``HEAD``,
``index``...) is never moved: a short name that begins with one resolves
there as a path git reads anyway. ``clear`` is linear in the names it
finds: one set look-up per ``/`` of each path tells one inside a directory
it moved aside already (a session can plant tens of thousands of names:
one per tag of the user's in each of 100 linked worktrees' directories).
"""

from __future__ import annotations

import os

from dispatchd.daemon.gitguard import fs
from dispatchd.daemon.gitguard.replacerefs import drop_named, packed_names

# What git keeps at a git directory's top level: a short name beginning with
# one of these is not taken for a ref of the session's (moving it would break git).
_GITS_OWN = frozenset({
    "objects", "refs", "logs", "hooks", "info", "branches", "worktrees", "modules", "rr-cache", "lfs",
    "config", "config.worktree", "index", "HEAD", "ORIG_HEAD", "FETCH_HEAD", "MERGE_HEAD", "packed-refs",
    "description", "shallow", "commondir", "gitdir", "COMMIT_EDITMSG", "sequencer", "rebase-merge",
    "rebase-apply", "AUTO_MERGE", "CHERRY_PICK_HEAD", "REVERT_HEAD", "BISECT_LOG", "MERGE_MSG", "MERGE_MODE",
})
_MAX_REFS = 20_000  # branches and tags looked at; past them, the rest are not


def in_front(common: str, refs: list[str]) -> tuple[set[str], set[str]]:
    """For the branches and tags ``refs``: the loose paths (relative to
    ``common``) and the ref names (of ``packed-refs`` records) git would
    resolve their short names to first."""
    tops = [""] + _worktree_dirs(common)
    loose: set[str] = set()
    names: set[str] = set()
    for ref in refs[:_MAX_REFS]:
        kind, _, short = ref[len("refs/"):].partition("/")
        if kind not in ("heads", "tags", "remotes") or not short:
            continue  # notes, the stash: not named short
        first = short.split("/", 1)[0]
        if first not in _GITS_OWN:  # the name's first part (a directory a session made), and the name in it
            loose.update(os.path.join(top, part) if top else part for top in tops for part in {first, short})
        ahead = [f"refs/{short}"] + {"heads": [f"refs/tags/{short}"], "tags": [],
                                     "remotes": [f"refs/tags/{short}", f"refs/heads/{short}"]}[kind]
        loose.update(ahead)
        # git's first place, ``$GIT_DIR/X``, falls back to a packed-refs record named ``X`` itself.
        names.update(ahead + [short])
    return loose, names


def present(common: str, refs: list[str]) -> list[str]:
    """Which names in front of ``refs`` exist now: ``loose:PATH`` and
    ``packed:NAME``. A path is looked at only when its directory's listing
    holds its first name (an ``lstat`` a ref cost 30 ms at an open for
    10,000 tags)."""
    loose, names = in_front(common, refs)
    listed: dict[str, set[str]] = {}

    def there(rel: str) -> bool:
        if rel.startswith("refs/"):
            parent, first = "refs", rel.split("/")[1]
        else:
            parent, _, first = rel.rpartition("/")  # the git directory's top, or a linked worktree's
        if parent not in listed:
            try:
                listed[parent] = set(os.listdir(os.path.join(common, parent)))
            except OSError:
                listed[parent] = set()
        return first in listed[parent] and os.path.lexists(os.path.join(common, rel))

    found = [f"loose:{p}" for p in sorted(loose) if there(p)]
    return found + [f"packed:{n}" for n in sorted(_packed_names(common) & names)]


def clear(common: str, refs: list[str], baseline: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Move aside what stands in front of ``refs`` and was not there at the
    baseline. Linear in the names found: each is looked up once per ``/``
    of its path among those moved (``_within``)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    had = set(baseline)
    why = "a ref a session made in front of one of your branches or tags (git resolves its short name there first)"
    moved: set[str] = set()
    # Read once: moving a loose name aside changes no packed-refs record (git's own
    # top-level names, packed-refs among them, are never moved).
    found = present(common, refs)
    for item in found:
        kind, _, rel = item.partition(":")
        if item in had or _within(rel, moved):
            continue  # the user's, or inside a directory moved aside just before (sorted: parents first)
        path = os.path.join(common, rel)
        if kind == "loose" and not _real_parents(common, rel):
            # A symlink on its way (to a directory elsewhere): never moved through, fail closed.
            failed.append(f"{path}: {why}, behind a symlink; not moved, remove it")
        elif kind == "loose":
            moved.add(rel)
            try:
                done.append((path, f"{why}; moved aside to {fs.move_aside(path)}"))
            except OSError as exc:
                failed.append(f"{path}: {why}, cannot be moved aside ({exc.strerror})")
    new_packed = {item.partition(":")[2] for item in found if item.startswith("packed:") and item not in had}
    if new_packed:
        problem = drop_named(common, new_packed)
        if problem:
            failed.append(problem)
        else:
            done.append((os.path.join(common, "packed-refs"), f"{why}: {', '.join(sorted(new_packed)[:5])} taken out"))
    return done, failed


def _within(rel: str, moved: set[str]) -> bool:
    """Whether ``rel`` lies strictly below one of ``moved`` (paths relative
    to the git directory, "/"-separated): one set look-up per ``/`` of
    ``rel``, where comparing it with every name moved before it grew as the
    square of their number (30,300 names a session planted in 100 linked
    worktrees' directories: 28 s at the end; as ``inside.outermost``)."""
    i = rel.find("/")
    while i >= 0:
        if rel[:i] in moved:
            return True
        i = rel.find("/", i + 1)
    return False


def _worktree_dirs(common: str) -> list[str]:
    try:
        return [os.path.join("worktrees", n) for n in sorted(os.listdir(os.path.join(common, "worktrees")))[:100]
                if fs.is_dir(os.path.join(common, "worktrees", n))]
    except OSError:
        return []


def _real_parents(common: str, rel: str) -> bool:
    """Whether every directory on ``rel``'s way below ``common`` is one, not a symlink."""
    path = common
    for part in rel.split("/")[:-1]:
        path = os.path.join(path, part)
        if not fs.is_dir(path):
            return False
    return True


def _packed_names(common: str) -> set[str]:
    return {name for name in packed_names(common).values() if name}
