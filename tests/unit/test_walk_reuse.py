"""What makes a close's check cheaper never makes it weaker: the stamp fast
paths (a listing or an index's submodules reused while the ctime, inode,
mtime and size are those they were read with) hide no change a session can
make (it can set an mtime back, never a ctime; daemon/gitguard/runnables.py,
fs.index_gitlinks; the writers' ends' sweep of temporary files,
treewalk.Listings), and the last end's record, removed after the reply,
is there for a start's check until then (daemon/gitguard/baselines.py;
docs/git-protection.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dispatchd import treewalk
from dispatchd.daemon.gitguard import baselines, fs, indexfile, layouts, redirects, runnables, snapshots
from dispatchd.tempfiles import no_temp_files, sweep_temp_files, temp_name
from tests.unit.gitrepo import git, make_repo
from tests.unit.deeptrees import opened_by_walks

pytestmark = pytest.mark.process  # git makes the repositories


def settled() -> None:
    """Past the window in which a ctime is not trusted (``SETTLE_NS``)."""
    time.sleep(runnables.SETTLE_NS / 1e9 + 0.02)


def mtime_back(path: Path, before: os.stat_result) -> None:
    """What a session can do after a change: put the directory's times back."""
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns


@pytest.fixture
def listings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many directories each later walk lists (``os.scandir`` calls)."""
    calls = [0]
    real = os.scandir

    def counting(fd: int) -> object:
        calls[0] += 1
        return real(fd)
    monkeypatch.setattr(runnables.os, "scandir", counting)
    yield calls


def baseline(repo: Path) -> runnables.TreeSnapshot:
    """A walk of a settled tree: it remembers the plain directories' listings."""
    settled()
    return runnables.take(str(repo))


def test_an_untouched_tree_is_not_listed_again_and_reports_nothing(tmp_path: Path, listings: list[int]) -> None:
    repo = make_repo(tmp_path / "r")
    for i in range(30):
        (repo / f"p{i}").mkdir()
        (repo / f"p{i}" / "f.py").write_text("x\n")
    before = baseline(repo)
    first = listings[0]
    now = runnables.take(str(repo))
    assert runnables.changes(before, now) == [] and now.entries == before.entries
    assert listings[0] - first < 10 < first  # the plain directories' listings were reused


def test_an_unchanged_leaf_directory_is_not_opened_again_and_a_changed_one_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    for i in range(5):
        (repo / f"p{i}").mkdir()
        (repo / f"p{i}" / "f.py").write_text("x\n")
    before = baseline(repo)
    opened = opened_by_walks(monkeypatch)
    now = runnables.take(str(repo))
    assert now.entries == before.entries and now.complete
    assert not [n for n in opened if n.startswith("p")]  # each leaf known by a stat of its name
    st = os.stat(repo / "p3")
    (repo / "p3" / ".envrc").write_text("evil\n")
    mtime_back(repo / "p3", st)
    opened.clear()
    assert runnables.changes(before, runnables.take(str(repo))) == ["p3/.envrc"]
    assert "p3" in opened and "p1" not in opened  # the changed leaf opened and listed; the others not


def test_leaves_known_by_a_stat_still_count_towards_the_walks_bounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    for i in range(5):
        (repo / f"p{i}").mkdir()
        for j in range(4):
            (repo / f"p{i}" / f"f{j}.py").write_text("x\n")
    full = baseline(repo)
    assert full.complete
    monkeypatch.setattr(runnables, "MAX_ENTRIES", 12)  # fewer than the 20 files in the leaves
    over = runnables.take(str(repo))
    assert not over.complete and over.why == "more than 12 entries"
    monkeypatch.setattr(runnables, "MAX_DIRS", 3)
    monkeypatch.setattr(runnables, "MAX_ENTRIES", 10_000)
    over = runnables.take(str(repo))
    assert not over.complete and over.why == "more than 3 directories"


