"""What of a worktree's git metadata a session may not write, found when it
opens; git keeps working.

What a session writes under ``.git`` is read later by the user's git, outside
any sandbox: ``.git/config`` (``core.hooksPath``, ``core.fsmonitor``, filters,
aliases) and ``.git/hooks/*`` run commands, ``.git/commondir`` and a linked
worktree's ``.git`` pointer file choose which of those are read. For one
worktree, ``inspect_git`` finds what must stay read-only and what git must be
able to write, as a ``GitLayout`` the planner turns into mounts and Landlock
rules (``dispatchd.confine.plan``):

- a plain repository (``WORKTREE/.git/``): the ``config``, ``hooks``,
  ``commondir``, ``config.worktree`` and ``info/attributes`` of every git
  directory it has — its ``.git``, its submodules' under ``.git/modules`` at
  any depth (names may hold slashes, submodules have submodules), and those
  kept in place (``sub/.git/``, found through the index) — and the other
  linked worktrees' entries (``.git/worktrees/*``, whole) are bound read-only
  over themselves in the session's mount namespace. The rest of ``.git``
  (objects, refs, index, lock files) stays writable, so add, commit and
  checkout -b work. In full mode ``.git``, ``.git/modules``,
  ``.git/worktrees`` and every submodule's git directory are also mount
  points of their own (``mount_points``): renaming one fails (EBUSY);
- a linked worktree (``WORKTREE/.git`` is a file naming ``COMMON/worktrees/N``):
  the pointer file, ``N``'s own ``commondir``, ``gitdir`` and
  ``config.worktree``, and the configuration and hooks of the git
  directories of its submodules (``N/modules/**``) are read-only; ``COMMON`` is readable, and only
  ``COMMON/objects``, ``COMMON/refs``, ``COMMON/logs`` and ``COMMON/worktrees/N``
  are writable. A pointer is believed only if git itself would (``N/gitdir``
  names this worktree's ``.git`` back), ``N`` and ``COMMON`` lie outside the
  worktree and around neither it, ``COMMON`` is a repository and belongs to the
  user: a pointer forged inside the worktree grants nothing.

The repository's packs (``objects/pack/pack-*`` of the common directory:
the pack, its index, and what git derives from them, ``.rev``, ``.bitmap``,
``.mtimes``) are bound read-only over themselves too (``held_packs``, at
most ``MAX_HELD_PACK_FILES``): git never writes a pack again, it writes
new ones, and a session that made one writable with ``chmod`` could rewrite
it in place (the history's keep hard-links packs, so the kept bytes would
be gone too: ``clones.py``). A session's ``git gc`` still works: it writes
its new pack and fails, quietly, to delete the old ones (EBUSY), which the
end would put back anyway.

Not a pure inspection: a git directory without ``hooks`` gets an empty one
(``mkdir``, the one thing the daemon creates in a worktree), so that it can
be held read-only; a ``hooks`` that is a symlink into the worktree has its
target held instead, and a ``core.hooksPath`` of the repository's own
configuration, or of a file it includes in the worktree, naming a directory
inside its git directory (``.git/myhooks``) is held as ``hooks`` is, and so
is each file it includes from inside its git directory (``.git/hooks.inc``),
the directories on the way to them mount points of their own
(``confreach``; one in the worktree, a tracked ``.githooks`` or a shared
config beside the code, is the code's: checked at the end, ``snapshots``).
A linked worktree's open refuses a common directory where a file of the
user's has another hard link a session could write through
(``hardlinks.open_note``). What no bind can hold (a redirect file created
where there was none, a git directory renamed away and rebuilt) is checked
when the session ends: ``redirects`` and ``snapshots``.

The read-only binds exist only in full mode (a mount namespace); without one,
Landlock cannot carve a read-only hole in a writable tree, and the session's
``leaves_open`` says so.

Everything here goes by name from the resolved worktree, each step checked
with ``lstat`` (no symlink entered), except the submodules the index names
(``fs.open_dir_below``: by descriptor); a gitfile's target and a
``hooks`` symlink are resolved (``realpath``) only to learn where they lead.
"""

from __future__ import annotations

import os
import stat

import msgspec

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import hardlinks
from dispatchd.daemon.gitguard.configs import IncludeBudget, PastBound
from dispatchd.daemon.gitguard.confreach import reach
from dispatchd.daemon.gitguard.fs import index_gitlinks, is_dir, is_file, open_dir_below, read_small, scanned
from dispatchd.daemon.gitguard.packlinks import is_pack_file
from dispatchd.daemon.gitguard.redirects import REDIRECTS
from dispatchd.errors import WorktreeError
from dispatchd.inside import is_below, overlap

