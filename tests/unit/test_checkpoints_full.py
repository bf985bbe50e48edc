"""Checkpoints and restores on a disk with no room left: a refusal that
names the error and the path, never an internal error, the worktree
untouched; a restore that stops half way says where what the worktree held
is (dispatchd/daemon/checkpoints/store.py). ENOSPC is injected where the
bytes are written: no unprivileged test can fill a real disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from dispatchd.daemon import checkpoints as cp
from dispatchd.daemon.checkpoints import restoring
from dispatchd.daemon.checkpoints import store as store_module
from dispatchd.errors import CheckpointError
from dispatchd.policy import Checkpoints

POLICY = Checkpoints()
NO_SPACE = os.strerror(errno.ENOSPC)


@pytest.fixture
def store(tmp_path: Path) -> cp.Store:
    state = tmp_path / "state"
    state.mkdir()
    return cp.Store(str(state), str(state / "keep"))


def _worktree(tmp_path: Path, n: int = 3) -> Path:
    wt = tmp_path / "wt"
    wt.mkdir()
    for i in range(n):
        (wt / f"f{i}.txt").write_text(f"{i}\n" * 100)
    return wt


def _contents(wt: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(wt.iterdir())}


def test_a_checkpoint_with_no_room_is_refused_naming_the_error_and_the_path(
        store: cp.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wt = _worktree(tmp_path)
    before = _contents(wt)

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, NO_SPACE)
    monkeypatch.setattr(store_module, "_clone_fd", full)
    with pytest.raises(CheckpointError) as err:
        store.take("s1", str(wt), POLICY)
    top = os.path.join(store.root, "s1")
    assert err.value.code == "checkpoint_refused"
    assert err.value.message == (f"checkpoint refused: {top}: {NO_SPACE} (ENOSPC); what it had copied is removed, "
                                 "the worktree is untouched")
    assert store.infos("s1") == [] and [n for _, _, names in os.walk(top) for n in names] == []  # nothing half made
    assert _contents(wt) == before
    monkeypatch.undo()  # the twin: with room, taken
    assert store.take("s1", str(wt), POLICY).entries == 4


def test_a_restore_that_stops_half_way_says_where_what_was_there_is_kept(
        store: cp.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wt = _worktree(tmp_path)
    info = store.take("s1", str(wt), POLICY)
    for i in range(3):
        (wt / f"f{i}.txt").write_text("session\n")
    real, written = restoring._put, []

    def put(fd: int, name: bytes, *rest: Any) -> None:
        if written:
            raise OSError(errno.ENOSPC, NO_SPACE)
        written.append(name)
        real(fd, name, *rest)
    monkeypatch.setattr(restoring, "_put", put)
    kept = str(tmp_path / "state" / "before-restore" / "k1")
    with pytest.raises(CheckpointError) as err:
        store.restore("s1", str(wt), info.id, POLICY, kept=kept, before="c0002-x")
    assert err.value.code == "restore_failed"
    assert err.value.message == (f"restore stopped half way: the worktree: {NO_SPACE}; the worktree is partly "
                                 f"restored: restore again; what it held before this restore is kept in {kept}")
    with pytest.raises(CheckpointError) as err:  # not kept past the session: its checkpoint is named
        store.restore("s1", str(wt), info.id, POLICY, before="c0002-x")
    assert err.value.message.endswith("; what it held before this restore is checkpoint c0002-x of this session "
                                      "(restore it to undo)")
    monkeypatch.undo()  # the twin: with room, the restore again finishes it
    store.restore("s1", str(wt), info.id, POLICY)
    assert _contents(wt) == {f"f{i}.txt": f"{i}\n" * 100 for i in range(3)}
