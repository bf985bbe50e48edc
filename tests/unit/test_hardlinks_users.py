"""dispatchd.daemon.gitguard.hardlinks at a part's end (``parts.check_part``,
on real repositories made by git): a link the user made, there at the
baseline, is left as it is; one a session could have made (a file's count
rose since) is split."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from dispatchd.daemon.gitguard import arealinks, gitlock, hardlinks, layouts, parts, redirects, runnables, snapshots
from dispatchd.daemon.gitguard.parts import Part, Protected
from dispatchd.policy import DEFAULT_PROTECTED
from tests.unit.gitrepo import ENV, empty_repo, git

pytestmark = pytest.mark.process  # starts git

AREA = ("had {} other hard link(s), a name a linked worktree's session could write them through; made a file of "
        "its own (the other names keep the old one)")
ROSE = ("had {} other hard link(s), more than at the session start, a way to write it from where a session could; "
        "made a file of its own (the other names keep the old one)")


def baseline(root: Path) -> Part:
    """A part's baseline, as ``baselines`` takes it at a join."""
    layout = layouts.inspect_git(str(root), uid=os.getuid())
    return Part(root=str(root), layout=layout, git=snapshots.take(str(root), layout, keep=True),
                redirects=redirects.redirects_present(layout, str(root)),
                tree=parts.baseline_tree(str(root), DEFAULT_PROTECTED, [], layout), names=list(DEFAULT_PROTECTED))


def end(part: Part, wrote: bool = True) -> tuple[list[tuple[str, str]], list[str]]:
    """One part's end, as ``parts.check_part`` runs it: what it did, with why, and what it could not."""
    found: list[Protected] = []
    failed = parts.check_part(part, found, time.time(), wrote=wrote)
    return [(f.path, f.why) for f in found], failed