# What the user's git runs or reads as configuration, in any git directory.
RUN_FROM = ("config", "hooks") + REDIRECTS
_MAX_GITDIRS = 1000  # submodule git directories walked at the most (the daemon's time is bounded)
_MAX_VISITS = 10000  # directories looked into for them


MAX_HELD_PACK_FILES = 256  # pack files bound read-only (git repacks past 50 packs: gc.autoPackLimit)


def held_packs(common: str) -> tuple[list[str], int]:
    """The pack files of ``common``'s objects bound read-only in a session
    (see the module), and how many more there are past
    ``MAX_HELD_PACK_FILES`` (left writable: the layout's note says so; the
    history's keep holds those as copies of their own). Only names git
    gives (``pack-<id>.<ext>``: ``packlinks.is_pack_file``), regular files,
    looked at without following a symlink; a pack directory that is a
    symlink holds nothing of the repository's."""
    pack = os.path.join(common, "objects", "pack")
    if not is_dir(pack):
        return [], 0
    files: list[tuple[int, str]] = []
    for entry in scanned(pack):
        if is_pack_file(entry.name):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files.append((st.st_ctime_ns, entry.path))
    # The oldest first (a ctime no session can set back): a session's own
    # packs, however many, never push the user's out of the bound.
    files.sort()
    return [p for _, p in files[:MAX_HELD_PACK_FILES]], max(0, len(files) - MAX_HELD_PACK_FILES)


def without_packs(layout: GitLayout) -> GitLayout:
    """The layout of a session with no mount namespace (degraded mode, or a
    policy's ``user_namespaces = "never"``): nothing is bound there, so no
    pack is held, and the history keeps copies of them all."""
    return msgspec.structs.replace(layout, read_only=[
        p for p in layout.read_only
        if not (is_pack_file(os.path.basename(p)) and os.path.dirname(p).endswith(os.path.join("objects", "pack")))])


def _over_note(over: int) -> str:
    return (f"{over} pack files past the first {MAX_HELD_PACK_FILES} are not held read-only (the history keeps "
            "copies of them within its budget; git gc packs them into one)") if over else ""


def _existing(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.lexists(p) and not os.path.islink(p)]


