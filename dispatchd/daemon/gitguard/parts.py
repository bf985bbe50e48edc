"""One part of a domain's baseline: a worktree, what it held at the
baseline, and its check.

``check_part`` compares a part's worktree now with its baseline and moves
aside what differs: redirect files a session created (``redirects``), git's
configuration, hooks and state (``snapshots``), repositories and files the
user's tools run (``runnables``), writes back the user's own git files
a session changed or deleted (``keptfiles``), and makes each file the user's
git or tools run that has another hard link one of its own (``hardlinks``).
It never deletes; what it cannot move, or a walk over its bounds, is
returned as a failure (the caller fails closed).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from typing import TypeVar

import msgspec

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import (arealinks, configs, gitdirs, hardlinks, history, hookslinks, indexreview,
                                       keptfiles, noroom, packlinks, refsback, runnables, snapshots)
from dispatchd.daemon.gitguard.redirects import quarantine_new_redirects, redirects_present
from dispatchd.errors import WorktreeError
from dispatchd.fsnames import shown
from dispatchd.inside import is_within
from dispatchd.logtext import Bounded

log = logging.getLogger("dispatchd.baselines")


class Protected(msgspec.Struct, frozen=True):
    """One thing a check moved aside or put back."""

    path: str
    why: str
    time: float = 0.0
    # One of the files the user's tools run (``runnables``), which a session
    # can make by the thousand: the first left out of a long report (reportlog.py).
    bulk: bool = False


NOT_WHOLE = "NOT checked whole"
MOST_FAILURES = 20  # named in one report (and status, and the log's line); the rest counted
MOST_FAILURE_CHARS = 1000  # of one failure's text
# What lifts the refusal of a worktree a check could not finish on (taints.py).
UNTIL_RESTART = "until a restart's check passes"
UNTIL_LAST_END = "until the check at the end of the last session still open on it passes, or a restart's"


def failures_said(failures: list[str]) -> str:
    """``failures`` as one text of bounded size: the first ``MOST_FAILURES``,
    each cut at ``MOST_FAILURE_CHARS``, then how many more. A session
    chooses how many there are (20,000 plants none of which can move) and
    how long their names are: unbounded, one report, one status and one
    log line ran to megabytes, past what a reply can carry."""
    shown = [f if len(f) <= MOST_FAILURE_CHARS else f"{f[:MOST_FAILURE_CHARS]}... ({len(f) - MOST_FAILURE_CHARS} "
             "more characters)" for f in failures[:MOST_FAILURES]]
    more = len(failures) - MOST_FAILURES
    return "; ".join(shown) + (f"; and {more} more that could not be done either" if more > 0 else "")


def unchecked(root: str, failures: list[str], now_t: float, until: str = UNTIL_RESTART) -> Protected:
    """What the close says (and status, until the refusal is lifted) of a
    worktree its check could not finish: not only the daemon's log. What
    no room let it move but it made unreadable (``noroom``) is not live,
    but not where it belongs either: still a failure, said as such.
    ``until``: what lifts the refusal (``UNTIL_LAST_END`` for a check
    beside live sessions of the domain: ``taints.py``)."""
    live = ("What could not be moved aside is still there, unreadable: look before you make it readable again"
            if all(noroom.MADE_UNREADABLE in f for f in failures) else
            "What the session left there may still be live: look before you run git or your tools in it")
    return Protected(path=root, time=now_t, why=(
        f"{NOT_WHOLE}: {failures_said(failures)}. {live}; dispatchd refuses sessions on it {until}"))


class Part(msgspec.Struct, frozen=True):
    root: str  # a worktree (resolved)
    layout: GitLayout
    git: snapshots.GitSnapshot
    redirects: list[str]
    tree: runnables.TreeSnapshot
    names: list[str]  # the protected names its walk looks for
    excluded: list[str] = []  # parts' roots inside this one: theirs to check
    home: str = ""
    resolved_common: str = ""  # ``common_of`` at its join: never resolved again (a session can plant links)
    # Added while no session of its domain could write (``Record.writable``):
    # its baseline is taken again (``renew``) once one that can joins, or the
    # domain is merged with one that can.
    unwritten: bool = False
    # The root's device, inode and inode generation at the join: at a start,
    # a worktree that is another directory now (removed and cloned anew at
    # its path) is no longer this baseline's (``drop_replaced``).
    ident: list[int] = []

    @property
    def related_common(self) -> str:
        """The common directory the domains relate by: as resolved at the
        join (a record of an older daemon: resolved now, "/" if it cannot be)."""
        return self.resolved_common or (_resolved(self.common) if self.common else "")

    @property
    def common(self) -> str:
        """The repository's common git directory, or ""."""
        if self.layout.kind == "repository":
            return os.path.join(self.root, ".git")
        if self.layout.kind == "linked" and self.layout.readable:
            return self.layout.readable[0]
        return ""

    @property
    def own_gitdir(self) -> str:
        if self.layout.kind == "repository":
            return os.path.join(self.root, ".git")
        return self.layout.gitdirs[0] if self.layout.kind == "linked" and self.layout.gitdirs else ""