def _dotfiles(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    """A repository holding ``name`` (mode 0755), hard-linked by the user:
    into a home directory, or, for a hook, under a second hook name."""
    repo = empty_repo(tmp_path / "dotfiles")
    home = tmp_path / "home"
    home.mkdir()
    target = repo / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("#!/bin/sh\nexec my-dispatcher\n")
    target.chmod(0o755)
    other = repo / ".git" / "hooks" / "pre-commit" if name.startswith(".git/") else home / os.path.basename(name)
    os.link(target, other)
    return repo, target, other


@pytest.mark.parametrize("name", [".bashrc", ".vscode/settings.json", ".git/hooks/pre-push"])
def test_a_link_the_user_made_before_the_session_is_left_at_its_end(tmp_path: Path, name: str) -> None:
    """A dotfiles repository's ``.bashrc`` hard-linked into the home (the
    user's later edit of ``~/.bashrc`` reaches the repository), VS Code
    settings shared between projects, a hook dispatcher under two names:
    links there at the baseline are the user's, and an end that changed
    nothing leaves them (before: each was split at every end, said as a
    way to write it from where a session could)."""
    repo, target, other = _dotfiles(tmp_path, name)
    assert end(baseline(repo)) == ([], [])
    assert os.stat(target).st_nlink == 2 and os.stat(target).st_ino == os.stat(other).st_ino


@pytest.mark.parametrize("name", [".bashrc", ".vscode/settings.json", ".git/hooks/pre-push"])
def test_a_link_a_session_adds_into_logs_is_made_a_file_of_its_own_there(tmp_path: Path, name: str) -> None:
    """The twin: the same file, one more link made during the session into
    ``.git/logs``, for a later linked session to write through: the end
    gives that name an inode of its own (``arealinks.split``), said, and
    the user's two names keep theirs."""
    repo, target, other = _dotfiles(tmp_path, name)
    part = baseline(repo)
    planted = repo / ".git" / "logs" / "x"
    os.link(target, planted)  # the session
    assert end(part) == ([(str(planted), AREA.format(2))], [])
    assert os.stat(planted).st_nlink == 1 and planted.read_text() == target.read_text()
    assert os.stat(target).st_nlink == 2 and os.stat(target).st_ino == os.stat(other).st_ino


def test_a_link_made_outside_git_s_directories_to_a_file_of_the_user_s_is_split_at_its_end(tmp_path: Path) -> None:
    """A file of the user's whose count rose, its new name somewhere no
    area walk reaches (here the worktree; another repository's ``logs``
    from an outer worktree): the user's name made a file of its own,
    said; a link there at the baseline is left (above)."""
    repo, target, other = _dotfiles(tmp_path, ".bashrc")
    part = baseline(repo)
    os.link(target, repo / "elsewhere")
    assert end(part) == ([(str(target), ROSE.format(2))], [])
    assert os.stat(target).st_nlink == 1 and os.stat(other).st_nlink == 2


def test_an_older_record_without_counts_splits_every_link_as_before(tmp_path: Path) -> None:
    """A baseline recorded before the counts were (no ``nlinks``: it loads
    as None) splits every file with another link, as then, said without
    claiming the count rose."""
    repo, target, _ = _dotfiles(tmp_path, ".bashrc")
    part = baseline(repo)
    old = msgspec.json.decode(msgspec.json.encode(part.tree).replace(b',"nlinks":{".bashrc":2}', b""),
                              type=runnables.TreeSnapshot)
    assert old.nlinks is None and part.tree.nlinks == {".bashrc": 2}
    assert msgspec.json.decode(b"{}", type=snapshots.GitSnapshot).nlinks is None
    assert end(msgspec.structs.replace(part, tree=old)) == (
        [(str(target), "had 1 other hard link(s), a way to write it from where a session could; made a file of its "
                       "own (the other names keep the old one)")], [])


NOT_GRANTED = ("has another hard link (a name elsewhere for the same file, which a write through would change); "
               "not granted (the next end of a session on the main worktree makes this name a file of its own)")


def _linked(repo: Path, where: Path) -> Path:
    git(repo, "worktree", "add", "-q", str(where), "-b", f"side-{where.name}")
    return where


def test_a_repository_copied_with_cp_al_has_its_linked_worktree_granted_after_a_main_worktree_end(
        tmp_path: Path) -> None:
    """``cp -al repo copy`` (a restore from hard-linked snapshots) leaves
    each file of ``copy/.git`` a second name in ``repo/.git``; git appends
    to a reflog in place, so ``logs/HEAD`` stays linked. The linked open is
    refused, saying what ends it; the end of a session on the main
    worktree, which changed nothing, gives each such name of the copy's an
    inode of its own (its config too), the original's keeping theirs, and
    the linked worktree is granted (before: refused for good, the note
    naming no way out)."""
    src = empty_repo(tmp_path / "src")
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(src), str(copy)], check=True)
    git(copy, "commit", "-q", "--allow-empty", "-m", "work in the copy")  # appends to logs/HEAD: still linked
    linked = _linked(copy, tmp_path / "wt")
    first = layouts.inspect_git(str(linked), uid=os.getuid())
    assert first.kind == "refused" and first.note == f"{copy / '.git' / 'logs' / 'HEAD'} {NOT_GRANTED}"
    theirs = (src / ".git" / "logs" / "HEAD").read_text()
    done, failed = end(baseline(copy))
    assert failed == [] and str(copy / ".git" / "logs" / "HEAD") in [path for path, _ in done]
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"
    assert os.stat(src / ".git" / "logs" / "HEAD").st_nlink == 1 and os.stat(src / ".git" / "config").st_nlink == 1
    assert (src / ".git" / "logs" / "HEAD").read_text() == theirs
    assert "work in the copy" in (copy / ".git" / "logs" / "HEAD").read_text()


def test_an_end_of_sessions_that_wrote_nothing_splits_in_the_linked_areas_only_with_a_linked_worktree(
        tmp_path: Path) -> None:
    """A domain whose sessions were never granted the write lock made no
    link: its end spares the walk of ``logs``, ``refs`` and ``objects``
    (some ms a close on a repository of loose objects) where no linked
    worktree is there to write through one; the link the user left stays.
    The twin: with a linked worktree (whose open such a link refuses), the
    same end splits it, as the refusal's note says."""
    repo = empty_repo(tmp_path / "repo")
    kept = repo / ".git" / "logs" / "kept"
    os.link(repo / ".git" / "logs" / "HEAD", kept)
    assert end(baseline(repo), wrote=False) == ([], [])
    assert os.stat(kept).st_nlink == 2
    _linked(repo, tmp_path / "wt")
    done, failed = end(baseline(repo), wrote=False)
    assert (failed, [why for _, why in done]) == ([], [AREA.format(1)]), done
    assert os.stat(kept).st_nlink == os.stat(repo / ".git" / "logs" / "HEAD").st_nlink == 1


def test_a_local_clone_has_its_linked_worktree_granted(tmp_path: Path) -> None:
    """The twin: ``git clone --local`` hard-links only ``objects``, at git's names."""
    src = empty_repo(tmp_path / "src")
    git(tmp_path, "clone", "-q", "--local", str(src), "clone")
    linked = _linked(tmp_path / "clone", tmp_path / "wt")
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"
    assert end(baseline(tmp_path / "clone")) == ([], [])


