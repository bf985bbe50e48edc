"""Branches, tags and replacement refs read as git reads them
(``gitguard/refvalues.py``): a session that writes one in a form git reads
and a stricter reader skipped (``<id> junk``, a symbolic ref, a symlink, an
id in capitals, a tab in ``packed-refs``, a name packed twice) had the
user's ``git show v1.0`` read its commit after an end that reported
nothing. Each beside its control, the user's git reading the forgery."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, refsback, refvalues
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process


def _user_reads(repo: Path, rev: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:f"], cwd=repo, capture_output=True, text=True, timeout=30).stdout


def _setup(tmp_path: Path) -> tuple[Path, history.History, str]:
    """A repository with a tag and a second branch, all packed (``git
    pack-refs``: loose refs a session writes then win), its baseline, and
    a commit of the session's own, on no branch and of no parent (a
    fast-forward of a branch is the session's to make)."""
    repo = commits_repo(tmp_path / "repo")
    git(repo, "tag", "v1.0")
    git(repo, "branch", "release")
    git(repo, "pack-refs", "--all")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    tree = git(repo, "mktree", stdin=f"100644 blob {git(repo, 'hash-object', '-w', '--stdin', stdin='evil').strip()}"
                                     f"\tf\n").strip()
    evil = git(repo, "commit-tree", tree, "-m", "the session's", stdin="").strip()  # no fast-forward
    return repo, kept, evil


def _loose(text: str) -> Callable[[Path, str, str], None]:
    def plant(repo: Path, name: str, evil: str) -> None:
        path = repo / ".git" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.format(evil=evil))
    return plant


def _symlink(repo: Path, name: str, evil: str) -> None:
    target = repo / ".git" / "elsewhere"
    target.write_text(evil + "\n")
    path = repo / ".git" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def _symref(repo: Path, name: str, evil: str) -> None:
    git(repo, "update-ref", "refs/hidden/x", evil)
    _loose("ref: refs/hidden/x\n")(repo, name, evil)


def _packed(sep: str, twice: bool = False) -> Callable[[Path, str, str], None]:
    def plant(repo: Path, name: str, evil: str) -> None:
        path = repo / ".git" / "packed-refs"
        # No header (unsorted: git sorts the records itself); the user's record kept or not.
        lines = [line for line in path.read_text().split("\n")
                 if line and not line.startswith("#") and (twice or not line.endswith(" " + name))]
        path.write_text("\n".join(lines + [f"{evil}{sep}{name}"]) + "\n")
    return plant


PLANTS = {
    "an id then junk": _loose("{evil} x\n"),
    "an id in capitals": lambda repo, name, evil: _loose(evil.upper())(repo, name, evil),
    "an id and no newline": _loose("{evil}"),
    "a symbolic ref": _symref,
    "a symlink": _symlink,
    "a tab in packed-refs": _packed("\t"),
    "a name packed twice": _packed(" ", twice=True),
}


@pytest.mark.parametrize("name", ["refs/tags/v1.0", "refs/heads/release"])
@pytest.mark.parametrize("how", sorted(PLANTS))
def test_a_ref_git_reads_as_the_session_s_commit_is_put_back(tmp_path: Path, how: str, name: str) -> None:
    repo, kept, evil = _setup(tmp_path)
    PLANTS[how](repo, name, evil)
    if how != "a name packed twice":  # git reads either: the control shows the reader's one form
        assert _user_reads(repo, name) == "evil", how  # the control: the user's git reads the session's
    done, failed = history.restore(kept)
    assert not failed and [ref for ref, _ in done] == [name], done
    assert "put back at" in done[0][1]
    assert _user_reads(repo, name) == "2\n"


