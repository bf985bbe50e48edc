"""A kept object file a session replaced by another file is found and put
back, the session's moved aside (dispatchd/daemon/gitguard/replaced.py);
each twin shows what is left alone: the kept file itself, an untouched
copy, the same bytes, a valid object recompressed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, replaced
from tests.unit.gitrepo import commits_repo, git


def _fsck(repo: Path) -> int:
    return subprocess.run(["git", "fsck", "--no-progress"], cwd=repo, capture_output=True, timeout=60).returncode


def _repo(tmp_path: Path) -> Path:
    return commits_repo(tmp_path / "repo")


def _loose(objects: Path) -> list[str]:
    return sorted(f"{d.name}/{f.name}" for d in objects.iterdir() if len(d.name) == 2 for f in d.iterdir())


def _kept(tmp_path: Path, repo: Path) -> tuple[history.History, Path]:
    time.sleep(0.06)  # the repository's files settled: only what comes next is looked at
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    time.sleep(0.06)  # past the racy margin: what the session does next is later
    return kept, repo / ".git" / "objects"


def _replace(path: Path, data: bytes) -> None:
    tmp = path.parent / "planted"
    tmp.write_bytes(data)
    os.rename(tmp, path)


def _dirs(objects: Path, kept: history.History) -> set[str]:
    return history._changed(kept.stamps, kept.stamped_ns, history._stamps(str(objects)))


@pytest.mark.process
def test_a_replaced_loose_object_is_put_back_and_the_session_s_file_moved_aside(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept, objects = _kept(tmp_path, repo)
    victim, other = _loose(objects)[:2]
    original = (objects / victim).read_bytes()
    _replace(objects / victim, b"garbage")
    assert _fsck(repo) != 0  # the attack works
    found = replaced.find(str(objects), kept.keep, _dirs(objects, kept), kept.stamped_ns)
    assert found == [victim]  # the twin: ``other``, untouched, is not
    done, failed = history.restore(kept)
    assert not failed and any("1 object files a session replaced put back" in why for _, why in done), done
    assert (objects / victim).read_bytes() == original and (objects / other).is_file()
    aside = [p for p in (objects / victim).parent.iterdir() if p.name.startswith(Path(victim).name + ".")]
    assert len(aside) == 1 and aside[0].read_bytes() == b"garbage"
    assert _fsck(repo) == 0


@pytest.mark.process
def test_a_valid_object_recompressed_and_the_same_bytes_are_left(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept, objects = _kept(tmp_path, repo)
    first, second = _loose(objects)[:2]
    body = zlib.decompress((objects / first).read_bytes())
    assert hashlib.sha1(body).hexdigest() == first.replace("/", "")
    _replace(objects / first, zlib.compress(body, 1) + b"")  # another compression of the same object
    _replace(objects / second, (objects / second).read_bytes())  # a new inode, the same bytes
    assert replaced.find(str(objects), kept.keep, _dirs(objects, kept), kept.stamped_ns) == []
    # The twin: a valid object of another name at this one is replaced.
    _replace(objects / first, (objects / _loose(objects)[2]).read_bytes())
    assert replaced.find(str(objects), kept.keep, _dirs(objects, kept), kept.stamped_ns) == [first]


@pytest.mark.process
def test_a_copied_keep_s_untouched_files_are_not_read_and_a_replaced_pack_is_found(tmp_path: Path) -> None:
    """A keep of copies (another file system): every kept file is another
    inode, so the ctime tells what the session touched."""
    repo = _repo(tmp_path)
    git(repo, "gc", "-q")
    (repo / "g").write_text("g\n")
    git(repo, "add", "g")
    git(repo, "commit", "-qm", "g")
    objects = repo / ".git" / "objects"
    keep = tmp_path / "keep"
    shutil.copytree(objects, keep, ignore=shutil.ignore_patterns("info"))
    time.sleep(0.06)
    stamped_ns = time.time_ns()
    kept = history.History(common=str(repo / ".git"), keep=str(keep), stamps=history._stamps(str(objects)),
                           stamped_ns=stamped_ns)
    time.sleep(0.06)
    every = set(history._stamps(str(objects)))
    assert replaced.find(str(objects), str(keep), every, stamped_ns) == []  # nothing read: all settled
    pack = next(p for p in (objects / "pack").iterdir() if p.suffix == ".pack")
    data = bytearray(pack.read_bytes())
    data[20] ^= 0xFF
    _replace(pack, bytes(data))
    (objects / "pack" / (pack.stem + ".rev")).write_bytes(b"derived")  # git's to write again: not looked at
    assert replaced.find(str(objects), str(keep), _dirs(objects, kept), stamped_ns) == [f"pack/{pack.name}"]


@pytest.mark.process
def test_a_directory_at_an_object_s_name_and_an_unreadable_file_are_replaced(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept, objects = _kept(tmp_path, repo)
    first, second = _loose(objects)[:2]
    os.unlink(objects / first)
    (objects / first).mkdir()
    _replace(objects / second, b"x" * (objects / second).stat().st_size)
    os.chmod(objects / second, 0)
    assert replaced.find(str(objects), kept.keep, _dirs(objects, kept), kept.stamped_ns) == sorted([first, second])
    done, failed = history.restore(kept)
    assert not failed and _fsck(repo) == 0


@pytest.mark.process
def test_past_the_compare_budget_a_changed_file_counts_as_replaced(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path)
    kept, objects = _kept(tmp_path, repo)
    victim = _loose(objects)[0]
    _replace(objects / victim, (objects / victim).read_bytes())  # the same bytes, a new inode
    dirs = _dirs(objects, kept)
    assert replaced.find(str(objects), kept.keep, dirs, kept.stamped_ns) == []
    monkeypatch.setattr(replaced, "_COMPARE_BUDGET", 1)
    assert replaced.find(str(objects), kept.keep, dirs, kept.stamped_ns) == []  # a valid loose object still
    monkeypatch.setattr(replaced, "_same_object", lambda *args: False)
    assert replaced.find(str(objects), kept.keep, dirs, kept.stamped_ns) == [victim]


@pytest.mark.process
def test_a_valid_object_with_bytes_after_its_stream_is_replaced(tmp_path: Path) -> None:
    """git refuses such a file ("garbage at end of loose object"); the twin
    above, a clean recompression, is left."""
    repo = _repo(tmp_path)
    kept, objects = _kept(tmp_path, repo)
    victim = _loose(objects)[0]
    _replace(objects / victim, (objects / victim).read_bytes() + b"junk")
    assert replaced.find(str(objects), kept.keep, _dirs(objects, kept), kept.stamped_ns) == [victim]
