"""The budget of what restores replaced (daemon/checkpoints/keptsize.py):
its bound, its words, and how kept files are counted; the daemon's refusal
and its twin are in tests/integration/test_before_restore_budget.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from dispatchd.daemon.checkpoints import keptsize
from dispatchd.errors import CheckpointError


def test_the_budget_is_the_lower_of_8_gib_and_a_quarter_of_the_free_space() -> None:
    assert keptsize.DEFAULT_BYTES == 8 << 30
    assert keptsize.limit(8 << 30, 100 << 30) == (8 << 30, "dispatchd's fixed bound")
    assert keptsize.limit(8 << 30, 32 << 30) == (8 << 30, "dispatchd's fixed bound")  # a tie: the fixed one
    assert keptsize.limit(8 << 30, 20 << 30) == (5 << 30, "a quarter of the 21474836480 bytes free on its file system")
    assert keptsize.limit(8 << 30, 3) == (0, "a quarter of the 3 bytes free on its file system")
    assert keptsize.limit(100, 1 << 30, "as set by X") == (100, "as set by X")


@pytest.mark.parametrize(("n", "words"), [
    (0, "0 bytes"), (1048575, "1048575 bytes"), (1 << 20, "1048576 bytes (1 MiB)"),
    (176160768, "176160768 bytes (168 MiB)"), (1363149, "1363149 bytes (1.3 MiB)"),
    (8 << 30, "8589934592 bytes (8 GiB)"), (3 << 29, "1610612736 bytes (1.5 GiB)"),
])
def test_amounts_are_exact_and_readable(n: int, words: str) -> None:
    assert keptsize.amount(n) == words


def _blocks(p: Path) -> int:
    return os.lstat(p).st_blocks * 512


def test_what_only_the_tree_names_is_its_own_and_linked_files_are_counted_by_inode(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "copy").write_bytes(b"x" * 10000)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "own.txt").write_bytes(b"y" * 5000)
    os.link(pool / "copy", tree / "sub" / "linked")
    os.symlink("/nowhere", tree / "link")
    own, linked = keptsize.measure(str(tree))
    assert own == sum(_blocks(p) for p in (tree, tree / "sub", tree / "own.txt", tree / "link"))
    st = os.stat(pool / "copy")
    assert linked == {(st.st_dev, st.st_ino): _blocks(pool / "copy")}


def _kept(sizes: keptsize.KeptSizes, name: str, make: dict[str, bytes | Path]) -> None:
    """A kept one made as ``preimages`` does: under a temporary name, admitted, renamed."""
    tmp = Path(sizes.path) / f".tmp-{name}"
    tmp.mkdir()
    for rel, what in make.items():
        if isinstance(what, Path):
            os.link(what, tmp / rel)
        else:
            (tmp / rel).write_bytes(what)
    try:
        with sizes.admitting(str(tmp), name):
            os.rename(tmp, Path(sizes.path) / name)
    finally:
        if tmp.exists():
            for child in tmp.iterdir():
                child.unlink()
            tmp.rmdir()


def test_a_copy_two_kept_ones_link_counts_once_and_one_over_the_budget_is_refused(tmp_path: Path) -> None:
    kept = tmp_path / "before-restore"
    kept.mkdir()
    copy = tmp_path / "copy"
    copy.write_bytes(b"z" * 100_000)
    sizes = keptsize.KeptSizes(str(kept))
    sizes.fixed, sizes.fixed_why = 200_000, "as set by a test"
    _kept(sizes, "a", {"f": copy})
    _kept(sizes, "b", {"f": copy, "g": b"small"})  # the same copy again: counted once
    expected = _blocks(copy) + sum(_blocks(p) for p in (kept / "a", kept / "b", kept / "b" / "g"))
    report = sizes.report()
    assert (report.count, report.bytes, report.budget, report.budget_why) == (2, expected, 200_000, "as set by a test")
    with pytest.raises(CheckpointError) as err:
        _kept(sizes, "c", {"h": b"w" * 150_000})
    assert err.value.code == "checkpoint_refused"
    found = re.search(r"this one would add (\d+) bytes", err.value.message)
    assert found and int(found.group(1)) >= 150_000
    assert err.value.message == (
        f"checkpoint refused: keeping it past the session in {kept} would take what restores replaced there over "
        f"its budget: the 2 kept there hold {expected} bytes, this one would add {found.group(1)} bytes, and all "
        "of them may hold at most 200000 bytes, as set by a test; nothing kept is removed to make room: remove old "
        "ones by hand (a directory each, named by when it was kept, oldest first; no session can), or wait for "
        "them to expire (7 days)")
    assert sorted(os.listdir(kept)) == ["a", "b"] and sizes.report().bytes == expected  # nothing of c remembered
    # Removed by hand (or expired): the rest measured again; the copy b links stays counted.
    (kept / "a" / "f").unlink()
    (kept / "a").rmdir()
    report = sizes.report()
    assert (report.count, report.bytes) == (1, sum(_blocks(p) for p in (copy, kept / "b", kept / "b" / "g")))
    # ... and the room is back.
    _kept(sizes, "c", {"h": b"w" * 50_000})
    assert sizes.report().count == 2
