"""dispatchd.daemon.gitguard.confreach, and the includes the end's look
follows: what a git directory's configuration names (its hooks paths, its
included files) found at the open, held read-only where it lies inside the
git directory, made only where git gives no name of its own, and both
walks of includes bounded in work (real repositories made by git)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import configs, confreach, layouts, snapshots
from dispatchd.errors import WorktreeError
from tests.unit.gitrepo import git

pytestmark = pytest.mark.process  # starts git

PAST = "more includes than dispatchd follows (10000 include paths, 4 MiB of included files)"


def _reach(repo: Path) -> confreach.Reach:
    return confreach.reach(str(repo), str(repo / ".git"), configs.IncludeBudget(), make=False)


@pytest.mark.parametrize("include", ["hooks.inc", "inc/hooks.inc", "myhooks/hooks.inc"])
def test_a_file_the_config_includes_inside_the_git_directory_is_held_read_only(repo: Path, include: str) -> None:
    """``[include] path = hooks.inc`` (``.git/hooks.inc``) sets the held
    hooks path: the include itself was writable, and a session rewrote it
    to ``core.hooksPath = evil``, the user's commit meanwhile running its
    hook. It is held as ``config`` is, and a directory on the way to it is
    a mount point of its own (a bind moves with a directory renamed around
    it), but not one held itself (the hooks path: bound writable first, it
    lost its read-only bind). The twins: an include beside the code is not
    held (the code's, checked at the end), nor one missing (nothing is made
    for it)."""
    (repo / ".git" / "myhooks").mkdir()
    (repo / ".git" / include).parent.mkdir(exist_ok=True)
    (repo / ".git" / include).write_text("[core]\n\thooksPath = .git/myhooks\n")
    (repo / "shared.inc").write_text("[include]\n\tpath = .git/missing.inc\n")
    for value in (include, "../shared.inc"):
        git(repo, "config", "--add", "include.path", value)
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    assert {str(repo / ".git" / include), str(repo / ".git" / "myhooks")} <= set(layout.read_only)
    assert str(repo / "shared.inc") not in layout.read_only
    assert not (repo / ".git" / "missing.inc").exists()
    steps = {str(repo / ".git" / "inc")} if include.startswith("inc/") else set()
    assert steps <= set(layout.mount_points) and str(repo / ".git" / "myhooks") not in layout.mount_points


@pytest.mark.parametrize("named", [".git/index.lock", ".git/hooks/pre-commit", ".git/ORIG_HEAD",
                                   ".git/refs/heads/feature", ".git/packed-refs", ".git/sharedindex.0a"])
def test_a_missing_hooks_path_is_made_only_at_a_name_git_gives_nothing(repo: Path, named: str) -> None:
    """An include a session rewrote named ``.git/index.lock``: the next
    open made it a directory (a missing hooks path inside ``.git`` is made,
    to be held) and the user's ``git commit`` failed ("File exists"); so
    for any name git gives a file or directory of its own there. The twin:
    ``.git/myhooks2`` is made, empty, and held."""
    (repo / "shared.inc").write_text(f"[core]\n\thooksPath = {named}\n\thooksPath = .git/myhooks2\n")
    git(repo, "config", "include.path", "../shared.inc")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    assert not os.path.isdir(repo / named) and str(repo / named) not in layout.read_only
    assert os.listdir(repo / ".git" / "myhooks2") == [] and str(repo / ".git" / "myhooks2") in layout.read_only
    git(repo, "commit", "-q", "--allow-empty", "-m", "the user's")


def test_the_open_s_include_walk_is_bounded_in_work_and_refuses_past_it(repo: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared config beside the code the user's config includes, which a
    session can write: 64 files (the bound) each listing 20,000 includes of
    itself. Each listed include was resolved (``realpath``) before being
    found seen: 1.3 million resolutions here, 94 s with 1 MiB files, at
    each open. Each distinct one is resolved once now, and past 4 MiB of
    included files read the open is refused, said (what the configuration
    names is not known: a hooks path it sets would be left unheld). The
    twin: an honest chain of includes yields its hooks path."""
    git(repo, "config", "include.path", "../inc0")
    for i in range(64):
        kids = "".join(f"path=inc{j}\n" for j in (2 * i + 1, 2 * i + 2) if j < 64)
        (repo / f"inc{i}").write_text("[include]\n" + kids + f"path=inc{i}\n" * 20000)
    real, calls = os.path.realpath, [0]

    def counted(path: str, *args: object, **kw: object) -> str:
        calls[0] += 1
        return real(path)

    monkeypatch.setattr(os.path, "realpath", counted)
    with pytest.raises(WorktreeError) as refused:
        layouts.inspect_git(str(repo), uid=os.getuid())
    assert str(refused.value) == f"{repo}: its git configuration has {PAST}; no session opened"
    assert calls[0] < 200
    monkeypatch.setattr(os.path, "realpath", real)
    for i in range(64):
        (repo / f"inc{i}").unlink()
    (repo / ".git" / "myhooks").mkdir()
    git(repo, "config", "--replace-all", "include.path", "../a.inc")
    (repo / "a.inc").write_text("[include]\n\tpath = b.inc\n")
    (repo / "b.inc").write_text("[core]\n\thooksPath = .git/myhooks\n")
    assert _reach(repo).hooks_inside == [str(repo / ".git" / "myhooks")]
    assert str(repo / ".git" / "myhooks") in layouts.inspect_git(str(repo), uid=os.getuid()).read_only


