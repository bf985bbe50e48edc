"""dispatchd.daemon.gitguard.snapshots: every git directory of a repository by
content, and what a session changed moved aside (real repositories made by
git, changed as a session could)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import gitdirs, layouts, snapshots
from tests.unit import permission_bits
from tests.unit.gitrepo import empty_repo, git, nested_submodules

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)

FSMONITOR = '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "touch PLANTED; false"\n'
_LAYOUTS: dict[Path, GitLayout] = {}


def _take(repo: Path) -> snapshots.GitSnapshot:
    """As the daemon does: the layout is the one found at open."""
    layout = _LAYOUTS.setdefault(repo, layouts.inspect_git(str(repo), uid=os.getuid()))
    return snapshots.take(str(repo), layout)


def _quarantine(repo: Path, before: snapshots.GitSnapshot) -> tuple[list[str], list[str]]:
    return snapshots.quarantine(str(repo), before, _take(repo))


def _aside(path: Path) -> list[str]:
    """What was moved aside in ``path``'s directory under ``path``'s name."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name + ".quarantined-by-dispatchd-"))


@pytest.fixture
def superproject(tmp_path: Path) -> Path:
    """``sub`` (its git directory in .git/modules/sub), and ``sub``'s own
    submodule ``inner`` (in .git/modules/sub/modules/inner)."""
    return nested_submodules(tmp_path, "super", ["sub"])


def test_every_git_directory_is_found_at_any_depth(superproject: Path) -> None:
    snap = _take(superproject)
    assert set(snap.gitdirs) == {".git", ".git/modules/sub", ".git/modules/sub/modules/inner"}
    assert set(snap.pointers) == {"sub/.git", "sub/inner/.git"}
    assert snap.pointers["sub/.git"].endswith(" -> gitdir:.git/modules/sub")
    assert snap.indexes == {} and snap.complete
    assert "config" in snap.gitdirs[".git/modules/sub"]
    assert not any(k.endswith(".sample") for k in snap.gitdirs[".git/modules/sub"])  # git never runs those


def test_work_inside_submodules_changes_nothing_git_reads(superproject: Path) -> None:
    """The allowed twin: commits in a submodule and in its submodule, a
    checkout of another commit and back, an update of the superproject's
    gitlink: nothing is moved aside."""
    before = _take(superproject)
    sub = superproject / "sub"
    git(sub / "inner", "commit", "-q", "--allow-empty", "-m", "more")
    git(sub, "add", "inner")
    git(sub, "commit", "-q", "-m", "inner moved")
    git(sub, "checkout", "-q", "HEAD~1")
    git(superproject, "submodule", "update", "-q", "--recursive")
    git(sub, "checkout", "-q", "-")
    git(superproject, "add", "sub")
    git(superproject, "commit", "-q", "-m", "sub moved")
    assert _quarantine(superproject, before) == ([], [])


