"""The budget of what restores replaced (daemon/checkpoints/keptsize.py):
its bound, its words, and how kept files are counted (a kept one gone
subtracted, never all measured again); when they are swept
(daemon/checkpoints/preimages.py ``Sweeps``: hourly, the clock a test's,
and before the budget refuses); the daemon's refusal and its twin are in
tests/integration/test_before_restore_budget.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from dispatchd.daemon import checkpoints as cp
from dispatchd.daemon.checkpoints import keptsize, preimages
from dispatchd.errors import CheckpointError
from dispatchd.policy import Checkpoints
from dispatchd.protocol import BeforeRestoreReport


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
    own, linked, _ = keptsize.measure(str(tree))
    assert own == sum(_blocks(p) for p in (tree, tree / "sub", tree / "own.txt", tree / "link"))
    st = os.stat(pool / "copy")
    assert linked == {(st.st_dev, st.st_ino): _blocks(pool / "copy")}


def _keep_and_files(tmp_path: Path, **files: bytes) -> tuple[Path, keptsize.KeptSizes, list[Path]]:
    """An empty keep of pre-images with its sizes, and ``files`` written
    beside it (to be linked into kept ones, as copies are)."""
    kept = tmp_path / "before-restore"
    kept.mkdir()
    made = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        made.append(tmp_path / name)
    return kept, keptsize.KeptSizes(str(kept)), made


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
    kept, sizes, (copy,) = _keep_and_files(tmp_path, copy=b"z" * 100_000)
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
    # Removed by hand (or expired): subtracted; the copy b links stays counted.
    (kept / "a" / "f").unlink()
    (kept / "a").rmdir()
    report = sizes.report()
    assert (report.count, report.bytes) == (1, sum(_blocks(p) for p in (copy, kept / "b", kept / "b" / "g")))
    # ... and the room is back.
    _kept(sizes, "c", {"h": b"w" * 50_000})
    assert sizes.report().count == 2


def test_a_kept_one_gone_is_subtracted_by_name_and_nothing_is_measured_again(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """a and b link one copy, c another; b removed: its own bytes go, the
    copy a still links stays; a removed: the copy goes too. Each total is
    what a daemon measuring them all afresh counts (the oracle), and no
    kept one is measured again."""
    kept, sizes, (one, two) = _keep_and_files(tmp_path, one=b"1" * 40_000, two=b"2" * 70_000)
    _kept(sizes, "a", {"f": one, "own": b"a" * 9000})
    _kept(sizes, "b", {"f": one, "own": b"b" * 20_000})
    _kept(sizes, "c", {"g": two})
    assert sizes.report().bytes == keptsize.KeptSizes(str(kept)).report().bytes
    measured: list[str] = []
    real = keptsize.measure
    monkeypatch.setattr(keptsize, "measure", lambda path: measured.append(path) or real(path))
    for gone, left in (("b", ("a", "c")), ("a", ("c",))):
        shutil.rmtree(kept / gone)
        report = sizes.report()
        assert (report.count, report.bytes) == (len(left), keptsize.KeptSizes(str(kept)).report().bytes)
        assert measured.count(str(kept / left[0])) == 1  # the oracle's look, not ours
        measured.clear()
    assert sizes.report().bytes == sum(_blocks(p) for p in (kept / "c", two))
    shutil.rmtree(kept / "c")
    assert (sizes.report().count, sizes.report().bytes) == (0, 0)
    assert measured == []


def test_admitting_gives_the_total_a_look_afterwards_finds(tmp_path: Path) -> None:
    kept, sizes, (copy,) = _keep_and_files(tmp_path, copy=b"z" * 30_000)
    _kept(sizes, "a", {"f": copy})
    tmp = kept / ".tmp-b"
    tmp.mkdir()
    os.link(copy, tmp / "f")
    (tmp / "own").write_bytes(b"o" * 5000)
    with sizes.admitting(str(tmp), "b") as given:
        os.rename(tmp, kept / "b")
    assert given == sizes.report() == keptsize.KeptSizes(str(kept)).report()
    assert given.count == 2


def _expired(kept: Path, name: str, age_s: float = preimages.RETENTION_S + 60) -> Path:
    """A kept one as preimages makes it, kept ``age_s`` ago."""
    path = kept / name
    (path / preimages.TREE).mkdir(parents=True)
    (path / preimages.TREE / "big").write_bytes(b"e" * 60_000)
    created = os.path.getmtime(path) - age_s
    (path / preimages.ABOUT).write_text(json.dumps({"worktree": "/w", "session": "s", "restored": "c1",
                                                    "before": "c2", "created": created,
                                                    "expires": created + preimages.RETENTION_S}))
    return path


def _store(tmp_path: Path, clock: list[float]) -> tuple[cp.Store, str, str]:
    """A store whose sweeps' clock is ``clock[0]``, a worktree, its checkpoint."""
    state = tmp_path / "state"
    state.mkdir()
    store = cp.Store(str(state), str(state / "keep"))
    store.sweeps = preimages.Sweeps(store.before_dir, clock=lambda: clock[0])
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "f").write_text("f\n")
    return store, str(wt), store.take("s1", str(wt), Checkpoints()).id