def test_distinct_includes_past_the_bound_refuse_the_open(repo: Path) -> None:
    """20,000 distinct include paths outside the worktree (not read, so
    not counted among the 64 files) in one shared config: each was
    resolved; past 10,000 the open is refused. The twin: 100 of them are
    looked at, and the open goes on."""
    git(repo, "config", "include.path", "../many.inc")
    (repo / "many.inc").write_text("[include]\n" + "".join(f"path=/nowhere/x{i}\n" for i in range(20000)))
    with pytest.raises(configs.PastBound):
        _reach(repo)
    (repo / "many.inc").write_text("[include]\n" + "".join(f"path=/nowhere/x{i}\n" for i in range(100)))
    assert _reach(repo) == confreach.Reach([], [], [])
    assert layouts.inspect_git(str(repo), uid=os.getuid()).kind == "repository"


def test_the_end_s_include_walk_is_bounded_and_fails_the_check_past_it(repo: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The end's look (``gitdirs.Walk.config_targets``) resolved every
    listed include before its ``included`` dropped it (125 s). Now each
    distinct one once, within the walk's budget; past it, the included file
    that names more is never equal (the end moves it aside, the user's
    kept bytes put back) and the check fails, saying so: what those
    includes name was not looked at. The twin: an honest include is
    recorded by its digest, and the check passes."""
    for name in ("honest.inc", "shared.inc"):
        (repo / name).write_text("[core]\n\tbare = false\n")
        git(repo, "config", "--add", "include.path", f"../{name}")
    before = snapshots.take(str(repo), GitLayout("repository"))
    assert before.included["honest.inc"].startswith("file:") and before.unfollowed == ""
    assert snapshots.quarantine(str(repo), before, snapshots.take(str(repo), GitLayout("repository"))) == ([], [])
    (repo / "shared.inc").write_text("[include]\n" + "".join(f"path=x{i}\n" for i in range(20000)))  # a session's
    real, calls = os.path.realpath, [0]

    def counted(path: str, *args: object, **kw: object) -> str:
        calls[0] += 1
        return real(path)

    monkeypatch.setattr(os.path, "realpath", counted)
    now = snapshots.take(str(repo), GitLayout("repository"))
    monkeypatch.setattr(os.path, "realpath", real)
    assert calls[0] <= configs.MAX_INCLUDE_VALUES + 10
    assert now.included["shared.inc"].startswith("more includes than dispatchd follows:") and now.unfollowed == PAST
    assert now.included["honest.inc"] == before.included["honest.inc"]
    moved, failed = snapshots.quarantine(str(repo), before, now)
    assert failed == [f"{repo}: its git configuration has {PAST}: what they name was not checked"]
    assert [os.path.basename(m).startswith("shared.inc.quarantined-by-dispatchd-") for m in moved] == [True], moved
