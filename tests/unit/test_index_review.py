"""The index a session wrote, made to show what the worktree holds
(``gitguard/indexreview.py``): an entry that says a changed file is the
committed one (its object id set back, or marked assume-unchanged or
skip-worktree) had ``git status`` and ``git diff`` say "clean" over the
session's edit. Each beside its control, the user's git fooled; the twins,
an honest ``git add`` and an index the session never wrote, keep what they
say."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import indexfile, indexreview
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process


def _status(repo: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                          timeout=30).stdout


def _start(tmp_path: Path) -> tuple[Path, int]:
    repo = commits_repo(tmp_path / "repo")
    time.sleep(0.06)  # past the review's racy margin: only what comes next is the session's
    return repo, time.time_ns()


def _set_oid(repo: Path, name: str, oid: str) -> None:
    """The entry of ``name`` given ``oid``, the checksum made again (what a
    session can write with a few lines of Python)."""
    index = repo / ".git" / "index"
    data = bytearray(index.read_bytes())
    found = indexfile.layout(bytes(data))
    assert found is not None
    entry = next(e for e in found.entries if e.name == name.encode())
    data[entry.start + 40:entry.start + 40 + found.hash_size] = bytes.fromhex(oid)
    data[-found.hash_size:] = hashlib.sha1(bytes(data[:-found.hash_size])).digest()
    index.write_bytes(bytes(data))


def _edit(repo: Path) -> None:
    (repo / "f").write_text("BACKDOOR\n")
    time.sleep(1.1)  # the index written a second later: git's "racy" re-check does not apply


def _hide_by_id(repo: Path) -> None:
    committed = git(repo, "rev-parse", "HEAD:f").strip()
    _edit(repo)
    git(repo, "add", "f")
    _set_oid(repo, "f", committed)


def _hide_by_flag(flag: str):  # type: ignore[no-untyped-def]
    def hide(repo: Path) -> None:
        _edit(repo)
        git(repo, "update-index", flag, "f")
    return hide


HIDES = {"the committed id": _hide_by_id, "assume-unchanged": _hide_by_flag("--assume-unchanged"),
         "skip-worktree": _hide_by_flag("--skip-worktree")}


@pytest.mark.parametrize("how", sorted(HIDES))
def test_an_entry_hiding_a_session_s_edit_is_reset(tmp_path: Path, how: str) -> None:
    repo, since = _start(tmp_path)
    HIDES[how](repo)
    assert (repo / "f").read_text() == "BACKDOOR\n" and _status(repo) == ""  # the control: git says clean
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.rewritten and not done.why_not and done.hid == ["f"], vars(done)
    assert _status(repo) == " M f\n"
    assert "+BACKDOOR" in git(repo, "diff")


def test_an_honest_add_is_left_byte_for_byte(tmp_path: Path) -> None:
    """The twin: the session's ``git add`` of a new and a changed file, a
    commit, another add; nothing hides, and the index is left as it is."""
    repo, since = _start(tmp_path)
    _edit(repo)
    (repo / "new").write_text("new\n")
    git(repo, "add", "f", "new")
    git(repo, "commit", "-qm", "the session's")
    (repo / "g").write_text("staged\n")
    git(repo, "add", "g")
    before = (_status(repo), git(repo, "diff", "--cached"), (repo / ".git" / "index").read_bytes())
    assert b"TREE" in before[2]  # a cache-tree, which agrees with the entries
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert not done.rewritten and done.hid == [] and not done.why_not, vars(done)
    assert (_status(repo), git(repo, "diff", "--cached"), (repo / ".git" / "index").read_bytes()) == before
    assert subprocess.run(["git", "fsck", "--no-progress"], cwd=repo, capture_output=True).returncode == 0


def test_an_index_the_session_never_wrote_is_left(tmp_path: Path) -> None:
    repo, since = _start(tmp_path)
    index = repo / ".git" / "index"
    was = index.read_bytes()
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert not done.rewritten and not done.why_not and index.read_bytes() == was


def test_a_running_git_s_lock_is_left_and_said(tmp_path: Path) -> None:
    repo, since = _start(tmp_path)
    _hide_by_id(repo)
    (repo / ".git" / "index.lock").write_bytes(b"")
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert not done.rewritten and done.why_not == "locked by a running git (index.lock)"
    assert (repo / ".git" / "index.lock").read_bytes() == b""


def _forge_cache_tree(repo: Path, directory: str, tree: str) -> None:
    """The index's cache-tree says ``directory`` is ``tree`` (its count kept)."""
    index = repo / ".git" / "index"
    data = bytearray(index.read_bytes())
    found = indexfile.layout(bytes(data))
    assert found is not None
    start, end = next((a, b) for sig, a, b in found.extensions if sig == b"TREE")
    at = data.index(directory.encode() + b"\0", start, end)
    at = data.index(b"\n", at) + 1
    data[at:at + 20] = bytes.fromhex(tree)
    data[-20:] = hashlib.sha1(bytes(data[:-20])).digest()
    index.write_bytes(bytes(data))