def test_untouched_refs_and_a_session_s_own_new_ones_are_left(tmp_path: Path) -> None:
    """The twin: packed and loose refs as git wrote them, a new branch of
    the session's and a symbolic ref the user had, unchanged, are no change."""
    repo = commits_repo(tmp_path / "repo")
    git(repo, "tag", "v1.0")
    git(repo, "pack-refs", "--all")
    git(repo, "branch", "loose-one")
    git(repo, "symbolic-ref", "refs/heads/alias", "refs/heads/loose-one")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.refs["refs/heads/alias"] == "ref: refs/heads/loose-one"
    git(repo, "branch", "the-session-s")
    assert history.restore(kept) == ([], [])


def test_a_user_s_symbolic_ref_a_session_pointed_elsewhere_is_put_back(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    git(repo, "branch", "stable", "HEAD~1")
    git(repo, "symbolic-ref", "refs/heads/alias", "refs/heads/stable")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "symbolic-ref", "refs/heads/alias", "refs/heads/master")
    done, failed = history.restore(kept)
    assert not failed and done == [("refs/heads/alias", "made ref: refs/heads/master by a session; put back at "
                                                        "ref: refs/heads/stable")], done
    assert git(repo, "symbolic-ref", "refs/heads/alias").strip() == "refs/heads/stable"


def test_a_replacement_after_a_tab_in_packed_refs_is_taken_out(tmp_path: Path) -> None:
    repo, kept, evil = _setup(tmp_path)
    blob = git(repo, "rev-parse", "HEAD:f").strip()
    evil_blob = git(repo, "rev-parse", f"{evil}:f").strip()
    path = repo / ".git" / "packed-refs"
    path.write_text(path.read_text().replace("# pack-refs with: peeled fully-peeled sorted \n", "")
                    + f"{evil_blob}\trefs/replace/{blob}\n")
    assert _user_reads(repo, "HEAD") == "evil"  # the control
    done, failed = history.restore(kept)
    assert not failed and any(f"refs/replace/{blob}" in why for _, why in done), done
    assert _user_reads(repo, "HEAD") == "2\n"


@pytest.mark.parametrize("text,value", [
    ("ref: refs/heads/x\n", "ref: refs/heads/x"), ("ref:refs/heads/x", "ref: refs/heads/x"),
    ("A" * 40 + "\tjunk", "a" * 40), ("b" * 64 + "\n", "b" * 64), ("c" * 41, "broken: '" + "c" * 41 + "'"),
    ("d" * 40 + "\v", "broken: '" + "d" * 40 + "\\x0b'"), ("ref: refs/x\f", "ref: refs/x\f"),
    ("", "broken: ''"),
])
def test_a_loose_ref_s_value(text: str, value: str) -> None:
    assert refvalues.parse_loose(text) == value


def test_a_packed_record() -> None:
    assert refvalues.packed_record("a" * 40 + " refs/heads/x") == ("a" * 40, "refs/heads/x")
    assert refvalues.packed_record("A" * 40 + "\trefs/heads/x") == ("a" * 40, "refs/heads/x")
    for line in ("# pack-refs with: peeled", "^" + "a" * 40, "a" * 39 + " refs/heads/x", "a" * 40 + " ", ""):
        assert refvalues.packed_record(line) is None, line
    # Git's lookup takes the name from the character after the separator on, whatever the separator.
    assert refvalues.packed_record("a" * 40 + "xrefs/tags/v") == ("a" * 40, "refs/tags/v")
    assert refvalues.packed_record("b" * 64 + " refs/tags/v", 64) == ("b" * 64, "refs/tags/v")


def _sorted_with_moved_records(repo: Path, names: list[str]) -> None:
    """``packed-refs`` keeps its ``sorted`` header with the records of
    ``names`` moved to its end: git's binary search no longer finds them."""
    path = repo / ".git" / "packed-refs"
    lines = path.read_text().split("\n")
    moved = [line for line in lines if any(line.endswith(" " + n) for n in names)]
    path.write_text("\n".join([line for line in lines if line and line not in moved] + moved) + "\n")