@pytest.mark.parametrize("name", [".envrc", ".mcp.json", ".vscode"])
def test_a_protected_name_added_under_a_put_back_mtime_is_found(tmp_path: Path, name: str) -> None:
    repo = make_repo(tmp_path / "r")
    before = baseline(repo)
    st = os.stat(repo / "d0")
    if name == ".vscode":
        (repo / "d0" / name).mkdir()
        (repo / "d0" / name / "tasks.json").write_text("{}")
    else:
        (repo / "d0" / name).write_text("evil\n")
    mtime_back(repo / "d0", st)
    assert runnables.changes(before, runnables.take(str(repo))) == [f"d0/{name}"]


def test_a_file_renamed_to_a_protected_name_under_a_put_back_mtime_is_found(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "d0" / "innocent.txt").write_text("{}\n")
    before = baseline(repo)
    st = os.stat(repo / "d0")
    os.rename(repo / "d0" / "innocent.txt", repo / "d0" / ".mcp.json")
    mtime_back(repo / "d0", st)
    assert runnables.changes(before, runnables.take(str(repo))) == ["d0/.mcp.json"]


def test_a_repository_made_deep_below_remembered_directories_is_found(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "d0" / "a" / "b").mkdir(parents=True)
    before = baseline(repo)
    sts = {p: os.stat(p) for p in (repo / "d0", repo / "d0" / "a", repo / "d0" / "a" / "b")}
    git(repo / "d0" / "a" / "b", "init", "-q")
    for p, st in sts.items():
        mtime_back(p, st)
    assert "d0/a/b/.git/config" in runnables.changes(before, runnables.take(str(repo)))


def test_a_protected_file_rewritten_with_its_size_and_mtime_is_found(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / ".vscode").mkdir()
    tasks = repo / ".vscode" / "tasks.json"
    tasks.write_text('{"a": 1}')
    before = baseline(repo)
    st, dst = os.stat(tasks), os.stat(repo / ".vscode")
    with open(tasks, "r+") as f:  # in place: the same inode, the same size
        f.write('{"b": 2}')
    mtime_back(tasks, st)
    mtime_back(repo / ".vscode", dst)
    assert os.stat(tasks).st_size == st.st_size and os.stat(tasks).st_ino == st.st_ino
    assert runnables.changes(before, runnables.take(str(repo))) == [".vscode/tasks.json"]


