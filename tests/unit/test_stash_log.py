"""The user's stash list kept across a session (``gitguard/stashlog.py``):
``git stash list`` reads only the reflog ``logs/refs/stash``, each line the
one name of a stash's work. A session's ``git stash clear`` left the end's
put-back ``refs/stash`` beside an empty list, the user's stashes below the
top unreachable. Each case beside its twin, the user's own git reading the
result."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd import recordjson
from dispatchd.daemon.gitguard import history, objectstore, stashlog
from tests.unit.gitrepo import git, make_repo

pytestmark = pytest.mark.process


def _stashed(tmp_path: Path, n: int = 3) -> Path:
    """A repository with ``n`` stashes of the user's, ``mine 0`` the oldest."""
    repo = make_repo(tmp_path / "r")
    for i in range(n):
        (repo / f"s{i}.txt").write_text(f"stash {i}\n")
        git(repo, "add", f"s{i}.txt")
        git(repo, "stash", "push", "-q", "-m", f"mine {i}")
    return repo


def _listed(repo: Path) -> list[str]:
    return git(repo, "stash", "list", "--format=%gs").splitlines()


def _end(tmp_path: Path, kept: history.History) -> tuple[list[tuple[str, str]], list[str]]:
    done, failed = history.restore(kept)
    return [(n, why) for n, why in done if n == stashlog.LOG], failed


@pytest.mark.parametrize("session", [["stash", "clear"], ["stash", "drop", "-q", "stash@{1}"],
                                     ["reflog", "expire", "--expire=now", "--expire-unreachable=now", "--all"]])
def test_a_stash_list_a_session_empties_or_cuts_is_put_back_whole(tmp_path: Path, session: list[str]) -> None:
    repo = _stashed(tmp_path)
    before = _listed(repo)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, *session)
    assert _listed(repo) != before
    said, failed = _end(tmp_path, kept)
    assert not failed and _listed(repo) == before == ["On master: mine 2", "On master: mine 1", "On master: mine 0"]
    gone = 1 if session[1] == "drop" else 3
    said_first = f"the stash list: {gone} of your stashes taken out of it while a session ran; put back as it was"
    if session[1] == "clear":  # the log removed with the ref: nothing to move out
        assert said == [(stashlog.LOG, said_first)]
    else:
        assert said[0][1].startswith(said_first + "; the list found moved to stash-log.quarantined-by-dispatchd-")
    git(repo, "stash", "apply", "-q", "stash@{2}")  # the oldest applies: its work is there
    assert (repo / "s0.txt").read_text() == "stash 0\n"
    assert not [n for n in os.listdir(repo / ".git" / "logs" / "refs") if n != "heads" and n != "stash"]


def test_a_stash_list_a_session_reads_only_is_left_as_it_is(tmp_path: Path) -> None:
    """The twin: the list shown and applied, never dropped: nothing said, nothing moved."""
    repo = _stashed(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    log = (repo / ".git" / stashlog.LOG).stat()
    git(repo, "stash", "show", "stash@{1}")
    git(repo, "stash", "apply", "-q", "stash@{1}")
    assert _end(tmp_path, kept) == ([], [])
    assert (repo / ".git" / stashlog.LOG).stat().st_ino == log.st_ino
    assert [n for n in os.listdir(repo / ".git") if n.startswith("stash-log")] == []


def test_a_stash_made_by_a_session_is_kept_as_a_ref_and_the_list_is_the_user_s(tmp_path: Path) -> None:
    repo = _stashed(tmp_path, 2)
    before = _listed(repo)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "agent.txt").write_text("the agent's\n")
    git(repo, "add", "agent.txt")
    git(repo, "stash", "push", "-q", "-m", "the session's")
    said, failed = _end(tmp_path, kept)
    assert not failed and _listed(repo) == before
    assert git(repo, "rev-parse", "refs/stash").strip() == git(repo, "rev-parse", "stash@{0}").strip()
    name = said[0][1].split("(git stash apply ")[1].split(")")[0]
    assert name.startswith("refs/dispatchd/displaced/") and name.endswith("/stash-entries/0"), said
    assert said[0][1].startswith("the stash list: changed while a session ran; put back as it was; 1 stashes made since "
                                 f"kept as {name[:-2]}/N"), said
    git(repo, "stash", "apply", "-q", name)
    assert (repo / "agent.txt").read_text() == "the agent's\n"