@pytest.mark.parametrize("how", ["the git directory's top", "refs/NAME", "a tag of the branch's name"])
def test_a_ref_in_front_of_a_short_name_is_moved_aside(tmp_path: Path, how: str) -> None:
    """Git resolves ``v1.0`` at ``.git/v1.0``, then ``refs/v1.0``, then
    ``refs/tags/v1.0``, then ``refs/heads/v1.0``: a ref of the session's in
    front (with the user's records hidden from git's binary search, so that
    git does not even say the name is ambiguous) showed its commit."""
    repo, kept, evil = _setup(tmp_path)
    short, ahead = {"the git directory's top": ("v1.0", ".git/v1.0"), "refs/NAME": ("v1.0", ".git/refs/v1.0"),
                    "a tag of the branch's name": ("release", ".git/refs/tags/release")}[how]
    _sorted_with_moved_records(repo, ["refs/tags/v1.0", "refs/heads/release"])
    (repo / ahead).write_text(evil + "\n")
    assert _user_reads(repo, short) == "evil"  # the control
    done, failed = history.restore(kept)
    assert not failed and any(p == str(repo / ahead) and "in front of one of your branches" in why
                              for p, why in done), done
    assert _user_reads(repo, short) == "2\n" and _user_reads(repo, "refs/heads/release") == "2\n"


def test_a_packed_tag_in_front_of_a_branch_is_taken_out_and_the_user_s_own_stays(tmp_path: Path) -> None:
    """The twin first: a tag and a branch of one name the user had at the
    baseline are the user's. Then a new packed tag named as a branch goes."""
    repo = commits_repo(tmp_path / "repo")
    git(repo, "branch", "release")
    git(repo, "branch", "both")
    git(repo, "tag", "both", "HEAD~1")
    git(repo, "pack-refs", "--all")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert history.restore(kept) == ([], [])
    path = repo / ".git" / "packed-refs"
    path.write_text(path.read_text().replace("# pack-refs with: peeled fully-peeled sorted \n", "")
                    + git(repo, "rev-parse", "HEAD~2").strip() + " refs/tags/release\n")
    assert _user_reads(repo, "release") == "0\n"  # the control: the tag comes first
    done, failed = history.restore(kept)
    assert not failed and any("refs/tags/release taken out" in why for _, why in done), done
    assert _user_reads(repo, "release") == "2\n" and _user_reads(repo, "both") == "1\n"


def test_a_ref_in_front_inside_a_directory_is_moved_aside(tmp_path: Path) -> None:
    """A branch ``feature/x``: ``.git/feature/x`` stands in front of it,
    in a directory the session made (moved whole) or one the user had
    (only the file goes)."""
    for user_had_the_directory in (False, True):
        base = tmp_path / str(user_had_the_directory)
        base.mkdir()
        repo = commits_repo(base / "repo")
        git(repo, "branch", "feature/x", "HEAD~1")
        if user_had_the_directory:
            (repo / ".git" / "feature").mkdir()
        kept = history.record(str(repo / ".git"), str(base / "keep"), own=[])
        (repo / ".git" / "feature").mkdir(exist_ok=True)
        (repo / ".git" / "feature" / "x").write_text(git(repo, "rev-parse", "HEAD~2").strip() + "\n")
        assert _user_reads(repo, "feature/x") == "0\n"  # the control
        done, failed = history.restore(kept)
        assert not failed and _user_reads(repo, "feature/x") == "1\n", done
        assert (repo / ".git" / "feature").is_dir() == user_had_the_directory


@pytest.mark.parametrize("header", ["# pack-refs with:sorted", "# pack-refs with: peeled fully-peeled sorted "])
def test_a_sorted_header_as_git_reads_it(header: str) -> None:
    """Git cuts the header's traits at each space: ``with:sorted`` is sorted."""
    records = ["b" * 40 + " refs/tags/b", "a" * 40 + " refs/tags/a"]
    assert refvalues.packed_out_of_order("\n".join([header] + records))
    assert not refvalues.packed_out_of_order("\n".join([header] + records[::-1]))
    assert not refvalues.packed_out_of_order("\n".join(["# pack-refs with: peeled"] + records))


