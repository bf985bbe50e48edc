"""The refs read as git reads them while the user's own git packs, prunes
and moves them beside the read (daemon/gitguard/refsback.py ``read_refs``),
and written back under git's own lock (daemon/gitguard/reflock.py): a ref
the user's git prunes between the listing and the read keeps its value, a
ref whose lock git holds is waited for, a lock left in the way (a git
killed, or a session's) is moved aside, and the value replaced is the one
git had under the lock, always kept."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import fs, history, ournames, reflock, refsback, reftemp
from tests.unit.gitrepo import commits_repo, git
from tests.unit.leftovers import adopt


pytestmark = pytest.mark.process  # git makes the repositories


_MADE: dict[tuple[str, str], str] = {}


def _T(leaf: str, key: str) -> str:
    """A temporary's name of ours for ``leaf`` (``ournames``: only the daemon's key makes one), one per ``key``."""
    return _MADE.setdefault((leaf, key), os.path.basename(ournames.make(leaf)))


def _repo(tmp_path: Path) -> tuple[Path, str, dict[str, str]]:
    """Three commits; ``feature`` and 20 branches ``h*`` loose at HEAD~1, a tag packed."""
    repo = commits_repo(tmp_path / "repo", 3)
    git(repo, "tag", "v1")
    git(repo, "pack-refs", "--all")
    for name in ["feature"] + [f"h{i}" for i in range(20)]:
        git(repo, "branch", name, "HEAD~1")
    common = str(repo / ".git")
    return repo, common, refsback.read_refs(common)


def _after_listing(monkeypatch: pytest.MonkeyPatch, deed: Callable[[], None], times: int = 1) -> list[int]:
    """``deed`` run just after the loose refs' first directory listings
    (``times`` of them) and before any file listed is read: the user's git
    at the worst moment. Returns the count of listings, for the caller."""
    real = fs.scanned
    seen = [0]

    def scanned(path: str) -> list[os.DirEntry[str]]:
        entries = real(path)
        seen[0] += 1
        if seen[0] <= times and path.endswith("heads"):
            deed()
        return entries

    monkeypatch.setattr(refsback.fs, "scanned", scanned)
    return seen


def test_a_loose_ref_git_packs_and_prunes_between_the_listing_and_the_read_keeps_its_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, common, truth = _repo(tmp_path)
    _after_listing(monkeypatch, lambda: git(repo, "pack-refs", "--all"))
    got = refsback.read_refs(common)
    assert not (repo / ".git" / "refs" / "heads" / "feature").exists()  # the deed was done: pruned
    assert got == truth


def test_the_twin_a_ref_git_moves_between_the_listing_and_the_read_reads_as_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, common, truth = _repo(tmp_path)
    head = git(repo, "rev-parse", "HEAD").strip()
    _after_listing(monkeypatch, lambda: git(repo, "update-ref", "refs/heads/feature", head))
    got = refsback.read_refs(common)
    assert got["refs/heads/feature"] == head != truth["refs/heads/feature"]
    assert {k: v for k, v in got.items() if k != "refs/heads/feature"} == \
        {k: v for k, v in truth.items() if k != "refs/heads/feature"}


def test_a_ref_deleted_between_the_listing_and_the_read_reads_as_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, common, truth = _repo(tmp_path)
    _after_listing(monkeypatch, lambda: git(repo, "branch", "-q", "-D", "h3"))
    got = refsback.read_refs(common)
    assert "refs/heads/h3" not in got and got == {k: v for k, v in truth.items() if k != "refs/heads/h3"}


def test_a_read_during_which_packed_refs_changed_is_done_again_and_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, common, truth = _repo(tmp_path)
    seen = _after_listing(monkeypatch, lambda: git(repo, "pack-refs", "--all"))
    assert refsback.read_refs(common) == truth
    assert seen[0] > 1 and seen[0] % 2 == 0  # listed again: the first read met a new packed-refs
    # packed-refs rewritten during every read: the read ends after _READS of them, with git's values.
    flip = [0]

    def repack() -> None:
        flip[0] += 1
        git(repo, "update-ref", f"refs/tags/t{flip[0]}", truth["refs/tags/v1"])
        git(repo, "pack-refs", "--all")
    _after_listing(monkeypatch, repack, times=100)
    got = refsback.read_refs(common)
    assert flip[0] == refsback._READS
    assert {k: v for k, v in got.items() if not k.startswith("refs/tags/t")} == truth


def test_a_lock_left_in_the_way_past_the_wait_is_moved_aside_and_the_ref_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``h6.lock`` is still there after the wait (a git killed, or a session
    that planted it so that its move of h6 would stay): it is moved aside,
    kept, and h6 put back; the report says where the lock went. The twin,
    in the same end: h5, whose lock was free, is put back as always."""
    repo, common, truth = _repo(tmp_path)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    head = git(repo, "rev-parse", "HEAD").strip()
    c0 = git(repo, "rev-parse", "HEAD~2").strip()
    git(repo, "update-ref", "refs/heads/h5", c0)
    git(repo, "update-ref", "refs/heads/h6", c0)
    lock = repo / ".git" / "refs" / "heads" / "h6.lock"
    lock.write_text(head + "\n")  # one name, as git makes it
    monkeypatch.setattr(reflock, "WAIT_S", 0.05)
    done, failed = history.restore(kept)
    assert failed == []
    why = dict(done)["refs/heads/h6"]
    aside = why.split(" moved aside to ")[1]
    assert why == (f"moved to {c0[:12]} by a session; put back at {truth['refs/heads/h6'][:12]}; "
                   f"git's lock refs/heads/h6.lock, left in the way, moved aside to {aside}")
    # Out of refs/ (a name there is a ref to git), to the git directory's top.
    assert aside.startswith(f"{repo / '.git' / 'h6.lock'}.quarantined-by-dispatchd-")
    assert Path(aside).read_text() == head + "\n"
    assert not lock.exists()
    assert git(repo, "rev-parse", "refs/heads/h6").strip() == truth["refs/heads/h6"]
    assert dict(done)["refs/heads/h5"] == f"moved to {c0[:12]} by a session; put back at {truth['refs/heads/h5'][:12]}"
    assert git(repo, "rev-parse", "refs/heads/h5").strip() == truth["refs/heads/h5"]
    displaced = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", reftemp.DISPLACED).split("\n")
    assert any(line.endswith(f"/refs/heads/h5 {c0}") for line in displaced), displaced
    assert any(line.endswith(f"/refs/heads/h6 {c0}") for line in displaced), displaced