def test_a_first_stash_list_a_session_made_is_taken_out_and_its_stash_kept(tmp_path: Path) -> None:
    """No stash at the baseline: the session's ``refs/stash`` is taken out
    (``newrefs``) and its list with it, else the user's next ``git stash``
    showed the session's below it, for ``git stash pop`` to apply."""
    repo = make_repo(tmp_path / "r")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.stash_log == stashlog.Kept(present=False)
    (repo / "agent.txt").write_text("the agent's\n")
    git(repo, "add", "agent.txt")
    git(repo, "stash", "push", "-q", "-m", "the session's")
    said, failed = _end(tmp_path, kept)
    assert not failed and not (repo / ".git" / stashlog.LOG).exists(), said
    assert said[0][1].startswith("the stash list: changed while a session ran; taken out (there was none); 1 stashes"), said
    (repo / "mine.txt").write_text("mine\n")
    git(repo, "add", "mine.txt")
    git(repo, "stash", "push", "-q", "-m", "mine")
    assert _listed(repo) == ["On master: mine"]


def test_a_stash_list_swapped_for_a_symlink_is_moved_out_not_followed(tmp_path: Path) -> None:
    repo = _stashed(tmp_path, 2)
    before = _listed(repo)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    target = tmp_path / "users-file"
    target.write_text("the user's\n")
    log = repo / ".git" / stashlog.LOG
    log.unlink()
    log.symlink_to(target)
    said, failed = _end(tmp_path, kept)
    assert not failed and _listed(repo) == before
    assert said[0][1].startswith(f"the stash list: {stashlog.LOG} is a symlink; put back as it was; the list found "
                                 "moved to stash-log.quarantined-by-dispatchd-"), said
    assert target.read_text() == "the user's\n" and not log.is_symlink()
    moved = [n for n in os.listdir(repo / ".git") if n.startswith("stash-log")]
    assert len(moved) == 1 and (repo / ".git" / moved[0]).is_symlink()


def test_a_stash_list_past_the_bound_is_not_kept_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _stashed(tmp_path, 2)
    monkeypatch.setattr(stashlog, "MAX_BYTES", 100)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.stash_log is None and kept.note == f"the stash list not kept: {stashlog.LOG} is larger than 0 MiB"
    git(repo, "stash", "clear")
    assert _end(tmp_path, kept) == ([], [])


def test_the_kept_list_survives_the_record_on_disk_and_an_older_record_reads_as_none(tmp_path: Path) -> None:
    repo = _stashed(tmp_path, 1)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert recordjson.decode(recordjson.encode(kept), history.History) == kept
    assert kept.stash_log is not None and kept.stash_log.data == (repo / ".git" / stashlog.LOG).read_bytes()
    older = recordjson.encode(kept).replace(b',"stash_log":', b',"unused":')
    assert recordjson.decode(older, history.History).stash_log is None


def test_an_entry_or_a_ref_naming_no_object_is_not_kept_and_the_user_s_git_gc_runs(tmp_path: Path) -> None:
    """A session appends lines of random ids to the stash list and points
    ``refs/stash`` at one: kept as refs of ours, each made the user's
    ``git gc``, ``git log --all`` and ``git for-each-ref`` fail for good
    ("bad object"). Not kept now, and said; the twin: a real stash made
    since is kept (the test above)."""
    repo = _stashed(tmp_path, 2)
    before = _listed(repo)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    log = repo / ".git" / stashlog.LOG
    top = git(repo, "rev-parse", "refs/stash").strip()
    bogus = ["1" * 40, "2" * 40]
    with open(log, "a") as f:
        for i, oid in enumerate(bogus):
            f.write(f"{top} {oid} A U Thor <a@example.com> 1700000000 +0000\tOn master: bogus {i}\n")
    (repo / ".git" / "refs" / "stash").write_text("3" * 40 + "\n")
    said, failed = _end(tmp_path, kept)
    assert not failed and _listed(repo) == before
    assert said[0][1].startswith("the stash list: changed while a session ran; put back as it was; 2 stashes made "
                                 "since not kept here (kept already, naming no object, or past the first 1000)"), said
    assert git(repo, "for-each-ref", "--format=%(refname)", "refs/dispatchd/") == ""
    git(repo, "gc", "-q")
    git(repo, "log", "--all", "--oneline")


