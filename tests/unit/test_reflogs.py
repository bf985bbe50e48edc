"""The user's reflogs kept across a session (``gitguard/reflogs.py``,
``gitguard/reflogsback.py``): a session's ``git reflog expire --all`` took
every line of the user's undo history, and with them the only names of the
commits an amend, a reset or a deleted branch left behind (the user's next
``git gc`` then deleted them). Each case beside its twin, the user's own git
reading the result."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, reflogs, reflogsback, reftemp
from tests.unit.gitrepo import git

pytestmark = pytest.mark.process


class Killed(BaseException):
    """The daemon's death half way through the put-back."""


def _repo(tmp_path: Path) -> tuple[Path, str]:
    """A repository with a commit amended away and two reset away: 7 lines
    in ``git reflog``; returns it and the amended-away commit's id."""
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    for i in range(4):
        (r / "f").write_text(f"{i}\n")
        git(r, "add", "f")
        git(r, "commit", "-qm", f"c{i}")
    amended = git(r, "rev-parse", "HEAD").strip()
    git(r, "commit", "-q", "--amend", "-m", "c3 amended")
    git(r, "reset", "-q", "--hard", "HEAD~1")
    return r, amended


def _record(tmp_path: Path, repo: Path) -> history.History:
    return history.record(str(repo / ".git"), str(tmp_path / "state" / "keep" / "k"), own=[])


def _end(kept: history.History) -> tuple[list[tuple[str, str]], list[str]]:
    done, failed = history.restore(kept)
    return [(n, why) for n, why in done if n == "logs"], failed


def _reflog(repo: Path, ref: str = "HEAD") -> list[str]:
    return git(repo, "reflog", "show", "--format=%H %gs", ref).splitlines()


def _unreachable(repo: Path) -> str:
    return git(repo, "fsck", "--unreachable", "--no-progress")


def test_reflogs_a_session_expires_and_gcs_are_put_back_and_name_their_commits_again(tmp_path: Path) -> None:
    repo, amended = _repo(tmp_path)
    head, main = _reflog(repo), _reflog(repo, "main")
    kept = _record(tmp_path, repo)
    assert set(kept.reflogs.logs) == {"logs/HEAD", "logs/refs/heads/main"} and kept.note == ""  # type: ignore[union-attr]
    git(repo, "reflog", "expire", "--expire=now", "--expire-unreachable=now", "--all")
    git(repo, "gc", "-q", "--prune=now")
    assert _reflog(repo) == [] and _reflog(repo, "main") == []
    said, failed = _end(kept)
    assert not failed and said == [("logs", f"2 reflogs a session cut put back ({len(head) + len(main)} lines of your "
                                            "`git reflog`, and the commits only they name): HEAD, refs/heads/main")]
    assert _reflog(repo) == head and _reflog(repo, "main") == main
    git(repo, "cat-file", "-e", amended)  # its object file put back (history.py) ...
    assert amended not in _unreachable(repo)  # ... and named by a reflog again: the user's gc keeps it
    git(repo, "show", "-q", "HEAD@{2}")
    assert _end(kept) == ([], [])  # whole now: a second run leaves it


def test_a_reflog_emptied_in_place_is_put_back_from_a_copy_of_its_own(tmp_path: Path) -> None:
    """``: > .git/logs/HEAD`` truncates the user's inode: a hard link in the keep would be emptied with it."""
    repo, _ = _repo(tmp_path)
    head = _reflog(repo)
    kept = _record(tmp_path, repo)
    log = repo / ".git" / "logs" / "HEAD"
    copy = Path(kept.reflogs.keep) / reflogs.COPIES / "logs" / "HEAD"  # type: ignore[union-attr]
    assert copy.stat().st_ino != log.stat().st_ino and copy.read_bytes() == log.read_bytes()
    with open(log, "r+b") as f:
        f.truncate(0)
    (repo / "f").write_text("session\n")
    git(repo, "commit", "-qam", "the session's")
    said, failed = _end(kept)
    assert not failed and said[0][1].startswith(f"1 reflogs a session cut put back ({len(head)} lines"), said
    assert _reflog(repo)[1:] == head and _reflog(repo)[0].endswith(" commit: the session's")