def test_a_lock_the_user_s_git_lets_go_within_the_wait_is_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live git holds h6's lock for 0.2 s of the end's wait: the end waits
    for it, then puts h6 back, and moves nothing aside."""
    repo, common, truth = _repo(tmp_path)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    c0 = git(repo, "rev-parse", "HEAD~2").strip()
    git(repo, "update-ref", "refs/heads/h6", c0)
    lock = repo / ".git" / "refs" / "heads" / "h6.lock"
    lock.write_text(c0 + "\n")
    letgo = threading.Timer(0.2, lock.unlink)
    letgo.start()
    try:
        done, failed = history.restore(kept)
    finally:
        letgo.join()
    assert failed == []
    assert dict(done)["refs/heads/h6"] == f"moved to {c0[:12]} by a session; put back at {truth['refs/heads/h6'][:12]}"
    assert git(repo, "rev-parse", "refs/heads/h6").strip() == truth["refs/heads/h6"]
    assert not any(".quarantined-by-dispatchd-" in p.name for p in lock.parent.iterdir())


def test_a_lock_that_cannot_be_moved_aside_leaves_the_ref_and_keeps_its_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the lock left in the way cannot be moved aside either, the ref
    is never written without it: left, and its value at the baseline kept."""
    repo, common, truth = _repo(tmp_path)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    head = git(repo, "rev-parse", "HEAD").strip()
    c0 = git(repo, "rev-parse", "HEAD~2").strip()
    git(repo, "update-ref", "refs/heads/h6", c0)
    lock = repo / ".git" / "refs" / "heads" / "h6.lock"
    lock.write_text(head + "\n")
    monkeypatch.setattr(reflock, "WAIT_S", 0.05)

    # The rename out of refs/ fails (an aside name in no directory there).
    monkeypatch.setattr(reflock.fs, "aside_name", lambda name: f"no-such-directory/{name}")
    done, failed = history.restore(kept)
    assert failed == []
    why = dict(done)["refs/heads/h6"]
    stamped = why.split(" kept as ")[1].split(" ")[0]
    assert why == ("not put back: git's lock refs/heads/h6.lock is held (your git is writing the ref, or left it); "
                   f"its value at the baseline kept as {stamped} (git update-ref refs/heads/h6 {stamped} puts it back)")
    assert git(repo, "rev-parse", stamped).strip() == truth["refs/heads/h6"]
    assert git(repo, "rev-parse", "refs/heads/h6").strip() == c0  # not written
    assert lock.read_text() == head + "\n"


