"""What a worktree's trusted baseline costs (daemon/gitguard/baselines.py): the
history keep (history.record, first and again), its restore when nothing
changed, the git walk and the tree walk, on a repository of N objects.

    python bench/baseline.py [--objects 100000] [--files 10000] [--loose]

Makes the repository with ``git fast-import`` in a temporary directory (N/3
commits, each one blob and one tree), packed (``git gc``), or with --loose every object a file of its own,
with a worktree of --files files checked out. Prints milliseconds, the
median of --rounds runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dispatchd.daemon.gitguard import history, layouts, runnables, snapshots  # noqa: E402


def make_repo(path: str, objects: int, files: int) -> None:
    subprocess.run(["git", "init", "-q", "-b", "main", path], check=True)
    commits = max(1, objects // 3)
    lines: list[str] = []
    for i in range(commits):
        data = f"blob {i}\n"
        lines.append(f"commit refs/heads/main\nmark :{i + 1}\ncommitter b <b@x> {1700000000 + i} +0000\n"
                     f"data 2\nc\n" + (f"from :{i}\n" if i else "") +
                     f"M 100644 inline f{i % files}\ndata {len(data)}\n{data}\n")
    subprocess.run(["git", "fast-import", "--quiet"], cwd=path, input="".join(lines).encode(), check=True)
    subprocess.run(["git", "checkout", "-q", "main"], cwd=path, check=True)


def unpack(repo: str) -> None:
    """Every object loose (fast-import writes a pack): as a repository whose
    objects were made one by one (``git add``, ``git commit``) and never packed."""
    packs = os.path.join(repo, ".git", "objects", "pack")
    for name in sorted(os.listdir(packs)):
        if name.endswith(".pack"):
            aside = os.path.join(repo, name)
            os.rename(os.path.join(packs, name), aside)
            os.unlink(os.path.join(packs, name[:-5] + ".idx"))
            with open(aside, "rb") as f:
                subprocess.run(["git", "unpack-objects", "-q"], cwd=repo, stdin=f, check=True)
            os.unlink(aside)


def timed(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loose", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        t = time.perf_counter()
        make_repo(repo, args.objects, args.files)
        if not args.loose:
            subprocess.run(["git", "gc", "-q"], cwd=repo, check=True)
        else:
            unpack(repo)
        count = subprocess.run(["git", "count-objects", "-v"], cwd=repo, capture_output=True, text=True).stdout
        print(f"repository made in {time.perf_counter() - t:.1f} s: "
              + ", ".join(line for line in count.splitlines() if line.split(":")[0] in ("count", "in-pack")))
        common = os.path.join(repo, ".git")
        keep = os.path.join(tmp, "keep")
        t = time.perf_counter()
        kept = history.record(common, keep, ["refs/heads/main"])
        print(f"history keep, first: {(time.perf_counter() - t) * 1e3:.1f} ms ({kept.note or 'kept'})")
        print(f"history keep, again: {timed(lambda: history.record(common, keep, []), args.rounds):.1f} ms")
        print(f"history restore, nothing changed: {timed(lambda: history.restore(kept), args.rounds):.1f} ms")
        layout = layouts.inspect_git(repo, uid=os.getuid())
        print(f"git walk: {timed(lambda: snapshots.take(repo, layout), args.rounds):.2f} ms")
        print(f"tree walk ({args.files} files): {timed(lambda: runnables.take(repo), args.rounds):.1f} ms")


if __name__ == "__main__":
    main()