def test_a_cache_tree_naming_another_tree_is_left_out(tmp_path: Path) -> None:
    """``git commit`` writes a valid cache-tree directory's tree as named:
    the user's next ``git add`` and commit recorded the session's ``d``."""
    repo = commits_repo(tmp_path / "repo")
    (repo / "d").mkdir()
    (repo / "d" / "x").write_text("old\n")
    git(repo, "add", "d")
    git(repo, "commit", "-qm", "d")
    old_d = git(repo, "rev-parse", "HEAD:d").strip()
    (repo / "d" / "x").write_text("new\n")
    git(repo, "commit", "-qam", "d again")
    time.sleep(0.06)
    since = time.time_ns()
    control = tmp_path / "control"
    subprocess.run(["cp", "-a", str(repo), str(control)], check=True)
    for r in (repo, control):
        git(r, "read-tree", "HEAD")  # a full cache-tree, every directory valid
        _forge_cache_tree(r, "d", old_d)
    (control / "f").write_text("user\n")
    git(control, "add", "f")
    git(control, "commit", "-qm", "the user's")
    assert git(control, "rev-parse", "HEAD:d").strip() == old_d  # the control: the session's tree committed
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.rewritten and "TREE" in done.dropped, vars(done)
    (repo / "f").write_text("user\n")
    git(repo, "add", "f")
    git(repo, "commit", "-qm", "the user's")
    assert git(repo, "show", "HEAD:d/x") == "new\n"


@pytest.mark.parametrize("object_format", ["sha1", "sha256"])
def test_git_s_own_cache_tree_agrees(tmp_path: Path, object_format: str) -> None:
    """Names git orders with a directory's as if it ended in ``/`` (``a``,
    ``a-b``, ``a.c``, ``a/b``), nesting, a symlink and an executable: every
    directory of a full cache-tree hashed as git wrote it."""
    from dispatchd.daemon.gitguard import cachetree
    repo = commits_repo(tmp_path / "repo", object_format=object_format)
    for name in ("a-b", "a.c", "a/b", "a/b c/d", "z/y/x/w", "a0"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(name + "\n")
    (repo / "run").write_text("#!/bin/sh\n")
    (repo / "run").chmod(0o755)
    (repo / "link").symlink_to("a.c")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "shapes")
    git(repo, "read-tree", "HEAD")
    data = (repo / ".git" / "index").read_bytes()
    found = indexfile.layout(data)
    assert found is not None
    start, end = next((a, b) for sig, a, b in found.extensions if sig == b"TREE")
    assert cachetree.agrees(data, found.entries, found.hash_size, start, end)
    forged = bytearray(data)
    forged[end - 1] ^= 1  # the last node's id, one bit off
    assert not cachetree.agrees(bytes(forged), found.entries, found.hash_size, start, end)