@pytest.mark.parametrize("renamed", [".git/modules/sub", ".git/modules"])
def test_a_rebuilt_submodule_git_directory_is_moved_aside(superproject: Path, renamed: str) -> None:
    """A delayed escape: rename the git directory (or .git/modules)
    away, rebuild it around a config naming a command; the gitfile is
    untouched."""
    before = _take(superproject)
    old = superproject / renamed
    old.rename(superproject / ".aside")
    module = superproject / ".git" / "modules" / "sub"
    aside = superproject / ".aside" if renamed.endswith("sub") else superproject / ".aside" / "sub"
    module.mkdir(parents=True)
    for name in ("HEAD", "objects", "refs", "index", "modules"):
        (aside / name).rename(module / name)
    (module / "config").write_text(FSMONITOR)
    moved, failed = _quarantine(superproject, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{module}.quarantined-by-dispatchd-"), moved
    assert not module.exists() and (superproject / "sub" / ".git").is_file()


def test_the_same_config_in_a_rebuilt_git_directory_is_left_alone(superproject: Path) -> None:
    before = _take(superproject)
    module = superproject / ".git" / "modules" / "sub"
    shutil.copytree(module, superproject / "copy", symlinks=True)
    shutil.rmtree(module)
    (superproject / "copy").rename(module)
    assert _quarantine(superproject, before) == ([], [])


def test_a_submodule_of_a_submodule_made_by_the_session_is_moved_aside(superproject: Path) -> None:
    before = _take(superproject)
    nested = empty_repo(superproject / "sub" / "made", "x")
    (nested / ".git" / "config").write_text(FSMONITOR)
    git(superproject / "sub", "update-index", "--add", "--cacheinfo",
        f"160000,{git(nested, 'rev-parse', 'HEAD').strip()},made")
    moved, failed = _quarantine(superproject, before)
    assert failed == [] and [m.rpartition("/")[0] for m in moved] == [str(nested)], moved
    assert _aside(nested / ".git") and not (nested / ".git").exists()


def test_a_changed_config_deep_down_moves_only_that_git_directory(superproject: Path) -> None:
    before = _take(superproject)
    inner = superproject / ".git" / "modules" / "sub" / "modules" / "inner"
    with open(inner / "config", "a") as f:
        f.write('[core]\n\tfsmonitor = "touch PLANTED; false"\n')
    moved, failed = _quarantine(superproject, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{inner}.quarantined-by-dispatchd-")
    assert (superproject / ".git" / "modules" / "sub" / "config").exists()


@pytest.mark.parametrize("change", ["new hook", "executable hook", "attributes", "config"])
def test_in_the_repositorys_own_git_only_the_changed_file_moves(superproject: Path, change: str) -> None:
    dotgit = superproject / ".git"
    (dotgit / "hooks" / "post-checkout").write_text("#!/bin/sh\n")
    before = _take(superproject)
    target = {"new hook": dotgit / "hooks" / "pre-commit", "executable hook": dotgit / "hooks" / "post-checkout",
              "attributes": dotgit / "info" / "attributes", "config": dotgit / "config"}[change]
    if change == "executable hook":
        target.chmod(0o755)  # the same content, now run by git
    else:
        with open(target, "a") as f:
            f.write("* filter=evil\n" if change == "attributes" else "#!/bin/sh\ntouch PLANTED\n")
    moved, failed = _quarantine(superproject, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{target}.quarantined-by-dispatchd-"), moved
    assert dotgit.is_dir() and (dotgit / "HEAD").exists()


def test_a_gitfile_rewritten_to_lead_elsewhere_is_moved_aside(superproject: Path) -> None:
    before = _take(superproject)
    gitfile = superproject / "sub" / ".git"
    st = gitfile.stat()
    gitfile.write_text("gitdir: ../.git/modules/xyz\n")  # the same length
    os.utime(gitfile, ns=(st.st_atime_ns, st.st_mtime_ns))
    moved, failed = _quarantine(superproject, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{gitfile}.quarantined-by-dispatchd-")


def test_a_gitfile_that_now_leads_outside_through_a_symlink_is_moved_aside(superproject: Path, tmp_path: Path) -> None:
    before = _take(superproject)
    modules = superproject / ".git" / "modules"
    modules.rename(tmp_path / "outside")
    modules.symlink_to(tmp_path / "outside")
    moved, failed = _quarantine(superproject, before)
    # The gitfile, and the symlinked modules (a git directory of the baseline
    # now behind a symlink: git follows it), moved aside, not through.
    assert failed == [] and sorted(Path(m).name.split(".quarantined")[0] for m in moved) == [".git", "modules"], moved
    assert (superproject / ".git").is_dir() and not (superproject / ".git" / "modules").exists()
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["sub"]  # nothing outside touched


def test_a_dot_git_turned_into_a_gitfile_is_moved_aside(superproject: Path) -> None:
    before = _take(superproject)
    (superproject / ".git").rename(superproject / "elsewhere")
    (superproject / ".git").write_text("gitdir: elsewhere\n")
    moved, failed = _quarantine(superproject, before)
    # the gitfile, the git directory it leads to (new), and what no longer leads where it did
    assert failed == [] and {Path(m).name.split(".quarantined-by-dispatchd-")[0] for m in moved} >= {".git", "elsewhere"}
    assert not (superproject / ".git").exists()


def test_an_unreadable_directory_under_modules_is_moved_aside(superproject: Path) -> None:
    before = _take(superproject)
    (superproject / ".git" / "modules" / "new").mkdir()
    (superproject / ".git" / "modules" / "new").chmod(0)
    with permission_bits.obeyed():
        moved, failed = _quarantine(superproject, before)
    assert failed == [] and len(moved) == 1 and "/.git/modules/new.quarantined-by-dispatchd-" in moved[0]
    Path(moved[0]).chmod(0o755)


def test_a_plain_repository_costs_one_walk(tmp_path: Path) -> None:
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q")
    snap = _take(r)
    assert list(snap.gitdirs) == [".git"] and snap.pointers == {} and snap.indexes == {}
    assert _quarantine(r, snap) == ([], [])


def test_mount_points_cover_every_git_directory(superproject: Path) -> None:
    (superproject / "emb").mkdir()
    git(superproject / "emb", "init", "-q")
    layout = layouts.inspect_git(str(superproject), uid=os.getuid())
    dotgit = str(superproject / ".git")
    assert layout.mount_points == [f"{dotgit}/modules", f"{dotgit}/modules/sub", f"{dotgit}/modules/sub/modules",
                                   f"{dotgit}/modules/sub/modules/inner"]
    assert f"{dotgit}/info/attributes" not in layout.read_only  # none: nothing to hold
    (superproject / ".git" / "info" / "attributes").write_text("")
    assert f"{dotgit}/info/attributes" in layouts.inspect_git(str(superproject), uid=os.getuid()).read_only


def test_a_walk_cut_short_hands_no_submodule_to_the_users_git(superproject: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A session can make more directories than the walk looks at, to hide
    one behind them: then .git/modules and the index go aside (git knows no
    submodule), and the failure is reported (the worktree is refused until
    the user has looked)."""
    before = _take(superproject)
    for i in range(40):
        (superproject / ".git" / "modules" / f"d{i:02}").mkdir()
    monkeypatch.setattr(gitdirs, "_MAX_VISITS", 20)
    moved, failed = _quarantine(superproject, before)
    assert len(failed) == 1 and "more git directories than dispatchd checks" in failed[0]
    assert sorted(Path(m).name.split(".quarantined-by-dispatchd-")[0] for m in moved) == ["index", "modules"]
    assert not (superproject / ".git" / "modules").exists() and not (superproject / ".git" / "index").exists()


def test_a_linked_worktrees_own_files_are_compared_by_content(tmp_path: Path) -> None:
    """A linked worktree: its git directory lies outside (COMMON/worktrees/N,
    writable to the session in degraded mode) and its pointer inside."""
    r = empty_repo(tmp_path / "main", "m")
    git(r, "config", "extensions.worktreeConfig", "true")
    linked = tmp_path / "linked"
    git(r, "worktree", "add", "-q", str(linked), "-b", "side")
    entry = r / ".git" / "worktrees" / "linked"
    (entry / "config.worktree").write_text("[user]\n\tname = u\n")
    before = _take(linked)
    assert _LAYOUTS[linked].kind == "linked" and str(entry / "config.worktree") in before.external
    assert _quarantine(linked, before) == ([], [])
    (entry / "config.worktree").write_text(FSMONITOR)
    moved, failed = _quarantine(linked, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{entry}/config.worktree.quarantined-by-")


def test_git_directories_only_the_walk_finds_are_protected_too(superproject: Path) -> None:
    """An in-place submodule of a submodule: not under .git/modules, not in
    the top index; the recursive walk finds it, and the layout holds it."""
    nested = empty_repo(superproject / "sub" / "kept", "k")
    git(superproject / "sub", "update-index", "--add", "--cacheinfo",
        f"160000,{git(nested, 'rev-parse', 'HEAD').strip()},kept")
    layout = layouts.inspect_git(str(superproject), uid=os.getuid())
    assert str(nested / ".git") not in layout.gitdirs
    snap = snapshots.take(str(superproject), layout)
    held = layouts.with_gitdirs(layout, str(superproject), snapshots.gitdir_paths(str(superproject), snap))
    assert held.gitdirs == layout.gitdirs + [str(nested / ".git")]
    assert {str(nested / ".git" / "config"), str(nested / ".git" / "hooks")} <= set(held.read_only)
    assert str(nested / ".git") in held.mount_points
    again = snapshots.take(str(superproject), held)
    assert msgspec.structs.replace(again, taken_ns=snap.taken_ns) == snap  # holding it changes nothing compared