def _paused_rebase(repo: Path) -> Path:
    for i in range(2):
        git(repo, "commit", "-q", "--allow-empty", "-m", f"c{i}")
    env = dict(ENV, GIT_SEQUENCE_EDITOR="sed -i 1s/^pick/edit/")
    subprocess.run(["git", "rebase", "-q", "-i", "--keep-empty", "HEAD~2"], cwd=repo, env=env, check=True,
                   capture_output=True)
    return repo / ".git" / "rebase-merge" / "git-rebase-todo"


@pytest.mark.parametrize("name", ["objects/aa-todo", "objects/ab/" + "c" * 38, "objects/zz/todo"])
def test_a_rebase_todo_linked_into_objects_is_written_by_no_later_linked_session(tmp_path: Path, name: str) -> None:
    """The user's interactive rebase is paused; a session on the main
    worktree (full mode: ``.git`` one mount) links the todo into
    ``objects``, which a later linked session is granted writable. A name
    not of git's refuses the linked open meanwhile; at the end, that name,
    or one at an object's name linked since the baseline, is made a file
    of its own, said: what the linked session then appends reaches nothing
    of the user's, and ``git rebase --continue`` runs no ``exec`` of its."""
    repo = empty_repo(tmp_path / "r")
    linked = _linked(repo, tmp_path / "wt")
    todo = _paused_rebase(repo)
    part = baseline(repo)
    planted = repo / ".git" / name
    planted.parent.mkdir(exist_ok=True)
    os.link(todo, planted)  # the session
    meanwhile = layouts.inspect_git(str(linked), uid=os.getuid())
    if name.startswith("objects/ab/"):  # not stat'ed at an open: written through until the end (left open)
        assert meanwhile.kind == "linked"
    else:
        assert meanwhile.kind == "refused" and meanwhile.note == f"{planted} {NOT_GRANTED}"
    assert end(part) == ([(str(planted), AREA.format(1))], [])
    layout = layouts.inspect_git(str(linked), uid=os.getuid())
    assert layout.kind == "linked" and str(repo / ".git" / "objects") in layout.writable
    with open(planted, "a") as f:  # the later linked session
        f.write(f"exec touch {tmp_path}/PWNED\n")
    subprocess.run(["git", "rebase", "--continue"], cwd=repo, env=ENV, check=True, capture_output=True)
    assert not (tmp_path / "PWNED").exists() and not (repo / ".git" / "rebase-merge").exists()


def test_an_unlinked_rebase_todo_continues_as_the_user_s(tmp_path: Path) -> None:
    """The twin: no link, nothing said, the linked worktree granted, the rebase continues."""
    repo = empty_repo(tmp_path / "r")
    linked = _linked(repo, tmp_path / "wt")
    _paused_rebase(repo)
    assert end(baseline(repo)) == ([], [])
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"
    subprocess.run(["git", "rebase", "--continue"], cwd=repo, env=ENV, check=True, capture_output=True)
    assert not (repo / ".git" / "rebase-merge").exists()


def test_a_reflog_a_session_linked_to_a_new_name_in_logs_refuses_no_linked_open_after_its_end(tmp_path: Path) -> None:
    """``ln .git/logs/HEAD .git/logs/refs/heads/zz`` by a session on the
    main worktree: refused meanwhile, said; at its end one of the two
    names, both in ``logs``, is made a file of its own under git's lock of
    its ref, and linked opens are granted again (before: refused for good,
    git's appends keeping the link)."""
    repo = empty_repo(tmp_path / "r")
    linked = _linked(repo, tmp_path / "wt")
    part = baseline(repo)
    head = repo / ".git" / "logs" / "HEAD"
    planted = repo / ".git" / "logs" / "refs" / "heads" / "zz"
    os.link(head, planted)
    assert layouts.inspect_git(str(linked), uid=os.getuid()).note in (f"{head} {NOT_GRANTED}",
                                                                       f"{planted} {NOT_GRANTED}")
    done, failed = end(part)
    assert failed == [] and len(done) == 1 and done[0] in [(str(head), AREA.format(1)), (str(planted), AREA.format(1))]
    git(repo, "commit", "-q", "--allow-empty", "-m", "the user's")
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"
    assert os.stat(head).st_ino != os.stat(planted).st_ino
    assert "the user's" in head.read_text() and "the user's" not in planted.read_text()