def test_bytes_git_passes_over_do_not_hide_an_index(tmp_path: Path) -> None:
    """Git reads extensions while 8 bytes or more are left before the
    checksum, and passes over fewer: 4 such bytes made a stricter reader
    take the index for one of SHA-256 ids (other entries, none hiding
    anything). Read with the repository's ids, as git does."""
    repo, since = _start(tmp_path)
    _hide_by_flag("--assume-unchanged")(repo)
    index = repo / ".git" / "index"
    data = index.read_bytes()
    padded = data[:-20] + b"\0\0\0\0"
    index.write_bytes(padded + hashlib.sha1(padded).digest())
    assert _status(repo) == ""  # the control: git reads it, and says clean
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.rewritten and done.hid == ["f"], vars(done)
    assert _status(repo) == " M f\n"


def _match_stat(repo: Path, name: str) -> None:
    """The entry of ``name`` given the file's stat data (its object id
    kept): git then takes the file as the entry's object without reading it."""
    index = repo / ".git" / "index"
    data = bytearray(index.read_bytes())
    found = indexfile.layout(bytes(data))
    assert found is not None
    entry = next(e for e in found.entries if e.name == name.encode())
    st = os.lstat(repo / name)
    fields = [int(st.st_ctime), st.st_ctime_ns % 10**9, int(st.st_mtime), st.st_mtime_ns % 10**9,
              st.st_dev & 0xFFFFFFFF, st.st_ino & 0xFFFFFFFF]
    data[entry.start:entry.start + 24] = b"".join(v.to_bytes(4, "big") for v in fields)
    data[entry.start + 36:entry.start + 40] = st.st_size.to_bytes(4, "big")
    data[-20:] = hashlib.sha1(bytes(data[:-20])).digest()
    index.write_bytes(bytes(data))


def test_a_directory_made_before_the_open_and_swapped_in_is_looked_into(tmp_path: Path) -> None:
    """Renaming a directory changes its own ctime, not its files': a copy of
    ``src`` edited before the open, swapped in after it, its entries given
    the new files' stat data, hid the edit from a look at files' ctimes."""
    repo = commits_repo(tmp_path / "repo")
    (repo / "src").mkdir()
    (repo / "src" / "app.py").write_text("print('app')\n")
    git(repo, "add", "src")
    git(repo, "commit", "-qm", "src")
    (repo / "build").mkdir()
    subprocess.run(["cp", "-a", str(repo / "src"), str(repo / "build" / "src")], check=True)
    (repo / "build" / "src" / "app.py").write_text("print('app')\nimport os; os.system('evil')\n")
    time.sleep(0.06)
    since = time.time_ns()  # the open: what is above was made before it
    time.sleep(0.06)
    os.rename(repo / "src", repo / "build" / "src.orig")
    os.rename(repo / "build" / "src", repo / "src")
    time.sleep(1.1)  # the index written a second after the file: git's "racy" re-check does not apply
    _match_stat(repo, "src/app.py")
    assert _status(repo) == "?? build/\n"  # the control: git says src/app.py is unchanged
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.rewritten and done.hid == ["src/app.py"], vars(done)
    assert " M src/app.py\n" in _status(repo)


def test_a_split_index_a_session_made_is_moved_aside(tmp_path: Path) -> None:
    """``git update-index --split-index`` keeps most entries in a shared
    index, changed by bitmaps the review does not read: one a session made
    hid its edit (assume-unchanged) after the end. It is moved aside; the
    twin, a split index the user's configuration asks for, is left (and
    logged as not reviewed)."""
    for splits in (False, True):
        (tmp_path / str(splits)).mkdir()
        repo, since = _start(tmp_path / str(splits))
        if splits:
            git(repo, "config", "core.splitIndex", "true")
        _hide_by_flag("--assume-unchanged")(repo)
        git(repo, "update-index", "--split-index")
        assert _status(repo) == ""  # the control: git says clean
        done = indexreview.review(str(repo / ".git"), str(repo), since, str(repo / ".git"))
        if splits:
            assert not done.moved_aside and done.why_not == "a split index (core.splitIndex)"
            continue
        assert done.moved_aside and not (repo / ".git" / "index").exists(), vars(done)
        git(repo, "reset", "-q")
        assert _status(repo) == " M f\n"


