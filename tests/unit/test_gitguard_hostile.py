"""The git protection's reads and writes at a session's end and the next
open, on what a session left in the repository: no write through a planted
symlink, no wait on a planted FIFO, no walk outside the repository, no
unbounded memory, no exception that skips the checks. Each case beside its
allowed twin."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, indexfile, objectstore, redirects, refsback
from tests.unit.gitrepo import git

pytestmark = pytest.mark.process  # git makes the repositories


def _repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "f").write_text("f\n")
    git(path, "add", "f")
    git(path, "commit", "-qm", "one")
    return path


def _returns_within(fn, seconds: float = 10.0):  # type: ignore[no-untyped-def]
    """``fn()``'s value, failing the test (not hanging it) if it has not
    returned within ``seconds``."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still running after {seconds} s"
    return out[0]


def test_a_ref_put_back_is_written_through_no_symlink_a_session_planted(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    common = repo / ".git"
    head = git(repo, "rev-parse", "HEAD").strip()
    kept = history.record(str(common), str(tmp_path / "keep"), own=[])
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's\n")
    (common / "refs" / "heads" / "main").unlink()
    # The name the old code wrote to (its pid was guessable), a symlink to the user's file; and a FIFO beside.
    (common / "refs" / "heads" / f"main.dispatchd-{os.getpid()}.tmp").symlink_to(victim)
    done, failed = _returns_within(lambda: history.restore(kept))
    assert failed == [] and ("refs/heads/main", f"deleted by a session; put back at {head[:12]}") in done
    assert victim.read_text() == "the user's\n"
    assert (common / "refs" / "heads" / "main").read_text() == head + "\n"
    assert not (common / "refs" / "heads" / "main").is_symlink()


def test_loose_refs_are_read_below_real_directories_only(tmp_path: Path) -> None:
    """``.git/refs/heads -> /`` walked the whole disk. The twin: the real
    directory's refs are read."""
    repo = _repo(tmp_path / "repo")
    common = repo / ".git"
    head = git(repo, "rev-parse", "HEAD").strip()
    assert refsback.read_refs(str(common)) == {"refs/heads/main": head}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "planted").write_text(head + "\n")
    os.rename(common / "refs" / "heads", tmp_path / "heads-aside")
    (common / "refs" / "heads").symlink_to(elsewhere)
    assert refsback.read_refs(str(common)) == {}