class Record(msgspec.Struct):
    """What is on disk for one domain."""
    id: str
    created: float
    sessions: list[str] = []
    parts: list[Part] = []
    histories: list[history.History] = []
    # What the domain's sessions could write, all that joined since its
    # baseline (their worktrees, ``read_write`` paths, git's writable
    # directories): a part joined while they ran keeps the bytes of the
    # user's files outside it only (``keep_outside``). None: not known (an
    # older daemon's record): it keeps none.
    reach: list[str] | None = None
    # False while every session that joined had its worktree held read-only
    # by the kernel (a read-only policy, no ``read_write`` path): nothing of
    # theirs can have changed it, so the ends check nothing, and what changed
    # meanwhile is the user's own (their ``git push -u`` in the config, an
    # ``.envrc`` they edited, had been moved aside as a session's).
    writable: bool = True


def merged(into: Record, other: Record) -> Record:
    """Pure: ``into`` with ``other``'s parts, sessions and the histories of
    repositories it does not keep already; writable if either is; its reach
    both's (not known if either's is not)."""
    reach = into.reach
    if reach is not None:
        reach = None if other.reach is None else sorted({*reach, *other.reach})
    return msgspec.structs.replace(
        into, parts=into.parts + other.parts, sessions=into.sessions + other.sessions,
        histories=into.histories + [kept for kept in other.histories
                                    if not any(h.common == kept.common for h in into.histories)],
        writable=into.writable or other.writable, reach=reach)


def add_history(record: Record, part: Part, keep_dir: str) -> str:
    """The history of ``part``'s repository kept at its join, once per
    repository (a worktree joining later adds its checked-out branch).
    Returns what of it is not kept, and why ("": all of it), for the
    session to be told."""
    common = part.common
    if not common:
        return ""
    branch = refsback.checked_out(part.own_gitdir)
    for i, kept in enumerate(record.histories):
        if os.path.realpath(kept.common) == os.path.realpath(common):
            # A worktree joining later: its branch is its own to move only if no session moved it since.
            if branch and refsback.read_refs(common).get(branch) == kept.refs.get(branch):
                record.histories[i] = msgspec.structs.replace(kept, own=sorted(set(kept.own) | {branch}))
            return ""
    keep = history.keep_for(keep_dir, common)
    held = frozenset() if record.sessions else packlinks.held_names(part.layout.read_only, common)  # theirs: none
    kept = history.record(common, keep, [branch] if branch else [], held)
    if kept.note:
        log.warning("event=history_not_kept common=%s why=%r", common, kept.note)
    record.histories.append(kept)
    return kept.note