def inspect_git(worktree: str, *, uid: int) -> GitLayout:
    """The worktree's git layout (see the module); ``uid`` must own a linked
    worktree's common directory. Makes the ``hooks`` it holds."""
    dotgit = os.path.join(worktree, ".git")
    try:
        st = os.lstat(dotgit)
    except FileNotFoundError:
        return GitLayout("none")
    if stat.S_ISDIR(st.st_mode):
        index = os.path.join(dotgit, "index")
        dirs = [dotgit] + module_gitdirs(dotgit) + _embedded_gitdirs(worktree, index)
        protect: list[str] = []
        budget = IncludeBudget()  # one for all the git directories of the open
        for gitdir in dirs:
            protect += _protect(worktree, gitdir, budget)
        worktrees = os.path.join(dotgit, "worktrees")
        if is_dir(worktrees):
            # The other linked worktrees' entries, whole: which common
            # directory and configuration git reads when the user works in
            # them, and their HEAD, index and logs, which a session's `git
            # worktree prune` would delete (under a private /tmp their
            # worktrees look gone).
            for entry in scanned(worktrees):
                if entry.is_dir(follow_symlinks=False):
                    protect.append(entry.path)
        protect = _existing(protect)
        held = ([os.path.join(d, "modules") for d in dirs] + [worktrees] + _module_steps(worktree, dirs[1:])
                + dirs[1:] + _steps(dirs, protect))
        packs, over = held_packs(dotgit)
        return GitLayout("repository", index=index, read_only=protect + packs, gitdirs=dirs,
                         mount_points=sorted(p for p in set(held) if is_dir(p)), note=_over_note(over))
    if not stat.S_ISREG(st.st_mode):
        return GitLayout("refused", note=".git is neither a directory nor a file")
    text = read_small(dotgit) or ""
    if not text.startswith("gitdir: "):
        return GitLayout("refused", read_only=[dotgit], note=".git file does not name a gitdir")
    gitdir = os.path.realpath(os.path.join(worktree, text[len("gitdir: "):].strip()))
    back = (read_small(os.path.join(gitdir, "gitdir")) or "").strip()
    if not back or os.path.realpath(back) != os.path.realpath(dotgit):
        return GitLayout("refused", read_only=[dotgit],
                         note=f"{gitdir} does not point back at this worktree; not granted")
    common_rel = (read_small(os.path.join(gitdir, "commondir")) or "").strip()
    common = os.path.realpath(os.path.join(gitdir, common_rel)) if common_rel else ""
    if not common or os.path.dirname(gitdir) != os.path.join(common, "worktrees"):
        return GitLayout("refused", read_only=[dotgit], note=f"{gitdir} is not a worktrees/ entry of its common dir")
    for name, where in (("git directory", gitdir), ("common directory", common)):
        # What a session wrote inside the worktree must not be believed: a
        # forged pointer there would have the next session granted (readable,
        # objects/refs/logs writable) whatever directory it names, up to the
        # worktree's parents.
        if overlap(where, worktree):
            return GitLayout("refused", read_only=[dotgit],
                             note=f"the {name} {where} is the worktree, inside it, or around it; not granted")
    if not (is_file(os.path.join(gitdir, "HEAD")) and is_file(os.path.join(common, "HEAD"))
            and all(is_dir(os.path.join(common, d)) for d in ("objects", "refs"))):
        return GitLayout("refused", read_only=[dotgit], note=f"{common} is not a git repository; not granted")
    try:
        if os.stat(common).st_uid != uid:
            return GitLayout("refused", read_only=[dotgit], note=f"{common} belongs to another user; not granted")
    except OSError:
        return GitLayout("refused", read_only=[dotgit], note=f"{common} cannot be inspected")
    logs = os.path.join(common, "logs")
    if os.path.lexists(logs) and not is_dir(logs):
        # A symlink there (a session's on the main worktree: ``ln -s .
        # .git/logs``) had the grant follow it: the whole common directory,
        # its config and hooks, or any directory of the user's, writable.
        return GitLayout("refused", read_only=[dotgit],
                         note=f"{logs} is not a directory (a symlink?); not granted")
    try:
        # Landlock and the binds hold names: another name of the same file
        # below the objects, refs or logs granted writable is a write to it.
        linked = hardlinks.open_note(common, gitdir)
    except PastBound as exc:
        linked = f"{common}: its git configuration has {exc}; not granted"
    if linked:
        return GitLayout("refused", read_only=[dotgit], note=linked)
    # lstat (``is_dir``), never followed: what is granted is the directory itself.
    writable = [gitdir] + [os.path.join(common, d) for d in ("objects", "refs", "logs") if is_dir(os.path.join(common, d))]
    read_only = _existing([dotgit] + [os.path.join(gitdir, n) for n in ("commondir", "gitdir", "config.worktree")])
    # This worktree's own submodules' git directories (``git submodule update`` run here keeps them in
    # ``N/modules``): their configuration and hooks held as the main worktree's ``.git/modules`` are.
    budget = IncludeBudget()
    read_only += _existing([p for d in module_gitdirs(gitdir) for p in _protect(worktree, d, budget)])
    packs, over = held_packs(common)
    return GitLayout("linked", index=os.path.join(gitdir, "index"), read_only=read_only + packs, readable=[common],
                     writable=writable, gitdirs=[gitdir], note=_over_note(over))


def _protect(worktree: str, gitdir: str, budget: IncludeBudget) -> list[str]:
    """What of one git directory is bound read-only (those that exist):
    besides its own files, the hooks paths and included files its
    configuration names inside it (``confreach``). ``WorktreeError`` past
    ``budget``: what the configuration names is not known, and the open is
    refused rather than leave a hooks path it sets unheld."""
    _ensure_hooks(gitdir)
    try:
        found = reach(worktree, gitdir, budget)
    except PastBound as exc:
        raise WorktreeError(f"{worktree}: its git configuration has {exc}; no session opened", worktree) from None
    return [os.path.join(gitdir, name) for name in RUN_FROM + ("info/attributes",)] + _hooks_target(worktree, gitdir) \
        + found.hooks_inside + found.includes_inside


def _steps(gitdirs: list[str], held: list[str]) -> list[str]:
    """The directories between a git directory and what of it is held
    (``.git/inc`` for ``.git/inc/hooks.inc``, ``.git/a`` for a hooks path
    ``.git/a/myhooks``), made mount points of their own: a bind moves with
    a directory renamed around it, and a new one built at the old name held
    nothing. None that is held itself (a hooks path holding an include):
    bound writable first, it would lose its read-only bind."""
    steps: set[str] = set()
    for path in held:
        top = max((d for d in gitdirs if is_below(path, d)), key=len, default="")
        parent = os.path.dirname(path)
        while top and is_below(parent, top):
            steps.add(parent)
            parent = os.path.dirname(parent)
    return sorted(steps - set(held))