def _keep(store: cp.Store, wt: str, cid: str) -> tuple[str, BeforeRestoreReport | None]:
    """What a restore of ``cid`` keeps first: a ``before`` checkpoint, kept past the session."""
    before = store.take("s1", wt, Checkpoints(), spare=cid).id
    return store.keep_before("s1", wt, before, cid)


def test_the_expired_are_swept_as_restores_keep_at_most_hourly(tmp_path: Path) -> None:
    clock = [1000.0]
    store, wt, cid = _store(tmp_path, clock)
    kept = Path(store.before_dir)
    _keep(store, wt, cid)  # the first keep of this daemon's clock sweeps
    old = _expired(kept, "20000101T000000Z-s0-c0001-00000000")
    clock[0] += preimages.SWEEP_EVERY_S - 1
    first, _ = _keep(store, wt, cid)
    assert old.exists()  # not an hour since that sweep: no about.json read
    young = _expired(kept, "20000101T000001Z-s0-c0002-00000000", age_s=preimages.RETENTION_S - 600)
    clock[0] += 1
    second, total = _keep(store, wt, cid)
    assert not old.exists() and young.exists() and Path(first).exists() and Path(second).exists()
    assert total is not None and total.count == 4 and total == store.kept_sizes.report()
    assert store.sweeps.if_due() == []  # swept just now


def test_an_expired_one_is_swept_before_the_budget_refuses_and_a_young_one_refuses(tmp_path: Path) -> None:
    clock = [1000.0]
    store, wt, cid = _store(tmp_path, clock)
    kept = Path(store.before_dir)
    _keep(store, wt, cid)
    store.kept_sizes.fixed, store.kept_sizes.fixed_why = store.kept_sizes.report().bytes + 70_000, "as set by a test"
    young = _expired(kept, "20000101T000001Z-s0-c0002-00000000", age_s=preimages.RETENTION_S - 600)
    with pytest.raises(CheckpointError) as err:  # the twin: not expired, so kept, and the new one refused
        _keep(store, wt, cid)
    assert err.value.code == "checkpoint_refused"
    assert err.value.message.startswith(f"checkpoint refused: keeping it past the session in {kept} would take "
                                        "what restores replaced there over its budget: the 2 kept there hold ")
    assert young.exists() and len(os.listdir(kept)) == 2
    shutil.rmtree(young)
    old = _expired(kept, "20000101T000000Z-s0-c0001-00000000")
    done, total = _keep(store, wt, cid)  # not an hour since the last sweep: the budget's sweep
    assert not old.exists() and Path(done).exists()
    assert total is not None and total.count == 2 and total == store.kept_sizes.report()


def test_the_inode_budget_is_the_lower_of_a_million_and_a_quarter_of_the_free_inodes() -> None:
    assert keptsize.inode_limit(1_000_000, 40_000_000, 60_000_000) == (1_000_000, "dispatchd's fixed bound")
    assert keptsize.inode_limit(1_000_000, 400_000, 60_000_000) == (
        100_000, "a quarter of the 400000 inodes free on its file system")
    # A file system that counts no inodes (btrfs: f_files 0): the fixed bound alone.
    assert keptsize.inode_limit(1_000_000, 0, 0) == (1_000_000, "dispatchd's fixed bound")


def test_empty_files_past_the_inode_budget_are_refused_and_within_it_kept(tmp_path: Path) -> None:
    """Empty files cost no block: a session restoring over thousands of
    them again and again kept them all past the session, within the bytes'
    budget, until the file system (the user's home) had no inode left. The
    twin: as many as the budget allows are kept."""
    kept, sizes, (copy,) = _keep_and_files(tmp_path, copy=b"")
    sizes.fixed_inodes = 12
    _kept(sizes, "a", {f"e{i}": b"" for i in range(5)} | {"linked": copy})  # 1 directory, 5 files, 1 link: 7
    with pytest.raises(CheckpointError) as err:
        _kept(sizes, "b", {f"e{i}": b"" for i in range(5)})  # 6 more: 13
    assert err.value.message == (
        f"checkpoint refused: keeping it past the session in {kept} would take what restores replaced there over "
        "its budget of inodes: the 1 kept there take 7, this one would add 6, and all of them may take at most 12, "
        "dispatchd's fixed bound; nothing kept is removed to make room: remove old ones by hand, or wait for them "
        "to expire (7 days)")
    _kept(sizes, "b", {f"e{i}": b"" for i in range(4)} | {"linked": copy})  # 5 more, the link counted once: 12
    assert sorted(os.listdir(kept)) == ["a", "b"]