def test_a_packed_record_named_as_the_short_name_itself_is_taken_out(tmp_path: Path) -> None:
    """``$GIT_DIR/v1.0`` falls back to a packed-refs record named ``v1.0``
    (no ``refs/``), in front of ``refs/tags/v1.0``."""
    repo, kept, evil = _setup(tmp_path)
    path = repo / ".git" / "packed-refs"
    path.write_text(path.read_text() + f"{evil} release\n{evil} v1.0\n")  # still sorted: after refs/
    assert _user_reads(repo, "v1.0") == "evil" and _user_reads(repo, "release") == "evil"  # the control
    done, failed = history.restore(kept)
    assert not failed and any("release, v1.0 taken out" in why for _, why in done), done
    assert _user_reads(repo, "v1.0") == "2\n" and _user_reads(repo, "release") == "2\n"


def test_a_record_git_s_binary_search_reads_past_any_separator_counts(tmp_path: Path) -> None:
    """``<id>xrefs/tags/v1.0``: git's lookup in a sorted ``packed-refs``
    takes the name from the character after the id's and one more, whatever
    that one is; a reader that wanted whitespace there saw only the user's
    record of the name, unchanged."""
    repo, kept, evil = _setup(tmp_path)
    path = repo / ".git" / "packed-refs"
    lines = path.read_text().split("\n")
    extra = [f"{evil}xrefs/heads/release", f"{evil}xrefs/tags/v1.0"]
    path.write_text("\n".join(sorted([line for line in lines[1:] if line] + extra,
                                     key=lambda line: line[41:])).join([lines[0] + "\n", "\n"]))
    assert "evil" in (_user_reads(repo, "v1.0"), _user_reads(repo, "release"))  # the control: one of them is found
    done, failed = history.restore(kept)
    assert not failed and {"refs/tags/v1.0", "refs/heads/release"} <= {name for name, _ in done}, done
    assert _user_reads(repo, "v1.0") == "2\n" and _user_reads(repo, "release") == "2\n"


def test_a_loose_ref_ending_in_a_vertical_tab_is_broken_to_git(tmp_path: Path) -> None:
    """Git's whitespace is space, tab, LF and CR: ``<id>\\v`` is a broken
    ref, which git skips for the next place of a short name (a branch of
    the tag's name, the session's)."""
    repo, kept, evil = _setup(tmp_path)
    tag = repo / ".git" / "refs" / "tags" / "v1.0"
    tag.write_text(git(repo, "rev-parse", "v1.0").strip() + "\v")
    git(repo, "update-ref", "refs/heads/v1.0", evil)
    assert _user_reads(repo, "v1.0") == "evil"  # the control
    done, failed = history.restore(kept)
    assert not failed and "refs/tags/v1.0" in [name for name, _ in done], done
    assert _user_reads(repo, "v1.0") == "2\n"


def _with_remote(tmp_path: Path) -> tuple[Path, str]:
    """A clone of a repository with a branch ``feature`` upstream (what a
    user's clone looks like), and a commit of the session's on its HEAD."""
    upstream = commits_repo(tmp_path / "upstream")
    git(upstream, "branch", "-m", "main")
    git(upstream, "branch", "feature")
    repo = tmp_path / "repo"
    git(tmp_path, "clone", "-q", str(upstream), str(repo))
    tree = git(repo, "mktree", stdin=f"100644 blob {git(repo, 'hash-object', '-w', '--stdin', stdin='evil')}".strip()
               + "\tf\n").strip()
    evil = git(repo, "commit-tree", tree, "-p", "HEAD", "-m", "the session's", stdin="").strip()
    return repo, evil