def test_a_stash_pushed_between_the_ref_s_put_back_and_the_list_s_leaves_them_agreeing(tmp_path: Path) -> None:
    """The user's ``git stash push`` in another worktree just after the end
    put ``refs/stash`` back and before it took the list: the list written
    back named the old top while the ref named the new stash (``git stash
    pop`` applied one, dropped the other). The ref is set under the same
    hold as the list now, the new stash kept as an entry."""
    repo = _stashed(tmp_path, 2)
    before = _listed(repo)
    base_top = git(repo, "rev-parse", "refs/stash").strip()
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "late.txt").write_text("late\n")
    git(repo, "add", "late.txt")
    git(repo, "stash", "push", "-q", "-m", "pushed in the gap")
    late = git(repo, "rev-parse", "refs/stash").strip()
    said, failed = stashlog.put_back(str(repo / ".git"), kept.stash_log, "20261201T101500", base_top)
    assert not failed and _listed(repo) == before
    assert git(repo, "rev-parse", "refs/stash", "stash@{0}").split() == [base_top, base_top]
    assert git(repo, "rev-parse", f"refs/dispatchd/displaced/20261201T101500/{stashlog.ENTRIES}/0").strip() == late


def test_a_list_already_right_with_the_ref_right_is_not_touched(tmp_path: Path) -> None:
    """The twin of the one above: nothing pushed, the ref and the list not written (same inodes)."""
    repo = _stashed(tmp_path, 2)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    ref, log = (repo / ".git" / "refs" / "stash").stat(), (repo / ".git" / stashlog.LOG).stat()
    assert stashlog.put_back(str(repo / ".git"), kept.stash_log, "20261201T101500",
                             git(repo, "rev-parse", "refs/stash").strip()) == ([], [])
    assert (repo / ".git" / "refs" / "stash").stat().st_ino == ref.st_ino
    assert (repo / ".git" / stashlog.LOG).stat().st_ino == log.st_ino


def test_an_end_cut_short_and_done_again_keeps_each_stash_once(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon killed after the entries were kept and before the list
    was moved out: the next start's end, under another TIME, kept the same
    stashes again. Kept once now."""
    repo = _stashed(tmp_path, 1)
    top = git(repo, "rev-parse", "refs/stash").strip()
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    for i in range(2):
        (repo / f"a{i}.txt").write_text(f"{i}\n")
        git(repo, "add", f"a{i}.txt")
        git(repo, "stash", "push", "-q", "-m", f"the session's {i}")

    class Death(BaseException):
        pass

    def dies(*args: object) -> str:
        raise Death

    with monkeypatch.context() as m:
        m.setattr(stashlog, "_move_out", dies)
        with pytest.raises(Death):
            stashlog.put_back(str(repo / ".git"), kept.stash_log, "20261201T101500", top)
    said, failed = stashlog.put_back(str(repo / ".git"), kept.stash_log, "20261201T101501", top)
    assert not failed and _listed(repo) == ["On master: mine 0"]
    entries = git(repo, "for-each-ref", "--format=%(refname)", "refs/dispatchd/").split()
    assert len(entries) == 2 and all("/20261201T101500/" in e for e in entries), entries
    assert "2 stashes made since not kept here (kept already" in said[0][1], said


def test_git_s_lock_of_the_list_left_by_a_killed_stash_pop_is_moved_out(tmp_path: Path) -> None:
    """``logs/refs/stash.lock``, left by a session's ``git stash pop``
    killed with the daemon, made every later ``git stash drop`` and ``pop``
    of the user's fail ("Unable to create ... File exists"), the popped
    stash left in the list. Git makes it only under ``refs/stash.lock``,
    which the end holds: moved out, and said; the user's drop works."""
    repo = _stashed(tmp_path, 2)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / ".git" / stashlog.LOCK_LEFT).write_text("half a list\n")
    said, failed = _end(tmp_path, kept)
    assert not failed and said[0][1].startswith(f"git's lock {stashlog.LOCK_LEFT}, left by a git that was killed "
                                                "(it blocked your git stash drop and pop), moved to "
                                                "stash-log-lock.quarantined-by-dispatchd-"), said
    git(repo, "stash", "drop", "-q")
    assert _listed(repo) == ["On master: mine 0"]


