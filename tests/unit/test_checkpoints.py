"""Checkpoints (dispatchd/daemon/checkpoints/): the pure plans by equality,
then the store on a temporary directory (no daemon, no sandbox)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading

import pytest

from dispatchd import protocol
from dispatchd.daemon import checkpoints as cp
from dispatchd.daemon.checkpoints.reading import _copy_path
from dispatchd.errors import CheckpointError, SessionError
from dispatchd.policy import Checkpoints
from dispatchd.worker.pausegate import Gate

E = cp.Entry


def f(path: bytes, ino: int = 1, ctime: int = 10**12, mode: int = 0o644, copy: int = -1, size: int = 3) -> cp.Entry:
    return E(path=path, kind="f", mode=mode, size=size, mtime_ns=5, ctime_ns=ctime, dev=1, ino=ino, copy=copy)


def d(path: bytes, mode: int = 0o755) -> cp.Entry:
    return E(path=path, kind="d", mode=mode)


def ln(path: bytes, target: bytes) -> cp.Entry:
    return E(path=path, kind="l", mode=0o777, target=target)


def manifest(entries: list[cp.Entry], started_ns: int) -> cp.Manifest:
    return cp.Manifest(info=protocol.CheckpointInfo(id="c0001-x", created=0.0), started_ns=started_ns,
                       entries=entries)


# --- plan_copies: what to link from the previous checkpoint -----------------------


def test_first_checkpoint_copies_everything():
    assert cp.plan_copies([f(b"a"), f(b"b", ino=2)], None) == {}


def test_unchanged_files_link_to_the_previous_copy_changed_ones_are_copied():
    prev = manifest([f(b"same", ino=1, copy=0), f(b"edited", ino=2, copy=1), f(b"moved", ino=3, copy=2),
                     f(b"chmod", ino=4, copy=3)], started_ns=10**12 + cp.RACY_NS)
    now = [f(b"same", ino=1), f(b"edited", ino=2, ctime=10**12 + 1), f(b"moved", ino=9), f(b"chmod", ino=4, ctime=7),
           f(b"new", ino=5)]
    assert cp.plan_copies(now, prev) == {b"same": 0}


def test_a_file_changed_just_before_the_previous_checkpoint_is_copied_again():
    # Its ctime may not have moved for a change made in the same clock tick.
    prev = manifest([f(b"racy", copy=0)], started_ns=10**12 + cp.RACY_NS - 1)
    assert cp.plan_copies([f(b"racy")], prev) == {}


def test_only_files_are_linked():
    prev = manifest([d(b"x"), ln(b"l", b"t")], started_ns=10**13)
    assert cp.plan_copies([d(b"x"), ln(b"l", b"t")], prev) == {}


# --- plan_restore: what to remove, make, write -------------------------------------


def test_restore_of_an_unchanged_tree_does_nothing():
    tree = [d(b""), d(b"src"), f(b"src/a"), ln(b"link", b"src/a")]
    plan = cp.plan_restore(tree, tree)
    assert (plan.remove, plan.make, plan.write, plan.modes) == ([], [], [], [])


def test_restore_removes_what_came_after_and_writes_back_what_changed_or_went():
    saved = [d(b""), d(b"src"), f(b"src/a", ino=1), f(b"src/deleted", ino=2), f(b"chmod", ino=3, mode=0o755)]
    now = [d(b""), d(b"src"), f(b"src/a", ino=1, ctime=99), d(b"new"), f(b"new/x", ino=7), f(b"src/created", ino=8),
           f(b"chmod", ino=3, mode=0o644, ctime=99)]
    plan = cp.plan_restore(saved, now)
    assert [e.path for e in plan.remove] == [b"new", b"src/created"]  # new/x goes with new
    assert plan.make == []
    assert [e.path for e in plan.write] == [b"chmod", b"src/a", b"src/deleted"]
    assert plan.modes == []


def test_restore_replaces_a_symlink_planted_where_a_directory_was():
    saved = [d(b""), d(b"src"), f(b"src/a")]
    now = [d(b""), ln(b"src", b"/home/user/.ssh")]
    plan = cp.plan_restore(saved, now)
    assert plan.remove == [ln(b"src", b"/home/user/.ssh")]
    assert plan.make == [d(b"src")]
    assert plan.write == [f(b"src/a")]
    assert plan.modes == [d(b"src")]


def test_restore_swaps_a_symlink_target_and_a_file_for_a_directory():
    saved = [d(b""), ln(b"l", b"a"), f(b"x")]
    now = [d(b""), ln(b"l", b"b"), d(b"x"), f(b"x/inner")]
    plan = cp.plan_restore(saved, now)
    assert [e.path for e in plan.remove] == [b"x"]
    assert [e.path for e in plan.write] == [b"l", b"x"]


def test_restore_sets_directory_modes_children_first():
    saved = [d(b"", 0o755), d(b"a", 0o555), d(b"a/b", 0o500)]
    now = [d(b"", 0o700), d(b"a", 0o755), d(b"a/b", 0o755)]
    plan = cp.plan_restore(saved, now)
    assert [e.path for e in plan.modes] == [b"a/b", b"a", b""]


def test_sibling_names_that_sort_between_a_directory_and_its_children():
    # "a-b" sorts between "a" and "a/x": a removed "a-b" must not hide "a/x".
    saved = [d(b""), d(b"a"), f(b"a/x")]
    now = [d(b""), d(b"a"), d(b"a-b"), f(b"a-b/y"), f(b"a/x")]
    plan = cp.plan_restore(saved, now)
    assert [e.path for e in plan.remove] == [b"a-b"]
    assert plan.write == []


# --- the store, on a temporary directory -----------------------------------------------


POLICY = Checkpoints()


def _tree(root: str) -> dict[str, tuple[str, int, str]]:
    """Every entry below ``root``: kind, mode, content or target."""
    out: dict[str, tuple[str, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", 0, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), "")
            else:
                with open(path) as fh:
                    out[rel] = ("f", stat.S_IMODE(st.st_mode), fh.read())
    return out


@pytest.fixture
def store(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    return cp.Store(str(state), str(state / "keep"))


def _worktree(tmp_path) -> str:
    wt = tmp_path / "wt"
    (wt / "src").mkdir(parents=True)
    (wt / "src" / "a.py").write_text("a = 1\n")
    (wt / "src" / "gone.py").write_text("gone\n")
    (wt / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(wt / "run.sh", 0o755)
    os.symlink("src/a.py", wt / "link")
    (wt / "ro").mkdir()
    (wt / "ro" / "k").write_text("k\n")
    os.chmod(wt / "ro", 0o555)
    return str(wt)


def test_take_then_restore_brings_everything_back(store, tmp_path):
    wt = _worktree(tmp_path)
    before = _tree(wt)
    info = store.take("s1", wt, POLICY, "first")
    assert (info.label, info.entries) == ("first", 8)
    os.chmod(os.path.join(wt, "ro"), 0o755)
    with open(os.path.join(wt, "src", "a.py"), "w") as fh:
        fh.write("a = 2\n")
    os.unlink(os.path.join(wt, "src", "gone.py"))
    os.chmod(os.path.join(wt, "run.sh"), 0o600)
    os.unlink(os.path.join(wt, "link"))
    os.symlink("/etc/passwd", os.path.join(wt, "link"))
    os.mkdir(os.path.join(wt, "new"))
    (tmp_path / "wt" / "new" / "n").write_text("n\n")
    (tmp_path / "wt" / "ro" / "planted").write_text("p\n")
    os.chmod(os.path.join(wt, "ro"), 0o555)
    done, _, _ = store.restore("s1", wt, info.id, POLICY)
    assert _tree(wt) == before
    assert done == {"removed": 2, "written": 4, "made": 0, "objects": 0}


def test_a_worktree_on_another_file_system_than_the_state_is_kept_and_restored(tmp_path):
    """A worktree on a tmpfs (or another disk) and the state on the home's
    file system: ``copy_file_range`` answers EXDEV there, and the take
    failed with it. Now the bytes go through the daemon. The twin: the
    test above, on one file system."""
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="dispatchd-test-")
    try:
        wt = _worktree(type(tmp_path)(shm))
        state = tmp_path / "state"
        state.mkdir()
        assert os.stat(wt).st_dev != os.stat(state).st_dev  # two file systems, or the test proves nothing
        store = cp.Store(str(state), str(state / "keep"))
        before = _tree(wt)
        info = store.take("s1", wt, POLICY, "first")
        with open(os.path.join(wt, "src", "a.py"), "w") as fh:
            fh.write("a = 2, and longer\n")
        os.unlink(os.path.join(wt, "src", "gone.py"))
        store.restore("s1", wt, info.id, POLICY)
        assert _tree(wt) == before
    finally:
        for top, dirs, _ in os.walk(shm):
            for name in dirs:
                os.chmod(os.path.join(top, name), 0o755)
        shutil.rmtree(shm)


def _pool(store: cp.Store, sid: str) -> list[str]:
    return [os.path.join(p, n) for p, _, names in os.walk(os.path.join(store.root, sid, "pool")) for n in names]


def _first_as_if_later(store: cp.Store, wt: str) -> cp.Manifest:
    """A first checkpoint, recorded as if it began RACY_NS later: the files
    just made count as older than the racy window, so the next one shares."""
    m1 = store.find("s1", store.take("s1", wt, POLICY).id)
    store._of("s1").last = cp.Manifest(info=m1.info, started_ns=m1.started_ns + cp.RACY_NS,
                                                entries=m1.entries)
    return m1


def test_a_second_checkpoint_shares_unchanged_copies_never_the_live_file(store, tmp_path):
    wt = _worktree(tmp_path)
    m1 = _first_as_if_later(store, wt)
    with open(os.path.join(wt, "src", "a.py"), "a") as fh:
        fh.write("b = 2\n")
    second = store.take("s1", wt, Checkpoints(max_bytes=20))  # only a.py's 12 bytes are copied
    assert second.copied_bytes == 12
    copies = lambda m: {e.path: e.copy for e in m.entries if e.kind == "f"}  # noqa: E731
    c1, c2 = copies(m1), copies(store.find("s1", second.id))
    assert {p for p in c1 if c1[p] == c2[p]} == {b"src/gone.py", b"run.sh", b"ro/k"}
    assert len(_pool(store, "s1")) == 5
    # Never a link to the live worktree file: a later write there changes no copy.
    live = {os.stat(os.path.join(wt, os.fsdecode(p))).st_ino for p in c2}
    assert live.isdisjoint({os.stat(c).st_ino for c in _pool(store, "s1")})
    assert all(os.stat(c).st_nlink == 1 for c in _pool(store, "s1"))


def test_over_the_byte_budget_a_checkpoint_is_refused_naming_it(store, tmp_path):
    wt = _worktree(tmp_path)
    if cp.reflinks(store.root, wt):
        pytest.skip("a file system with reflinks copies nothing")
    with pytest.raises(CheckpointError) as err:
        store.take("s1", wt, Checkpoints(max_bytes=4))
    assert err.value.message == ("checkpoint refused: it would copy more than 4 bytes (the policy's "
                                 "[checkpoints] max_bytes; reflink clones and links are not counted)")
    assert err.value.code == "checkpoint_refused"
    assert store.infos("s1") == []
    assert _pool(store, "s1") == [] and os.listdir(os.path.join(store.root, "s1")) == ["pool"]  # nothing half made
    # Its twin: within the budget, taken.
    assert store.take("s1", wt, Checkpoints(max_bytes=1024)).entries == 8


def test_over_the_entry_and_depth_budgets(store, tmp_path):
    wt = _worktree(tmp_path)
    with pytest.raises(CheckpointError) as err:
        store.take("s1", wt, Checkpoints(max_files=5))
    assert err.value.message == ("checkpoint refused: the worktree has more than 5 entries "
                                 "(the policy's [checkpoints] max_files)")
    os.makedirs(os.path.join(wt, *["d"] * 6))
    with pytest.raises(CheckpointError) as err:
        store.take("s1", wt, Checkpoints(max_depth=4))
    assert err.value.message == ("checkpoint refused: the worktree is deeper than 4 levels "
                                 "(the policy's [checkpoints] max_depth)")
    assert store.take("s1", wt, Checkpoints(max_depth=8, max_files=100)).entries == 14


def test_the_oldest_checkpoints_go_past_keep(store, tmp_path):
    wt = _worktree(tmp_path)
    ids = [store.take("s1", wt, Checkpoints(keep=2)).id for _ in range(3)]
    assert [i.id for i in store.infos("s1")] == ids[1:]
    assert sorted(os.listdir(os.path.join(store.root, "s1"))) == sorted(ids[1:] + ["pool"])
    with pytest.raises(CheckpointError) as err:
        store.find("s1", ids[0])
    assert err.value.code == "unknown_checkpoint"
    assert err.value.message == f"no such checkpoint: {ids[0]!r} (session s1 has: {ids[1]}, {ids[2]})"


def test_a_half_made_checkpoint_is_gone_at_the_next_start(tmp_path):
    state = tmp_path / "state"
    half = state / "checkpoints" / "s1" / "pool" / "0"
    half.mkdir(parents=True)
    (half / "0").write_text("x")
    (state / "checkpoints" / "s1" / ".tmp-c0001-deadbeef").write_text("half a manifest")
    cp.Store(str(state), str(state / "keep"))
    assert os.listdir(state / "checkpoints") == []


def test_dropping_a_session_removes_its_checkpoints(store, tmp_path):
    wt = _worktree(tmp_path)
    store.take("s1", wt, POLICY)
    store.drop("s1")
    assert store.infos("s1") == [] and not os.path.exists(os.path.join(store.root, "s1"))


def test_an_unreadable_directory_refuses_the_checkpoint(store, tmp_path):
    wt = _worktree(tmp_path)
    os.chmod(os.path.join(wt, "src"), 0)
    try:
        with pytest.raises(CheckpointError) as err:
            store.take("s1", wt, POLICY)
        assert err.value.message == ("checkpoint refused: src: a directory that cannot be read "
                                     "(a checkpoint without it would delete it at a restore)")
    finally:
        os.chmod(os.path.join(wt, "src"), 0o755)
    assert store.take("s1", wt, POLICY).entries == 8


# --- the worker's gate --------------------------------------------------------------


def test_the_gate_closes_only_when_nothing_runs_and_holds_calls_until_resumed():
    gate = Gate()
    assert gate.pause(lambda: 2, grace_s=0.01) == "2 tool calls in flight"
    with gate:
        assert gate.pause(lambda: 0, grace_s=0.01) == "1 tool call in flight"
    # A call being counted out when the pause comes is waited for, briefly.
    ending = threading.Timer(0.05, lambda: finished.append(1))
    finished: list[int] = []
    ending.start()
    assert gate.pause(lambda: 1 - len(finished), grace_s=5) == ""
    gate.resume()
    assert gate.pause(lambda: 0) == ""
    passed = threading.Event()

    def call() -> None:
        with gate:
            passed.set()

    t = threading.Thread(target=call)
    t.start()
    assert not passed.wait(0.2)
    gate.resume()
    assert passed.wait(5)
    t.join()


def test_a_copy_goes_with_the_last_checkpoint_that_names_it(store, tmp_path):
    wt = _worktree(tmp_path)
    m1 = _first_as_if_later(store, wt)
    with open(os.path.join(wt, "src", "a.py"), "a") as fh:
        fh.write("b = 2\n")
    old_a = {e.path: e.copy for e in m1.entries}[b"src/a.py"]
    second = store.take("s1", wt, Checkpoints(keep=1))
    assert [i.id for i in store.infos("s1")] == [second.id]
    assert len(_pool(store, "s1")) == 4  # the three shared, and a.py's new copy
    assert not os.path.exists(_copy_path(os.path.join(store.root, "s1"), old_a))
    with open(os.path.join(wt, "src", "a.py"), "w") as fh:
        fh.write("changed again\n")
    store.restore("s1", wt, second.id, POLICY)
    with open(os.path.join(wt, "src", "a.py")) as fh:
        assert fh.read() == "a = 1\nb = 2\n"


def test_git_object_files_come_back_from_the_keep_and_newer_ones_stay(store, tmp_path):
    wt = _worktree(tmp_path)
    objects = os.path.join(wt, ".git", "objects")
    os.makedirs(os.path.join(objects, "ab"))
    os.makedirs(os.path.join(objects, "info"))
    with open(os.path.join(objects, "ab", "cdef"), "w") as fh:
        fh.write("an object")
    info = store.take("s1", wt, POLICY)
    assert info.objects == 1
    os.unlink(os.path.join(objects, "ab", "cdef"))
    os.makedirs(os.path.join(objects, "12"))
    with open(os.path.join(objects, "12", "3456"), "w") as fh:
        fh.write("a newer object")
    with open(os.path.join(objects, "info", "alternates"), "w") as fh:  # a file of git's, not an object
        fh.write("/elsewhere\n")
    done, _, _ = store.restore("s1", wt, info.id, POLICY)
    assert (done["objects"], done["removed"]) == (1, 1)
    with open(os.path.join(objects, "ab", "cdef")) as fh:
        assert fh.read() == "an object"
    assert os.path.exists(os.path.join(objects, "12", "3456"))  # never removed: unreachable, git's gc drops it
    assert not os.path.exists(os.path.join(objects, "info", "alternates"))


def test_a_checkpoint_asked_after_its_session_ended_is_refused_and_makes_nothing(store, tmp_path):
    """A checkpoint the policy takes before a write runs on a thread of its
    own: one that gets to the store after the session's end (``drop``) is
    refused naming the end, and leaves no store behind for the next start."""
    wt = _worktree(tmp_path)
    store.take("s1", wt, POLICY, "before the end")
    store.drop("s1")
    assert not os.path.exists(os.path.join(store.root, "s1"))
    with pytest.raises(SessionError, match=r"^session s1 has ended: its checkpoints are gone$"):
        with store.lock("s1"):
            pass
    with pytest.raises(SessionError, match=r"^session s1 has ended: its checkpoints are gone$"):
        store.take("s1", wt, POLICY, "after the end")
    assert not os.path.exists(os.path.join(store.root, "s1"))
    # The twin: another session's checkpoint is taken, its store private at every level.
    with store.lock("s2"):
        store.take("s2", wt, POLICY, "alive")
    assert [i.label for i in store.infos("s2")] == ["alive"]
    assert stat.S_IMODE(os.stat(os.path.join(store.root, "s2")).st_mode) == 0o700