def test_a_remote_tracking_branch_moved_even_forward_is_put_back(tmp_path: Path) -> None:
    """A plain ``git merge`` takes the upstream's branch: a session's commit
    on top of ``origin/main`` was merged as a fast-forward."""
    repo, evil = _with_remote(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert history.restore(kept) == ([], [])  # the twin: untouched, nothing said
    git(repo, "update-ref", "refs/remotes/origin/main", evil)
    control = tmp_path / "control"
    subprocess.run(["cp", "-a", str(repo), str(control)], check=True)
    git(control, "merge", "-q")
    assert _user_reads(control, "HEAD") == "evil"  # the control: a plain merge takes it
    done, failed = history.restore(kept)
    assert not failed and [name for name, _ in done] == ["refs/remotes/origin/main"], done
    git(repo, "merge", "-q")
    assert _user_reads(repo, "HEAD") == "2\n"


def test_new_remote_tracking_refs_notes_and_stash_are_taken_out(tmp_path: Path) -> None:
    """A new ``origin/feature2`` is what ``git checkout feature2`` makes a
    branch from; new notes show in ``git log``; a new stash is what ``git
    stash pop`` applies. A new branch of the session's stays (its work)."""
    repo, evil = _with_remote(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    for ref in ("refs/remotes/origin/feature2", "refs/notes/commits", "refs/stash", "refs/heads/work"):
        git(repo, "update-ref", ref, evil)
    git(repo, "pack-refs", "--all")  # packed or loose alike
    done, failed = history.restore(kept)
    assert not failed and sorted(n for n, _ in done) == ["refs/notes/commits", "refs/remotes/origin/feature2",
                                                        "refs/stash"], done
    assert git(repo, "for-each-ref", "--format=%(refname)", "refs/remotes", "refs/notes", "refs/stash",
               "refs/heads/work").split() == ["refs/heads/work", "refs/remotes/origin/HEAD",
                                             "refs/remotes/origin/feature", "refs/remotes/origin/main"]
    assert git(repo, "rev-parse", f"refs/dispatchd/displaced/{done[0][1].split('/')[3]}/refs/stash").strip() == evil


def test_a_packed_record_naming_a_path_out_of_refs_is_never_made_into_one(tmp_path: Path) -> None:
    """``refs/remotes/../../config`` in a session's ``packed-refs`` is no ref
    to git (its name fails check_refname_format); taken for a new
    remote-tracking ref, its removal by path deleted ``.git/config``, and a
    branch of such a name, kept as the session's work, was written back
    over a file of the worktree at the next end. The twin: a new
    remote-tracking ref of a plain name is taken out."""
    repo, kept, evil = _setup(tmp_path)
    config = (repo / ".git" / "config").read_bytes()
    path = repo / ".git" / "packed-refs"
    records = [line for line in path.read_text().split("\n") if line and not line.startswith("#")]  # unsorted
    path.write_text("\n".join(records + [f"{evil} refs/remotes/../../config", f"{evil} refs/heads/../../../f",
                                          f"{evil} refs/remotes/origin/plain"]) + "\n")
    done, failed = history.restore(kept)
    assert not failed and [n for n, _ in done] == ["refs/remotes/origin/plain"], done
    assert (repo / ".git" / "config").read_bytes() == config and (repo / "f").read_text() == "2\n"
    assert "refs/heads/../../../f" not in refsback.read_refs(str(repo / ".git"))


def test_a_ref_in_front_behind_a_symlink_is_not_moved_through_it(tmp_path: Path) -> None:
    """A directory of the git directory's top the user had, swapped for a
    symlink to a directory elsewhere holding a file of the short name's:
    nothing there is renamed (it may be the user's), the check fails and
    says so. The twin is the test above, the directory a real one."""
    repo = commits_repo(tmp_path / "repo")
    git(repo, "branch", "feature/x", "HEAD~1")
    (repo / ".git" / "feature").mkdir()
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x").write_text(git(repo, "rev-parse", "HEAD~2").strip() + "\n")
    (repo / ".git" / "feature").rmdir()
    (repo / ".git" / "feature").symlink_to(elsewhere)
    done, failed = history.restore(kept)
    assert [f for f in failed if "behind a symlink; not moved" in f], (done, failed)
    assert (elsewhere / "x").is_file()