def _objects(repo: Path) -> str:
    return str(repo / ".git" / "objects")


def test_an_object_is_told_there_in_a_pack_and_loose_and_junk_at_its_name_is_not(tmp_path: Path) -> None:
    """``Store.has``: a packed commit and a loose one are there; junk
    written at a random id's loose path names nothing (a ref of ours to it
    failed the user's ``git gc`` as a missing one did)."""
    repo = _stashed(tmp_path, 1)
    git(repo, "gc", "-q")
    packed = git(repo, "rev-parse", "HEAD").strip()
    (repo / "n.txt").write_text("new\n")
    git(repo, "add", "n.txt")
    git(repo, "commit", "-qm", "loose one")
    loose = git(repo, "rev-parse", "HEAD").strip()
    junk = "ab" + "c" * 38
    (repo / ".git" / "objects" / "ab").mkdir(exist_ok=True)
    (repo / ".git" / "objects" / "ab" / ("c" * 38)).write_bytes(b"not an object")
    store = objectstore.Store(_objects(repo))
    assert (store.has(packed), store.has(loose), store.has(junk), store.has("1" * 40)) == (True, True, False, False)


def test_an_object_not_told_for_packs_left_unread_counts_as_there(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound of packs read (a session's 1,024 empty indexes sorted
    before the user's pack), the user's packed stash looked absent, and was
    not kept: a value is refused only when it surely names nothing. The
    twin: within the bound, an id no pack holds is told absent."""
    repo = _stashed(tmp_path, 1)
    git(repo, "gc", "-q")
    top = git(repo, "rev-parse", "refs/stash").strip()
    monkeypatch.setattr(objectstore, "_MAX_PACKS", 2)
    pack = repo / ".git" / "objects" / "pack"
    assert objectstore.Store(_objects(repo)).has("1" * 40) is False
    for i in range(3):
        (pack / f"0{i}.idx").write_bytes(b"")  # unreadable indexes, named before the user's pack-*.idx
    store = objectstore.Store(_objects(repo))
    assert store.has(top) is True and store.has("1" * 40) is True and store.left_out


def test_the_user_s_stashes_are_kept_as_refs_when_the_list_cannot_be_put_back(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory the end cannot move at ``refs/stash.lock`` keeps git's
    lock from it: the list is left, and the baseline's stashes are kept as
    refs instead, each, whatever a look at the objects says (a session can
    cloud that look: it is not asked for the user's own values)."""
    repo = _stashed(tmp_path)
    ids = git(repo, "log", "-g", "--format=%H", "refs/stash").split()
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "stash", "clear")
    lock = repo / ".git" / "refs" / "stash.lock"
    lock.mkdir()
    lock.chmod(0o555)  # a directory renamed elsewhere needs its own write permission (its "..")
    monkeypatch.setattr(objectstore.Store, "has", lambda self, hexid: False)
    try:
        said, failed = _end(tmp_path, kept)
    finally:
        lock.chmod(0o755)
    assert not failed and said[0][1].startswith("the stash list not put back: git's lock refs/stash.lock is held"), said
    named = git(repo, "for-each-ref", "--format=%(objectname)", "refs/dispatchd/").split()
    assert set(ids) <= set(named), (ids, named)


def test_a_thousand_lines_naming_one_stash_keep_one_ref(tmp_path: Path) -> None:
    """Each line of the list found was kept as a ref of its own, each keep
    reading all of ``packed-refs`` again (with a session's 17 MB of it, a
    close of minutes, holding git's lock). One ref a stash now."""
    repo = _stashed(tmp_path, 1)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", "a.txt")
    git(repo, "stash", "push", "-q", "-m", "the session's")
    line = (repo / ".git" / stashlog.LOG).read_bytes().splitlines(keepends=True)[-1]
    with open(repo / ".git" / stashlog.LOG, "ab") as f:
        f.write(line * 1000)
    said, failed = _end(tmp_path, kept)
    assert not failed and _listed(repo) == ["On master: mine 0"]
    assert len(git(repo, "for-each-ref", "--format=%(refname)", "refs/dispatchd/").split()) == 2  # the ref's, one entry
    assert "; 1 stashes made since kept as " in said[0][1], said
