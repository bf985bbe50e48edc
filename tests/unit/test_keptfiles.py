"""dispatchd.daemon.gitguard.keptfiles: the user's own config, hooks and
review files kept by bytes at the baseline and written back at the end
where a session changed or deleted them; the session's version moved
aside, never deleted; nothing written through a symlink (real repositories
made by git, changed as a session could)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest

from dispatchd.daemon.gitguard import fs, keptfiles, layouts, runnables, snapshots
from tests.unit.gitrepo import empty_repo, git

pytestmark = pytest.mark.process  # starts git

FSMONITOR = '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "touch PLANTED; false"\n'
HOOK = "#!/bin/sh\nexec ./check-before-commit\n"
ASIDE = "git configuration, hooks or state changed or new"  # the report's word for what was kept aside


def _take(repo: Path, keep: bool = False) -> snapshots.GitSnapshot:
    return snapshots.take(str(repo), layouts.inspect_git(str(repo), uid=os.getuid()), keep=keep)


def _end(repo: Path, before: snapshots.GitSnapshot) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """As ``parts.check_part`` does: the look, the quarantine (which leaves
    the kept files to the put-back), the put-back. Returns what went or was
    kept aside, what was put back, what failed."""
    now = _take(repo)
    skip = keptfiles.left_in_place(str(repo), before.kept, now.gitdirs, now.external, included=now.included)
    moved, failed = snapshots.quarantine(str(repo), before, now, skip)
    put, bad = keptfiles.put_back(str(repo), before.kept, now.gitdirs, now.external, included=now.included)
    moved += [path for path, why in put if why == ASIDE]
    return moved, [(path, why) for path, why in put if why != ASIDE], failed + bad


def _aside(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.name + ".quarantined-by-dispatchd-"))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = empty_repo(tmp_path / "repo", "empty")
    git(r, "config", "user.email", "me@example.invalid")
    git(r, "remote", "add", "origin", "https://example.invalid/me/repo.git")
    hook = r / ".git" / "hooks" / "pre-commit"
    hook.write_text(HOOK)
    hook.chmod(0o750)
    (r / ".git" / "info" / "exclude").write_text("secrets.env\n")
    return r


def test_the_baseline_keeps_config_hooks_and_excludes_by_bytes(repo: Path) -> None:
    snap = _take(repo, keep=True)
    kept = {k.rel: k for k in snap.kept}
    assert {".git/config", ".git/hooks/pre-commit", ".git/info/exclude"} <= set(kept)
    assert kept[".git/hooks/pre-commit"].data == HOOK and kept[".git/hooks/pre-commit"].mode == 0o750
    assert "me@example.invalid" in kept[".git/config"].data
    assert not any(k.rel.endswith(".sample") for k in snap.kept)  # git never runs those
    # The record carries them (JSON, as the baseline's record is written).
    again = msgspec.json.decode(msgspec.json.encode(snap), type=snapshots.GitSnapshot)
    assert again.kept == snap.kept
    assert _take(repo).kept == []  # an end's look keeps nothing


def test_an_unchanged_repository_is_left_byte_for_byte(repo: Path) -> None:
    """The allowed twin: commits and a branch, nothing of the kept files
    touched: nothing moved, nothing written."""
    before = _take(repo, keep=True)
    config_ino = (repo / ".git" / "config").stat().st_ino
    (repo / "f").write_text("x\n")
    git(repo, "add", "f")
    git(repo, "commit", "-qm", "work", "--no-verify")
    git(repo, "branch", "side")
    assert _end(repo, before) == ([], [], [])
    assert (repo / ".git" / "config").stat().st_ino == config_ino


def test_a_rewritten_config_is_moved_aside_and_the_users_put_back(repo: Path) -> None:
    config = repo / ".git" / "config"
    original = config.read_bytes()
    before = _take(repo, keep=True)
    config.write_text(FSMONITOR)
    moved, put, failed = _end(repo, before)
    assert failed == [] and moved == [str(_aside(config)[0])]
    assert put == [(str(config), "yours, as it was before the session changed it, put back")]
    assert config.read_bytes() == original
    assert _aside(config)[0].read_text() == FSMONITOR  # the session's, kept beside for review
    assert git(repo, "config", "user.email").strip() == "me@example.invalid"
    assert _end(repo, before) == ([], [], [])  # a later end finds it as the baseline had it


def test_a_deleted_config_and_hook_come_back_with_their_mode(repo: Path) -> None:
    hook = repo / ".git" / "hooks" / "pre-commit"
    before = _take(repo, keep=True)
    (repo / ".git" / "config").unlink()
    hook.unlink()
    moved, put, failed = _end(repo, before)
    assert failed == [] and moved == []
    assert sorted(p for p, _ in put) == [str(repo / ".git" / "config"), str(hook)]
    assert all("deleted it, put back" in why for _, why in put)
    assert hook.read_text() == HOOK and hook.stat().st_mode & 0o7777 == 0o750
    assert git(repo, "remote", "get-url", "origin").strip() == "https://example.invalid/me/repo.git"


def test_a_hook_made_executable_gets_its_mode_back(repo: Path) -> None:
    hook = repo / ".git" / "hooks" / "pre-commit"
    before = _take(repo, keep=True)
    hook.chmod(0o755)
    moved, put, failed = _end(repo, before)
    assert failed == [] and len(moved) == 1 and len(put) == 1
    assert hook.stat().st_mode & 0o7777 == 0o750 and hook.read_text() == HOOK


def test_a_symlinked_hooks_directory_is_never_written_through(repo: Path, tmp_path: Path) -> None:
    """A session replaces ``.git/hooks`` with a symlink to a directory of the
    user's: the put-back makes a real ``hooks`` again and writes nothing
    there (the twin above: the same hook put back in place)."""
    elsewhere = tmp_path / "users-dir"
    elsewhere.mkdir()
    hooks = repo / ".git" / "hooks"
    before = _take(repo, keep=True)
    hooks.rename(repo / ".git" / "hooks-gone")
    hooks.symlink_to(elsewhere)
    moved, put, failed = _end(repo, before)
    assert failed == [] and [Path(m).is_symlink() for m in moved] == [True], moved
    assert list(elsewhere.iterdir()) == []
    assert hooks.is_dir() and not hooks.is_symlink() and (hooks / "pre-commit").read_text() == HOOK
    assert [p for p, _ in put] == [str(hooks / "pre-commit")]


def test_a_file_in_the_way_of_info_is_moved_aside(repo: Path) -> None:
    info = repo / ".git" / "info"
    before = _take(repo, keep=True)
    (info / "exclude").unlink()
    info.rmdir()
    info.write_text("a file where a directory was\n")
    moved, put, failed = _end(repo, before)
    assert failed == [], failed
    assert (info / "exclude").read_text() == "secrets.env\n"
    assert [p.read_text() for p in _aside(info)] == ["a file where a directory was\n"]


def test_a_merge_the_session_finished_is_not_brought_back(repo: Path) -> None:
    """MERGE_HEAD removed (a session's ``git commit`` ended the user's merge)
    stays removed; one a session rewrote gets the user's value back."""
    head = git(repo, "rev-parse", "HEAD")
    merge_head = repo / ".git" / "MERGE_HEAD"
    merge_head.write_text(head + "\n")
    before = _take(repo, keep=True)
    merge_head.write_text("1" * 40 + "\n")
    _, put, failed = _end(repo, before)
    assert failed == [] and merge_head.read_text() == head + "\n" and len(put) == 1
    merge_head.unlink()
    assert _end(repo, before) == ([], [], [])
    assert not merge_head.exists()