def test_more_files_in_logs_than_are_looked_at_are_said_with_their_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``MAX_SCANNED`` (200,000) entries a session left in ``logs``,
    the linked open is refused and the end's split fails, each naming the
    directory listed then (before: the note said `git pack-refs --all`,
    which packs no reflog). The twin: within the bound, granted."""
    monkeypatch.setattr(arealinks, "MAX_SCANNED", 40)
    repo = empty_repo(tmp_path / "r")
    linked = _linked(repo, tmp_path / "wt")
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"  # the twin
    part = baseline(repo)
    junk = repo / ".git" / "logs" / "junk"
    junk.mkdir()
    for i in range(50):
        (junk / str(i)).write_text("")
    said = (f"{repo / '.git'}: more than 40 files in its refs, logs and objects to look at for hard links, 50 of them "
            f"in {junk} (`git pack-refs --all` packs the refs; a reflog or a file git does not use can be removed)")
    assert layouts.inspect_git(str(linked), uid=os.getuid()).note == f"{said}; not granted"
    assert end(part) == ([], [f"{said}: its other names not made files of their own"])


def test_a_reflog_is_split_only_under_its_ref_s_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Git appends to ``logs/HEAD`` holding ``HEAD.lock``: a copy made
    meanwhile would lose the line. While the lock is held (past the wait)
    the name is left linked, said; the twin: the lock gone, split."""
    monkeypatch.setattr(gitlock, "WAIT_S", 0.2)
    repo = empty_repo(tmp_path / "r")
    part = baseline(repo)
    head = repo / ".git" / "logs" / "HEAD"
    os.link(head, repo / "kept-reflog")  # the other name, outside logs
    lock = repo / ".git" / "HEAD.lock"
    lock.write_text("")
    said = "had 1 other hard link(s), a name a linked worktree's session could write them through"
    assert end(part) == ([], [f"{head}: {said}; not made a file of its own (git's lock {lock} is held)"])
    lock.unlink()
    assert end(part) == ([(str(head), AREA.format(1))], [])
    assert os.stat(head).st_nlink == 1


def test_a_symlink_swapped_in_on_the_way_after_the_walk_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session still running swaps a directory of ``logs`` the walk went
    through for a symlink to a directory of the user's, whose file of the
    same name has another link: the split reaches the directory from the
    common directory with no symlink on the way, and does nothing there.
    The twin: the real directory, split."""
    repo = empty_repo(tmp_path / "r")
    common = repo / ".git"
    users = tmp_path / "users"
    users.mkdir()
    (users / "f").write_text("mine\n")
    os.link(users / "f", tmp_path / "f-too")
    via = common / "logs" / "via"
    via.symlink_to(users)
    found = [(str(via / "f"), os.lstat(users / "f"))]
    monkeypatch.setattr(arealinks, "walk", lambda *a: iter(found))
    ino = os.stat(users / "f").st_ino
    assert arealinks.split(str(common), [], 0, hardlinks.Copied()) == ([], [])
    assert os.stat(users / "f").st_ino == ino and os.stat(users / "f").st_nlink == 2
    via.unlink()
    via.mkdir()
    os.link(users / "f", via / "f")
    found[:] = [(str(via / "f"), os.lstat(via / "f"))]
    assert arealinks.split(str(common), [], 0, hardlinks.Copied()) == ([(str(via / "f"), AREA.format(2))], [])
    assert os.stat(users / "f").st_ino == ino and os.stat(via / "f").st_nlink == 1


def test_a_fan_out_directory_s_names_are_listed_again_only_once_its_ctime_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look through ``objects`` remembers each fan-out directory's odd
    names by its ctime (a close spared 256 listings): unchanged, it is not
    listed again; a name linked into it since (its ctime moved) is found at
    the next look, listed afresh."""
    repo = empty_repo(tmp_path / "repo")
    common = str(repo / ".git")
    fanout = next(p for p in (repo / ".git" / "objects").iterdir() if len(p.name) == 2)
    time.sleep(0.05)  # the directories' ctimes settled: their listings remembered
    assert list(arealinks.walk(common, [])) == []
    listed: list[str] = []
    real = arealinks._names
    monkeypatch.setattr(arealinks, "_names", lambda top: listed.append(top) or real(top))
    assert list(arealinks.walk(common, [])) == [] and listed == []
    todo = repo / ".git" / "todo"
    todo.write_text("pick 1\n")
    os.link(todo, fanout / "todo")
    assert [path for path, _ in arealinks.walk(common, [])] == [str(fanout / "todo")]
    assert listed == [str(fanout)]
