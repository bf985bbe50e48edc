"""Replacement refs a session made are taken out at the end, the user's own
kept or put back (dispatchd/daemon/gitguard/replacerefs.py). Repositories
are real and changed by git, as a session would change them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, replacerefs
from tests.unit.gitrepo import git

pytestmark = pytest.mark.process


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "f").write_text("user\n")
    git(repo, "add", "f")
    git(repo, "commit", "-qm", "one")
    git(repo, "tag", "-a", "-m", "t", "v1")
    return repo


def _evil(repo: Path, text: str = "evil\n") -> tuple[str, str]:
    """(the blob of f, a blob of ``text``), the latter written."""
    blob = git(repo, "rev-parse", "HEAD:f").strip()
    return blob, git(repo, "hash-object", "-w", "--stdin", stdin=text).strip()


def _show(repo: Path) -> str:
    return git(repo, "show", "HEAD:f")


def test_a_session_s_replacement_is_taken_out_and_kept_aside(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.replaces == {}
    blob, evil = _evil(repo)
    git(repo, "replace", blob, evil)
    assert _show(repo) == "evil\n"  # the attack works
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n"
    assert any(name == f"refs/replace/{blob}" and "git replace" in why for name, why in done), done
    displaced = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/dispatchd/displaced").split()
    assert displaced[0].endswith(f"/refs/replace/{blob}") and displaced[1] == evil


def test_a_packed_replacement_goes_and_every_other_line_stays(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    git(repo, "replace", blob, evil)
    git(repo, "pack-refs", "--all")
    packed = repo / ".git" / "packed-refs"
    before = packed.read_bytes()
    assert f"refs/replace/{blob}".encode() in before and b"^" in before  # the tag's peeled line
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n"
    after = packed.read_bytes()
    assert after == b"".join(line + b"\n" for line in before.splitlines() if b"refs/replace/" not in line)
    assert git(repo, "rev-parse", "v1^{commit}").strip() == git(repo, "rev-parse", "HEAD").strip()


def test_the_user_s_own_replacement_stays_and_is_put_back(tmp_path: Path) -> None:
    """The twin: a replacement the user had at the baseline is theirs."""
    repo = _repo(tmp_path)
    blob, mine = _evil(repo, "mine\n")
    git(repo, "replace", blob, mine)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.replaces == {f"refs/replace/{blob}": mine}
    assert history.restore(kept) == ([], []) and _show(repo) == "mine\n"  # untouched: nothing done
    _, evil = _evil(repo)
    git(repo, "replace", "-f", blob, evil)  # changed by a session
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "mine\n" and "put back" in done[0][1]
    git(repo, "replace", "-d", blob)  # deleted by a session
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "mine\n" and done == [(f"refs/replace/{blob}",
                                                                f"deleted by a session; put back at {mine[:12]}")]


def test_what_is_not_a_ref_file_under_refs_replace_is_moved_aside_unfollowed(tmp_path: Path) -> None:
    """A symlink git would read through (to a file naming the evil blob, out
    of the worktree's reach of the check), a symbolic ref, and refs/replace
    itself a symlink: moved aside, what they point at untouched."""
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    target = tmp_path / "outside"
    target.write_text(evil + "\n")
    top = repo / ".git" / "refs" / "replace"
    top.mkdir()
    (top / blob).symlink_to(target)
    assert _show(repo) == "evil\n"  # git reads through it
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n" and target.read_text() == evil + "\n"
    assert "moved aside" in done[0][1] and not list(top.iterdir())
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / blob).write_text(evil + "\n")
    for p in top.iterdir():
        p.unlink()
    top.rmdir()
    top.symlink_to(other)
    assert _show(repo) == "evil\n"
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n" and (other / blob).is_file() and not top.is_symlink()


def test_a_packed_ref_name_that_is_not_utf8_is_kept_byte_for_byte(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    head = git(repo, "rev-parse", "HEAD").strip()
    packed = repo / ".git" / "packed-refs"
    packed.write_bytes(b"# pack-refs with: peeled fully-peeled sorted \n" + head.encode() + b" refs/heads/caf\xe9\n"
                       + evil.encode() + f" refs/replace/{blob}\n".encode())
    done, failed = history.restore(kept)
    assert not failed and packed.read_bytes().endswith(head.encode() + b" refs/heads/caf\xe9\n")
    assert subprocess.run(["git", "show", "HEAD:f"], cwd=repo, capture_output=True, text=True).stdout == "user\n"


def test_an_older_record_without_replacements_read_leaves_them(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    git(repo, "replace", blob, evil)
    older = history.History(common=kept.common, refs=kept.refs, keep=kept.keep, stamps=kept.stamps,
                            stamped_ns=kept.stamped_ns)
    assert older.replaces is None and history.restore(older) == ([], []) and _show(repo) == "evil\n"
    assert os.path.isfile(repo / ".git" / "refs" / "replace" / blob)
    assert replacerefs.read(str(repo / ".git")) == ({f"refs/replace/{blob}": evil}, [])
