"""What the git checks cost the daemon, at open and at the end of a session.

    python bench/gitsnapshot.py [--quick] [--sessions]

``--sessions`` (as an ordinary user) also times a whole session open and
close through a real daemon, on an empty directory, the plain repository and
the one with 300 submodules (in full mode each of those is a mount point of
its own, and its config and hooks two read-only binds).

At open the daemon runs ``layouts.inspect_git`` (what to hold read-only),
``redirects.redirects_present`` and ``snapshots.take`` (what git reads for
configuration, by content); at the end (and at a network switch)
``redirects_present``, ``snapshots.take`` and ``snapshots.quarantine``.
Measured here on repositories made for the purpose: a plain one, one with a
few submodules (one nested), one with 300 submodules, and one whose index
holds 300,000 entries (about 30 MB). The figures go in docs/design.md
(git metadata).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dispatchd.daemon.gitguard import layouts, redirects, snapshots  # noqa: E402
from tests.unit.gitrepo import empty_repo, git, nested_submodules, one_file_repo  # noqa: E402

def plain(root: Path) -> Path:
    return one_file_repo(root / "plain")


def few_submodules(root: Path) -> Path:
    return nested_submodules(root, "few", [f"libs/lib{i}" for i in range(4)])


def many_submodules(root: Path, n: int) -> Path:
    """``n`` submodules laid out as ``git submodule add`` does (a gitfile in
    the worktree, the git directory in .git/modules), copied from one."""
    r = root / f"many{n}"
    r.mkdir()
    git(r, "init", "-q")
    src = empty_repo(root / "one-src", "one")
    head = git(src, "rev-parse", "HEAD").strip()
    lines = []
    for i in range(n):
        module = r / ".git" / "modules" / f"m{i}"
        shutil.copytree(src / ".git", module, symlinks=True)
        (r / f"m{i}").mkdir()
        (r / f"m{i}" / ".git").write_text(f"gitdir: ../.git/modules/m{i}\n")
        lines.append(f"160000 {head}\tm{i}\n")
    git(r, "update-index", "--index-info", stdin="".join(lines))
    git(r, "commit", "-qm", "many")
    return r


def big_index(root: Path, n: int) -> Path:
    r = root / "big"
    r.mkdir()
    git(r, "init", "-q")
    blob = git(r, "hash-object", "-w", "--stdin", stdin="x").strip()
    git(r, "update-index", "--index-info",
        stdin="".join(f"100644 {blob}\td{i % 1000:03}/file-with-a-name-{i}.txt\n" for i in range(n)))
    return r


def measure(repo: Path, runs: int) -> tuple[float, float, float]:
    """Median seconds: at open (inspect, redirects, take), at the end (a
    take, redirects, compare), and the snapshot alone at open."""
    opens, ends, takes = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        layout = layouts.inspect_git(str(repo), uid=os.getuid())
        redirects.redirects_present(layout, str(repo))
        t1 = time.perf_counter()
        before = snapshots.take(str(repo), layout)
        t2 = time.perf_counter()
        redirects.quarantine_new_redirects(layout, redirects.redirects_present(layout, str(repo)), str(repo))
        now = snapshots.take(str(repo), layout)
        moved, failed = snapshots.quarantine(str(repo), before, now)
        t3 = time.perf_counter()
        assert (moved, failed) == ([], []), (moved, failed)
        opens.append(t2 - t0)
        takes.append(t2 - t1)
        ends.append(t3 - t2)
    return statistics.median(opens), statistics.median(ends), statistics.median(takes)


def sessions(repos: list[tuple[str, Path]], runs: int) -> None:
    import dispatch

    from bench import bench_dir, start_daemon, stop_daemon

    tmp = bench_dir("gitsnapshot")
    # DISPATCHD_TREE: another checkout's daemon (main's, for a before/after)
    tree = os.environ.get("DISPATCHD_TREE", str(Path(__file__).resolve().parent.parent))
    proc, sock = start_daemon(tmp, code=tree)
    try:
        with dispatch.connect(sock) as client:
            for name, repo in repos:
                client.open_session(str(repo), network=False).close()  # warm
                times = []
                for _ in range(runs):
                    t = time.perf_counter()
                    client.open_session(str(repo), network=False).close()
                    times.append(time.perf_counter() - t)
                print(f"session open+close, {name:28} median {statistics.median(times) * 1e3:8.2f}ms, "
                      f"fastest {min(times) * 1e3:8.2f}ms")
    finally:
        stop_daemon(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    quick = "--quick" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = [("plain repository", plain(root), 50),
                 ("4 submodules, each with a submodule", few_submodules(root), 20),
                 ("300 submodules", many_submodules(root, 30 if quick else 300), 5),
                 ("index of 300,000 entries", big_index(root, 3000 if quick else 300_000), 3)]
        print(f"{'repository':40} {'open: all':>10} {'of it: snapshot':>16} {'end: all':>10}")
        for name, repo, runs in cases:
            at_open, at_end, snapshot = measure(repo, runs)
            print(f"{name:40} {at_open * 1e3:8.2f}ms {snapshot * 1e3:14.2f}ms {at_end * 1e3:8.2f}ms")
        if "--sessions" in sys.argv:
            empty = root / "empty"
            empty.mkdir()
            sessions([("an empty directory", empty), ("plain repository", cases[0][1]),
                      ("300 submodules", cases[2][1])], 20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