def test_the_value_replaced_is_the_one_git_has_under_the_lock_and_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's commit lands between the end's read and its lock: the
    end writes the baseline back over that commit's value, and keeps it."""
    repo, common, truth = _repo(tmp_path)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    c0 = git(repo, "rev-parse", "HEAD~2").strip()
    git(repo, "update-ref", "refs/heads/feature", c0)  # the session's move (backward)
    git(repo, "commit", "-q", "--allow-empty", "-m", "the user's")
    users = git(repo, "rev-parse", "HEAD").strip()  # not a descendant of c0's move... nor on feature
    real = reflock._take

    def take(*args: object) -> str:
        git(repo, "update-ref", "refs/heads/feature", users)  # the user's git, just before the lock
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(reflock, "_take", take)
    done, failed = history.restore(kept)
    assert failed == [] and dict(done)["refs/heads/feature"].startswith("moved forward")  # users descends from the baseline
    assert git(repo, "rev-parse", "refs/heads/feature").strip() == users  # a fast-forward is kept, never written over


def test_a_value_the_user_s_git_wrote_just_before_the_lock_is_the_one_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin of the above with a move that is not forward: the end writes
    the baseline back, and keeps the value git had under the lock (not the
    one its first read saw)."""
    repo, common, truth = _repo(tmp_path)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    c0 = git(repo, "rev-parse", "HEAD~2").strip()
    git(repo, "update-ref", "refs/heads/feature", c0)
    sideways = git(repo, "commit-tree", "HEAD^{tree}", "-m", "sideways").strip()  # no parent: not forward
    real = reflock._take

    def take(*args: object) -> str:
        git(repo, "update-ref", "refs/heads/feature", sideways)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(reflock, "_take", take)
    done, failed = history.restore(kept)
    assert failed == []
    assert dict(done)["refs/heads/feature"] == \
        f"moved to {sideways[:12]} by a session; put back at {truth['refs/heads/feature'][:12]}"
    assert git(repo, "rev-parse", "refs/heads/feature").strip() == truth["refs/heads/feature"]
    kept_refs = git(repo, "for-each-ref", "--format=%(objectname)", reftemp.DISPLACED).split()
    assert kept_refs == [sideways]


def test_a_baseline_value_that_names_no_commit_is_said_and_not_failed(tmp_path: Path) -> None:
    """An older daemon's record read a loose ref while the user's git pruned
    it ("not a regular file"): nothing to write back, nothing of the user's
    lost; said, and the check is whole (the worktree is not refused)."""
    repo, common, truth = _repo(tmp_path)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    kept.refs["refs/heads/feature"] = "not a regular file"
    done, failed = history.restore(kept)
    assert failed == []
    assert done == [("refs/heads/feature", "its value at the baseline (not a regular file) names no commit, so none "
                                           f"is written back; left at {truth['refs/heads/feature'][:12]} "
                                           "(git reflog refs/heads/feature names what it held)")]
    assert git(repo, "rev-parse", "refs/heads/feature").strip() == truth["refs/heads/feature"]


def test_a_lock_of_git_s_left_at_the_last_end_is_said_and_left(tmp_path: Path) -> None:
    """``index.lock`` made while a session ran and still there at the last
    end blocks the user's git: said, never removed (a ``git commit`` of the
    user's, its editor open, holds the same lock). The twin: a lock that was
    there before the baseline's look is not said again."""
    repo, common, truth = _repo(tmp_path)
    (repo / ".git" / "shallow.lock").write_text("")  # there before the look
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    (repo / ".git" / "index.lock").write_text("")
    (repo / ".git" / "refs" / "heads" / "feature.lock").write_text("")  # stops a commit on feature
    done, failed = history.restore(kept)
    assert failed == []
    said = [(path, why) for path, why in done if path.endswith(".lock")]
    why = ("git's lock, made while a session ran and still there: your git stops on it (`File exists`) until it "
           "is removed; remove it once no git of yours runs")
    assert said == [(f"{common}/index.lock", why), (f"{common}/refs/heads/feature.lock", why)]
    assert (repo / ".git" / "index.lock").exists() and (repo / ".git" / "shallow.lock").exists()


