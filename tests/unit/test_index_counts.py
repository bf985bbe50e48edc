"""An index whose header counts more entries than its bytes can hold is
refused before any entry is built (indexfile), not read past its header
(fs), and an index that does not parse is parsed once, not once for each
submodule it is hard-linked under (fs, gitdirs): 256 MiB of sparse zeros
counting 2^32-1 entries cost ~5 s and ~0.9 GB at each parse, once for each
submodule of each walk."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import fs, gitdirs, indexfile

# (version, id size, the fewest bytes an entry takes: all zeros, an empty name)
SMALLEST = [(2, 20, 64), (3, 20, 64), (4, 20, 64), (2, 32, 80), (3, 32, 80), (4, 32, 76)]


def _index(names: list[bytes], mode: int = 0o160000) -> bytes:
    """A version 2 SHA-1 index whose entries are ``names``, each of ``mode``."""
    out = bytearray(b"DIRC" + (2).to_bytes(4, "big") + len(names).to_bytes(4, "big"))
    for name in names:
        start = len(out)
        stat_part = bytearray(40)
        stat_part[24:28] = mode.to_bytes(4, "big")
        out += stat_part + bytes(20) + len(name).to_bytes(2, "big") + name
        out += b"\0" * (8 - (len(out) - start) % 8)
    return bytes(out) + hashlib.sha1(bytes(out)).digest()


def _zeros(version: int, count: int, entries_bytes: int, hash_size: int) -> bytes:
    """A header counting ``count`` entries, then zeros: entries of empty names, and a checksum."""
    return b"DIRC" + version.to_bytes(4, "big") + count.to_bytes(4, "big") + bytes(entries_bytes + hash_size)


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The id size of each walk of entries from now on."""
    walked: list[int] = []
    real = indexfile.walk_entries

    def counted(data: bytes, version: int, count: int, hash_size: int) -> tuple[list[indexfile.Entry], int] | None:
        walked.append(hash_size)
        return real(data, version, count, hash_size)

    monkeypatch.setattr(indexfile, "walk_entries", counted)
    return walked


def _parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of the bytes of each ``parse_index`` from now on."""
    sizes: list[int] = []
    real = indexfile.parse_index

    def counted(data: bytes, all_names: bool = False) -> indexfile.Index | None:
        sizes.append(len(data))
        return real(data, all_names)

    monkeypatch.setattr(indexfile, "parse_index", counted)
    return sizes


def test_a_count_no_size_can_hold_is_refused_before_any_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    walked = _walks(monkeypatch)
    data = _zeros(2, 0xFFFFFFFF, 1 << 20, 20)  # what took ~4 s in 256 MiB, here in 1 MiB
    assert indexfile.parse_index(data) is None and indexfile.layout(data) is None
    assert walked == []
    assert not indexfile.could_fit(data[:12], len(data))
    # The twin: an index whose count is its own is walked and read.
    good = _index([b"lib/a", b"lib/b"])
    parsed = indexfile.parse_index(good)
    assert parsed is not None and parsed.links == {"lib/a", "lib/b"} and parsed.shared == ""
    assert walked == [20] and indexfile.could_fit(good[:12], len(good))


@pytest.mark.parametrize(("version", "hash_size", "smallest"), SMALLEST)
def test_the_bound_is_the_smallest_entry_exactly(monkeypatch: pytest.MonkeyPatch, version: int, hash_size: int,
                                                 smallest: int) -> None:
    data = _zeros(version, 10, 10 * smallest, hash_size)
    found = indexfile.layout(data, hash_size)
    assert found is not None and found.hash_size == hash_size and len(found.entries) == 10
    assert [e.name for e in found.entries] == [b""] * 10 and found.entries_end == 12 + 10 * smallest
    walked = _walks(monkeypatch)
    # One entry more than the bytes hold: refused for that id size without a walk.
    assert indexfile.layout(_zeros(version, 11, 10 * smallest, hash_size), hash_size) is None
    assert hash_size not in walked


@pytest.mark.parametrize("head", [b"DIRC" + bytes(8), b"DIRC\0\0\0\x02\0\0\0\x01", b"DIRC\0\0\0\x05" + bytes(4),
                                  b"XIRC\0\0\0\x02" + bytes(4), b"DIRC"])
def test_could_fit_reads_the_header_as_the_parse_does(head: bytes) -> None:
    # Version 0 or 5, another signature, a short header: never; one entry in 32 bytes: not either.
    assert not indexfile.could_fit(head, 32)
    assert indexfile.could_fit(b"DIRC\0\0\0\x02\0\0\0\x01", 12 + 64 + 20)


def test_a_planted_count_is_not_read_past_its_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs, "_links_seen", {})
    parsed = _parses(monkeypatch)
    with open(tmp_path / "index", "wb") as f:
        f.write(_zeros(2, 0xFFFFFFFF, 0, 0))
        f.truncate(64 << 20)  # sparse: no disk
    assert fs.index_gitlinks(str(tmp_path / "index")) is None
    assert parsed == [0]  # the header said enough: 64 MiB not read
    # The twin: an index whose count fits is read whole.
    good = _index([b"sub"])
    (tmp_path / "good").write_bytes(good)
    assert fs.index_gitlinks(str(tmp_path / "good")) == {"sub"}
    assert parsed == [0, len(good)]


def _settled(path: Path) -> None:
    """Wait till ``path``'s ctime is well before any look from now on (``fs._SETTLE_NS``)."""
    time.sleep(2 * fs._SETTLE_NS / 1e9)
    assert time.time_ns() - os.stat(path).st_ctime_ns > fs._SETTLE_NS


