"""What the user's git reads for configuration or hooks, by content, at open
and at the end of a session; and moving aside what a session changed.

Read-only binds hold names, and a session can rename the directory around a
name (``.git/modules/sub``, ``.git/modules``, a submodule's worktree) and
build a new one in its place, or make a git directory where there was none
(a submodule of a submodule). This module does not care how: it records, for
every git directory of a repository, the content of what git reads from it
for configuration or commands — ``config``, ``config.worktree``,
``commondir``, ``info/attributes`` and every entry of ``hooks`` (content and
mode, a symlink by its target; ``*.sample`` never runs) — and the content of
every gitfile (a submodule's ``.git`` file or symlink) with where it leads;
``take`` walks, and
``quarantine`` compares two walks by content (never by name, inode or time)
and moves aside, to an unguessable name beside it:

- a submodule's git directory (``.git/modules/**``, an in-place ``sub/.git``,
  or wherever a gitfile inside the worktree leads) that is new or whose
  recorded content differs: whole (the user's git then finds no repository
  there: it runs nothing, and says so);
- in the repository's own ``.git`` and in the entries of its other linked
  worktrees (``.git/worktrees/N``), each changed or new file only: moving the
  ``.git`` whole would leave the worktree no repository, and the user's git
  would look for one in a directory above; but one whose bytes the
  baseline kept is left where it is, for ``keptfiles.put_back`` to replace
  under git's lock, keeping it aside then (a rename aside left the name
  absent until the put-back, and a ``git config`` of the user's meanwhile
  was lost);
- a gitfile that is new or differs (content, or where it leads);
- an index that cannot be checked now (unparsable, recording a submodule
  under a name git would not write, or behind a directory the daemon cannot
  search) unless it is byte for byte the index of the open (the user's own).

Which git directories exist is found the way the user's git finds them, by
the walk of ``gitdirs`` (bounded, by descriptor, no symlink followed); each
is recorded by ``digests`` (bounded reads). What cannot be looked at counts
as changed, every time (a random value that no later walk repeats): fail
closed.

Call ``quarantine`` only once every process of the session is gone: nothing
can then change the tree between the walk and the renames.
"""

from __future__ import annotations

import os
import stat
import time

import msgspec

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import fs, hardlinks, keptfiles
from dispatchd.daemon.gitguard.configs import config_targets
from dispatchd.daemon.gitguard.digests import HOOK_NAMES, digest_at, fingerprint, never_equal
from dispatchd.daemon.gitguard.gitdirs import MAX_GITDIRS, Walk
from dispatchd.daemon.gitguard.layouts import module_gitdirs
from dispatchd.inside import is_within, outermost

__all__ = ["MAX_GITDIRS", "GitSnapshot", "changes", "gitdir_paths", "quarantine", "take"]


class GitSnapshot(msgspec.Struct, frozen=True):
    """Paths are relative to the worktree (``/``-separated); values are
    digests, equal only for equal content."""

    gitdirs: dict[str, dict[str, str]] = {}  # a git directory -> {"config", "hooks/pre-commit", ...: digest}
    taken_ns: int = 0  # when the look began (0: an older record's, before any file's time)
    by_file: list[str] = []  # git directories never moved whole (``.git``, ``.git/worktrees/N``)
    pointers: dict[str, str] = {}  # a ``.git`` that is a file or a symlink -> digest of it and where it leads
    indexes: dict[str, str] = {}  # an index that cannot be checked -> why (equal only for the same bytes)
    # An unparsable index -> its stamps at the look (gitdirs._index_content):
    # the next look reads it again only if they changed.
    index_stamps: dict[str, list[int]] = {}
    external: dict[str, str] = {}  # a linked worktree's own git directory, outside: absolute path -> digest
    complete: bool = True  # False: more git directories than the walk looks at
    # Files inside the worktree that a git directory's configuration reads or
    # runs: ``include.path``/``includeIf.*.path`` targets and ``core.hooksPath``
    # entries, keyed by the file git would open (worktree-relative, after
    # symlinks) -> digest.
    included: dict[str, str] = {}
    # The submodules' git directories outside the worktree this look found
    # and fingerprinted (a linked worktree's ``modules/**``), absolute: what
    # it judges whole. (Its own git directory: file by file, ``external``.)
    external_roots: list[str] = []
    # The user's own config, hooks and review files, by bytes, to put back
    # where a session changed or deleted them (``keptfiles``); a baseline's only.
    kept: list[keptfiles.Kept] = []
    # The symlinks on the way to a hooks path in the worktree, where met
    # (worktree-relative) -> target, made again where a session changed
    # them (``hookslinks``); a baseline's only (an older record's: none).
    links: dict[str, str] = {}
    # Why the includes were not all followed (``configwalk``; "": they were):
    # what names them is never equal, and the check fails, saying so.
    unfollowed: str = ""
    # A baseline's: the link count of each file an end would split that had
    # more than one (``hardlinks.counts``): the user's links, left. None: an
    # older record's, every file with another link split.
    nlinks: dict[str, int] | None = None