def test_a_cache_tree_count_is_read_as_git_reads_it_or_not_at_all() -> None:
    """``1_0`` is 10 to Python's ``int`` and 1 to git's ``strtol``: only
    plain digits (and -1) are read; anything else leaves the extension out."""
    from dispatchd.daemon.gitguard import cachetree
    oid = b"\x01" * 20
    assert cachetree._nodes(b"\x001 0\n" + oid, 20) == [(b"", 1, oid)]
    assert cachetree._nodes(b"\x00-1 0\n", 20) == [(b"", -1, b"")]
    for bad in (b"\x001_0 0\n" + oid, b"\x00 1 0\n" + oid, b"\x00+1 0\n" + oid, b"\x001 0 \n" + oid):
        assert cachetree._nodes(bad, 20) is None, bad


def test_an_index_that_is_a_symlink_is_moved_aside(tmp_path: Path) -> None:
    """Git follows a symlink at ``.git/index`` to an index of the session's
    choosing (here one hiding its edit); the review reads no such file, so
    it is not left either."""
    repo, since = _start(tmp_path)
    _hide_by_flag("--assume-unchanged")(repo)
    index = repo / ".git" / "index"
    os.rename(index, repo / "elsewhere")
    index.symlink_to(repo / "elsewhere")
    assert "f" not in _status(repo).split()  # the control: git reads it, f said clean
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.moved_aside and not os.path.lexists(index), vars(done)


def test_a_sparse_index_a_session_made_is_moved_aside(tmp_path: Path) -> None:
    """A sparse index's directory entry stands for every file below it, each
    skip-worktree: the user's git expands it and never looks at them (an
    edit of ``src/a.py`` hidden). Made in a clone with sparse-checkout and
    copied in; the user's configuration asks for none, so it is moved aside."""
    repo = commits_repo(tmp_path / "repo")
    (repo / "src").mkdir()
    (repo / "src" / "a.py").write_text("a\n")
    git(repo, "add", "src")
    git(repo, "commit", "-qm", "src")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "sparse-checkout", "set", "--cone", "--sparse-index", "nothing")
    time.sleep(0.06)
    since = time.time_ns()
    (repo / "src" / "a.py").write_text("a\nimport os; os.system('evil')\n")
    subprocess.run(["cp", str(clone / ".git" / "index"), str(repo / ".git" / "index")], check=True)
    control = tmp_path / "control"  # git's own look expands the index (and writes it): on a copy
    subprocess.run(["cp", "-a", str(repo), str(control)], check=True)
    assert _status(control) == ""  # the control: git says clean over the edit
    assert b"sdir" in (repo / ".git" / "index").read_bytes()
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.moved_aside and not (repo / ".git" / "index").exists(), vars(done)
    git(repo, "reset", "-q")
    assert _status(repo) == " M src/a.py\n"


