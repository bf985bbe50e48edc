"""dispatchd.daemon.gitguard.layouts: what of a repository or a linked worktree
stays read-only, what is granted, and pointers that are not believed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import layouts
from tests.unit.gitrepo import git, submodule_repo

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)


def test_inspect_a_repository(repo: Path) -> None:
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    assert layout.kind == "repository"
    assert layout.index == str(repo / ".git" / "index")
    assert layout.read_only == [str(repo / ".git" / "config"), str(repo / ".git" / "hooks")]
    assert layout.writable == [] and layout.readable == []


def test_inspect_a_linked_worktree(repo: Path, tmp_path: Path) -> None:
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    layout = layouts.inspect_git(str(linked), uid=os.getuid())
    common = repo / ".git"
    gitdir = common / "worktrees" / "linked"
    assert layout.kind == "linked"
    assert layout.readable == [str(common)]
    assert layout.writable == [str(gitdir), str(common / "objects"), str(common / "refs"), str(common / "logs")]
    assert layout.read_only == [str(linked / ".git"), str(gitdir / "commondir"), str(gitdir / "gitdir")]
    assert layout.index == str(gitdir / "index")


def test_a_pointer_that_does_not_point_back_is_not_believed(repo: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    # A .git file naming another repository's worktree entry it is not.
    (fake / ".git").write_text(f"gitdir: {repo / '.git'}\n")
    layout = layouts.inspect_git(str(fake), uid=os.getuid())
    assert layout.kind == "refused"
    assert layout.writable == [] and layout.readable == []
    assert layout.read_only == [str(fake / ".git")]


def test_a_pointer_forged_inside_the_worktree_grants_nothing(tmp_path: Path) -> None:
    # W = .../worktrees/feat names itself as its git directory, and the
    # directory two levels up as the common one: the user's home, say.
    home = tmp_path / "home"
    worktree = home / "worktrees" / "feat"
    worktree.mkdir(parents=True)
    (home / "secret.txt").write_text("s")
    for d in ("objects", "refs"):
        (home / d).mkdir()
    (home / "HEAD").write_text("ref: refs/heads/main\n")
    (worktree / "HEAD").write_text("ref: refs/heads/main\n")
    (worktree / ".git").write_text("gitdir: .\n")
    (worktree / "gitdir").write_text(f"{worktree / '.git'}\n")
    (worktree / "commondir").write_text("../..\n")
    layout = layouts.inspect_git(str(worktree), uid=os.getuid())
    assert layout.kind == "refused" and layout.readable == [] and layout.writable == []
    assert layout.note == f"the git directory {worktree} is the worktree, inside it, or around it; not granted"


def test_a_common_directory_that_is_no_repository_is_not_believed(repo: Path, tmp_path: Path) -> None:
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    os.rename(repo / ".git" / "objects", repo / ".git" / "objects.moved")
    layout = layouts.inspect_git(str(linked), uid=os.getuid())
    assert layout.kind == "refused" and layout.readable == [] and layout.writable == []
    assert layout.note == f"{repo / '.git'} is not a git repository; not granted"


def test_every_git_directory_of_a_repository_is_protected(tmp_path: Path) -> None:
    r = submodule_repo(tmp_path)
    dotgit = r / ".git"
    layout = layouts.inspect_git(str(r), uid=os.getuid())
    assert layout.kind == "repository"
    assert layout.gitdirs == [str(dotgit), str(dotgit / "modules" / "libs" / "sub"), str(r / "emb" / ".git")]
    assert (dotgit / "hooks").is_dir()  # made, empty, to be held read-only
    protected = set(layout.read_only)
    for gitdir in layout.gitdirs:
        assert {f"{gitdir}/config", f"{gitdir}/hooks"} <= protected, gitdir
    assert str(dotgit / "worktrees" / "other") in protected  # the other worktree's entry, whole


def test_a_hooks_path_inside_the_git_directory_is_held_as_hooks_is(repo: Path, tmp_path: Path) -> None:
    """``core.hooksPath = .git/myhooks``: held read-only; the twins: one in the
    worktree (the code's, checked at the end), one reached through a symlink,
    one outside the repository, none bound."""
    for d in (".git/myhooks", ".githooks", ".git/real"):
        (repo / d).mkdir()
    (repo / ".git" / "linked").symlink_to("real")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for value in (".git/myhooks", ".githooks", ".git/linked", str(outside)):
        git(repo, "config", "--add", "core.hooksPath", value)
    git(repo, "config", "--add", "core.hooksPath", ".git/not-yet/hooks")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    assert str(repo / ".git" / "myhooks") in layout.read_only
    assert str(repo / ".git" / "not-yet" / "hooks") in layout.read_only  # made, empty, to be held
    assert os.listdir(repo / ".git" / "not-yet" / "hooks") == []
    (repo / ".git" / "swapped").symlink_to(outside)  # a link on the way: nothing made through it
    git(repo, "config", "--add", "core.hooksPath", ".git/swapped/hooks")
    assert str(repo / ".git" / "swapped" / "hooks") not in layouts.inspect_git(str(repo), uid=os.getuid()).read_only
    assert os.listdir(outside) == []
    for not_held in (repo / ".githooks", repo / ".git" / "linked", repo / ".git" / "real", outside):
        assert str(not_held) not in layout.read_only


def test_a_hooks_path_an_included_file_sets_is_held_too(repo: Path, tmp_path: Path) -> None:
    """``core.hooksPath = .git/fromin`` set in a file the config includes (in
    ``.git``; beside the code, two deep; under ``includeIf``): git reads it
    as the repository's own, and the end checked it, but only the config's
    own was bound read-only. The twins: one the config sets itself is held;
    one an include sets beside the code (``.githooks``) is not (the code's);
    an include that leads out of the worktree through a symlink, or loops,
    is not followed (nothing made, no hang)."""
    for d in (".git/myhooks", ".git/fromin", ".git/deeper", ".git/cond", ".githooks", ".git/outside"):
        (repo / d).mkdir()
    (repo / ".git" / "shared.inc").write_text("[core]\n\thooksPath = .git/fromin\n")
    (repo / ".gitconfig.shared").write_text("[include]\n\tpath = more.inc\n[core]\n\thooksPath = .githooks\n")
    (repo / "more.inc").write_text("[core]\n\thooksPath = .git/deeper\n[include]\n\tpath = more.inc\n")
    (repo / ".git" / "cond.inc").write_text("[core]\n\thooksPath = .git/cond\n")
    elsewhere = tmp_path / "elsewhere.inc"
    elsewhere.write_text("[core]\n\thooksPath = .git/outside\n")
    (repo / "out.inc").symlink_to(elsewhere)
    with open(repo / ".git" / "config", "a") as config:  # written as is: git itself stops at the loop
        config.write(f"[core]\n\thooksPath = .git/myhooks\n[include]\n\tpath = shared.inc\n"
                     f"\tpath = ../.gitconfig.shared\n\tpath = ../out.inc\n"
                     f"[includeIf \"gitdir:{repo}/\"]\n\tpath = cond.inc\n")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    held = {p for p in layout.read_only if p.startswith(str(repo / ".git")) or p.startswith(str(repo / ".githooks"))}
    for where in (".git/myhooks", ".git/fromin", ".git/deeper", ".git/cond"):
        assert str(repo / where) in held, where
    assert str(repo / ".githooks") not in held and str(repo / ".git" / "outside") not in held


def test_a_linked_open_refuses_a_common_directory_whose_hooks_path_hook_has_another_link(
        repo: Path, tmp_path: Path) -> None:
    """``core.hooksPath = .git/myhooks`` (set by an include here): its hook
    hard-linked into ``.git/objects`` at an object's name (which the open
    does not stat) was a way for a linked worktree's session, granted
    ``objects`` writable, to write it; only ``config`` and ``hooks/*``
    refused the open. The twins: without the link the open is granted; a
    sample there of two names refuses nothing (git runs none); nothing is
    made in the common directory for a hooks path missing there."""
    hooks = repo / ".git" / "myhooks"
    hooks.mkdir()
    (hooks / "pre-commit").write_text("#!/bin/sh\n")
    (repo / ".git" / "objects" / "ab").mkdir()
    os.link(hooks / "pre-commit", repo / ".git" / "objects" / "ab" / ("c" * 38))
    (hooks / "pre-push.sample").write_text("#!/bin/sh\n")
    os.link(hooks / "pre-push.sample", repo / ".git" / "pre-push.sample")  # not where a linked session writes
    (repo / ".git" / "hooks.inc").write_text("[core]\n\thooksPath = .git/myhooks\n\thooksPath = .git/not-yet\n")
    git(repo, "config", "include.path", "hooks.inc")
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    layout = layouts.inspect_git(str(linked), uid=os.getuid())
    assert layout.kind == "refused" and layout.writable == []
    assert layout.note == (f"{hooks / 'pre-commit'} has another hard link (a name elsewhere for the same file, "
                           "which a write through would change); not granted (yours? `cp -p NAME NAME.new && mv "
                           "NAME.new NAME` makes it a file of its own)")
    assert not (repo / ".git" / "not-yet").exists()
    (hooks / "pre-commit").unlink()
    (hooks / "pre-commit").write_text("#!/bin/sh\n")
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"


def test_a_hooks_symlink_into_the_worktree_protects_its_target(repo: Path) -> None:
    shutil.rmtree(repo / ".git" / "hooks")
    (repo / "githooks").mkdir()
    (repo / ".git" / "hooks").symlink_to("../githooks")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    assert str(repo / "githooks") in layout.read_only
    assert str(repo / ".git" / "hooks") not in layout.read_only  # a symlink is not bound over