def renew(record: Record, keep_dir: str) -> None:
    """The parts no session could write (``Part.unwritten``) of a domain that
    one that can joins (or was merged into one that can): what is there now
    is the user's, their changes since the baseline included (a remote they
    added, a hook, an ``.envrc``, commits), so those parts' baselines and
    their repositories' histories are taken again. Otherwise a writable
    session's end judged the user's work by a read-only session's old
    baseline, and put its old bytes and refs back. Call with no session of
    those parts able to write."""
    renewed: dict[int, Part] = {}
    for i, p in enumerate(record.parts):  # every walk first: one over its bounds changes nothing
        if not p.unwritten:
            continue
        tree = baseline_tree(p.root, tuple(p.names), p.excluded, p.layout, p.home)
        renewed[i] = msgspec.structs.replace(p, git=snapshots.take(p.root, p.layout, p.home, keep=True),
                                             tree=tree, redirects=redirects_present(p.layout, p.root),
                                             unwritten=False)
    commons = {os.path.realpath(p.common) for p in renewed.values() if p.common}
    record.histories = [h for h in record.histories if os.path.realpath(h.common) not in commons]
    for i, part in renewed.items():
        record.parts[i] = part
        add_history(record, part, keep_dir)


def session_reach(worktree: str, git_writable: list[str], read_write: tuple[str, ...],
                  worktree_rw: bool) -> tuple[str, ...]:
    """What a session's commands can write of the host's files (its
    worktree and git's writable directories when the worktree is writable,
    the policy's ``read_write``): ``Baselines.join``'s ``reach``. Landlock
    and the binds follow a symlink to what it names: both count; one that
    cannot be resolved (swapped while looked at) counts as everything."""
    paths = ((worktree, *git_writable) if worktree_rw else ()) + tuple(read_write)
    try:
        return tuple(sorted({*paths, *(os.path.realpath(p) for p in paths)}))
    except OSError:
        return ("/",)


_Looked = TypeVar("_Looked", snapshots.GitSnapshot, runnables.TreeSnapshot)


def keep_outside(snapshot: _Looked, root: str, reach: list[str] | None) -> _Looked:
    """``snapshot`` (a git look or a tree walk) of a part joined while
    sessions of its domain run, its kept bytes only of files none of them
    could write (``Record.reach``): a session on a linked worktree cannot
    write the repository's config or hooks, so a session on the main
    worktree opened after it still has the user's to put back."""
    def outside(path: str) -> bool:
        return reach is not None and not any(is_within(path, r) for r in reach)
    kept = [k for k in snapshot.kept if outside(os.path.join(k.base or root, k.rel))]
    if isinstance(snapshot, snapshots.GitSnapshot):  # the links to its hooks path too, as kept bytes (hookslinks.py)
        links = {rel: target for rel, target in snapshot.links.items() if outside(os.path.join(root, rel))}
        return msgspec.structs.replace(snapshot, kept=kept, links=links)
    return msgspec.structs.replace(snapshot, kept=kept)


def baseline_tree(root: str, names: tuple[str, ...], excluded: list[str], layout: GitLayout,
                  home: str = "") -> runnables.TreeSnapshot:
    """A part's tree walk at its baseline (``runnables.take``, with
    ``nested_targets``), with the bytes of the config and hooks of the
    repositories it found and of what their configuration runs or reads in
    the worktree (``keptfiles.read_tree``; the walk then holds the digests
    of the bytes kept). ``WorktreeError`` past the walk's bounds."""
    tree = runnables.take(root, names, excluded=excluded, skip_root_git=layout.kind in ("repository", "linked"))
    if not tree.complete:
        raise WorktreeError(f"{root}: {tree.why}, more than dispatchd checks for repositories and files your "
                            "tools run; no session opened", root)
    try:
        targets = nested_targets(root, home, tree.entries)
    except configs.PastBound as exc:
        raise WorktreeError(f"{root}: the git configuration of a repository in it has {exc}; no session opened",
                            root) from None
    kept = keptfiles.read_tree(root, tree.entries, targets)
    for k in kept:  # read a moment after the walk: judged by the bytes kept (as snapshots.take does)
        tree.entries[k.rel] = keptfiles.digest_of(k)
    return msgspec.structs.replace(tree, kept=kept, nlinks=hardlinks.counts(root, hardlinks.tree_items(tree.entries)))


