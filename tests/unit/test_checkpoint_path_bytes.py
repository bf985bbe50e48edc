"""A checkpoint's listing holds every entry's full path: the bytes of those
paths (and of the symlinks' targets) are bounded together
(``checkpoints.reading.MAX_PATH_BYTES``), past which the checkpoint, or the
restore, is refused as over the policy's budgets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dispatchd import treewalk
from dispatchd.daemon import checkpoints as cp
from dispatchd.daemon.checkpoints import reading
from dispatchd.errors import CheckpointError
from dispatchd.policy import Checkpoints
from tests.unit.deeptrees import chain, touch

LONG = b"b" * 250


def _worktree(tmp_path: Path) -> str:
    wt = tmp_path / "wt"
    (wt / "src").mkdir(parents=True)
    (wt / "src" / "a.py").write_text("a = 1\n")
    (wt / "run.sh").write_text("#!/bin/sh\n")
    os.symlink("src/a.py", wt / "link")
    return str(wt)


# src, src/a.py, run.sh, link and its target src/a.py
HELD = 3 + 8 + 6 + 4 + 8


def _message(verb: str, bound: int) -> str:
    return (f"{verb} refused: the paths of the worktree's entries (each from the worktree's top) and its "
            f"symlinks' targets add up to more than {bound} bytes (dispatchd's fixed bound on what one listing "
            f"holds)")


def test_paths_past_the_bound_refuse_a_checkpoint_that_leaves_nothing(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    wt = _worktree(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    store = cp.Store(str(state), str(state / "keep"))
    monkeypatch.setattr(reading, "MAX_PATH_BYTES", HELD - 1)
    with pytest.raises(CheckpointError) as err:
        store.take("s1", wt, Checkpoints())
    assert err.value.message == _message("checkpoint", HELD - 1)
    assert err.value.code == "checkpoint_refused"
    assert store.infos("s1") == []
    # Its twin: at the bound exactly, taken, every entry listed.
    monkeypatch.setattr(reading, "MAX_PATH_BYTES", HELD)
    assert store.take("s1", wt, Checkpoints()).entries == 5
    entries, _ = cp.list_tree(wt, Checkpoints())
    assert sorted(e.path for e in entries) == [b"", b"link", b"run.sh", b"src", b"src/a.py"]


def test_a_symlink_s_target_counts_and_a_restore_s_listing_says_restore(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    wt = _worktree(tmp_path)
    monkeypatch.setattr(reading, "MAX_PATH_BYTES", HELD)
    assert len(cp.list_tree(wt, Checkpoints(), "restore")[0]) == 5
    os.remove(os.path.join(wt, "link"))
    os.symlink("src/a.pyX", os.path.join(wt, "link"))  # one byte more of target
    with pytest.raises(CheckpointError) as err:
        cp.list_tree(wt, Checkpoints(), "restore")
    assert err.value.message == _message("restore", HELD)


def test_the_default_bound_is_64_mib_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert reading.MAX_PATH_BYTES == 64 * 1024 * 1024
    wt = _worktree(tmp_path)
    monkeypatch.setattr(reading, "MAX_PATH_BYTES", 1 << 20)
    assert len(cp.list_tree(wt, Checkpoints())[0]) == 5
    (Path(wt) / "big").mkdir()
    name = "n" * 200
    for i in range((1 << 20) // 200):
        (Path(wt) / "big" / f"{name}{i}").touch()
    with pytest.raises(CheckpointError) as err:
        cp.list_tree(wt, Checkpoints())
    assert err.value.message == (
        "checkpoint refused: the paths of the worktree's entries (each from the worktree's top) and its "
        "symlinks' targets add up to more than 1048576 bytes (1 MiB, dispatchd's fixed bound on what one "
        "listing holds)")


def _deep(wt: Path, levels: int, files: int) -> None:
    wt.mkdir()
    fd = chain(wt, levels, LONG)
    try:
        touch(fd, *(f"f{i}" for i in range(files)))
    finally:
        os.close(fd)


_LIST = """
    import resource
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    from dispatchd.daemon.checkpoints import list_tree
    from dispatchd.errors import CheckpointError
    from dispatchd.policy import Checkpoints
    try:
        entries, _ = list_tree({wt!r}, Checkpoints())
        print("listed", len(entries), sum(len(e.path) for e in entries))
    except CheckpointError as exc:
        print(exc.message)
"""


@pytest.mark.process
@pytest.mark.parametrize("files", [25_000, 1_000])
def test_a_deep_tree_of_long_names_is_refused_within_memory(tmp_path: Path, files: int) -> None:
    """200 levels of 250-byte names (inside the default max_depth 256), with
    25,000 files at the bottom (inside max_files 200,000): 1.25 GB of paths,
    which a listing held whole (a MemoryError under 1 GiB; the defaults
    allowed 12 GB). Refused under the same cap; the twin, 1,000 files there
    (50 MB of paths), listed whole."""
    wt = tmp_path / "wt"
    _deep(wt, 200, files)
    try:
        code = textwrap.dedent(_LIST.format(cap=1 << 30, wt=str(wt)))
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert got.returncode == 0, got.stderr[-1500:]
        if files == 1_000:
            depth = 200 * 251  # each level's name and its slash
            paths = sum(i * 251 - 1 for i in range(1, 201)) + sum(depth + len(f"f{i}") for i in range(files))
            assert got.stdout.split() == ["listed", str(1 + 200 + files), str(paths)]
        else:
            assert got.stdout.strip() == (
                "checkpoint refused: the paths of the worktree's entries (each from the worktree's top) and its "
                "symlinks' targets add up to more than 67108864 bytes (64 MiB, dispatchd's fixed bound on what "
                "one listing holds)")
    finally:
        assert not treewalk.remove_tree(str(wt)).skipped


def test_a_policy_s_larger_max_files_scales_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A monorepo's policy raises ``max_files`` (700,000 files of 100-byte
    paths are more than 64 MiB): the bound scales with it, the default's
    for every default-sized one. The twin: the default policy is refused
    past the bound, as above."""
    wt = _worktree(tmp_path)
    monkeypatch.setattr(reading, "MAX_PATH_BYTES", HELD - 1)
    with pytest.raises(CheckpointError):
        cp.list_tree(wt, Checkpoints())
    assert len(cp.list_tree(wt, Checkpoints(max_files=Checkpoints().max_files + 1))[0]) == 5  # twice the bound
