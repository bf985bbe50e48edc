"""dispatchd.daemon.gitguard.arealinks on real repositories: git's names in
``objects/pack`` and ``objects/info`` (a local clone links them, so the
ends judge them by their inode's ctime), a packed ref's reflog split under
its ref's lock, and the baseline's time read for a file system keeping
whole seconds."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from dispatchd import treewalk
from dispatchd.daemon.gitguard import arealinks, gitlock, layouts
from tests.unit.gitrepo import ENV, git, one_file_repo
from tests.unit.test_hardlinks_users import AREA, NOT_GRANTED, _linked, baseline, end

pytestmark = pytest.mark.process  # starts git

_ID = "1" * 40
SHAPED = ["info/packs", "info/commit-graph", f"pack/pack-{_ID}.keep", f"pack/pack-{_ID}.promisor",
          "pack/multi-pack-index", "pack/multi-pack-index.d/multi-pack-index-chain",
          "info/commit-graphs/commit-graph-chain", f"info/commit-graphs/graph-{_ID}.graph"]


@pytest.mark.parametrize("name", SHAPED)
def test_a_link_at_git_s_name_in_objects_pack_or_info_made_during_a_session_is_split_at_its_end(
        tmp_path: Path, name: str) -> None:
    """A session on the main worktree links a worktree file of the user's
    at a name git gives in ``objects/pack`` or ``objects/info``: the open
    of a linked worktree meanwhile is granted (a local clone links these
    names too, so an open cannot tell), and the end, finding it linked
    since the baseline, makes it a file of its own, said; the user's file
    keeps its inode (before: never stat'ed, written through for good)."""
    repo = one_file_repo(tmp_path / "repo", "app.py")
    wt = _linked(repo, tmp_path / "wt")
    part = baseline(repo)
    planted = repo / ".git" / "objects" / name
    planted.parent.mkdir(exist_ok=True)
    ino = os.stat(repo / "app.py").st_ino
    os.link(repo / "app.py", planted)  # the session on the main worktree
    assert layouts.inspect_git(str(wt), uid=os.getuid()).kind == "linked"
    assert end(part) == ([(str(planted), AREA.format(1))], [])
    assert os.stat(planted).st_nlink == 1 and os.stat(repo / "app.py").st_ino == ino
    assert planted.read_text() == "app.py"


@pytest.mark.parametrize("name", ["info/x", "pack/x", "pack/multi-pack-index.d/x", "info/commit-graphs/x"])
def test_a_link_at_a_name_not_of_git_s_in_objects_pack_or_info_refuses_a_linked_open(
        tmp_path: Path, name: str) -> None:
    """The twin: a name git never gives there refuses the linked open meanwhile, said, and is split at the end."""
    repo = one_file_repo(tmp_path / "repo", "app.py")
    wt = _linked(repo, tmp_path / "wt")
    part = baseline(repo)
    planted = repo / ".git" / "objects" / name
    planted.parent.mkdir(exist_ok=True)
    os.link(repo / "app.py", planted)
    opened = layouts.inspect_git(str(wt), uid=os.getuid())
    assert (opened.kind, opened.note) == ("refused", f"{planted} {NOT_GRANTED}")
    assert end(part) == ([(str(planted), AREA.format(1))], [])
    assert layouts.inspect_git(str(wt), uid=os.getuid()).kind == "linked"


def _with_graphs(path: Path) -> Path:
    """A repository whose objects hold a commit-graph, a multi-pack-index, ``info/packs`` and a ``.keep``."""
    repo = one_file_repo(path, "app.py")
    git(repo, "repack", "-qad")
    git(repo, "commit-graph", "write", "--reachable")
    git(repo, "multi-pack-index", "write")
    git(repo, "update-server-info")
    pack = next(p for p in (repo / ".git" / "objects" / "pack").iterdir() if p.suffix == ".pack")
    pack.with_suffix(".keep").write_text("")
    return repo


def test_a_local_clone_s_links_at_git_s_names_in_pack_and_info_are_left(tmp_path: Path) -> None:
    """The twin: ``git clone --local`` links every file of ``objects`` (the
    commit-graph, the multi-pack-index, ``info/packs``, a ``.keep``) before
    the baseline: its linked worktree is granted and the end leaves them."""
    src = _with_graphs(tmp_path / "src")
    git(tmp_path, "clone", "-q", "--local", str(src), "clone")
    clone = tmp_path / "clone"
    objects = clone / ".git" / "objects"
    linked = [n for n in ("info/packs", "info/commit-graph", "pack/multi-pack-index") if (objects / n).exists()]
    assert linked and all(os.stat(objects / n).st_nlink == 2 for n in linked)
    time.sleep(0.05)  # the links well before the baseline
    wt = _linked(clone, tmp_path / "wt")
    assert layouts.inspect_git(str(wt), uid=os.getuid()).kind == "linked"
    assert end(baseline(clone)) == ([], [])
    assert all(os.stat(objects / n).st_nlink == 2 for n in linked)


def test_alternates_with_another_link_refuses_a_linked_open_until_an_end(tmp_path: Path) -> None:
    """``objects/info/alternates`` is the one name a local clone copies
    rather than links: linked (a session's ``ln``, before any baseline)
    it refuses the open, said, and an end makes it a file of its own,
    however old the link, the other name keeping the old inode."""
    repo = one_file_repo(tmp_path / "repo", "app.py")
    alternates = repo / ".git" / "objects" / "info" / "alternates"
    alternates.write_text(f"{tmp_path}/elsewhere/objects\n")
    os.link(alternates, repo / "also")
    time.sleep(0.05)
    wt = _linked(repo, tmp_path / "wt")
    opened = layouts.inspect_git(str(wt), uid=os.getuid())
    assert (opened.kind, opened.note) == ("refused", f"{alternates} {NOT_GRANTED}")
    done, failed = end(baseline(repo))
    assert failed == [] and (str(alternates), AREA.format(1)) in done, done
    assert os.stat(alternates).st_nlink == 1 and os.stat(repo / "also").st_nlink == 1
    assert layouts.inspect_git(str(wt), uid=os.getuid()).kind == "linked"


def test_alternates_of_one_name_grants_the_linked_open(tmp_path: Path) -> None:
    """The twin: the same file, no other name: granted, nothing split."""
    repo = one_file_repo(tmp_path / "repo", "app.py")
    (repo / ".git" / "objects" / "info" / "alternates").write_text(f"{tmp_path}/elsewhere/objects\n")
    wt = _linked(repo, tmp_path / "wt")
    assert layouts.inspect_git(str(wt), uid=os.getuid()).kind == "linked"
    assert end(baseline(repo)) == ([], [])


def test_a_pack_file_git_reads_is_left_to_the_pack_checks_and_its_keep_is_found(tmp_path: Path) -> None:
    """A pack's files (``.pack``, ``.idx``, ...) are held read-only in each
    session and the history's keep links them after the baseline: the walk
    at an end leaves them (``packlinks.py`` makes a pack given another name
    the repository's own). The twin: its ``.keep``, linked since, is found."""
    repo = one_file_repo(tmp_path / "repo", "app.py")
    git(repo, "repack", "-qad")
    pack = repo / ".git" / "objects" / "pack"
    idx = next(p for p in pack.iterdir() if p.suffix == ".idx")
    keep = idx.with_suffix(".keep")
    keep.write_text("")
    taken = time.time_ns()
    os.link(idx, tmp_path / "idx-too")
    os.link(keep, tmp_path / "keep-too")
    assert [path for path, _ in arealinks.walk(str(repo / ".git"), [], taken)] == [str(keep)]


def _feature_reflog(tmp_path: Path, packed: bool) -> tuple[Path, Path, str]:
    repo = one_file_repo(tmp_path / "repo", "app.py")
    git(repo, "branch", "feature/x")
    if packed:
        git(repo, "pack-refs", "--all")  # prunes refs/heads/feature/x and its now empty directory
    assert (repo / ".git" / "refs" / "heads" / "feature").exists() != packed
    reflog = repo / ".git" / "logs" / "refs" / "heads" / "feature" / "x"
    newer = git(repo, "commit-tree", "-m", "c2", "-p", "HEAD", "HEAD^{tree}").strip()
    return repo, reflog, newer


def _update_ref(repo: Path, newer: str) -> str:
    run = subprocess.run(["git", "update-ref", "-m", "user's update", "refs/heads/feature/x", newer],
                         cwd=repo, env=ENV, capture_output=True, text=True)
    return f"{run.returncode}:{run.stderr}"


def _user_git_during_split(monkeypatch: pytest.MonkeyPatch, repo: Path, newer: str) -> list[str]:
    """The user's ``git update-ref`` run while the end has copied the reflog and not yet renamed the copy."""
    said: list[str] = []

    def step(name: str) -> None:
        if name == "written" and not said:
            said.append(_update_ref(repo, newer))
    monkeypatch.setattr(gitlock, "_step", step)
    return said


@pytest.mark.parametrize("packed", [True, False])
def test_a_reflog_is_split_under_its_ref_s_lock_its_ref_packed_or_loose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    """A branch's reflog linked elsewhere by a session is split at the end
    holding ``refs/heads/feature/x.lock``, as git would take it: the user's
    git run meanwhile fails loudly, nothing of theirs lost, and succeeds
    after. A packed ref's directory (``git pack-refs --all`` removed
    ``refs/heads/feature/``) is made for the lock and removed after (before:
    no lock taken there, and the user's reflog line, appended to the old
    inode, was lost). The loose ref is the twin."""
    repo, reflog, newer = _feature_reflog(tmp_path, packed)
    part = baseline(repo)
    os.link(reflog, repo / "elsewhere")  # the session
    said = _user_git_during_split(monkeypatch, repo, newer)
    done, failed = end(part)
    assert failed == [] and (str(reflog), AREA.format(1)) in done, done
    assert said and said[0].startswith("128:") and "refs/heads/feature/x.lock" in said[0], said
    assert os.stat(reflog).st_nlink == 1
    assert (repo / ".git" / "refs" / "heads" / "feature").exists() != packed
    assert _update_ref(repo, newer) == "0:"
    assert "user's update" in reflog.read_text() and "user's update" not in (repo / "elsewhere").read_text()


def test_a_symlink_in_place_of_a_packed_ref_s_directory_is_not_followed(tmp_path: Path) -> None:
    """A session leaves ``refs/heads/feature`` a symlink to a directory of
    the user's: no lock is made there (nor anything else), and the reflog
    is split all the same. The twin is the packed ref's case above."""
    repo, reflog, _ = _feature_reflog(tmp_path, packed=True)
    part = baseline(repo)
    users = tmp_path / "users"
    users.mkdir()
    (repo / ".git" / "refs" / "heads" / "feature").symlink_to(users)
    os.link(reflog, repo / "elsewhere")
    done, failed = end(part)
    assert failed == [] and (str(reflog), AREA.format(1)) in done, done
    assert list(users.iterdir()) == []


_S = 1_000_000_000


@pytest.mark.parametrize(("ctime_ns", "since_ns", "is_after"), [
    (100 * _S + 5, 100 * _S + 5, True),  # at the baseline
    (100 * _S + 5 - treewalk.COARSE_SETTLE_NS // 4, 100 * _S + 5, False),  # a fine ctime before it
    (100 * _S, 100 * _S + _S // 2, True),  # a whole second: made in the baseline's second, read as its start
    (99 * _S, 100 * _S + _S // 2, True),  # within two seconds of it
    (97 * _S, 100 * _S + _S // 2, False),  # well before it
])
def test_a_ctime_in_whole_seconds_is_after_a_baseline_within_two_seconds(
        ctime_ns: int, since_ns: int, is_after: bool) -> None:
    """A file system keeping whole seconds gives a link made just after the
    baseline the second's start, before the baseline's time: such a ctime
    counts as after it within ``treewalk.COARSE_SETTLE_NS`` (before: missed,
    the link left); a fine ctime as far before is not (the twin)."""
    assert arealinks._after(ctime_ns, since_ns) is is_after