def test_a_deleted_reflog_is_put_back(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    main = _reflog(repo, "main")
    kept = _record(tmp_path, repo)
    (repo / ".git" / "logs" / "refs" / "heads" / "main").unlink()
    said, failed = _end(kept)
    assert not failed and said == [("logs", f"1 reflogs a session cut put back ({len(main)} lines of your "
                                            "`git reflog`, and the commits only they name): refs/heads/main")]
    assert _reflog(repo, "main") == main


def test_a_reflog_swapped_for_a_symlink_is_moved_out_not_followed(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    head = _reflog(repo)
    kept = _record(tmp_path, repo)
    target = tmp_path / "users-file"
    target.write_text("the user's\n")
    log = repo / ".git" / "logs" / "HEAD"
    log.unlink()
    log.symlink_to(target)
    said, failed = _end(kept)
    assert not failed and said[0][1].startswith(
        f"1 reflogs a session cut put back ({len(head)} lines of your `git reflog`, and the commits only they "
        "name): HEAD; "
        "what was found in place of 1 of them moved to the git directory: reflog-HEAD.quarantined-by-dispatchd-"), said
    assert target.read_text() == "the user's\n" and not log.is_symlink() and _reflog(repo) == head
    moved = [n for n in os.listdir(repo / ".git") if n.startswith("reflog-HEAD")]
    assert len(moved) == 1 and (repo / ".git" / moved[0]).is_symlink()


def test_a_reflog_a_directory_took_the_place_of_is_moved_out(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    main = _reflog(repo, "main")
    kept = _record(tmp_path, repo)
    log = repo / ".git" / "logs" / "refs" / "heads" / "main"
    log.unlink()
    (log / "x").mkdir(parents=True)
    said, failed = _end(kept)
    assert not failed and "moved to the git directory: reflog-main.quarantined-by-dispatchd-" in said[0][1], said
    assert _reflog(repo, "main") == main


def test_reflogs_a_session_only_appends_to_are_left_as_they_are(tmp_path: Path) -> None:
    """The twin: a session's commits, a branch and a checkout append to the
    reflogs (git's own use): nothing said, nothing written, the same inode."""
    repo, _ = _repo(tmp_path)
    head = _reflog(repo)
    kept = _record(tmp_path, repo)
    log = repo / ".git" / "logs" / "HEAD"
    before = log.stat()
    (repo / "f").write_text("session\n")
    git(repo, "commit", "-qam", "the session's")
    git(repo, "checkout", "-qb", "side")
    git(repo, "checkout", "-q", "main")
    assert _end(kept) == ([], [])
    assert log.stat().st_ino == before.st_ino and _reflog(repo)[3:] == head
    assert [n for n in os.listdir(repo / ".git") if n.startswith("reflog-")] == []


def test_a_reflog_read_as_it_was_is_not_read_again_and_an_appended_one_appends_to_its_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reflogs, "_RACY_NS", 0)  # every ctime settled at the next look (else read again)
    repo, _ = _repo(tmp_path)
    first = _record(tmp_path, repo)
    copy = Path(first.reflogs.keep) / reflogs.COPIES / "logs" / "HEAD"  # type: ignore[union-attr]
    ino = copy.stat().st_ino
    read = reflogs._read
    seen: list[str] = []
    monkeypatch.setattr(reflogs, "_read", lambda d, name: seen.append(name) or read(d, name))
    again = _record(tmp_path, repo)
    assert seen == [] and again.reflogs == first.reflogs
    (repo / "f").write_text("more\n")
    git(repo, "commit", "-qam", "more")
    later = _record(tmp_path, repo)
    assert sorted(seen) == ["HEAD", "main"] and copy.stat().st_ino == ino  # appended, not replaced
    assert copy.read_bytes() == (repo / ".git" / "logs" / "HEAD").read_bytes()
    assert later.reflogs.logs["logs/HEAD"].size > first.reflogs.logs["logs/HEAD"].size  # type: ignore[union-attr]


def test_a_copy_an_older_record_names_stays_until_that_record_is_gone(tmp_path: Path) -> None:
    """The user's own ``reflog expire`` between two baselines rewrites the
    reflog: a record still on disk (its end not yet run) names the old
    bytes, which stay in the keep until no record names it."""
    repo, _ = _repo(tmp_path)
    head = _reflog(repo)
    older = _record(tmp_path, repo)
    records = tmp_path / "state" / "baselines"
    records.mkdir()
    (records / "d.json").write_text(f'{{"histories": [{{"keep": "{older.reflogs.keep}"}}]}}')  # type: ignore[union-attr]
    git(repo, "reflog", "expire", "--expire=now", "--expire-unreachable=now", "--all")
    (repo / "f").write_text("user\n")
    git(repo, "commit", "-qam", "the user's, since")
    newer = _record(tmp_path, repo)
    assert len(os.listdir(Path(older.reflogs.keep) / reflogs.OLD)) == 2  # type: ignore[union-attr]
    (repo / ".git" / "logs" / "HEAD").unlink()
    said, failed = _end(older)
    assert not failed and said and _reflog(repo)[:len(head)] == head
    (records / "d.json").unlink()
    _record(tmp_path, repo)
    assert not (Path(older.reflogs.keep) / reflogs.OLD).exists()  # type: ignore[union-attr]
    assert newer.reflogs is not None


def test_reflogs_past_the_bounds_are_not_kept_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 remote-tracking refs' logs (a large clone's): HEAD and the
    branches kept first, the rest said; a 50 MB ``logs/HEAD`` is not read."""
    repo, _ = _repo(tmp_path)
    head_id = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "update-ref", "--create-reflog", "--stdin",
        stdin="".join(f"create refs/remotes/origin/b{i:04} {head_id}\n" for i in range(5000)))
    kept = _record(tmp_path, repo)
    assert kept.note == "reflogs past 2000 not kept (from logs/refs/remotes/origin/b1998 on)", kept.note
    assert {"logs/HEAD", "logs/refs/heads/main"} <= set(kept.reflogs.logs)  # type: ignore[union-attr]
    # By hand: git writes no 50 MB reflog in a test's time; its lines are git's, repeated.
    with open(repo / ".git" / "logs" / "HEAD", "ab") as f:
        line = (repo / ".git" / "logs" / "HEAD").read_bytes().splitlines(keepends=True)[0]
        f.write(line * (50_000_000 // len(line)))
    read = reflogs._read
    monkeypatch.setattr(reflogs, "_read", lambda d, name: pytest.fail("read") if name == "HEAD" else read(d, name))
    again = _record(tmp_path, repo)
    assert again.note.startswith("logs/HEAD not kept: larger than 16 MiB; reflogs past 2000"), again.note
    assert "logs/HEAD" not in again.reflogs.logs  # type: ignore[union-attr]
    monkeypatch.setattr(reflogs, "MAX_DIRS", 2)
    assert _record(tmp_path, repo).note.endswith("reflogs past 2 directories not kept (from logs/refs/heads on)")


def test_a_put_back_cut_short_by_the_daemon_s_death_is_finished_by_the_next_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, _ = _repo(tmp_path)
    head, main = _reflog(repo), _reflog(repo, "main")
    kept = _record(tmp_path, repo)
    git(repo, "reflog", "expire", "--expire=now", "--expire-unreachable=now", "--all")
    (repo / "f").write_text("session\n")
    git(repo, "commit", "-qam", "the session's")
    real, renames = os.rename, []

    def rename(src: str, dst: str, *args: object, **kwargs: object) -> None:
        # The second reflog's write: its temporary file made, the daemon killed before the rename.
        if ".dispatchd-" in str(src) and "src_dir_fd" in kwargs:
            renames.append(src)
            if len(renames) == 2:
                raise Killed
        real(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Killed):
        reflogsback.put_back(str(repo / ".git"), kept.reflogs)
    monkeypatch.setattr(os, "rename", real)
    assert (repo / ".git" / "refs" / "heads" / "main.lock").exists()  # left, as a death leaves it
    said, failed = _end(kept)
    assert not failed and said == [("logs", f"1 reflogs a session cut put back ({len(main)} lines of your "
                                            "`git reflog`, and the commits only they name): refs/heads/main")], said
    assert _reflog(repo)[1:] == head and _reflog(repo, "main")[1:] == main
    assert _reflog(repo)[0].endswith("commit: the session's") and len(_reflog(repo)) == len(head) + 1
    assert [n for n in os.listdir(repo / ".git" / "logs" / "refs" / "heads") if ".dispatchd-" in n] == []
    reftemp.sweep(str(repo / ".git"), ["refs/heads/main", "HEAD"])  # the start's, after its restore (baselines.recover)
    leftovers = [n for d in ("logs", "logs/refs/heads", "refs/heads") for n in os.listdir(repo / ".git" / d)
                 if ".dispatchd-" in n or n.endswith(".lock")]
    assert leftovers == [] and (repo / ".git" / "refs" / "heads" / "main").exists()


def test_a_cut_reflog_whose_copy_is_gone_is_said_not_failed(tmp_path: Path) -> None:
    """The keep's copy gone (a machine's crash before it was written out, a
    hand that cleaned the state directory): said in the report, not a
    failure, which would have refused the worktree at every start after,
    no later check finding the copy either. The twin: with its copy, put
    back (the tests above)."""
    repo, _ = _repo(tmp_path)
    kept = _record(tmp_path, repo)
    (repo / ".git" / "logs" / "HEAD").write_text("")
    for copy in (tmp_path / "state" / "keep" / "k").rglob("HEAD"):
        if ".logs" in copy.parts:
            copy.unlink()
    said, failed = _end(kept)
    assert failed == [] and said[-1] == ("logs", "1 reflogs cut by a session not put back: their copies kept at "
                                                  "the baseline are gone (a crash of the machine before they "
                                                  "were written?): logs/HEAD"), said


def test_a_reflog_grown_past_the_bound_is_taken_for_cut_and_within_it_left(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A session appended 17 MiB of lines to ``logs/HEAD``: it still began
    with the kept bytes, so the end left it, and the next baseline, past the
    bound, kept it no more; a second session's ``reflog expire`` then took
    the user's lines for good. Grown past the bound, it is moved out and the
    kept lines written back. The twin: a reflog only appended to within the
    bound (a commit) is left, the same file."""
    monkeypatch.setattr(reflogs, "MAX_FILE", 4096)
    repo, _ = _repo(tmp_path)
    head = _reflog(repo)
    kept = _record(tmp_path, repo)
    log = repo / ".git" / "logs" / "HEAD"
    line = log.read_bytes().splitlines(keepends=True)[-1]
    with open(log, "ab") as f:
        f.write(line)  # within the bound: as a commit appends
    inode = log.stat().st_ino
    assert _end(kept) == ([], []) and log.stat().st_ino == inode
    with open(log, "ab") as f:
        f.write(line * (4096 // len(line) + 1))
    said, failed = _end(kept)
    assert not failed and _reflog(repo) == head, said
    assert [n for n in os.listdir(repo / ".git") if n.startswith("reflog-HEAD.quarantined-by-dispatchd-")]


def test_empty_reflogs_count_for_no_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's 2,000 empty reflogs of no ref, named to sort before the
    user's branches, pushed ``main``'s out of the next baseline's bound. The
    twin: non-empty ones still count (the bound's own test, above)."""
    monkeypatch.setattr(reflogs, "MAX_FILES", 3)
    repo, _ = _repo(tmp_path)
    for i in range(5):
        (repo / ".git" / "logs" / "refs" / "heads" / f"a{i}").write_text("")
    kept = _record(tmp_path, repo)
    assert kept.note == "" and "logs/refs/heads/main" in kept.reflogs.logs  # type: ignore[union-attr]


def test_reflogs_of_no_ref_count_for_no_bound_and_the_checked_out_branch_s_come_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's one-byte files in ``logs/`` (``0000`` ... sorting before
    ``HEAD``), and real branches of its own sorting before ``main``, took the
    bound's places: the next baseline kept neither ``HEAD``'s nor ``main``'s,
    and a second session's ``reflog expire`` took them for good. Reflogs of no
    ref are not kept now, and ``HEAD``'s and the checked-out branch's come
    first; the twin: the planted branches' own reflogs are kept after them."""
    monkeypatch.setattr(reflogs, "MAX_FILES", 3)
    repo, _ = _repo(tmp_path)
    for i in range(5):
        (repo / ".git" / "logs" / f"{i:04}").write_text("x")
        git(repo, "branch", f"a{i}")  # refs/heads/a0.. with reflogs, before main
    kept = _record(tmp_path, repo)
    logs = set(kept.reflogs.logs)  # type: ignore[union-attr]
    assert {"logs/HEAD", "logs/refs/heads/main", "logs/refs/heads/a0"} == logs, logs
    assert not any(name.startswith("logs/000") for name in logs)
    assert kept.note == "reflogs past 3 not kept (from logs/refs/heads/a1 on)", kept.note
