"""The worktree walk's memory (daemon/gitguard/runnables.py): bounded by its
bounds, never by their product. A pending directory holds its name, not its
path; a path past ``MAX_PATH`` bytes is treated as one past the depth (at an
end the session's, moved aside whole; at a baseline refused, saying where);
what a walk records is bounded in bytes; a walk out of memory is incomplete
(the caller fails closed), never the daemon's crash. Each with its twin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import runnables
from tests.unit.deeptrees import chain

LONG = "a" * 250  # one name: 250 bytes


def _chain(root: Path, depth: int) -> int:
    """``root/LONG/LONG/...`` ``depth`` deep (far past PATH_MAX); a descriptor of the bottom directory."""
    return chain(root, depth, LONG)


def _remove(root: Path) -> None:
    """The chain gone without recursion: each level moved up to the top."""
    at, i = root, 0
    while (at / LONG).is_dir():
        i += 1
        os.rename(at / LONG, root / f"level{i}")
        at = root / f"level{i}"
    shutil.rmtree(root)


def _write(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
    os.write(fd, data)
    os.close(fd)


WALK = """
import resource, sys, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from dispatchd.daemon.gitguard import runnables
runnables.MAX_PATH = 1 << 30  # no path bound: the pending directories alone
tracemalloc.start()
snap = runnables.take(sys.argv[1], ending=True)
peak = tracemalloc.get_traced_memory()[1]
print(snap.complete, snap.why or "-", sorted(len(k) for k in snap.entries), peak)
"""


@pytest.mark.process
@pytest.mark.parametrize("plant", [False, True])
def test_a_deep_chain_of_long_names_over_a_wide_bottom_holds_no_path_per_directory(
        tmp_path: Path, plant: bool) -> None:
    """1,000 levels of 250-byte names (a 250 KB path) over 5,000 empty
    directories: each pending directory held its whole path (1.25 GB, a
    MemoryError under 1 GiB); now its name. The twin: an ``.envrc`` at the
    bottom is recorded by its whole path, once."""
    wt = tmp_path / "wt"
    wt.mkdir()
    bottom = _chain(wt, 1000)
    try:
        for i in range(5000):
            os.mkdir(f"d{i}", dir_fd=bottom)
        if plant:
            _write(bottom, ".envrc", b"export X=1\n")
    finally:
        os.close(bottom)
    try:
        got = subprocess.run([sys.executable, "-c", textwrap.dedent(WALK), str(wt)],
                             capture_output=True, text=True, timeout=600)
        assert got.returncode == 0, got.stderr[-2000:]
        complete, why, lengths, peak = got.stdout.split()
        assert (complete, why) == ("True", "-")
        assert lengths == (f"[{1000 * 251 + len('.envrc')}]" if plant else "[]")
        assert int(peak) < 32 << 20, f"{int(peak) >> 20} MiB held"
    finally:
        _remove(wt)


def test_at_an_end_a_path_past_its_bound_is_moved_aside_whole_and_the_rest_walked(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    (wt / "z").mkdir(parents=True)
    before = runnables.take(str(wt))
    bottom = _chain(wt, 300)  # 75 KB of path: past 64 KiB at the 262nd level
    try:
        _write(bottom, ".envrc", b"export X=1\n")
    finally:
        os.close(bottom)
    (wt / "z" / ".envrc").write_text("export Y=1\n")  # walked whatever the order
    try:
        end = runnables.take(str(wt), ending=True)
        assert end.complete, end.why
        assert sorted(runnables.changes(before, end)) == sorted(["/".join([LONG] * 262), "z/.envrc"])
        # At a baseline the open is refused, saying where and why.
        snap = runnables.take(str(wt))
        assert not snap.complete
        assert snap.why == f"a path longer than 65536 bytes (below {LONG}/{LONG}/{LONG}/...; remove that chain " \
                           "to open sessions here)"
    finally:
        _remove(wt)


def test_a_long_path_within_its_bound_is_walked_whole(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    bottom = _chain(wt, 261)  # 65,510 bytes: within the bound
    try:
        _write(bottom, ".envrc", b"export X=1\n")
    finally:
        os.close(bottom)
    try:
        snap = runnables.take(str(wt))
        assert snap.complete and list(snap.entries) == ["/".join([LONG] * 261) + "/.envrc"]
    finally:
        _remove(wt)


@pytest.mark.parametrize("files", [10, 100])
def test_what_a_walk_records_is_bounded_in_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  files: int) -> None:
    monkeypatch.setattr(runnables, "MAX_RECORDED", 20_000)
    (tmp_path / ".vscode").mkdir()
    for i in range(files):
        (tmp_path / ".vscode" / f"f{i}").write_text("{}\n")
    snap = runnables.take(str(tmp_path))
    if files == 10:  # the twin: recorded whole
        assert snap.complete and sorted(snap.entries) == [".vscode", *sorted(f".vscode/f{i}" for i in range(10))]
    else:
        assert not snap.complete and snap.why == "more than 0 MiB of paths to record"


@pytest.mark.parametrize("fail", [False, True])
def test_a_walk_out_of_memory_is_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    """A MemoryError anywhere in the walk is its refusal (``complete``
    False: the end's check fails closed, the close says so), not the
    daemon's crash; the twin walks as ever."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / ".envrc").write_text("x\n")
    real = runnables._Walk._list

    def short(walk: runnables._Walk, fd: int, node: runnables.Node, protected: bool) -> object:
        if fail and node.name == "b":
            raise MemoryError
        return real(walk, fd, node, protected)

    monkeypatch.setattr(runnables._Walk, "_list", short)
    snap = runnables.take(str(tmp_path), ending=True)
    if fail:
        assert (snap.complete, snap.why, snap.entries) == (False, "ran out of memory walking it", {})
    else:
        assert (snap.complete, snap.entries) == (True, {"a/b/.envrc": snap.entries["a/b/.envrc"]})
