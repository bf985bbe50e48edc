"""What restores replaced, kept past their sessions, within one budget of
the daemon (daemon/checkpoints/keptsize.py, docs/checkpoints.md): a
restore that would take them over it keeps nothing and is refused, saying
what is kept, how much, where and how to make room, and changes nothing;
its twin under the budget goes through; the restore's reply and status
show the total; force goes on; a session's end frees nothing, the user's
removal by hand does, and so does expiry: a kept one past its 7 days is
swept rather than refusing a restore."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dispatch
from dispatch._cli_text import size
from dispatchd.daemon.checkpoints import RACY_NS
from dispatchd.daemon.checkpoints.keptsize import amount
from tests.conftest import Daemon, _refuse_root
from tests.integration.test_cli import run

BUDGET = 2 << 20  # what the kept files may hold at most, set for this daemon
BIG = 1_200_000  # one such file fits; two do not
WHY = "as set by --before-restore-budget-for-testing"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp("before-restore-budget"), "--before-restore-budget-for-testing", str(BUDGET))
    yield d  # the client is tests/conftest.py's, connected to this daemon
    assert d.stop() == 0, d.log()


@pytest.fixture
def kept_dir(daemon: Daemon) -> Path:
    """Empty as each test begins: what the ones before kept, removed by hand as a user would."""
    path = daemon.state / "dispatchd" / "before-restore"
    if path.exists():
        for child in path.iterdir():
            shutil.rmtree(child)
    return path


def du(kept_dir: Path) -> int:
    """What the kept ones hold as the file system charges them, by du (each
    inode once, its allocated blocks): the oracle the daemon's count must equal."""
    kept = sorted(str(p) for p in kept_dir.iterdir())
    out = subprocess.run(["du", "-s", "-B1", "-c", *kept], check=True, capture_output=True, text=True).stdout
    return int(out.splitlines()[-1].split()[0])


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"dir"
            for p in sorted(root.rglob("*"))}


def kept_there(client: dispatch.Client) -> dict[str, Any]:
    report: dict[str, Any] = client.status()["daemon"]["before_restore"]
    return report


def test_a_restore_over_the_budget_is_refused_and_changes_nothing(client: dispatch.Client, daemon: Daemon,
                                                                   worktree: Path, kept_dir: Path) -> None:
    (worktree / "notes.txt").write_text("mine\n")
    with client.open_session(str(worktree)) as s:
        cid = s.checkpoint()
        (worktree / "first.bin").write_bytes(os.urandom(BIG))
        # The twin: under the budget, the restore keeps what it replaces and goes through.
        done = s.restore(cid)
        assert not (worktree / "first.bin").exists()
        first = Path(done["kept"])
        assert (first / "worktree" / "first.bin").stat().st_size == BIG
        held = du(kept_dir)
        assert BIG < held < BUDGET
        assert done["kept_total"] == {"path": str(kept_dir), "count": 1, "bytes": held, "budget": BUDGET,
                                      "budget_why": WHY}
        assert kept_there(client) == done["kept_total"]
        status = run(daemon, "status")
        assert status.returncode == 0, status.stderr
        assert (f"what restores replaced: in {kept_dir}, 1 kept there, {size(held)} of at most 2 MiB ({WHY}); "
                "each kept 7 days, remove old ones by hand to make room\n") in status.stdout

        (worktree / "second.bin").write_bytes(os.urandom(BIG))
        before, listed = snapshot(worktree), sorted(os.listdir(kept_dir))
        with pytest.raises(dispatch.RequestFailed) as err:
            s.restore(cid)
        assert err.value.code == "checkpoint_refused"
        found = re.search(r"this one would add (\d+) bytes", err.value.message)
        assert found, err.value.message
        more = int(found.group(1))  # what the half-made one held, measured by the daemon before it went
        assert BIG <= more < BUDGET and held + more > BUDGET
        assert err.value.message == (
            "restore refused: the worktree as it is now could not be kept first, and a restore would lose it "
            f"(checkpoint refused: keeping it past the session in {kept_dir} would take what restores replaced "
            f"there over its budget: the 1 kept there hold {amount(held)}, this one would add {amount(more)}, and "
            f"all of them may hold at most 2097152 bytes (2 MiB), {WHY}; nothing kept is removed to make room: "
            "remove old ones by hand (a directory each, named by when it was kept, oldest first; no session can), "
            "or wait for them to expire (7 days)); nothing was changed (force=True, `dispatch session restore "
            "--force`: restore anyway, without keeping it)")
        assert snapshot(worktree) == before  # second.bin still there
        assert sorted(os.listdir(kept_dir)) == listed  # nothing half made left beside
        assert kept_there(client)["bytes"] == held

        # Forced, it goes on without keeping them, as force means.
        forced = s.restore(cid, force=True)
        assert forced["kept"] == "" and forced["kept_total"] is None and forced["before"]
        assert not (worktree / "second.bin").exists() and (worktree / "notes.txt").read_text() == "mine\n"
        assert sorted(os.listdir(kept_dir)) == listed
    # The session ended and its checkpoints went: what it kept was counted in full
    # from the start (hard links to them included), so its end changes nothing.
    assert kept_there(client)["bytes"] == held == du(kept_dir)
    # The user removes the kept one by hand: the room is back.
    shutil.rmtree(first)
    assert kept_there(client) == {"path": str(kept_dir), "count": 0, "bytes": 0, "budget": BUDGET,
                                  "budget_why": WHY}
    with client.open_session(str(worktree)) as s:
        cid = s.checkpoint()
        (worktree / "fourth.bin").write_bytes(os.urandom(BIG))
        restored = run(daemon, "session", "restore", s.id, cid)
        assert restored.returncode == 0, restored.stderr
        assert not (worktree / "fourth.bin").exists()
        again = kept_there(client)
        assert again["count"] == 1 and BIG < again["bytes"] < BUDGET
        assert restored.stdout.rstrip().endswith(
            f" (1 kept there, {size(again['bytes'])} of at most 2 MiB ({WHY}))"), restored.stdout