def test_an_index_that_does_not_parse_is_parsed_once_for_all_its_links(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs, "_links_seen", {})
    parsed = _parses(monkeypatch)
    # Its count fits (~1,000 empty entries, no split index to stand for): walked, and refused.
    bad = _zeros(2, 1000, 1000 * 64, 20)
    (tmp_path / "bad").write_bytes(bad)
    for i in range(6):
        os.link(tmp_path / "bad", tmp_path / f"link{i}")
    _settled(tmp_path / "bad")  # a link sets the ctime too
    assert [fs.index_gitlinks(str(tmp_path / f"link{i}")) for i in range(6)] == [None] * 6
    assert parsed == [len(bad)]
    # The twins: the same bytes written again (a new ctime) are parsed again,
    # still refused; a parsable index is remembered as before.
    (tmp_path / "bad").write_bytes(bad)
    _settled(tmp_path / "bad")
    assert fs.index_gitlinks(str(tmp_path / "link0")) is None and fs.index_gitlinks(str(tmp_path / "link1")) is None
    assert parsed == [len(bad)] * 2
    good = _index([b"a", b"b/c"])
    (tmp_path / "good").write_bytes(good)
    _settled(tmp_path / "good")
    assert [fs.index_gitlinks(str(tmp_path / "good")) for _ in range(3)] == [{"a", "b/c"}] * 3
    assert parsed == [len(bad)] * 2 + [len(good)]


def test_an_index_written_just_now_that_does_not_parse_is_parsed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs, "_links_seen", {})
    monkeypatch.setattr(fs, "_SETTLE_NS", 10 ** 12)  # nothing is settled: a write may still come in its tick
    parsed = _parses(monkeypatch)
    bad = _zeros(2, 10, 640, 20)
    (tmp_path / "index").write_bytes(bad)
    assert [fs.index_gitlinks(str(tmp_path / "index")) for _ in range(2)] == [None, None]
    assert parsed == [len(bad), len(bad)]


def _worktree(tmp_path: Path, subs: list[bytes]) -> Path:
    worktree = tmp_path / "wt"
    git = worktree / ".git"
    (git / "refs").mkdir(parents=True)
    (git / "objects").mkdir()
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "index").write_bytes(_index(subs))
    _settled(git / "index")
    return worktree