def with_gitdirs(layout: GitLayout, worktree: str, found: list[str]) -> GitLayout:
    """The layout, with git directories found since (``snapshots`` walks
    every index, recursively: in-place submodules of submodules, where a
    gitfile leads) protected like the others: read-only config and hooks,
    and a mount point of their own."""
    new = [d for d in found if d not in layout.gitdirs and is_dir(d)]
    if layout.kind != "repository" or not new:
        return layout
    budget = IncludeBudget()
    protect = _existing([p for d in new for p in _protect(worktree, d, budget)])
    held = [os.path.join(d, "modules") for d in new] + new + _steps(layout.gitdirs + new, protect)
    return msgspec.structs.replace(
        layout, gitdirs=layout.gitdirs + new, read_only=layout.read_only + protect,
        mount_points=sorted(set(layout.mount_points) | {p for p in held if is_dir(p)}))


def _is_gitdir(path: str) -> bool:
    """A directory holding a ``HEAD`` of any kind: git takes a symlinked
    ``HEAD`` (or ``objects``) for a git directory, and a session rebuilt a
    submodule's that way to drop out of a stricter test's walk."""
    try:
        os.lstat(os.path.join(path, "HEAD"))
        return True
    except OSError:
        return False


def module_gitdirs(gitdir: str, unsearchable: list[str] | None = None) -> list[str]:
    """The git directories of submodules kept under ``modules/``, at any depth:
    a submodule's name may hold slashes (``modules/libs/sub``), and a submodule
    has submodules of its own (``modules/a/modules/b``). No symlink is followed;
    a directory that cannot be listed goes into ``unsearchable``."""
    found: list[str] = []
    pending = [os.path.join(gitdir, "modules")]
    visited = 0
    while pending and len(found) < _MAX_GITDIRS and visited < _MAX_VISITS:
        top = pending.pop()
        visited += 1
        if not is_dir(top):  # lstat: a ``modules`` that is a symlink leads nowhere we go
            continue
        try:
            entries = scanned(top)
        except OSError:
            if unsearchable is not None:
                unsearchable.append(top)
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if _is_gitdir(entry.path):
                found.append(entry.path)
                pending.append(os.path.join(entry.path, "modules"))
            else:
                pending.append(entry.path)  # a directory of a name with slashes
    return sorted(found)


def _module_steps(worktree: str, gitdirs: list[str]) -> list[str]:
    """The directories under a ``modules`` on the way to a submodule's git
    directory whose name has slashes (``modules/libs`` for ``libs/sub``)."""
    steps: set[str] = set()
    for found in gitdirs:
        chain, parent = [], os.path.dirname(found)
        while is_below(parent, worktree) and os.path.basename(parent) != "modules":
            chain.append(parent)
            parent = os.path.dirname(parent)
        if is_below(parent, worktree):
            steps.update(chain)
    return sorted(steps)


def _embedded_gitdirs(worktree: str, index: str) -> list[str]:
    """The ``.git`` directories of submodules the index lists that hold their
    git directory in place (``git submodule add`` of an existing clone), and
    the submodules' own ``modules/``."""
    links = index_gitlinks(index)
    found: list[str] = []
    for link in sorted(links or ()):
        try:
            fd = open_dir_below(worktree, link)
        except OSError:
            fd = None  # unsearchable now; checked again when the session ends
        if fd is None:
            continue
        try:
            st = os.stat(".git", dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        finally:
            os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            embedded = os.path.join(worktree, link, ".git")
            found += [embedded] + module_gitdirs(embedded)
        if len(found) >= _MAX_GITDIRS:
            break
    return found


def _ensure_hooks(gitdir: str) -> None:
    """A git directory without ``hooks`` gets an empty one, so that it can be
    held read-only: a session must not create the one git would run."""
    path = os.path.join(gitdir, "hooks")
    if not os.path.lexists(path):
        try:
            os.mkdir(path, 0o755)
        except OSError:
            pass


def _hooks_target(worktree: str, gitdir: str) -> list[str]:
    """Where a ``hooks`` that is a symlink leads, when that is in the worktree
    (the session could write it there); outside it, Landlock refuses writes."""
    path = os.path.join(gitdir, "hooks")
    if not os.path.islink(path):
        return []
    target = os.path.realpath(path)
    return [target] if is_below(target, worktree) and os.path.isdir(target) else []