def test_git_s_locks_left_in_a_linked_worktree_s_directory_and_below_logs_are_said(tmp_path: Path) -> None:
    """A killed session's git left ``worktrees/wt/index.lock`` (the linked
    worktree's next ``git add`` stops on it) and ``logs/refs/heads/main.lock``
    (a killed ``git reflog expire``): said as the top's are. The twin: a lock
    of two names (a killed daemon's own, taken over by the next write and
    swept at the start) is not said."""
    repo, common, truth = _repo(tmp_path)
    (repo / ".git" / "worktrees" / "wt").mkdir(parents=True)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    (repo / ".git" / "worktrees" / "wt" / "index.lock").write_text("")
    (repo / ".git" / "logs" / "refs" / "heads" / "main.lock").write_text("")
    (repo / ".git" / _T("ORIG_HEAD", "0123456789abcdef")).write_text("")
    os.link(repo / ".git" / _T("ORIG_HEAD", "0123456789abcdef"), repo / ".git" / "ORIG_HEAD.lock")
    adopt(repo / ".git")
    done, failed = history.restore(kept)
    said = sorted(path for path, why in done if path.endswith(".lock"))
    assert failed == [] and said == [f"{common}/logs/refs/heads/main.lock", f"{common}/worktrees/wt/index.lock"]


def test_decoy_locks_push_no_blocking_one_out_of_the_report_and_the_rest_are_counted(tmp_path: Path) -> None:
    """Twenty decoys (``refs/decoyN.lock``, of no ref) filled the report's
    twenty places, and ``refs/heads/main.lock``, which stops the user's next
    commit, went unsaid, with no word of more. The locks of a ref or file
    that exists come first now, and the rest are counted."""
    repo, common, truth = _repo(tmp_path)
    kept = history.record(common, str(tmp_path / "keep"), own=[])
    for i in range(25):
        (repo / ".git" / "refs" / f"decoy{i}.lock").write_text("")
    (repo / ".git" / "refs" / "heads" / "feature.lock").write_text("")
    done, failed = history.restore(kept)
    said = [(path, why) for path, why in done if ".lock" in path or path == common]
    assert failed == [] and said[0][0] == f"{common}/refs/heads/feature.lock" and len(said) == 21, said
    assert said[-1] == (common, "6 more of git's locks made while a session ran and still there, not named one by "
                                "one (find .git -name '*.lock')")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "loose"])
def test_a_baseline_over_the_refs_bound_refuses_the_open_rather_than_keep_part_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    """A session made as many branches as the bound, named to sort before
    the user's (kept at its end: new branches are the session's work): the
    next baseline held none of the user's branches and tags, and that
    session's ``git branch -D`` of theirs was never put back. Now a baseline
    the bound would cut refuses the open, naming why; the twin: one ref
    under the bound, read whole, and a read that may be cut (an end's)
    still returns what it read."""
    from dispatchd.daemon.gitguard import history, refsback
    from dispatchd.errors import WorktreeError
    from tests.unit.gitrepo import commits_repo

    repo = commits_repo(tmp_path / "repo")
    git(repo, "tag", "v1.0")
    head = git(repo, "rev-parse", "HEAD").strip()
    for i in range(5):
        git(repo, "branch", f"aaa-{i}", head)
    if packed:
        git(repo, "pack-refs", "--all")
    common = str(repo / ".git")
    count = len(refsback.read_refs(common))
    monkeypatch.setattr(refsback, "_MAX_REFS", count)
    assert len(refsback.read_refs(common, whole=True)) == count  # the twin: at the bound, whole
    history.record(common, str(tmp_path / "keep"), own=[])
    git(repo, "branch", "aaa-5", head)
    with pytest.raises(WorktreeError, match=f"more than {count:,} refs.*no session opened"):
        history.record(common, str(tmp_path / "keep"), own=[])
    assert len(refsback.read_refs(common)) == count  # an end's read: what the bound lets it read