def _walk(worktree: Path) -> gitdirs.Walk:
    walk = gitdirs.Walk(str(worktree))
    walk.gitdir(".git", "")
    walk.run()
    return walk


def test_submodules_sharing_a_planted_index_cost_one_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs, "_links_seen", {})
    subs = [b"s%d" % i for i in range(8)]
    worktree = _worktree(tmp_path, subs)
    with open(tmp_path / "planted", "wb") as f:
        f.write(_zeros(2, 0xFFFFFFFF, 0, 0))
        f.truncate(16 << 20)
    for sub in subs:
        (worktree / sub.decode() / ".git").mkdir(parents=True)
        (worktree / sub.decode() / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        os.link(tmp_path / "planted", worktree / sub.decode() / ".git" / "index")
    _settled(tmp_path / "planted")  # a link sets the ctime too
    parsed, walked = _parses(monkeypatch), _walks(monkeypatch)
    walk = _walk(worktree)
    assert sorted(walk.gitdirs) == [".git"] + [f"s{i}/.git" for i in range(8)]
    assert parsed == [len(_index(subs)), 0] and walked == [20]  # the worktree's index; the planted one, once, unread
    # Each is still what cannot be parsed: compared by its bytes, all alike.
    values = {walk.indexes[f"s{i}/.git/index"] for i in range(8)}
    assert len(values) == 1 and values.pop().startswith("an index that cannot be parsed:")


def test_submodules_with_indexes_of_their_own_are_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The twin: each submodule's index parses, and names a submodule of its own.
    monkeypatch.setattr(fs, "_links_seen", {})
    worktree = _worktree(tmp_path, [b"s0", b"s1"])
    for sub in ("s0", "s1"):
        (worktree / sub / ".git").mkdir(parents=True)
        (worktree / sub / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (worktree / sub / ".git" / "index").write_bytes(_index([b"inner"]))
        (worktree / sub / "inner" / ".git").mkdir(parents=True)
        (worktree / sub / "inner" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    walk = _walk(worktree)
    assert sorted(walk.gitdirs) == [".git", "s0/.git", "s0/inner/.git", "s1/.git", "s1/inner/.git"]
    assert walk.indexes == {}


def test_the_submodules_indexes_a_walk_parses_are_bounded_in_all(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Separate planted indexes whose counts fit their sizes cannot be
    refused from their headers: each parsed (2 s a 256 MiB one), thousands
    of them hours a walk. Past the walk's bound an index is judged by its
    bytes, unparsed. The twin: within the bound each parses, and links of
    one file count once."""
    monkeypatch.setattr(fs, "_links_seen", {})
    subs = [b"s%d" % i for i in range(4)]
    worktree = _worktree(tmp_path, subs)
    one = _index([b"inner"])
    for sub in subs:
        (worktree / sub.decode() / ".git").mkdir(parents=True)
        (worktree / sub.decode() / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (worktree / sub.decode() / ".git" / "index").write_bytes(one)
    monkeypatch.setattr(gitdirs, "_MAX_PARSED_INDEXES", 2 * len(one) + len(_index(subs)))
    parsed = _parses(monkeypatch)
    walk = _walk(worktree)
    assert parsed == [len(_index(subs)), len(one), len(one)]  # the worktree's, then two of the four
    assert len(walk.indexes) == 2  # the other two judged by their bytes
    for sub in subs[2:]:  # the twin: the same file under other names costs nothing more
        os.unlink(worktree / sub.decode() / ".git" / "index")
        os.link(worktree / "s0" / ".git" / "index", worktree / sub.decode() / ".git" / "index")
    monkeypatch.setattr(fs, "_links_seen", {})
    parsed.clear()
    assert _walk(worktree).indexes == {} and len(parsed) == 5
