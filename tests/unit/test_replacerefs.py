"""Replacement refs a session made are taken out at the end, the user's own
kept or put back (dispatchd/daemon/gitguard/replacerefs.py). Repositories
are real and changed by git, as a session would change them."""

from __future__ import annotations

import os
import stat
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
    assert any(path.endswith(f"refs/replace/{blob}") and "git replace" in why for path, why in done), done
    aside = [p for p in (repo / ".git").iterdir() if p.name.startswith(f"replace-ref-{blob}.quarantined")]
    assert len(aside) == 1 and aside[0].read_text().strip() == evil  # kept, out of refs/


def _packed_replacement(tmp_path: Path) -> tuple[Path, history.History, str, str]:
    """A repository kept, then a session's replacement of its blob, packed."""
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    git(repo, "replace", blob, evil)
    git(repo, "pack-refs", "--all")
    return repo, kept, blob, evil


def test_a_packed_replacement_goes_and_every_other_line_stays(tmp_path: Path) -> None:
    repo, kept, blob, evil = _packed_replacement(tmp_path)
    packed = repo / ".git" / "packed-refs"
    before = packed.read_bytes()
    assert f"refs/replace/{blob}".encode() in before and b"^" in before  # the tag's peeled line
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n"
    after = packed.read_bytes()
    assert after == b"".join(line + b"\n" for line in before.splitlines() if b"refs/replace/" not in line)
    assert git(repo, "rev-parse", "v1^{commit}").strip() == git(repo, "rev-parse", "HEAD").strip()


def test_packed_refs_is_rewritten_under_git_s_lock_and_the_user_s_pack_refs_waits_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's ``git pack-refs`` at the moment the end read ``packed-refs``
    used to land between that read and the end's write, which put back the
    values it had just packed (a branch the user committed to, set back).
    Now the read and the write are under ``packed-refs.lock``: the user's
    git, run in between, is refused the lock (loudly: it can run again),
    and the file written is the one read. The twin: once the end is done,
    the same ``git pack-refs`` runs, and every value is the user's."""
    repo, kept, blob, evil = _packed_replacement(tmp_path)
    git(repo, "branch", "ub")
    real = replacerefs.packed_lines
    tried: list[subprocess.CompletedProcess[str]] = []

    def read_then_the_user_s_git(common: str) -> tuple[list[bytes] | None, str]:
        read = real(common)
        if (repo / ".git" / "packed-refs.lock").exists():  # the read the end writes back from
            tried.append(subprocess.run(["git", "pack-refs", "--all"], cwd=repo, capture_output=True, text=True))
        return read

    monkeypatch.setattr(replacerefs, "packed_lines", read_then_the_user_s_git)
    done, failed = history.restore(kept)
    monkeypatch.setattr(replacerefs, "packed_lines", real)
    assert not failed and _show(repo) == "user\n"
    assert len(tried) == 1 and tried[0].returncode != 0 and "packed-refs.lock" in tried[0].stderr, tried
    assert not (repo / ".git" / "packed-refs.lock").exists()
    git(repo, "commit", "-q", "--allow-empty", "-m", "two")
    assert subprocess.run(["git", "pack-refs", "--all"], cwd=repo).returncode == 0
    assert git(repo, "rev-parse", "HEAD").strip() == git(repo, "rev-parse", "refs/heads/" + git(
        repo, "symbolic-ref", "--short", "HEAD").strip()).strip()


def test_the_user_s_own_replacement_stays_and_is_put_back(tmp_path: Path) -> None:
    """The twin: a replacement the user had at the baseline is theirs."""
    repo = _repo(tmp_path)
    blob, mine = _evil(repo, "mine\n")
    git(repo, "replace", blob, mine)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.replaces == {f"refs/replace/{blob}": mine} and kept.replaces_packed == []
    assert history.restore(kept) == ([], []) and _show(repo) == "mine\n"  # untouched: nothing done
    _, evil = _evil(repo)
    git(repo, "replace", "-f", blob, evil)  # changed by a session
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "mine\n" and "put back" in done[-1][1]
    git(repo, "replace", "-d", blob)  # deleted by a session
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "mine\n" and [n for n, _ in done] == [f"refs/replace/{blob}"]


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
    found = replacerefs.read(str(repo / ".git"))
    assert (found.loose, found.packed, found.odd) == ({f"refs/replace/{blob}": evil}, [], [])


def _plant_packed(repo: Path, *lines: bytes) -> Path:
    packed = repo / ".git" / "packed-refs"
    old = packed.read_bytes() if packed.exists() else b"# pack-refs with: peeled fully-peeled sorted \n"
    packed.write_bytes(old + b"".join(line + b"\n" for line in lines))
    return packed


def test_a_packed_name_that_climbs_out_touches_nothing_outside(tmp_path: Path) -> None:
    """A name is never made into a path: the line goes, the file it names stays."""
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    _, evil = _evil(repo)
    (repo / ".git" / "refs" / "replace").mkdir()
    packed = _plant_packed(repo, evil.encode() + b" refs/replace/" + b"../" * 30 + os.fsencode(victim)[1:])
    done, failed = history.restore(kept)
    assert not failed and victim.read_text() == "precious\n" and b"refs/replace" not in packed.read_bytes()