@pytest.mark.parametrize("setting", [("core.trustctime", "false"), ("core.checkStat", "minimal")])
def test_an_edit_with_its_mtime_set_back_is_shown_where_git_trusts_less_than_ctime(
        tmp_path: Path, setting: tuple[str, str]) -> None:
    """A same-size edit whose mtime the session set back, the index never
    written: git sees nothing where the user's configuration does not trust
    ctime. The review then runs whatever the index's own ctime says; the
    twin, without that setting, git itself shows the edit."""
    from dispatchd.daemon.gitguard import configs
    repo = commits_repo(tmp_path / "repo")
    git(repo, "config", *setting)
    assert configs.weak_stat(str(tmp_path / "nobody"), str(repo / ".git"))
    time.sleep(1.1)
    git(repo, "update-index", "--really-refresh")  # the index a second after the files: none racily clean
    time.sleep(0.06)
    since = time.time_ns()
    st = os.stat(repo / "f")
    (repo / "f").write_text("X\n")  # the size of "2\n"
    os.utime(repo / "f", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _status(repo) == ""  # the control
    assert not indexreview.review(str(repo / ".git"), str(repo), since).rewritten  # the index: not written
    done = indexreview.review(str(repo / ".git"), str(repo), since, str(repo / ".git"), always=True)
    assert done.rewritten and done.hid == ["f"], vars(done)
    assert _status(repo) == " M f\n"
    git(repo, "config", "--unset", setting[0])
    assert not configs.weak_stat(str(tmp_path / "nobody"), str(repo / ".git"))


def _entry_times(repo: Path, name: str) -> tuple[int, int]:
    """The mtime (seconds, nanoseconds) the index caches for ``name``."""
    data = (repo / ".git" / "index").read_bytes()
    found = indexfile.layout(data)
    assert found is not None
    entry = next(e for e in found.entries if e.name == name.encode())
    return (int.from_bytes(data[entry.start + 8:entry.start + 12], "big"),
            int.from_bytes(data[entry.start + 12:entry.start + 16], "big"))


def _index_time(repo: Path, seconds: int, nanoseconds: int) -> None:
    ns = seconds * 1_000_000_000 + nanoseconds
    os.utime(repo / ".git" / "index", ns=(ns, ns))


def test_a_racily_clean_entry_is_read_by_git_and_left(tmp_path: Path) -> None:
    """An entry whose file changed within the second git last wrote the
    index (a session's `git add` in a loop, the file written again): git
    reads it whatever its cached stat says. Before, the review called it a
    hide and wrote the index again, racing the session's next `git add`."""
    repo, since = _start(tmp_path)
    _hide_by_id(repo)  # the entry names the committed blob, the file says BACKDOOR: its size and mtime cached
    sec, sub = _entry_times(repo, "f")
    _index_time(repo, sec, sub)  # the index written in the same instant as the file: racily clean
    was = (repo / ".git" / "index").read_bytes()
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert not done.rewritten and done.hid == [] and not done.why_not, vars(done)
    assert (repo / ".git" / "index").read_bytes() == was
    assert _status(repo) == " M f\n"  # and git, reading the file, sees the edit


def test_an_index_whose_time_is_set_past_its_entries_still_hides_and_is_reset(tmp_path: Path) -> None:
    """The twin: the same entry, the index's time set after it (as a session
    can: `touch`): git trusts the cached stat, and the review resets it."""
    repo, since = _start(tmp_path)
    _hide_by_id(repo)
    sec, sub = _entry_times(repo, "f")
    _index_time(repo, sec + 10, 0)
    assert _status(repo) == ""  # git fooled
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.rewritten and done.hid == ["f"], vars(done)
    assert _status(repo) == " M f\n"


def test_a_rewrite_resets_the_entries_that_were_only_racily_clean(tmp_path: Path) -> None:
    """Written again, the index is no longer racy for them: git would trust
    their stat. As git's own writes do, their cached size becomes 0."""
    repo, since = _start(tmp_path)
    (repo / "g").write_text("aaaa\n")
    future = (int(time.time()) + 100) * 1_000_000_000
    os.utime(repo / "g", ns=(future, future))
    git(repo, "add", "g")  # its mtime 100 s ahead
    _hide_by_id(repo)  # f hidden
    (repo / "g").write_text("bbbb\n")  # same size, not staged
    os.utime(repo / "g", ns=(future, future))
    _index_time(repo, int(time.time()) + 50, 0)  # after f's entry, before g's: f hides, g is racily clean
    # A user's git that trusts no ctime (core.trustctime false): g's rewrite
    # is then seen by its mtime alone, which the rewrite would make trusted.
    done = indexreview.review(str(repo / ".git"), str(repo), since, always=True)
    assert done.rewritten and done.hid == ["f"], vars(done)
    data = (repo / ".git" / "index").read_bytes()
    found = indexfile.layout(data)
    assert found is not None
    g = next(e for e in found.entries if e.name == b"g")
    assert data[g.start + 36:g.start + 40] == b"\0\0\0\0"
    assert _status(repo) == " M f\nAM g\n"  # g added, then changed


def test_the_index_is_read_under_git_s_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """So that a git writing it meanwhile waits, instead of having its write
    undone by the review's rename."""
    repo, since = _start(tmp_path)
    _hide_by_id(repo)
    locked_at_read: list[bool] = []
    real = indexreview.fs.read_regular

    def read_regular(name: str, *args: object, **kwargs: object) -> object:
        if name.endswith("/index"):
            locked_at_read.append((repo / ".git" / "index.lock").exists())
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(indexreview.fs, "read_regular", read_regular)
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert done.rewritten and locked_at_read == [True]
    assert not (repo / ".git" / "index.lock").exists()  # renamed over the index
    # The twin: nothing to change, the lock let go all the same.
    locked_at_read.clear()
    done = indexreview.review(str(repo / ".git"), str(repo), since)
    assert not done.rewritten and locked_at_read == [True] and not (repo / ".git" / "index.lock").exists()


def test_a_lock_a_killed_review_left_is_removed_and_the_review_goes_on(tmp_path: Path) -> None:
    """A daemon killed while its review held index.lock: the lock has a
    second name of ours nobody holds, and the next review removes it (a lock
    of one name, a running git's, is left: the test above)."""
    from dispatchd.daemon.gitguard import lockfile

    repo, since = _start(tmp_path)
    _hide_by_id(repo)
    gitdir = repo / ".git"
    dir_fd = os.open(gitdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        left = lockfile.temporary(dir_fd, "index", b"", 0o644, lend=False)
        left.take(lockfile.Policy(0.0))
        left.close()  # as a daemon's death leaves it: both names, no flock
    finally:
        os.close(dir_fd)
    assert (gitdir / "index.lock").exists()
    done = indexreview.review(str(gitdir), str(repo), since)
    assert done.rewritten and done.hid == ["f"] and not done.why_not, vars(done)
    assert sorted(n for n in os.listdir(gitdir) if "lock" in n) == []


def _entry(name: bytes) -> indexfile.Entry:
    return indexfile.Entry(start=0, mode=0o100644, flags_at=0, extended_at=-1, name=name)


def test_the_directories_of_deep_names_are_made_once_and_bounded(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every directory an index's names lie in was made as a prefix of each
    name, again for every name: 500 names of 2,000 levels (a 2 MB index a
    session planted) took gigabytes at the end. Now each directory once, and
    past the bound every name counts as changed (git then compares their
    content: the safe side), a name no file can have too. The twin: a
    repository's names give their directories, and a moved directory still
    counts the names below it as changed (the test above)."""
    assert indexreview._dirs_of([b"src/a/x.py", b"src/a/y.py", b"src/b.py", b"top"]) == {b"src", b"src/a"}
    deep = [b"d%04d/" % i + b"a/" * 2000 + b"f" for i in range(500)]
    assert indexreview._dirs_of(deep) is None  # 2 GB of prefixes before; now refused after 32 MiB
    monkeypatch.setattr(indexreview, "_MAX_DIRS", 3)
    assert indexreview._dirs_of([b"a/b/c/d/e"]) is None and indexreview._dirs_of([b"a/b/c/d"]) == {b"a", b"a/b", b"a/b/c"}
    monkeypatch.undo()
    (tmp_path / "f").write_text("x")
    long = b"a/" * 2100 + b"f"  # past PATH_MAX: no file has it
    since = time.time_ns() + 10**9  # nothing in the worktree changed since
    assert indexreview._recent(str(tmp_path), [_entry(b"f"), _entry(long)], since) == {long}
    assert indexreview._recent(str(tmp_path), [_entry(b"f")] + [_entry(n) for n in deep], since) == {b"f", *deep}
    assert indexreview._below_moved({b"a", b"a/b", b"a/b/c", b"z"}, {b"a/b"}) == {
        b"a": False, b"z": False, b"a/b": True, b"a/b/c": True}
