"""dispatchd.confine.gitdirs: what of a repository stays read-only, and the
index reader that finds submodules (indexes made by git itself)."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from dispatchd.confine import gitdirs, gitsnapshot

ENV = dict(os.environ, GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@example.invalid",
           GIT_COMMITTER_NAME="a", GIT_COMMITTER_EMAIL="a@example.invalid")


def parse_gitlinks(data: bytes) -> set[str] | None:
    """The paths a git index (versions 2-4, SHA-1 or SHA-256) records as
    submodules (mode 160000). None when the bytes are not an index we can read."""
    parsed = gitdirs._parse_index(data)
    return parsed.links if parsed is not None else None


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=ENV).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q")
    for i in range(20):
        (r / f"d{i % 3}").mkdir(exist_ok=True)
        (r / f"d{i % 3}" / f"file-with-a-longer-name-{i}.txt").write_text("x")
    git(r, "add", ".")
    git(r, "commit", "-qm", "init")
    return r


def _take(repo: Path) -> gitsnapshot.GitSnapshot:
    return gitsnapshot.take(str(repo), gitdirs.inspect_git(str(repo), uid=os.getuid()))


def _quarantine(repo: Path, before: gitsnapshot.GitSnapshot) -> tuple[list[str], list[str]]:
    return gitsnapshot.quarantine(str(repo), before, _take(repo))


def _add_gitlink(repo: Path, path: str, hexsha: str = "1" * 40) -> None:
    git(repo, "update-index", "--add", "--cacheinfo", f"160000,{hexsha},{path}")


@pytest.mark.parametrize("version", ["2", "3", "4"])
def test_gitlinks_are_found_in_every_index_version(repo: Path, version: str) -> None:
    _add_gitlink(repo, "vendor/nested")
    _add_gitlink(repo, "z" * 150 + "/deep")  # a long shared prefix: v4's varint beyond one byte
    (repo / "intent.txt").write_text("x")
    git(repo, "add", "-N", "intent.txt")  # an extended-flags entry (v3)
    git(repo, "update-index", "--index-version", version)
    data = (repo / ".git" / "index").read_bytes()
    assert parse_gitlinks(data) == {"vendor/nested", "z" * 150 + "/deep"}


def test_gitlinks_in_a_sha256_repository(tmp_path: Path) -> None:
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q", "--object-format=sha256")
    (r / "f").write_text("x")
    git(r, "add", "f")
    _add_gitlink(r, "m/n", "1" * 64)
    assert parse_gitlinks((r / ".git" / "index").read_bytes()) == {"m/n"}


def test_an_index_without_submodules(repo: Path) -> None:
    assert parse_gitlinks((repo / ".git" / "index").read_bytes()) == set()


@pytest.mark.parametrize("data", [b"", b"DIRC", b"XXXX\x00\x00\x00\x02\x00\x00\x00\x01", b"DIRC\x00\x00\x00\x09\x00\x00\x00\x00",
                                  b"DIRC\x00\x00\x00\x02\x00\x00\x00\x05" + b"\x00" * 30])
def test_what_is_not_an_index_is_refused(data: bytes) -> None:
    assert parse_gitlinks(data) is None


def test_a_truncated_index_is_refused(repo: Path) -> None:
    data = (repo / ".git" / "index").read_bytes()
    assert parse_gitlinks(data[:100]) is None


def test_inspect_a_repository(repo: Path) -> None:
    layout = gitdirs.inspect_git(str(repo), uid=os.getuid())
    assert layout.kind == "repository"
    assert layout.index == str(repo / ".git" / "index")
    assert layout.read_only == [str(repo / ".git" / "config"), str(repo / ".git" / "hooks")]
    assert layout.writable == [] and layout.readable == []


def test_inspect_a_linked_worktree(repo: Path, tmp_path: Path) -> None:
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    layout = gitdirs.inspect_git(str(linked), uid=os.getuid())
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
    layout = gitdirs.inspect_git(str(fake), uid=os.getuid())
    assert layout.kind == "refused"
    assert layout.writable == [] and layout.readable == []
    assert layout.read_only == [str(fake / ".git")]


def test_a_new_submodule_is_moved_aside(repo: Path) -> None:
    before = _take(repo)
    nested = repo / "sub"
    nested.mkdir()
    git(nested, "init", "-q")
    (nested / "a").write_text("a")
    git(nested, "add", "a")
    git(nested, "commit", "-qm", "x")
    _add_gitlink(repo, "sub", git(nested, "rev-parse", "HEAD").strip())
    moved, failed = _quarantine(repo, before)
    assert len(moved) == 1 and moved[0].startswith(str(nested / ".git.quarantined-by-dispatchd-")) and failed == [], moved
    assert not (nested / ".git").exists()


def test_a_submodule_that_was_there_before_is_left_alone(repo: Path) -> None:
    nested = repo / "sub"
    nested.mkdir()
    git(nested, "init", "-q")
    _add_gitlink(repo, "sub")
    before = _take(repo)
    assert _quarantine(repo, before) == ([], [])
    assert (nested / ".git").is_dir()
    # ...and so is one replaced by a .git that reads the same configuration
    # (git runs nothing new there)...
    (nested / ".git").rename(repo / "old-git")
    git(nested, "init", "-q")
    assert _quarantine(repo, before) == ([], [])
    # ...but not one whose configuration differs.
    git(nested, "config", "core.fsmonitor", "echo planted")
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(str(nested / ".git.quarantined-by-dispatchd-"))


def test_a_submodule_path_through_a_symlink_never_moves_what_is_outside(repo: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    git(victim, "init", "-q")
    before = _take(repo)
    (repo / "evil").symlink_to("../victim")
    _add_gitlink(repo, "evil")
    (repo / "inner").mkdir()
    (repo / "inner" / "link").symlink_to(victim)
    _add_gitlink(repo, "inner/link/x")
    assert _quarantine(repo, before) == ([], [])
    assert (victim / ".git").is_dir()  # the daemon left the repository outside alone


@pytest.mark.parametrize("link", ["../victim", "/abs/victim", "a/../../victim", "a//b", "./a", "a/.", ""])
def test_submodule_paths_git_would_refuse_are_never_followed(repo: Path, link: str) -> None:
    assert gitdirs._open_parent(str(repo), link) is None


def _rename_in_index(index: Path, old: str, new: str) -> None:
    """Rewrite an entry's name byte by byte (same length), as a session can,
    with the checksum git checks made right again."""
    data = index.read_bytes()
    assert len(old) == len(new) and data.count(old.encode()) == 1
    body = data[:-20].replace(old.encode(), new.encode())
    index.write_bytes(body + hashlib.sha1(body).digest())


@pytest.mark.parametrize("odd", ["a//b", "a/./b", "./a/b", "a/b/"])
def test_a_submodule_name_git_would_not_write_moves_the_index_aside(repo: Path, odd: str) -> None:
    """Git reads such a name from an index it did not write, and walks it to
    a/b: the daemon never follows it, and moves the index aside instead of
    skipping it."""
    before = _take(repo)
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    placeholder = "x" * len(odd)
    _add_gitlink(repo, placeholder)
    _rename_in_index(repo / ".git" / "index", placeholder, odd)
    assert gitdirs.index_gitlinks(str(repo / ".git" / "index")) == {odd}
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{repo}/.git/index.quarantined-by-dispatchd-")
    assert (repo / "a" / "b" / ".git").is_dir()  # untracked now: git runs nothing there


def test_a_gitfile_rewritten_in_place_with_its_mtime_put_back_is_moved_aside(repo: Path) -> None:
    (repo / "s").mkdir()
    (repo / "s" / ".git").write_text("gitdir: ../.git/modules/s\n")
    _add_gitlink(repo, "s")
    before = _take(repo)
    assert _quarantine(repo, before) == ([], [])
    st = os.stat(repo / "s" / ".git")
    (repo / "s" / ".git").write_text("gitdir: xxxxxxxxxxxxxxxxx\n")  # the same length, the same inode
    os.utime(repo / "s" / ".git", ns=(st.st_atime_ns, st.st_mtime_ns))
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{repo}/s/.git.quarantined-by-dispatchd-")


@pytest.mark.parametrize("unsearchable", ["a", "a/b"])
def test_a_submodule_that_cannot_be_looked_at_moves_the_index_aside(repo: Path, unsearchable: str) -> None:
    """A new submodule behind a directory the daemon may not search: neither
    it nor the user's git sees the .git now, but the user's git will once the
    directory is searchable again. Never taken for "no submodule there": the
    index that records it is moved aside."""
    before = _take(repo)
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    _add_gitlink(repo, "a/b")
    (repo / unsearchable).chmod(0)
    try:
        moved, failed = _quarantine(repo, before)
    finally:
        (repo / unsearchable).chmod(0o755)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{repo}/.git/index.quarantined-by-dispatchd-")
    assert not (repo / ".git" / "index").exists()  # a/b is no submodule of the user's git now
    assert (repo / "a" / "b" / ".git").is_dir()  # and nothing of theirs is lost


def test_a_submodule_unsearchable_before_the_session_too_still_moves_the_index_aside(repo: Path) -> None:
    # The session could have opened it, changed its config and closed it again.
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    _add_gitlink(repo, "a/b")
    (repo / "a").chmod(0)
    try:
        before = _take(repo)
        assert before.indexes[".git/index"].startswith(f"a submodule that cannot be looked at ({errno.EACCES})")
        moved, failed = _quarantine(repo, before)
    finally:
        (repo / "a").chmod(0o755)
    assert failed == [] and moved[0].startswith(f"{repo}/.git/index.quarantined-by-dispatchd-")


def test_open_parent_tells_absent_from_unsearchable(repo: Path) -> None:
    (repo / "a" / "b").mkdir(parents=True)
    (repo / "file").write_text("x")
    assert gitdirs._open_parent(str(repo), "missing/b") is None
    assert gitdirs._open_parent(str(repo), "file/b") is None  # ENOTDIR
    (repo / "a").chmod(0)
    try:
        with pytest.raises(PermissionError):
            gitdirs._open_parent(str(repo), "a/b")
    finally:
        (repo / "a").chmod(0o755)
    fd = gitdirs._open_parent(str(repo), "a/b")
    assert fd is not None
    os.close(fd)


def test_a_plain_nested_submodule_path_is_followed(repo: Path) -> None:
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    _add_gitlink(repo, "a/b")
    assert "a/b/.git" in _take(repo).gitdirs


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
    layout = gitdirs.inspect_git(str(worktree), uid=os.getuid())
    assert layout.kind == "refused" and layout.readable == [] and layout.writable == []
    assert layout.note == f"the git directory {worktree} is the worktree, inside it, or around it; not granted"


def test_a_common_directory_that_is_no_repository_is_not_believed(repo: Path, tmp_path: Path) -> None:
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    os.rename(repo / ".git" / "objects", repo / ".git" / "objects.moved")
    layout = gitdirs.inspect_git(str(linked), uid=os.getuid())
    assert layout.kind == "refused" and layout.readable == [] and layout.writable == []
    assert layout.note == f"{repo / '.git'} is not a git repository; not granted"


def _submodule_repo(tmp_path: Path) -> Path:
    """A repository with a submodule named with a slash (its git directory in
    .git/modules/libs/sub), one kept in place (emb/.git), a second linked
    worktree, and no hooks directory."""
    src = tmp_path / "src"
    src.mkdir()
    git(src, "init", "-q")
    git(src, "commit", "-q", "--allow-empty", "-m", "src")
    r = tmp_path / "super"
    r.mkdir()
    git(r, "init", "-q")
    git(r, "commit", "-q", "--allow-empty", "-m", "super")
    git(r, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(src), "libs/sub")
    emb = r / "emb"
    emb.mkdir()
    git(emb, "init", "-q")
    git(emb, "commit", "-q", "--allow-empty", "-m", "emb")
    _add_gitlink(r, "emb", git(emb, "rev-parse", "HEAD").strip())
    git(r, "worktree", "add", "-q", str(tmp_path / "other"), "-b", "other")
    import shutil
    shutil.rmtree(r / ".git" / "hooks")
    return r


def test_every_git_directory_of_a_repository_is_protected(tmp_path: Path) -> None:
    r = _submodule_repo(tmp_path)
    dotgit = r / ".git"
    layout = gitdirs.inspect_git(str(r), uid=os.getuid())
    assert layout.kind == "repository"
    assert layout.gitdirs == [str(dotgit), str(dotgit / "modules" / "libs" / "sub"), str(r / "emb" / ".git")]
    assert (dotgit / "hooks").is_dir()  # made, empty, to be held read-only
    protected = set(layout.read_only)
    for gitdir in layout.gitdirs:
        assert {f"{gitdir}/config", f"{gitdir}/hooks"} <= protected, gitdir
    assert str(dotgit / "worktrees" / "other") in protected  # the other worktree's entry, whole


def test_a_hooks_symlink_into_the_worktree_protects_its_target(repo: Path) -> None:
    import shutil
    shutil.rmtree(repo / ".git" / "hooks")
    (repo / "githooks").mkdir()
    (repo / ".git" / "hooks").symlink_to("../githooks")
    layout = gitdirs.inspect_git(str(repo), uid=os.getuid())
    assert str(repo / "githooks") in layout.read_only
    assert str(repo / ".git" / "hooks") not in layout.read_only  # a symlink is not bound over


def test_redirects_in_any_git_directory_are_moved_aside(tmp_path: Path) -> None:
    r = _submodule_repo(tmp_path)
    layout = gitdirs.inspect_git(str(r), uid=os.getuid())
    before = gitdirs.redirects_present(layout, str(r))
    assert before == []  # the other worktree's commondir leads back to .git
    # A worktree the session adds itself is fine, until its commondir is aimed elsewhere.
    git(r, "worktree", "add", "-q", str(r / "added"), "-b", "added")
    assert gitdirs.redirects_present(layout, str(r)) == []
    planted = [r / ".git" / "modules" / "libs" / "sub" / "commondir", r / "emb" / ".git" / "config.worktree",
               r / ".git" / "commondir"]
    for p in planted:
        p.write_text("../evil\n")
    assert sorted(gitdirs.redirects_present(layout, str(r))) == sorted(map(str, planted))
    (r / ".git" / "worktrees" / "added" / "commondir").write_text(str(tmp_path / "evil") + "\n")
    moved, failed = gitdirs.quarantine_new_redirects(layout, before, str(r))
    assert failed == [] and len(moved) == 4 and all(".quarantined-by-dispatchd-" in m for m in moved)
    assert not any(p.exists() for p in planted)
    assert not (r / ".git" / "worktrees" / "added" / "commondir").exists()


def test_a_split_index_is_read_with_its_shared_part(repo: Path) -> None:
    _add_gitlink(repo, "in/shared")
    git(repo, "update-index", "--split-index")
    _add_gitlink(repo, "in/split", "2" * 40)
    index = str(repo / ".git" / "index")
    assert parse_gitlinks((repo / ".git" / "index").read_bytes()) == {"in/split"}  # the split part alone
    assert gitdirs.index_gitlinks(index) == {"in/shared", "in/split"}
    shared = next((repo / ".git").glob("sharedindex.*"))
    shared.unlink()
    assert gitdirs.index_gitlinks(index) is None  # cannot be checked


def test_an_index_that_cannot_be_checked_after_a_session_is_moved_aside(repo: Path) -> None:
    index = repo / ".git" / "index"
    before = _take(repo)
    assert before.indexes == {}
    index.write_bytes(b"DIRC" + b"\0\0\0\2" + b"\xff" * 64)  # garbled
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(str(index) + ".quarantined-by-dispatchd-")
    assert not index.exists()


def test_the_users_own_unreadable_index_is_left_alone(repo: Path) -> None:
    index = repo / ".git" / "index"
    index.write_bytes(b"not an index")
    before = _take(repo)
    assert list(before.indexes) == [".git/index"]
    assert _quarantine(repo, before) == ([], [])
    assert index.read_bytes() == b"not an index"


def test_a_garbled_commondir_is_a_redirect_not_a_crash(repo: Path) -> None:
    layout = gitdirs.inspect_git(str(repo), uid=os.getuid())
    entry = repo / ".git" / "worktrees" / "zz"
    entry.mkdir(parents=True)
    (entry / "commondir").write_bytes(b"\0")
    assert gitdirs.redirects_present(layout, str(repo)) == [str(entry / "commondir")]
    moved, failed = gitdirs.quarantine_new_redirects(layout, [], str(repo))
    assert failed == [] and len(moved) == 1 and not (entry / "commondir").exists()


def test_a_read_only_git_directory_does_not_keep_a_redirect(repo: Path) -> None:
    layout = gitdirs.inspect_git(str(repo), uid=os.getuid())
    (repo / ".git" / "commondir").write_text("../evil\n")
    os.chmod(repo / ".git", 0o555)
    try:
        moved, failed = gitdirs.quarantine_new_redirects(layout, [], str(repo))
    finally:
        os.chmod(repo / ".git", 0o755)
    assert failed == [] and len(moved) == 1 and not (repo / ".git" / "commondir").exists()


def test_quarantine_names_cannot_be_taken_in_advance(repo: Path) -> None:
    layout = gitdirs.inspect_git(str(repo), uid=os.getuid())
    (repo / ".git" / "commondir").write_text("../evil\n")
    now = int(__import__("time").time())
    for t in range(now - 2, now + 300):
        (repo / ".git" / f"commondir.quarantined-by-dispatchd-{t}").mkdir()
        (repo / ".git" / f"commondir.quarantined-by-dispatchd-{t}" / "x").write_text("x")
    moved, failed = gitdirs.quarantine_new_redirects(layout, [], str(repo))
    assert failed == [] and len(moved) == 1 and not (repo / ".git" / "commondir").exists()


def test_symlinks_under_git_never_take_the_daemon_elsewhere(repo: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    git(other, "commit", "-q", "--allow-empty", "-m", "o")
    git(other, "worktree", "add", "-q", str(tmp_path / "owt"), "-b", "o")
    foreign = other / ".git" / "worktrees" / "owt" / "commondir"
    layout = gitdirs.inspect_git(str(repo), uid=os.getuid())
    # .git/worktrees and .git/modules made symlinks to another repository's.
    (repo / ".git" / "worktrees").symlink_to(other / ".git" / "worktrees")
    (repo / ".git" / "modules").symlink_to(tmp_path)
    (foreign).write_text("../../../../elsewhere\n")  # as if aimed elsewhere: still not ours to touch
    assert gitdirs.redirects_present(layout, str(repo)) == []
    assert gitdirs.quarantine_new_redirects(layout, [], str(repo)) == ([], [])
    assert foreign.exists()
    again = gitdirs.inspect_git(str(repo), uid=os.getuid())
    assert again.gitdirs == [str(repo / ".git")]  # the modules symlink is not walked
    assert not (tmp_path / "hooks").exists()


def test_a_git_directory_replaced_by_a_symlink_is_itself_moved_aside(repo: Path, tmp_path: Path) -> None:
    layout = gitdirs.inspect_git(str(repo), uid=os.getuid())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "index").write_text("not ours")
    os.rename(repo / ".git", repo / ".git-real")
    (repo / ".git").symlink_to(elsewhere)
    assert gitdirs.redirects_present(layout, str(repo)) == [str(repo / ".git")]
    moved, failed = gitdirs.quarantine_new_redirects(layout, [], str(repo))
    assert failed == [] and len(moved) == 1 and not os.path.lexists(repo / ".git")
    assert (elsewhere / "index").read_text() == "not ours"


def test_work_in_a_submodule_kept_in_place_keeps_its_git_directory(repo: Path) -> None:
    emb = repo / "emb"
    emb.mkdir()
    git(emb, "init", "-q")
    git(emb, "commit", "-q", "--allow-empty", "-m", "1")
    _add_gitlink(repo, "emb", git(emb, "rev-parse", "HEAD").strip())
    before = _take(repo)
    git(emb, "commit", "-q", "--allow-empty", "-m", "2")  # the session's normal work there
    (emb / ".git" / "new-file").write_text("changes the directory's mtime")
    assert _quarantine(repo, before) == ([], [])
    assert (emb / ".git").is_dir()


def test_a_split_index_that_replaces_an_entry_by_a_submodule(repo: Path) -> None:
    # "sub" is a file in the shared index; the split part replaces that entry,
    # by position and with no name, with a submodule.
    (repo / "sub").write_text("f")
    git(repo, "add", "sub")
    git(repo, "update-index", "--split-index")
    _add_gitlink(repo, "sub")
    index = repo / ".git" / "index"
    parsed = gitdirs._parse_index(index.read_bytes())
    assert parsed is not None and parsed.replaced_gitlink and parsed.links == set()
    links = gitdirs.index_gitlinks(str(index))
    assert links is not None and "sub" in links