def test_a_file_changed_between_the_two_reads_is_kept_as_read(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write between the look and the read (the user's own ``git config``
    as a session opens) is kept, and the look records its digest: the end
    judges the bytes it would put back. Before, such a file was not kept,
    and the end renamed it aside with nothing put back."""
    real = keptfiles._read

    def racing(top: str, rel: str) -> tuple[int, bytes] | None:
        if rel == ".git/config":
            with open(os.path.join(top, rel), "a") as f:
                f.write("[user]\n\tname = raced\n")
        return real(top, rel)

    monkeypatch.setattr(keptfiles, "_read", racing)
    snap = _take(repo, keep=True)
    [config] = [k for k in snap.kept if k.rel == ".git/config"]
    assert config.data.endswith("[user]\n\tname = raced\n")
    assert snap.gitdirs[".git"]["config"] == keptfiles.digest_of(config)
    monkeypatch.undo()
    assert _end(repo, snap) == ([], [], [])  # the user's own, unchanged since: nothing moved, nothing written


def test_past_the_bounds_a_file_is_not_kept(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keptfiles, "MAX_TOTAL", len(HOOK) + 1)
    snap = _take(repo, keep=True)
    assert sum(len(k.data) for k in snap.kept) <= len(HOOK) + 1


def test_a_linked_worktrees_own_config_is_put_back(tmp_path: Path) -> None:
    r = empty_repo(tmp_path / "main", "m")
    git(r, "config", "extensions.worktreeConfig", "true")
    linked = tmp_path / "linked"
    git(r, "worktree", "add", "-q", str(linked), "-b", "side")
    own = r / ".git" / "worktrees" / "linked" / "config.worktree"
    own.write_text("[user]\n\tname = u\n")
    before = _take(linked, keep=True)
    assert ("config.worktree", str(own.parent)) in [(k.rel, k.base) for k in before.kept], before.kept
    own.write_text(FSMONITOR)
    moved, put, failed = _end(linked, before)
    assert failed == [] and len(moved) == 1 and put == [(str(own), "yours, as it was before the session changed "
                                                                   "it, put back")]
    assert own.read_text() == "[user]\n\tname = u\n"


def test_nothing_is_made_where_the_git_directory_is_gone(repo: Path, tmp_path: Path) -> None:
    """Another directory at the worktree's path (no ``.git``), or a ``.git``
    without ``HEAD``: no config or hook is written into it. The twin: with
    ``HEAD`` there, the deleted config comes back."""
    before = _take(repo, keep=True)
    repo.rename(tmp_path / "aside")
    repo.mkdir()
    (repo / "theirs.txt").write_text("someone else's\n")
    assert _end(repo, before) == ([], [], []) and sorted(p.name for p in repo.iterdir()) == ["theirs.txt"]
    (repo / ".git").mkdir()
    assert _end(repo, before)[1] == [] and not (repo / ".git" / "config").exists()
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert str(repo / ".git" / "config") in [p for p, _ in _end(repo, before)[1]]


def test_a_hooks_directory_made_read_only_still_gets_the_hook_back(repo: Path) -> None:
    """A session rewrote the hook and made ``hooks`` read-only (``chmod 555``):
    the directory is the user's, so the end gives it its owner's rights to
    move the session's hook aside and write the user's back."""
    hook = repo / ".git" / "hooks" / "pre-commit"
    before = _take(repo, keep=True)
    hook.write_text("#!/bin/sh\ntouch PLANTED\n")
    hook.parent.chmod(0o555)
    try:
        moved, put, failed = _end(repo, before)
    finally:
        hook.parent.chmod(0o755)
    assert failed == [] and len(moved) == 1 and [p for p, _ in put] == [str(hook)]
    assert hook.read_text() == HOOK


def test_what_an_end_moved_aside_among_the_hooks_is_no_new_hook_at_the_next(repo: Path) -> None:
    """git runs a hook by its exact name: ``pre-commit.quarantined-by-…``
    never runs, and a later end of the same domain took it for a new hook,
    renaming it again at every end (``….quarantined-….quarantined-…``)."""
    hook = repo / ".git" / "hooks" / "pre-commit"
    before = _take(repo, keep=True)
    hook.write_text("#!/bin/sh\ntouch PLANTED\n")
    assert len(_end(repo, before)[0]) == 1
    assert _end(repo, before) == ([], [], [])
    [aside] = _aside(hook)
    assert aside.name.count(".quarantined-by-dispatchd-") == 1 and aside.read_text() == "#!/bin/sh\ntouch PLANTED\n"


@pytest.mark.parametrize("where", [".git/myhooks", ".githooks"])
def test_the_hooks_of_a_hooks_path_come_back_changed_or_deleted(repo: Path, where: str) -> None:
    """``core.hooksPath`` naming a directory in the worktree (in its ``.git``,
    or tracked beside the code): a hook a session rewrote is kept aside and
    the user's put back, one it deleted comes back, with their modes; before,
    the rewritten one was only moved aside (the user's bytes gone) and the
    deleted one neither put back nor named."""
    hooks = repo / where
    hooks.mkdir()
    for name in ("pre-commit", "pre-push"):
        (hooks / name).write_text(f"#!/bin/sh\n# the user's {name}\n")
        (hooks / name).chmod(0o755)
    git(repo, "config", "core.hooksPath", where)
    before = _take(repo, keep=True)
    assert {f"{where}/pre-commit", f"{where}/pre-push"} <= {k.rel for k in before.kept if k.source == "included"}
    (hooks / "pre-commit").write_text("#!/bin/sh\necho planted\n")
    (hooks / "pre-push").unlink()
    (hooks / "post-rewrite").write_text("#!/bin/sh\necho new\n")
    moved, put, failed = _end(repo, before)
    assert failed == []
    assert (hooks / "pre-commit").read_text() == "#!/bin/sh\n# the user's pre-commit\n"
    assert (hooks / "pre-push").read_text() == "#!/bin/sh\n# the user's pre-push\n"
    assert os.stat(hooks / "pre-push").st_mode & 0o777 == 0o755
    assert sorted(put) == [
        (str(hooks / "pre-commit"), "yours, as it was before the session changed it, put back"),
        (str(hooks / "pre-push"), "yours, as it was before the session deleted it, put back")]
    assert [p.read_text() for p in _aside(hooks / "pre-commit")] == ["#!/bin/sh\necho planted\n"]
    assert not (hooks / "post-rewrite").exists() and len(_aside(hooks / "post-rewrite")) == 1  # new: moved aside


def test_the_hooks_of_a_hooks_path_left_alone_are_left_byte_for_byte(repo: Path) -> None:
    """The twin: nothing changed, nothing written, nothing said."""
    hooks = repo / ".githooks"
    hooks.mkdir()
    (hooks / "pre-commit").write_text("#!/bin/sh\n# the user's\n")
    git(repo, "config", "core.hooksPath", ".githooks")
    before = _take(repo, keep=True)
    st = os.stat(hooks / "pre-commit")
    assert _end(repo, before) == ([], [], [])
    assert os.stat(hooks / "pre-commit").st_ino == st.st_ino and sorted(os.listdir(hooks)) == ["pre-commit"]


def test_a_nested_repository_s_config_and_hooks_are_kept_from_the_tree_walk(repo: Path) -> None:
    """``read_tree``: a repository the worktree holds (a nested clone) keeps
    its config and hooks by bytes, none of git's samples; the put-back
    writes them back where a session changed or deleted them."""
    inner = empty_repo(repo / "inner", "inner")
    (inner / ".git" / "hooks" / "pre-commit").write_text(HOOK)
    (inner / ".git" / "hooks" / "pre-push.sample").write_text("#!/bin/sh\n")
    before = runnables.take(str(repo), skip_root_git=True)
    kept = keptfiles.read_tree(str(repo), before.entries)
    assert {k.rel for k in kept} >= {"inner/.git/config", "inner/.git/hooks/pre-commit"}
    assert not any(k.rel.endswith(".sample") for k in kept) and {k.gitdir for k in kept} == {"inner/.git"}
    config = (inner / ".git" / "config").read_bytes()
    (inner / ".git" / "config").write_text(FSMONITOR)
    (inner / ".git" / "hooks" / "pre-commit").unlink()
    now = runnables.take(str(repo), skip_root_git=True)
    put, failed = keptfiles.put_back(str(repo), kept, {}, {}, tree=now.entries)
    assert failed == [] and sorted(why for _, why in put) == [
        ASIDE, "yours, as it was before the session changed it, put back",
        "yours, as it was before the session deleted it, put back"]
    assert (inner / ".git" / "config").read_bytes() == config
    assert (inner / ".git" / "hooks" / "pre-commit").read_text() == HOOK


@pytest.fixture
def hooks_path(repo: Path) -> Path:
    hooks = repo / ".githooks"
    hooks.mkdir()
    (hooks / "pre-commit").write_text(HOOK)
    git(repo, "config", "core.hooksPath", ".githooks")
    return repo


def _tree_end(repo: Path, kept: list[keptfiles.Kept]) -> tuple[list[tuple[str, str]], list[str]]:
    return keptfiles.put_back(str(repo), kept, {}, {}, tree=runnables.take(str(repo), skip_root_git=True).entries)


def test_names_an_end_moved_aside_in_a_hooks_path_are_not_kept_at_the_next_baseline(hooks_path: Path) -> None:
    """What a session planted beside the hooks is moved aside there at its
    end; the next baseline kept those aside names (and samples, and locks)
    as the user's, each a lock's wait at the end after. The twin: the
    user's hook is kept."""
    before = _take(hooks_path, keep=True)
    for name in ("junk", "pre-push.sample", "x.lock"):
        (hooks_path / ".githooks" / name).write_text("")
    _end(hooks_path, before)
    assert any(fs.QUARANTINED in n for n in os.listdir(hooks_path / ".githooks"))
    again = _take(hooks_path, keep=True)
    assert [k.rel for k in again.kept if k.source == "included"] == [".githooks/pre-commit"]


def test_a_lock_a_session_left_beside_a_file_it_could_write_is_moved_aside_not_waited_on(hooks_path: Path) -> None:
    """A session leaves ``NAME.lock`` (a file, or a directory) beside a hook
    of the hooks path and a nested repository's config it changed: the end
    waited for each, then failed, the worktree refused until the user
    removed the locks by hand. Now each is moved aside past the wait and the
    user's file put back. The twin (git's own ``.git/config``, degraded
    mode): a lock held is never written around."""
    repo = hooks_path
    inner = empty_repo(repo / "sub", "inner")
    kept_tree = keptfiles.read_tree(str(repo), runnables.take(str(repo), skip_root_git=True).entries)
    before = _take(repo, keep=True)
    (repo / ".githooks" / "pre-commit.lock").mkdir()
    (repo / ".githooks" / "pre-commit").unlink()
    (inner / ".git" / "config.lock").write_text("")
    (inner / ".git" / "config").write_text(FSMONITOR)
    moved, put, failed = _end(repo, before)
    tree_put, tree_failed = _tree_end(repo, kept_tree)
    assert failed == [] and tree_failed == []
    assert (repo / ".githooks" / "pre-commit").read_text() == HOOK and "fsmonitor" not in (inner / ".git" / "config").read_text()
    assert [n for n in os.listdir(repo / ".githooks") if n.startswith("pre-commit.lock" + fs.QUARANTINED)]
    assert not (inner / ".git" / "config.lock").exists()
    before = _take(repo, keep=True)
    (repo / ".git" / "config.lock").write_text("the user's git config\n")
    (repo / ".git" / "config").write_text(FSMONITOR)
    _, _, failed = _end(repo, before)
    assert len(failed) == 1 and "config.lock is held" in failed[0]
    assert (repo / ".git" / "config.lock").read_text() == "the user's git config\n"


def test_a_lock_left_held_is_disarmed_where_the_put_back_reached_never_by_path_again(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the put-back waited on a lock, a session still running swapped
    the directory on the way (``sub/.git``) for a link to a directory of the
    user's: the file there (``~/.ssh/config``) was made mode 000, reached by
    path again. Now what stands at the name is made unreadable in the
    directory the write reached (the swapped-out one). The twin: nothing
    outside changes mode."""
    inner = empty_repo(repo / "sub", "inner")
    before = runnables.take(str(repo), skip_root_git=True)
    kept = [k for k in keptfiles.read_tree(str(repo), before.entries) if k.name == "config"]
    outside = tmp_path / "dot-ssh"
    outside.mkdir()
    (outside / "config").write_text("Host *\n")
    (outside / "config").chmod(0o600)
    (inner / ".git" / "config.lock").write_text("")
    (inner / ".git" / "config").write_text(FSMONITOR)
    now = runnables.take(str(repo), skip_root_git=True)
    real = keptfiles.gitlock.replace

    def swapped(*args: object, **kwargs: object) -> str | None:
        os.rename(inner / ".git", inner / ".git-moved")
        os.symlink(outside, inner / ".git")
        kwargs["move_left"] = False  # as a lock of git's own: left held
        return real(*args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(keptfiles.gitlock, "replace", swapped)
    put, failed = keptfiles.put_back(str(repo), kept, {}, {}, tree=now.entries)
    assert len(failed) == 1 and "made unreadable" in failed[0], failed
    assert os.stat(outside / "config").st_mode & 0o777 == 0o600
    assert os.stat(inner / ".git-moved" / "config").st_mode & 0o777 == 0


def test_nothing_is_made_where_a_git_directory_or_the_way_to_it_is_gone(hooks_path: Path, tmp_path: Path) -> None:
    """A hooks path inside ``.git`` whose ``.git`` a session removed, and a
    nested repository a session swapped for a link to another: a git
    directory of hooks or config alone was made at the name. The twin: the
    hook of a hooks path beside the code comes back (the tests above)."""
    repo = hooks_path
    (repo / ".git" / "myhooks").mkdir()
    (repo / ".git" / "myhooks" / "pre-commit").write_text(HOOK)
    git(repo, "config", "core.hooksPath", ".git/myhooks")
    before = _take(repo, keep=True)
    assert ".git/myhooks/pre-commit" in {k.rel for k in before.kept if k.source == "included"}
    inner = empty_repo(repo / "sub", "inner")
    kept_tree = keptfiles.read_tree(str(repo), runnables.take(str(repo), skip_root_git=True).entries)
    os.rename(inner, tmp_path / "sub-moved")
    os.symlink(empty_repo(tmp_path / "elsewhere", "x"), repo / "sub")
    assert _tree_end(repo, kept_tree) == ([], [])
    shutil.rmtree(repo / ".git")
    _end(repo, before)
    assert not (repo / ".git").exists()


def test_a_hooks_path_an_included_config_sets_is_kept_and_put_back(repo: Path) -> None:
    """``[include] path = ../.gitconfig.shared`` setting ``core.hooksPath``
    (a shared config): git reads it as the repository's own, but only the
    config's own hooks path was looked at, so a session's rewrite of a hook
    there ran at the user's next commit, unreported. The twin: the
    include's own bytes are kept and judged as before."""
    hooks = repo / ".githooks"
    hooks.mkdir()
    (hooks / "pre-commit").write_text(HOOK)
    (repo / ".gitconfig.shared").write_text("[core]\n\thooksPath = .githooks\n")
    git(repo, "config", "include.path", "../.gitconfig.shared")
    before = _take(repo, keep=True)
    assert {".gitconfig.shared", ".githooks/pre-commit"} <= {k.rel for k in before.kept if k.source == "included"}
    (hooks / "pre-commit").write_text("#!/bin/sh\necho planted\n")
    moved, put, failed = _end(repo, before)
    assert failed == [] and put == [(str(hooks / "pre-commit"), "yours, as it was before the session changed it, put back")]
    assert (hooks / "pre-commit").read_text() == HOOK


def test_a_killed_put_back_s_leftovers_beside_a_hook_are_swept_before_the_look(
        hooks_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon killed while it put a hook back left its temporary and the
    lock that is its second name; the next end's look took both for a
    session's new hooks, moved them aside and said so. Now they are swept
    first (journal-known, nobody's flock). The twin: a file of that shape a
    session made is still moved aside."""
    from dispatchd.daemon.gitguard import lockfile, ournames

    monkeypatch.setattr(ournames, "_journal", ournames._journal)  # this process's journal back after the test
    ournames.use(str(tmp_path / "state"))
    before = _take(hooks_path, keep=True)
    fd = os.open(hooks_path / ".githooks", os.O_PATH | os.O_DIRECTORY)
    try:
        dead = lockfile.temporary(fd, "pre-commit", b"the user's, half put back\n")
        dead.take(lockfile.Policy(0.05))
        dead.close()  # the daemon's death: both names left, its flock gone
    finally:
        os.close(fd)
    planted = hooks_path / ".githooks" / "pre-push.dispatchd-0123456789abcdef.lock"
    planted.write_text("a session's\n")
    keptfiles.sweep(str(hooks_path), before.kept)
    moved, put, failed = _end(hooks_path, before)
    assert failed == [] and put == []
    assert sorted(os.listdir(hooks_path / ".githooks")) == sorted(["pre-commit", os.path.basename(_aside(planted)[0])])


def test_locks_beside_many_hooks_cost_one_wait_in_all(hooks_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock planted beside each of many kept hooks was a wait each (a
    second; thousands of files: hours of an end, the domain's lock held).
    Now one wait in all, each moved aside. The twin: a single one is
    waited for, then moved aside (above)."""
    import time

    hooks = hooks_path / ".githooks"
    for i in range(10):
        (hooks / f"hook-{i}").write_text(HOOK)
    before = _take(hooks_path, keep=True)
    monkeypatch.setattr(keptfiles.gitlock, "WAIT_S", 0.3)
    for i in range(10):
        (hooks / f"hook-{i}.lock").write_text("")
        (hooks / f"hook-{i}").unlink()
    began = time.monotonic()
    moved, put, failed = _end(hooks_path, before)
    assert time.monotonic() - began < 2.0  # before: 10 waits of 0.3 s
    assert failed == [] and len(put) == 10 and all((hooks / f"hook-{i}").read_text() == HOOK for i in range(10))


def test_a_nested_repository_s_own_hooks_path_is_checked_kept_and_put_back(repo: Path) -> None:
    """A clone inside the worktree with ``core.hooksPath = .githooks`` (its
    own, relative to it): a session's rewrite of a hook there, or a new one,
    ran at the user's next commit in that clone, unseen (only its ``.git``
    was looked at). Now judged as the worktree's own hooks path: the user's
    put back, a new one moved aside. The twin: left alone, nothing said."""
    from dispatchd.daemon.gitguard import parts

    inner = empty_repo(repo / "inner", "inner")
    (inner / ".githooks").mkdir()
    (inner / ".githooks" / "pre-commit").write_text(HOOK)
    git(inner, "config", "core.hooksPath", ".githooks")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    before = parts.baseline_tree(str(repo), (), [], layout)
    assert "inner/.githooks/pre-commit" in {k.rel for k in before.kept}

    def end() -> tuple[list[str], list[tuple[str, str]], list[str]]:
        now = runnables.take(str(repo), skip_root_git=True, ending=True, before=before)
        parts.nested_targets(str(repo), "", now.entries)
        locked = keptfiles.left_in_place(str(repo), before.kept, {}, {}, tree=now.entries)
        moved, failed = runnables.quarantine(str(repo), [r for r in runnables.changes(before, now)
                                                         if str(repo / r) not in locked])
        put, bad = keptfiles.put_back(str(repo), before.kept, {}, {}, tree=now.entries)
        return moved, put, failed + bad

    assert end() == ([], [], [])  # the twin
    (inner / ".githooks" / "pre-commit").write_text("#!/bin/sh\necho planted\n")
    (inner / ".githooks" / "post-checkout").write_text("#!/bin/sh\necho new\n")
    moved, put, failed = end()
    assert failed == [] and [p for p in put if p[1] != ASIDE] == [
        (str(inner / ".githooks" / "pre-commit"), "yours, as it was before the session changed it, put back")]
    assert [p for p in put if p[1] == ASIDE][0][0].startswith(str(inner / ".githooks" / "pre-commit") + fs.QUARANTINED)
    assert [os.path.basename(m).startswith("post-checkout" + fs.QUARANTINED) for m in moved] == [True]
    assert (inner / ".githooks" / "pre-commit").read_text() == HOOK