def test_a_directory_changed_just_before_a_walk_is_not_remembered(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    settled()
    (repo / "fresh").mkdir()
    (repo / "fresh" / "f.txt").write_text("x")
    runnables.take(str(repo))  # within the window: its ctime says nothing yet
    st = os.stat(repo / "fresh")
    remembered = runnables._REMEMBERED[frozenset(runnables.DEFAULT_PROTECTED)]
    assert (st.st_dev, st.st_ino) not in remembered
    old = os.stat(repo / "d0")
    assert (old.st_dev, old.st_ino) in remembered  # its twin, settled, is


def test_an_excluded_root_below_a_remembered_directory_stays_excluded(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "d0" / "inner").mkdir()
    git(repo / "d0" / "inner", "init", "-q")
    settled()
    runnables.take(str(repo), excluded=[str(repo / "d0" / "inner")])
    again = runnables.take(str(repo), excluded=[str(repo / "d0" / "inner")])
    assert not any(k.startswith("d0/inner") for k in again.entries)
    assert "d0/inner/.git" in runnables.take(str(repo)).entries  # not excluded: walked


# --- an index's submodules ---------------------------------------------------------------------


def index_read_once(index: str, monkeypatch: pytest.MonkeyPatch) -> tuple[set[str] | None, list[int]]:
    """The index's submodules, read once it has settled; then a count of the
    parses that follow."""
    settled()
    links = fs.index_gitlinks(index)
    parsed = [0]
    real = indexfile.parse_index

    def counting(data: bytes, **kw: object) -> object:
        parsed[0] += 1
        return real(data, **kw)  # type: ignore[arg-type]
    monkeypatch.setattr(fs.indexfile, "parse_index", counting)
    return links, parsed


def test_an_unchanged_index_is_not_parsed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    index = str(repo / ".git" / "index")
    links, parsed = index_read_once(index, monkeypatch)
    assert fs.index_gitlinks(index) == links and parsed[0] == 0
    # Rewritten in place, the same bytes, its mtime put back: its ctime moved, so it is read again.
    st = os.stat(index)
    data = Path(index).read_bytes()
    with open(index, "r+b") as f:
        f.write(data)
    os.utime(index, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fs.index_gitlinks(index) == links and parsed[0] == 1


def test_a_submodule_added_to_a_remembered_index_is_seen(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    sub = make_repo(tmp_path / "sub")
    index = str(repo / ".git" / "index")
    settled()
    assert fs.index_gitlinks(index) == set()
    git(repo, "submodule", "add", "-q", str(sub), "mod")
    assert fs.index_gitlinks(index) == {"mod"}


# --- the last end's record, removed after the reply --------------------------------------------------


def _join(store: baselines.Baselines, sid: str, root: Path) -> None:
    layout = layouts.inspect_git(str(root), uid=os.getuid())
    snap = snapshots.take(str(root), layout)
    store.join(sid, str(root), layout, snap, redirects.redirects_present(layout, str(root)), (".vscode",))


def test_the_last_ends_record_goes_after_the_reply_and_a_new_open_takes_its_own(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    jobs: list[Callable[[], None]] = []
    store.later = jobs.append
    records = tmp_path / "state" / "baselines"
    _join(store, "s1", repo)
    (repo / ".vscode").mkdir()  # the session's plant: the check, before the reply, moves it aside
    found = store.leave("s1")
    assert [Path(p.path).name.split(".quarantined")[0] for p in found] == [".vscode"]
    assert not (repo / ".vscode").exists()
    old = sorted(os.listdir(records))
    assert len(old) == 2 and len(jobs) == 1  # still on disk, its lock held: no start takes it for a dead daemon's
    assert baselines.Baselines(str(tmp_path / "state")).recover() == []
    _join(store, "s2", repo)  # the next open: a new baseline, a record of its own
    assert len(os.listdir(records)) == 4
    jobs.pop()()
    assert sorted(os.listdir(records)) != old and len(os.listdir(records)) == 2
    assert store.leave("s2") == [] and len(jobs) == 1
    jobs.pop()()
    assert os.listdir(records) == []


def test_a_daemon_that_dies_before_the_records_removal_leaves_a_check_that_moves_nothing_unchanged(
        tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    dead = baselines.Baselines(str(tmp_path / "state"))
    dead.later = lambda job: None  # never run: the daemon died first
    _join(dead, "s", repo)
    lock_fd = next(iter(dead._domains.values())).lock_fd
    assert dead.leave("s") == []
    os.close(lock_fd)  # what the kernel does for a dead daemon
    live = baselines.Baselines(str(tmp_path / "state"))
    assert live.recover() == [] and os.listdir(tmp_path / "state" / "baselines") == []


# --- the writers' ends' sweep of temporary files ---------------------------------------------------


def _tree(root: Path) -> None:
    for i in range(20):
        (root / f"p{i}" / "q").mkdir(parents=True)
        (root / f"p{i}" / "user.txt").write_text("mine\n")
        (root / f"p{i}" / "q" / "f.py").write_text("x\n")


def test_an_untouched_tree_is_swept_without_listing_it_again_and_keeps_every_file(tmp_path: Path) -> None:
    _tree(tmp_path)
    listings = treewalk.Listings(no_temp_files)
    settled()
    assert sweep_temp_files(str(tmp_path), listings=listings) == [] and listings.reused == 0
    assert sweep_temp_files(str(tmp_path), listings=listings) == []
    assert listings.reused == 41  # every directory: the top, p*, p*/q
    assert all((tmp_path / f"p{i}" / "user.txt").read_text() == "mine\n" for i in range(20))


def test_a_temporary_file_left_in_a_remembered_directory_under_a_put_back_mtime_is_swept(tmp_path: Path) -> None:
    _tree(tmp_path)
    listings = treewalk.Listings(no_temp_files)
    settled()
    sweep_temp_files(str(tmp_path), listings=listings)
    left = tmp_path / "p3" / "q" / temp_name("f.py")
    st = os.stat(left.parent)
    left.write_text("cut short")
    mtime_back(left.parent, st)
    assert sweep_temp_files(str(tmp_path), listings=listings) == [str(left)]
    assert not left.exists() and (tmp_path / "p3" / "q" / "f.py").exists()


def test_a_directory_with_a_temporary_file_in_flight_is_listed_every_time(tmp_path: Path) -> None:
    _tree(tmp_path)
    flying = tmp_path / "p0" / temp_name("user.txt")
    flying.write_text("being written")
    listings = treewalk.Listings(no_temp_files)
    settled()
    for _ in range(2):
        assert sweep_temp_files(str(tmp_path), lambda: frozenset({os.fsencode(flying.name)}), listings=listings) == []
    st = os.stat(tmp_path / "p0")
    assert (st.st_dev, st.st_ino) not in listings.seen  # its temporary name keeps it listed
    assert sweep_temp_files(str(tmp_path), listings=listings) == [str(flying)]  # once no longer in flight


def test_the_file_systems_whose_ctime_is_trusted(tmp_path: Path) -> None:
    """The test's own directory is on one of the local file systems listed
    (the twin of the next tests); /proc is not: nothing there is remembered."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert treewalk.fine_local_ctime(fd, os.fstat(fd).st_dev) is True
    finally:
        os.close(fd)
    fd = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert treewalk.fine_local_ctime(fd, os.fstat(fd).st_dev) is False
    finally:
        os.close(fd)


@pytest.fixture
def ctime_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file system taken for one whose ctime this kernel does not keep
    (NFS, FUSE, FAT): as a worktree there would be."""
    monkeypatch.setattr(treewalk, "FINE_CTIME_FS", frozenset())


@pytest.mark.usefixtures("ctime_not_kept")
def test_on_a_file_system_of_untrusted_ctimes_every_walk_lists_every_directory(
        tmp_path: Path, listings: list[int]) -> None:
    repo = make_repo(tmp_path / "r")
    for i in range(30):
        (repo / f"p{i}").mkdir()
    baseline(repo)
    first = listings[0]
    runnables.take(str(repo))
    assert listings[0] - first == first  # listed again, all of it
    swept = treewalk.Listings(no_temp_files)
    assert sweep_temp_files(str(repo), listings=swept) == []
    assert sweep_temp_files(str(repo), listings=swept) == [] and swept.reused == 0


@pytest.mark.usefixtures("ctime_not_kept")
def test_on_a_file_system_of_untrusted_ctimes_an_index_is_parsed_every_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    index = str(repo / ".git" / "index")
    links, parsed = index_read_once(index, monkeypatch)
    assert fs.index_gitlinks(index) == links and parsed[0] == 1


def _counted_fine(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    asked: list[int] = []
    real = treewalk.fine_local_ctime

    def counting(fd: int, dev: int) -> bool:
        asked.append(dev)
        return real(fd, dev)
    monkeypatch.setattr(treewalk, "fine_local_ctime", counting)
    return asked


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_a_walk_asks_a_block_devices_file_system_once_and_an_anonymous_ones_at_each_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The file system's type (fstatfs) was asked at every directory of a
    remembered walk, a third of its time: a block device's is asked once a
    walk. An anonymous device number (tmpfs here, btrfs, FUSE) can be given
    to another mount, so it is asked at each directory as before. The same
    sweep, either way: nothing left, every file kept."""
    if where == "shm":
        root = Path("/dev/shm") / f"dispatchd-test-{os.getpid()}"
        root.mkdir()
    else:
        root = tmp_path / "tree"
        root.mkdir()
    try:
        _tree(root)
        block = os.major(os.stat(root).st_dev) != 0
        listings = treewalk.Listings(no_temp_files)
        settled()
        asked = _counted_fine(monkeypatch)
        for _ in range(2):
            assert sweep_temp_files(str(root), listings=listings) == []
        assert len(asked) == (2 if block else 2 * 41)  # once a walk, or every directory (the top, p*, p*/q)
        assert listings.reused == 41
        assert all((root / f"p{i}" / "user.txt").read_text() == "mine\n" for i in range(20))
    finally:
        if where == "shm":
            treewalk.remove_tree(str(root))


def test_the_shm_case_above_is_an_anonymous_device() -> None:
    """So that the parametrised test above covers both branches wherever
    the test's own directory is: /dev/shm is a tmpfs."""
    assert os.major(os.stat("/dev/shm").st_dev) == 0