def test_a_symlinked_objects_directory_is_neither_kept_nor_written_through(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    common = repo / ".git"
    kept = history.record(str(common), str(tmp_path / "keep"), own=[])
    before = sorted(p.relative_to(common / "objects") for p in (common / "objects").rglob("*") if p.is_file())
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    (outside / "ab" / "user-file").write_text("the user's\n")
    os.rename(common / "objects", tmp_path / "objects-aside")
    (common / "objects").symlink_to(outside)
    # At an open: not kept (its target's two-letter directories would have been linked in).
    again = history.record(str(common), str(tmp_path / "keep2"), own=[])
    assert again.keep == "" and "objects is not a directory" in again.note
    # At the end: moved aside, a directory in its place, every kept object file put back there.
    done, failed = history.restore(kept)
    assert failed == []
    assert (common / "objects").is_dir() and not (common / "objects").is_symlink()
    assert sorted(p.relative_to(common / "objects") for p in (common / "objects").rglob("*") if p.is_file()) == before
    assert sorted(os.listdir(outside)) == ["ab"] and os.listdir(outside / "ab") == ["user-file"]
    git(repo, "fsck", "--strict")


def test_a_delta_that_grows_past_its_size_is_refused_as_it_grows() -> None:
    """Each one-byte op copies 64 KiB: the result was checked only at the
    end (a 178-byte pack took 1.9 GiB). The twin: a delta of its size."""
    base = b"x" * 0x10000
    header = bytes([0x80, 0x80, 0x04])  # source size 65,536 as a varint
    small = header + bytes([0x80, 0x80, 0x04]) + bytes([0x80])  # result 65,536: one copy of it all
    assert objectstore._apply(base, small) == base
    bomb = header + bytes([0x80, 0x80, 0x04]) + bytes([0x80]) * 100_000
    with pytest.raises(ValueError, match="larger than it says"):
        objectstore._apply(base, bomb)


def test_a_version_4_index_whose_names_keep_growing_is_not_parsed(tmp_path: Path) -> None:
    """Each v4 name is the last one plus what follows: with no bound, a 6.5 MB
    index took 5 GiB. Past a path's length (4,096 bytes) it is refused."""
    def v4(count: int) -> bytes:
        entries = b""
        for _ in range(count):
            e = bytearray(62)
            e[24:28] = (0o160000).to_bytes(4, "big")
            e[60:62] = (0xFFF).to_bytes(2, "big")
            entries += bytes(e) + b"\x00" + b"a\x00"  # strip 0, add one byte
        body = b"DIRC" + struct.pack(">II", 4, count) + entries
        return body + b"\x00" * 20
    assert indexfile._MAX_NAME == 4096
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(v4(100))
    big.write_bytes(v4(indexfile._MAX_NAME + 10))
    assert indexfile.parse_gitlinks(small.read_bytes()) is not None
    assert indexfile.parse_gitlinks(big.read_bytes()) is None


def test_a_commondir_behind_a_thousand_symlinks_is_not_taken_as_leading_back(tmp_path: Path) -> None:
    """``realpath`` recursed once a link: RecursionError escaped and skipped
    the checks after it. The twin: ``../..`` leads back."""
    repo = _repo(tmp_path / "repo")
    entry = repo / ".git" / "worktrees" / "x"
    entry.mkdir(parents=True)
    (entry / "commondir").write_text("../..\n")
    assert redirects._leads_back(str(entry), str(repo / ".git"))
    chain = tmp_path / "chain"
    chain.mkdir()
    for i in range(1200):
        (chain / f"l{i}").symlink_to(f"l{i + 1}")
    (entry / "commondir").write_text(f"{chain}/l0\n")
    assert redirects._leads_back(str(entry), str(repo / ".git")) is False


def test_an_unreadable_worktrees_directory_is_recorded_not_raised(tmp_path: Path) -> None:
    """``chmod 000 .git/worktrees``: the walk raised PermissionError, and the
    checks after it did not run. It is recorded as unknowable (never equal:
    moved aside at the end). The twin: readable, it is walked."""
    from dispatchd.daemon.gitguard import layouts, snapshots

    repo = _repo(tmp_path / "repo")
    (repo / ".git" / "worktrees").mkdir()
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    assert snapshots.take(str(repo), layout) is not None
    os.chmod(repo / ".git" / "worktrees", 0)
    try:
        if os.access(repo / ".git" / "worktrees", os.R_OK):
            pytest.fail("the tests run as the unprivileged user (root reads a mode-0 directory)", pytrace=False)
        assert snapshots.take(str(repo), layout) is not None
    finally:
        os.chmod(repo / ".git" / "worktrees", 0o755)


def test_the_moved_branches_share_one_store_and_one_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each moved branch read the packs again under a deadline of its own
    (100,000 branches: hours). One store, one deadline for all: past it a
    branch is put back, its moved value kept aside (nothing lost). The
    twin: within it, a fast-forward is kept."""
    repo = _repo(tmp_path / "repo")
    git(repo, "branch", "other")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "g").write_text("g\n")
    git(repo, "add", "g")
    git(repo, "commit", "-qm", "two")
    tip = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "update-ref", "refs/heads/other", tip)  # fast-forwarded, as the user's own commits look
    done, failed = history.restore(kept)
    assert failed == [] and [d[1][:41] for d in done if d[0] == "refs/heads/other"] == [
        "moved forward while a session ran, kept ("]  # reported, not put back
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "h").write_text("h\n")
    git(repo, "add", "h")
    git(repo, "commit", "-qm", "three")
    git(repo, "update-ref", "refs/heads/other", git(repo, "rev-parse", "HEAD").strip())
    monkeypatch.setattr(objectstore, "BUDGET_S", 0.0)  # the deadline spent before the first question
    done, failed = history.restore(kept)
    assert failed == [] and [d for d in done if d[0] == "refs/heads/other"]
    assert git(repo, "rev-parse", "refs/heads/other").strip() == tip


def test_config_continuation_lines_join_as_before() -> None:
    """A value continued over many lines is joined once (adding each line
    to the text so far grew as the square: 2.6 s a MiB); the same entries
    as before, escaped backslashes and a last line's trailing one included."""
    from dispatchd.daemon.gitguard import configs

    text = "[core]\n\tx = a\\\nb\\\nc\n\ty = d\\\\\n\tz = e\\"
    assert configs.config_entries(text) == [("core", None, "x", "abc"), ("core", None, "y", "d\\"),
                                             ("core", None, "z", "e\\")]
    many = "[core]\n\tx = " + "a\\\n" * 50_000 + "b\n"
    assert configs.config_entries(many) == [("core", None, "x", "a" * 50_000 + "b")]


def test_an_unclosed_section_line_of_a_million_spaces_is_read_in_linear_time() -> None:
    """``[a`` and a run of spaces with no ``]``: the section's pattern tried
    every split of the run between its two ``\\s*`` (100,000 spaces: 7 s,
    the interpreter's lock held; the read bound's 1 MiB: minutes, at every
    end, for every git directory a session makes). The twins: sections with
    and without a subsection, spaces where git allows them, read as before."""
    import time

    from dispatchd.daemon.gitguard import configs

    began = time.monotonic()
    assert configs.config_entries("[a" + " " * 1_000_000 + "x\n[b" + " " * 1_000_000 + '"x\n') == []
    assert time.monotonic() - began < 2  # before: about 12 minutes for one such line
    text = '[core]\n\thooksPath = h\n[ remote   "o r"  ] url = u\n[branch.main]\nremote=o\n'
    assert configs.config_entries(text) == [("core", None, "hookspath", "h"), ("remote", "o r", "url", "u"),
                                            ("branch", "main", "remote", "o")]


def test_an_object_is_put_back_through_no_symlinked_fan_out_directory(tmp_path: Path) -> None:
    """A session deletes an object and makes its fan-out directory a symlink
    to a directory of the user's: the put-back wrote the object file there.
    The symlink goes aside and the object is put back in the repository
    (the twin: a plain deletion is put back in place, test_history_packed)."""
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    victim = next(p for p in objects.iterdir() if len(p.name) == 2)
    names = sorted(os.listdir(victim))
    for name in names:
        os.unlink(victim / name)
    victim.rmdir()
    users = tmp_path / "users-dir"
    users.mkdir()
    victim.symlink_to(users)
    done, failed = history.restore(kept)
    assert failed == [] and done and os.listdir(users) == []
    assert victim.is_dir() and not victim.is_symlink() and sorted(os.listdir(victim)) == names
    git(repo, "fsck", "--strict")