def nested_targets(root: str, home: str, entries: dict[str, str]) -> dict[str, str]:
    """What the configuration of each repository the tree walk found in
    the worktree (``PATH/.git``) runs or reads there, as the worktree's own
    is looked at (``gitdirs.Walk.config_targets``: every entry of its
    ``core.hooksPath``, relative to ``PATH``, the user's own included, and
    its includes' targets): added to ``entries`` (the walk's; what it holds
    already is left), and returned, each file -> its repository's git
    directory. A session's hook planted in a nested clone's ``.githooks``
    ran at the user's next commit there, unseen. ``configs.PastBound``, once
    all are added, where the includes were more than the walk follows (what
    names them is never equal in ``entries``)."""
    nested = sorted(r for r, digest in entries.items() if digest == "gitdir" and r.endswith("/.git"))
    found: dict[str, str] = {}
    if not nested:
        return found
    walk = gitdirs.Walk(root, home)
    for rel in nested:
        try:
            fd = walk.open(rel)  # no symlink on the way
        except OSError:
            continue
        if fd is None:
            continue
        try:
            includes, hooks = configs.config_targets(fd)
        finally:
            os.close(fd)
        had = set(walk.included)
        walk.config_targets(rel, rel[:-len("/.git")], includes, hooks)
        for path in walk.included.keys() - had:
            digest = walk.included[path]
            if digest not in ("absent", "directory", "hooks directory") and path not in entries:
                entries[path] = digest
                found[path] = rel
    if walk.unfollowed:
        raise configs.PastBound()
    return found