@pytest.mark.parametrize("name", [b"UPPER", b"\xff", "\u0085".encode(), "\u2028".encode(), b"0\x00x"])
def test_packed_lines_git_reads_are_taken_out_byte_for_byte(tmp_path: Path, name: bytes) -> None:
    """An id in capitals, a name with bytes that are not UTF-8 or that a text
    split would cut, a NUL: each line goes, and a real replacement after it."""
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    oid = evil.upper().encode() if name == b"UPPER" else evil.encode()
    packed = _plant_packed(repo, oid + b" refs/replace/" + (blob.encode() if name == b"UPPER" else name),
                           evil.encode() + f" refs/replace/{blob}".encode())
    done, failed = history.restore(kept)
    assert not failed and b"refs/replace/" not in packed.read_bytes()
    assert subprocess.run(["git", "show", "HEAD:f"], cwd=repo, capture_output=True).stdout == b"user\n"


def test_a_symlinked_packed_refs_is_moved_aside(tmp_path: Path) -> None:
    repo, kept, blob, evil = _packed_replacement(tmp_path)
    common = repo / ".git"
    os.rename(common / "packed-refs", tmp_path / "elsewhere")
    (common / "packed-refs").symlink_to(tmp_path / "elsewhere")
    assert _show(repo) == "evil\n"  # git reads through it
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n" and not (common / "packed-refs").is_symlink()
    assert (tmp_path / "elsewhere").read_text().count("refs/replace/") == 1  # untouched


def test_a_packed_refs_too_large_to_read_fails_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "pack-refs", "--all")
    monkeypatch.setattr(replacerefs, "_PACKED_MAX", 8)
    done, failed = history.restore(kept)
    assert failed == [f"{repo / '.git' / 'packed-refs'}: over 8 bytes; not looked at for replacement refs"]


def test_a_read_only_refs_replace_and_many_refs_are_moved_aside(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    git(repo, "replace", blob, evil)
    top = repo / ".git" / "refs" / "replace"
    os.chmod(top, 0o555)
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n"
    git(repo, "replace", blob, evil)
    for n in range(5):
        (top / f"{n:040x}").write_text(evil + "\n")
    monkeypatch.setattr(replacerefs, "_MAX_MOVED", 3)
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == "user\n" and not top.exists() and len(done) == 1


def test_the_packed_refs_mode_is_kept(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    blob, evil = _evil(repo)
    packed = _plant_packed(repo, evil.encode() + f" refs/replace/{blob}".encode())
    os.chmod(packed, 0o640)
    done, failed = history.restore(kept)
    assert not failed and stat.S_IMODE(packed.stat().st_mode) == 0o640


def test_a_packed_refs_lock_the_user_s_git_holds_is_waited_for_and_never_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``packed-refs.lock`` held past the wait (git's ``pack-refs`` of many
    refs holds it for seconds): the end leaves ``packed-refs`` and says so,
    and the lock stays where git will rename it. Moved aside, git's own
    rename put back what the end had taken out. The twin (the lock free)
    is the test above."""
    from dispatchd.daemon.gitguard import reflock

    repo, kept, blob, evil = _packed_replacement(tmp_path)
    lock = repo / ".git" / "packed-refs.lock"
    lock.write_text("git's\n")
    monkeypatch.setattr(reflock, "WAIT_S", 0.05)
    done, failed = history.restore(kept)
    assert any("packed-refs: replacement refs could not be taken out (git's lock packed-refs.lock is held" in f
               for f in failed), failed
    assert lock.read_text() == "git's\n"
    assert not any("packed-refs.lock.quarantined" in p.name for p in (repo / ".git").iterdir())


def test_a_session_s_packed_ref_left_behind_a_held_lock_is_said_not_taken_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote-tracking ref a session made and packed, ``packed-refs.lock``
    held by the user's git at the end: the failure names what could not be
    taken out, and the ref is not also listed as taken out (the close said
    both). The twin: the lock free, it is taken out and said so."""
    from dispatchd.daemon.gitguard import reflock

    for held in (True, False):
        (tmp_path / ("held" if held else "free")).mkdir()
        repo = _repo(tmp_path / ("held" if held else "free"))
        kept = history.record(str(repo / ".git"), str(tmp_path / ("keep-held" if held else "keep-free")), own=[])
        git(repo, "update-ref", "refs/remotes/origin/sx", "HEAD")
        git(repo, "pack-refs", "--all")
        lock = repo / ".git" / "packed-refs.lock"
        if held:
            lock.write_text("git's\n")
        monkeypatch.setattr(reflock, "WAIT_S", 0.05)
        done, failed = history.restore(kept)
        names = [name for name, _ in done]
        if held:
            assert "refs/remotes/origin/sx" not in names, done
            assert [f for f in failed if "packed-refs" in f] == [
                f"{repo / '.git' / 'packed-refs'}: refs a session made there could not be taken out (git's lock "
                "packed-refs.lock is held (your git is writing the ref, or left it))"], failed
            lock.unlink()
        else:
            assert "refs/remotes/origin/sx" in names and failed == []
            assert "refs/remotes/origin/sx" not in git(repo, "for-each-ref", "refs/remotes")
