"""What the digests read (daemon/gitguard/digests.py): a file over the read
bound is known by its size and never read; each inode's verdict, "too
large" included, is looked at once a walk; what is read is charged to the
walk's budget; a digest of a file within the bound is its content's SHA-256,
as the records on disk hold it. Each with its twin."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import digests, runnables


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each ``os.read`` of the digests returned."""
    got: list[int] = []
    real = os.read

    def counted(fd: int, n: int) -> bytes:
        data = real(fd, n)
        got.append(len(data))
        return data

    monkeypatch.setattr(digests.os, "read", counted)
    return got


@pytest.mark.parametrize("size", [1 << 20, digests._MAX_READ + 1])
def test_hard_links_in_a_new_protected_directory_cost_one_look(tmp_path: Path, reads: list[int], size: int) -> None:
    """64 links of one sparse file: one byte over the bound, none is read
    (each was read to the bound: 1 GiB here, 1.6 TB for 100,000 links);
    the twin, 1 MiB, is read once and all links get its digest."""
    vs = tmp_path / ".vscode"
    vs.mkdir()
    with open(vs / "f0", "wb") as f:
        f.truncate(size)
    for i in range(1, 64):
        os.link(vs / "f0", vs / f"f{i}")
    snap = runnables.take(str(tmp_path), ending=True)
    found = {snap.entries[f".vscode/f{i}"] for i in range(64)}
    if size > digests._MAX_READ:
        assert sum(reads) == 0
        assert len(found) == 64 and all(d.startswith("too large:") for d in found)
    else:
        assert sum(reads) == size
        assert found == {digests.file_digest(0o644, hashlib.sha256(b"\0" * size).hexdigest())}


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097])
def test_hash_fd_is_the_contents_sha256_within_the_bound_and_none_past_it(tmp_path: Path, reads: list[int],
                                                                          size: int) -> None:
    data = bytes(range(256)) * 17
    (tmp_path / "f").write_bytes(data[:size])
    budget = digests.Budget(1 << 20)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = digests.hash_fd(fd, 4096, budget)
    finally:
        os.close(fd)
    if size <= 4096:
        assert got == hashlib.sha256(data[:size]).hexdigest() and sum(reads) == size
        assert budget.left == (1 << 20) - size
    else:
        assert got is None and sum(reads) == 0 and budget.left == 1 << 20
    assert list(budget.seen.values()) == [got]  # the verdict remembered, "too large" too


def test_a_file_past_what_the_budget_has_left_is_not_read(tmp_path: Path, reads: list[int]) -> None:
    (tmp_path / "small").write_bytes(b"x" * 100)
    (tmp_path / "big").write_bytes(b"y" * 1000)
    budget = digests.Budget(500)
    fd = os.open(tmp_path, os.O_PATH)
    try:
        assert str(digests.digest_at(fd, "big", budget)).startswith("too large:")
        assert sum(reads) == 0 and budget.left == 500
        digest = digests.digest_at(fd, "small", budget)  # the twin
    finally:
        os.close(fd)
    assert digest == digests.file_digest(0o644, hashlib.sha256(b"x" * 100).hexdigest())
    assert sum(reads) == 100 and budget.left == 400