def check_part(part: Part, found: list[Protected], now_t: float, covered: set[str] | None = None,
               said: Bounded | None = None, index: bool = True, wrote: bool = True) -> list[str]:
    """Check one part against its baseline and move aside what differs
    (``redirects``, ``snapshots``, ``runnables``); appends what it moved to
    ``found`` and returns what it could not, with why. ``covered``: git's
    files the domain's earlier parts judge, left to them (``snapshots.covered``);
    this part's are added. ``said``: the check's log lines, one a file up
    to its bound (the caller says what it left out). ``index``: the
    worktree's index reviewed too (``indexreview``), where no other session
    of the domain runs: a live one's git would race the review. ``wrote``:
    a session of the domain was granted the write lock (or it is not known);
    with none, no link was made, and the linked areas are walked only where
    the repository has a linked worktree (a refused linked open's links, a
    ``cp -al`` copy's, are the user's and split at the next end)."""
    said = said if said is not None else Bounded()
    failed: list[str] = []
    copied = hardlinks.Copied()  # what this part's end copies to make files of their own
    skip = covered if covered is not None else set()
    keptfiles.sweep(part.root, part.git.kept + part.tree.kept)  # a killed put-back's, before the looks see them
    if part.layout.kind in ("repository", "linked"):
        unmoved: set[str] = set()
        moved, bad = quarantine_new_redirects(part.layout, part.redirects, part.root,
                                              lambda path: snapshots.skipped(path, skip), unmoved)
        failed += bad
        for path in map(shown, moved):  # a name not UTF-8 as \xNN, in the log as in the report (fsnames.py)
            said.say(log, "event=git_redirect_quarantined path=%s", path)
            found.append(Protected(path=path, why="a file that redirects git's configuration, new", time=now_t))
        now = snapshots.take(part.root, part.layout, part.home, before=part.git)
        # Before the quarantine: a directory put where a link was goes aside whole, its plants in it.
        put, bad = hookslinks.put_back(part.root, part.git.links, lambda path: snapshots.skipped(path, skip))
        failed += bad
        for path, why in ((shown(path), why) for path, why in put):
            said.say(log, "event=git_hooks_link_put_back path=%s", path)
            found.append(Protected(path=path, why=why, time=now_t))
        # The user's kept files are replaced under git's lock, what stood there
        # kept aside by the put-back (keptfiles.py): never renamed away first.
        locked = keptfiles.left_in_place(part.root, part.git.kept, now.gitdirs, now.external,
                                         lambda path: snapshots.skipped(path, skip), now.included)
        moved, bad = snapshots.quarantine(part.root, part.git, now, skip | unmoved | locked)  # a redirect: said once
        failed += bad
        for path in map(shown, moved):
            said.say(log, "event=git_changed_quarantined path=%s", path)
            found.append(Protected(path=path, why="git configuration, hooks or state changed or new",
                                   time=now_t))
        put, bad = keptfiles.put_back(part.root, part.git.kept, now.gitdirs, now.external,
                                      lambda path: snapshots.skipped(path, skip), now.included)
        failed += bad
        # First the names a linked session could write (the user's other names keep their links), then the user's.
        linked = arealinks.worktree_dirs(part.common) if part.common else []
        if part.common and (wrote or linked):
            split, bad = arealinks.split(part.common, linked, part.git.taken_ns, copied)
            put += split
            failed += bad
        split, bad = hardlinks.detach(part.root, now.gitdirs, now.by_file, now.included, part.git.kept, copied,
                                     part.git.nlinks)
        put += split
        if covered is not None:
            covered |= snapshots.covered(part.root, part.git, now)
        failed += bad
        for path, why in ((shown(path), why) for path, why in put):
            said.say(log, "event=git_file_put_back path=%s", path)
            found.append(Protected(path=path, why=why, time=now_t))
        if part.own_gitdir and index:  # the index, made to show what the worktree holds (indexreview.py)
            try:
                _review_index(part, found, now_t)
            except Exception as exc:  # noqa: BLE001 - said; the tree's check below still runs
                log.exception("event=git_index_review_failed gitdir=%s", part.own_gitdir)
                failed.append(f"{os.path.join(part.own_gitdir, 'index')}: the review of the index failed "
                              f"({type(exc).__name__})")
    tree = runnables.take(part.root, tuple(part.names), excluded=part.excluded,
                         skip_root_git=part.layout.kind in ("repository", "linked"), ending=True, before=part.tree)
    if not tree.complete:
        failed.append(f"{part.root}: {tree.why}: dispatchd cannot check it for repositories and files "
                      "your tools run")
        return failed
    try:
        nested_targets(part.root, part.home, tree.entries)  # judged as the baseline's were
    except configs.PastBound as exc:
        failed.append(f"{part.root}: the git configuration of a repository in it has {exc}: what they name was not "
                      "checked")
    # A nested repository's config and hooks: replaced under git's lock by the put-back, never renamed away first.
    locked = keptfiles.left_in_place(part.root, part.tree.kept, {}, {}, tree=tree.entries)
    changed = [rel for rel in runnables.changes(part.tree, tree) if os.path.join(part.root, rel) not in locked]
    moved, bad = runnables.quarantine(part.root, changed)
    failed += bad
    for path in map(shown, moved):
        said.say(log, "event=tool_file_quarantined path=%s", path)
        found.append(Protected(path=path, why="a repository or a file your tools run, changed or new",
                               time=now_t, bulk=True))
    put, bad = keptfiles.put_back(part.root, part.tree.kept, {}, {}, tree=tree.entries)
    failed += bad
    # What was moved aside (or, with no room, made unreadable and said) is not the user's to split.
    split, bad = hardlinks.detach_tree(part.root, _outside(tree.entries, changed), part.tree.kept, copied,
                                     part.tree.nlinks)
    put += split
    failed += bad
    for path, why in ((shown(path), why) for path, why in put):
        said.say(log, "event=git_file_put_back path=%s", path)
        found.append(Protected(path=path, why=why, time=now_t))
    return failed


def _outside(entries: dict[str, str], rels: list[str]) -> dict[str, str]:
    """``entries`` but those at or below one of ``rels``."""
    if not rels:
        return entries
    below = set(rels)
    return {rel: d for rel, d in entries.items()
            if not any(rel[:i] in below for i in [len(rel)] + [i for i, c in enumerate(rel) if c == "/"])}