def _external_modules(gitdir: str, external: dict[str, str], walk: Walk, roots: list[str]) -> None:
    """Each git directory below a linked worktree's own ``modules`` (its
    submodules', made by ``git submodule update`` in that worktree: outside
    the worktree, where the walk's relative paths do not reach), recorded as
    the worktree's own git directory is, by absolute path; one that cannot
    be listed is never equal (moved aside)."""
    unsearchable: list[str] = []
    for found in module_gitdirs(gitdir, unsearchable):
        try:
            fd = os.open(found, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            unsearchable.append(found)
            continue
        try:
            external.update({os.path.join(found, name): digest for name, digest in fingerprint(fd, walk.budget).items()})
            roots.append(found)
        finally:
            os.close(fd)
    external.update({path: never_equal("unsearchable") for path in unsearchable})


def take(worktree: str, layout: GitLayout, home: str = "", before: GitSnapshot | None = None, *,
         keep: bool = False) -> GitSnapshot:
    """Walk every git directory of the worktree's repository (see the module);
    ``home`` is where ``~/`` in an include path leads; ``before``: the look
    this one is compared with (an unparsable index unchanged since is not
    read again); ``keep``: a baseline's look, which keeps the user's own
    small files' bytes (``keptfiles``)."""
    taken_ns = time.time_ns()  # before the look: what changes from here on is after it
    known = {rel: (value, before.index_stamps[rel]) for rel, value in before.indexes.items()
             if rel in before.index_stamps} if before is not None else None
    walk = Walk(worktree, home, known)
    by_file: list[str] = []
    external: dict[str, str] = {}
    roots: list[str] = []
    if layout.kind == "repository":
        by_file.append(".git")
        walk.gitdir(".git", "")
        walk.run()
        top = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.stat(".git", dir_fd=top, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                # A .git the session turned into a gitfile or a symlink:
                # where it leads is the session's choice.
                walk.pointer(".git", "", top, st)
                walk.run()
        except FileNotFoundError:
            pass
        finally:
            os.close(top)
        by_file += walk.linked_entries()
    elif layout.kind == "linked":
        try:
            top = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            top = None
        if top is not None:
            try:
                external[os.path.join(worktree, ".git")] = digest_at(top, ".git") or "absent"
            finally:
                os.close(top)
        for gitdir in layout.gitdirs:  # outside the worktree; held by Landlock, its redirects by the plan
            try:
                fd = os.open(gitdir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                for name, digest in fingerprint(fd, walk.budget).items():
                    external[os.path.join(gitdir, name)] = digest
            finally:
                os.close(fd)
            _external_modules(gitdir, external, walk, roots)
        # What the repository's configuration (its common directory's, this
        # worktree's own) reads or runs inside this worktree.
        for gitdir in layout.gitdirs + layout.readable[:1]:
            try:
                fd = os.open(gitdir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                includes, hooks_paths = config_targets(fd)
            finally:
                os.close(fd)
            walk.config_targets(gitdir, "", includes, hooks_paths)
    kept = keptfiles.read(worktree, walk.gitdirs, by_file, external,
                          layout.gitdirs if layout.kind == "linked" else [], walk.included) if keep else []
    for k in kept:  # the look judges the bytes kept, read a moment after it (keptfiles.digest_of)
        if k.source == "included":
            walk.included[k.rel] = keptfiles.digest_of(k)
        elif k.base:
            external[os.path.join(k.base, k.rel)] = keptfiles.digest_of(k)
        else:
            walk.gitdirs[k.gitdir][k.name] = keptfiles.digest_of(k)
    nlinks = hardlinks.counts(worktree, hardlinks.git_items(walk.gitdirs, by_file, walk.included)) if keep else None
    return GitSnapshot(taken_ns=taken_ns, gitdirs=walk.gitdirs, by_file=by_file, pointers=walk.pointers,
                       indexes=walk.indexes, index_stamps=walk.index_stamps, external=external,
                       complete=walk.complete, included=walk.included, kept=kept,
                       external_roots=roots, links=walk.links if keep else {}, unfollowed=walk.unfollowed,
                       nlinks=nlinks)


def gitdir_paths(worktree: str, snap: GitSnapshot) -> list[str]:
    """The git directories of a walk (absolute), those it could look into,
    not the repository's ``.git`` itself nor the other worktrees' entries."""
    return [os.path.join(worktree, rel) for rel, found in snap.gitdirs.items()
            if rel not in snap.by_file and "" not in found]


def changes(before: GitSnapshot, now: GitSnapshot) -> list[str]:
    """What to move aside, worktree-relative, outermost first, none inside another."""
    found: list[str] = []
    for rel, now_fp in now.gitdirs.items():
        old = before.gitdirs.get(rel)
        if rel in now.by_file and "" not in now_fp:
            if old is None and rel != ".git":
                # A linked worktree added since the baseline (by the session,
                # or by the user while it ran): `git worktree add` writes none
                # of what is checked but its commondir, which
                # redirects.quarantine_new_redirects judges (one leading back
                # to this .git is git's). Anything else there, a rebase's
                # todo above all, a session planted: `git rebase --continue`
                # in that worktree ran its `exec` line.
                found += [f"{rel}/{name}" for name, digest in now_fp.items()
                          if name != "commondir" and digest != "directory"]
                continue
            found += [f"{rel}/{name}" for name, digest in now_fp.items()
                      if (old or {}).get(name) != digest and (digest != "directory" or _at_a_hook(name))]
        elif old != now_fp:
            found.append(rel)
    found += [rel for rel, digest in now.pointers.items() if before.pointers.get(rel) != digest]
    found += [rel for rel, why in now.indexes.items() if before.indexes.get(rel) != why]
    found += [rel for rel, digest in now.included.items()
              if before.included.get(rel) != digest and (digest not in ("absent", "directory", "hooks directory")
                                                         or digest == "directory" and _in_hooks(now, rel))]
    return outermost(found)


def _at_a_hook(name: str) -> bool:
    """``hooks/NAME`` of a git directory, NAME one git runs: a directory
    there is no hook, and the user's git fails on it ("cannot exec")."""
    return name.startswith("hooks/") and name[len("hooks/"):] in HOOK_NAMES


def _in_hooks(snap: GitSnapshot, rel: str) -> bool:
    """``rel`` an entry of a hooks path (``included``) at a name git runs."""
    parent, _, leaf = rel.rpartition("/")
    return snap.included.get(parent) == "hooks directory" and leaf in HOOK_NAMES


def covered(worktree: str, before: GitSnapshot, now: GitSnapshot) -> set[str]:
    """What a part judged against its baseline at this end, exactly
    (absolute paths), for the parts after it (``skipped``): the git
    directories its walk found now (one compared whole; one checked file by
    file where its baseline had it, and each of those files), the files
    outside the worktree it compared, and the submodule git directories
    there it found now. Only these paths, nothing below them: a git
    directory its walk no longer recognises (a rebuilt submodule's) is a
    later part's to catch; nor an entry of a linked worktree new since its
    baseline (a later part whose baseline holds it judges it too)."""
    judged = [rel for rel in now.gitdirs if rel not in now.by_file or rel in before.gitdirs]
    found = {os.path.join(worktree, rel) for rel in judged}
    for snap in (before, now):
        found |= {os.path.join(worktree, rel, name) for rel in snap.by_file if rel in before.gitdirs
                  for name in snap.gitdirs.get(rel, {})}
    found |= set(before.external) | set(now.external) | set(now.external_roots)
    found |= {os.path.join(worktree, rel) for rel in before.links}
    return found


def skipped(path: str, skip: set[str]) -> bool:
    """``path`` is one an earlier part judged (``covered``): its baseline is
    the user's; a later part's was taken while sessions ran."""
    return path in skip


def _replaced(top: str, rel: str) -> str | None:
    """The first component of ``rel`` below ``top`` that is there but is no
    real directory (a symlink, a file), or ``rel`` itself when every one is
    a directory; None when it is gone (``rel``-relative, ``/``-separated)."""
    path, done = top, []
    for part in rel.split("/"):
        path = os.path.join(path, part)
        done.append(part)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return "/".join(done)
        except FileNotFoundError:
            return None
        except OSError:
            return "/".join(done)  # what cannot be looked at goes aside
    return rel


def quarantine(worktree: str, before: GitSnapshot, now: GitSnapshot,
               skip: set[str] | None = None) -> tuple[list[str], list[str]]:
    """Move aside what ``changes`` lists; returns the new names (absolute) and
    what could not be moved, with why. A walk that stopped short (more git
    directories than it looks at) is itself a failure. ``skip``: absolute
    paths to leave: those an earlier part of the domain judges
    (``covered``), and the user's kept files the put-back replaces under
    git's lock (``keptfiles.left_in_place``). Two parts
    cover a linked worktree's own git directory (the repository's
    ``.git/worktrees/N`` and the linked worktree's), and the later one's
    baseline may hold what a session of the earlier wrote before it joined."""
    failed: list[str] = []
    todo = changes(before, now)
    # A git directory of the baseline the walk no longer finds, but not gone:
    # one of its directories made a symlink (git follows it to a directory of
    # the session's), or it lost its HEAD. Until the last end's sweep of
    # symlinks it ran for the user's git while another session lived.
    todo += [r for r in (_replaced(worktree, rel) for rel in before.gitdirs if rel not in now.gitdirs) if r]
    if skip:
        todo = [r for r in todo if not skipped(os.path.join(worktree, r), skip)]
    if not now.complete:
        # More than the walk looks at (a session can make that many cheaply):
        # what was not looked at is not handed to the user's git either. With
        # .git/modules and the index aside, git knows no submodule.
        failed.append(f"{worktree}: more git directories than dispatchd checks ({MAX_GITDIRS}); "
                      ".git/modules and .git/index moved aside")
        if ".git" in now.by_file:
            todo = [".git/index", ".git/modules"] + [r for r in todo if not is_within(r, ".git/modules")]
    if now.unfollowed:
        failed.append(f"{worktree}: its git configuration has {now.unfollowed}: what they name was not checked")
    moved, bad = fs.move_all_below_aside(worktree, outermost(todo))
    failed += bad
    for root in before.external_roots:
        base = root[:root.find("/modules/")] if "/modules/" in root else ""
        found = _replaced(base, root[len(base) + 1:]) if base and root not in now.external_roots else None
        path = os.path.join(base, found) if found is not None else ""
        if path and os.path.lexists(path) and not (skip and skipped(path, skip)):
            try:
                moved.append(fs.move_aside(path))
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror}")
    gone = {path: "unrecognised" for path in before.external if path not in now.external and os.path.lexists(path)}
    for path, digest in {**now.external, **gone}.items():
        old = before.external.get(path)
        # New or changed: a redirect redirects.quarantine_new_redirects
        # moved already is absent from ``now``; rebase state, a hook, a config.
        # A directory where the baseline had a file: a linked worktree's
        # ``.git`` made a repository of its own (``git init`` there). A file
        # the baseline had in a git directory the walk no longer recognises
        # (its ``HEAD`` made a symlink: git still takes it): what git reads
        # there is no more what was checked.
        changed = old != digest and (digest not in ("absent", "directory") or
                                     (digest == "directory" and old not in (None, "absent", "directory")))
        if changed and not (skip and skipped(path, skip)):
            try:
                moved.append(fs.move_aside(path))
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror}")
    return moved, failed