def test_a_file_two_restores_keep_alike_is_counted_once(client: dispatch.Client, worktree: Path,
                                                         kept_dir: Path) -> None:
    """Both keep the same unchanged large file, one inode linked twice: counted
    twice, the second restore would be over the budget and refused."""
    big = worktree / "big.bin"
    big.write_bytes(os.urandom(BIG))
    # Not "changed within RACY_NS before the checkpoint began" (then copied
    # again at the next one, another inode): wait until it is older than that.
    while time.time_ns() - big.stat().st_ctime_ns <= 2 * RACY_NS:
        time.sleep(0.01)
    with client.open_session(str(worktree)) as s:
        cid = s.checkpoint()
        (worktree / "a.txt").write_text("a\n")
        one = s.restore(cid)
        (worktree / "b.txt").write_text("b\n")
        two = s.restore(cid)
    first, second = (Path(d["kept"]) / "worktree" / "big.bin" for d in (one, two))
    assert first.stat().st_ino == second.stat().st_ino and first.read_bytes() == big.read_bytes()
    assert (Path(one["kept"]) / "worktree" / "a.txt").exists() and (Path(two["kept"]) / "worktree" / "b.txt").exists()
    assert two["kept_total"]["count"] == 2
    assert two["kept_total"]["bytes"] == du(kept_dir) < BUDGET < 2 * BIG
    assert kept_there(client) == two["kept_total"]


def test_an_expired_one_is_swept_rather_than_refusing_a_restore(client: dispatch.Client, daemon: Daemon,
                                                                worktree: Path, kept_dir: Path) -> None:
    """What a restore kept 7 days ago is what stands over the budget: the
    next restore sweeps it and goes through (no start came between, and no
    hour since the last sweep). The twin: the same kept files, younger,
    refuse that restore."""
    with client.open_session(str(worktree)) as s:
        cid = s.checkpoint()
        (worktree / "first.bin").write_bytes(os.urandom(BIG))
        first = Path(s.restore(cid)["kept"])
        held = du(kept_dir)
        (worktree / "second.bin").write_bytes(os.urandom(BIG))
        with pytest.raises(dispatch.RequestFailed) as err:
            s.restore(cid)
        found = re.search(r"this one would add (\d+) bytes", err.value.message)
        assert err.value.code == "checkpoint_refused" and found, err.value.message
        assert err.value.message.startswith(
            "restore refused: the worktree as it is now could not be kept first, and a restore would lose it "
            f"(checkpoint refused: keeping it past the session in {kept_dir} would take what restores replaced "
            f"there over its budget: the 1 kept there hold {amount(held)}, this one would add "
            f"{amount(int(found.group(1)))}, and all of them may hold at most 2097152 bytes (2 MiB), {WHY}; "), \
            err.value.message
        assert first.exists() and (worktree / "second.bin").exists()
        about = json.loads((first / "about.json").read_text())
        about["created"] -= 7 * 86400 + 60  # kept a week and a minute ago
        (first / "about.json").write_text(json.dumps(about))
        done = s.restore(cid)
        assert not first.exists() and not (worktree / "second.bin").exists()
        assert (Path(done["kept"]) / "worktree" / "second.bin").stat().st_size == BIG
        assert done["kept_total"] == {"path": str(kept_dir), "count": 1, "bytes": du(kept_dir), "budget": BUDGET,
                                      "budget_why": WHY}
    assert f"event=before_restore_expired path={first}" in daemon.log()