def _review_index(part: Part, found: list[Protected], now_t: float) -> None:
    review = indexreview.review(part.own_gitdir, part.root, part.git.taken_ns, part.common,
                                always=configs.weak_stat(part.home, part.common))
    index = os.path.join(part.own_gitdir, "index")
    if review.why_not:
        log.warning("event=git_index_not_reviewed gitdir=%s why=%s", part.own_gitdir, review.why_not)
    if review.moved_aside:
        found.append(Protected(path=index, time=now_t, why=(
            f"an index the check cannot review (a split or sparse index your configuration asks for none of, a "
            f"symlink, a FIFO): moved aside to {review.moved_aside}; `git reset` makes a new one from HEAD")))
    if review.hid:
        found.append(Protected(path=index, time=now_t, why=(
            f"said {len(review.hid)} files the session changed were unchanged ({', '.join(review.hid[:5])}"
            f"{', ...' if len(review.hid) > 5 else ''}; or a filter such as Git LFS's makes them differ): "
            f"their entries reset, git compares their content at its next look")))


def _resolved(path: str) -> str:
    """``os.path.realpath(path)``, or "/" (which overlaps every path) where
    it cannot be told: a loop, a chain of symbolic links deeper than the
    interpreter follows (a session can make one)."""
    try:
        return os.path.realpath(path)
    except (OSError, RecursionError, ValueError):
        return "/"


def common_of(root: str, layout: GitLayout) -> str:
    """The repository's common git directory, resolved, or ""."""
    if layout.kind == "repository":
        return os.path.realpath(os.path.join(root, ".git"))
    if layout.kind == "linked" and layout.readable:
        return os.path.realpath(layout.readable[0])
    return ""


def ident_of(root: str) -> list[int]:
    """``Part.ident`` of the directory ``root`` as it is now: its device,
    inode and the inode's generation (``FS_IOC_GETVERSION``; 0 where the
    file system keeps none): ext4 gives a directory removed and made anew
    at once (``rm -rf`` and ``git clone``) the inode number it freed, and a
    new generation. [] when it cannot be looked at."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        try:
            generation = struct.unpack("l", fcntl.ioctl(fd, _FS_IOC_GETVERSION, bytes(8)))[0]
        except OSError:
            generation = 0
    finally:
        os.close(fd)
    return [st.st_dev, st.st_ino, generation]


_FS_IOC_GETVERSION = 0x80087601  # _IOR('v', 1, long)


def drop_replaced(record: Record, now_t: float, reach: list[str] | None) -> list[Protected]:
    """The parts of a dead daemon's ``record`` whose worktree's root is
    another directory than at the join (``Part.ident``; a part of an older
    daemon's record has none, and stays), taken out of it with their
    repository's history, each said: checked against that baseline, a repository cloned
    anew at the path had the old one's branches and objects written into it,
    and the user's work in it taken for a session's. A worktree gone
    altogether stays: its check says so."""
    said: list[Protected] = []
    if record.reach is None or reach is None:  # what sessions could write is not known (an older record): none
        return said
    writable = [*record.reach, *reach]  # ``reach``: every record's of the state directory (recordfiles.reach_of_all)
    for part in list(record.parts):
        # The root alone decides, and only one whose parent no session could
        # write (of its domain, or of any other whose record is on disk): a
        # session can swap a repository's ``.git`` for a copy (a new inode),
        # or, on a worktree around another one's (a part inside its part, or
        # a policy's read_write path above a root, in another domain too),
        # that worktree itself, and would then have the check dropped.
        if any(is_within(os.path.dirname(part.root), r) for r in writable):
            continue
        now = ident_of(part.root)
        if len(part.ident) != 3 or not now or now == part.ident:
            continue
        record.parts.remove(part)
        if part.common and not any(p.common == part.common for p in record.parts):
            record.histories = [h for h in record.histories if h.common != part.common]
        said.append(Protected(path=part.root, time=now_t, why=(
            "another directory than at its baseline (removed, and made or cloned anew at its path): the baseline "
            "a daemon that stopped kept of it was dropped, and nothing of it written here")))
    return said

