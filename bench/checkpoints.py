"""What a checkpoint and a restore cost (daemon/checkpoints.py), on the file
system of --dir: a worktree of --files files, a git repository of its
sources, and a node_modules of about --node-mib MiB (many small files and a
few big ones).

    python bench/checkpoints.py --dir /var/tmp/ckbench [--files 10000] [--node-mib 1024]

The worktree and the daemon's state directory are both made in --dir (one
file system, as ``~/.local/state`` and a project under ``~`` usually are):
reflink clones where it has them (btrfs, XFS), else links and copies.
Prints seconds for each step and what the checkpoint copied; the page cache
is warm (the worktree was just written). Last, restores as a client's
request makes them (the worktree kept first, past the session, within the
budget of what restores keep: docs/checkpoints.md), with a few kept there
already, then after one of them was removed by hand. Removes what it made.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dispatchd import treewalk  # noqa: E402
from dispatchd.daemon import checkpoints  # noqa: E402
from dispatchd.daemon.checkpoints import preimages  # noqa: E402
from dispatchd.policy import Checkpoints  # noqa: E402

BIG = 8  # big files in node_modules (binaries, bundles), the rest of its bytes
KEPT = 5  # what restores replaced, kept in the state directory, before the steps that look at them


def make_worktree(wt: str, files: int, node_mib: int) -> None:
    src_files = files // 10
    small = files - src_files - BIG
    os.makedirs(wt)
    for i in range(src_files):
        d = os.path.join(wt, "src", f"pkg{i // 50}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"mod{i}.py"), "w") as f:
            f.write(f"# module {i}\n" + "x = 1\n" * (i % 200))
    subprocess.run(["git", "init", "-q", "-b", "main", wt], check=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@x", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@x"}
    subprocess.run(["git", "add", "src"], cwd=wt, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=wt, check=True, env=env)
    block = os.urandom(1 << 20)
    small_bytes = 0
    for i in range(small):
        d = os.path.join(wt, "node_modules", f"dep{i // 40}", "lib")
        os.makedirs(d, exist_ok=True)
        size = 512 + (i * 7919) % 8192  # 0.5-8.5 KiB, about 4.5 on average
        with open(os.path.join(d, f"f{i}.js"), "wb") as f:
            f.write(block[:size])
        small_bytes += size
    big_each = max(1, (node_mib * (1 << 20) - small_bytes) // BIG)
    for i in range(BIG):
        d = os.path.join(wt, "node_modules", f"native{i}", "build")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "addon.node"), "wb") as f:
            left = big_each
            while left > 0:
                left -= f.write(block[:min(left, len(block))])


def count(wt: str) -> tuple[int, int]:
    """Files and bytes, git's object files aside (those made after a
    checkpoint stay after its restore), and the refs restores keep of the
    values they moved (``refs/dispatchd/displaced``: made by them)."""
    files = size = 0
    for dirpath, dirs, names in os.walk(wt):
        if dirpath == os.path.join(wt, ".git"):
            dirs.remove("objects")
        if dirpath == os.path.join(wt, ".git", "refs") and "dispatchd" in dirs:
            dirs.remove("dispatchd")
        for n in names:
            files += 1
            size += os.lstat(os.path.join(dirpath, n)).st_size
    return files, size


def step(name: str, fn: object) -> object:
    t = time.perf_counter()
    out = fn()  # type: ignore[operator]
    print(f"{name:<58} {time.perf_counter() - t:8.3f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="a directory on the file system to measure (made, then removed)")
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--node-mib", type=int, default=1024)
    args = ap.parse_args()
    base = os.path.abspath(args.dir)
    wt, state = os.path.join(base, "wt"), os.path.join(base, "state")
    os.makedirs(state, exist_ok=True)
    try:
        make_worktree(wt, args.files, args.node_mib)
        files, size = count(wt)
        fs = subprocess.run(["stat", "-f", "-c", "%T", base], capture_output=True, text=True).stdout.strip()
        store = checkpoints.Store(state, os.path.join(state, "keep"))
        print(f"worktree: {files} files, {size / (1 << 30):.2f} GiB; file system {fs}; "
              f"reflink clones: {'yes' if checkpoints.reflinks(state, wt) else 'no'}")
        policy = Checkpoints()
        subprocess.run(["sync", "-f", wt], check=True)  # the worktree just written is on the disk before any step
        step("(reference: cp -a --reflink=auto of the worktree, then sync)", lambda: subprocess.run(
            f"cp -a --reflink=auto {wt} {base}/ref && sync -f {base}/ref", shell=True, check=True))
        treewalk.remove_tree(os.path.join(base, "ref"))
        step("(reference: the walk alone, 10,000 files)", lambda: checkpoints.list_tree(wt, Checkpoints()))
        time.sleep(checkpoints.RACY_NS / 1e9)  # what was just written is not "racy" for the second checkpoint
        first = step("checkpoint, first (every file cloned or copied)", lambda: store.take("s", wt, policy))
        print(f"  copied {first.copied_bytes / (1 << 20):.0f} MiB, {first.entries} entries, "  # type: ignore[attr-defined]
              f"{first.objects} git object files kept")  # type: ignore[attr-defined]
        second = step("checkpoint, again, nothing changed (copies shared)", lambda: store.take("s", wt, policy))
        print(f"  copied {second.copied_bytes} bytes")  # type: ignore[attr-defined]
        step("restore, nothing changed", lambda: store.restore("s", wt, second.id, policy))  # type: ignore[attr-defined]
        for i in range(10):  # an agent's edit: 10 files changed, 10 deleted, 10 created
            with open(os.path.join(wt, "src", "pkg0", f"mod{i}.py"), "a") as f:
                f.write("y = 2\n")
            os.unlink(os.path.join(wt, "src", "pkg1", f"mod{50 + i}.py"))
            with open(os.path.join(wt, "src", f"new{i}.py"), "w") as f:
                f.write("z = 3\n")
        step("restore, 10 edited + 10 deleted + 10 created", lambda: store.restore("s", wt, second.id, policy))  # type: ignore[attr-defined]
        third = step("checkpoint after that restore (30 copied)", lambda: store.take("s", wt, policy))
        print(f"  copied {third.copied_bytes} bytes")  # type: ignore[attr-defined]
        subprocess.run(["git", "commit", "-qam", "x", "--allow-empty"], cwd=wt, check=True, env={
            **os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@x", "GIT_COMMITTER_NAME": "b",
            "GIT_COMMITTER_EMAIL": "b@x"})
        step("restore after a git commit", lambda: store.restore("s", wt, third.id, policy))  # type: ignore[attr-defined]
        step("(rm -rf node_modules, as an agent might)", lambda: shutil.rmtree(os.path.join(wt, "node_modules")))
        step("restore, node_modules deleted (every byte back)", lambda: store.restore("s", wt, third.id, policy))  # type: ignore[attr-defined]
        assert count(wt) == (files, size), "the restore did not bring everything back"
        # What a client's restore adds (requests.handle): the worktree kept first, as a checkpoint and as
        # plain files past the session (preimages: a hard link a file, within keptsize's one budget), and
        # the total kept there, for the reply. Without fsync (the policy's limits.fsync = false): the
        # file system's flushes (seconds on a busy disk) would hide what the look at the kept ones costs.
        def as_a_request(cid: str) -> object:
            with open(os.path.join(wt, "src", "pkg0", "mod0.py"), "a") as f:
                f.write("w = 4\n")  # an agent's edit since
            before = store.take("s", wt, policy, fsync=False, spare=cid).id
            kept, total = store.keep_before("s", wt, before, cid, fsync=False)
            store.restore("s", wt, cid, policy, fsync=False, kept=kept)
            return total
        for i in range(KEPT):
            as_a_request(third.id)  # type: ignore[attr-defined]
        kept_dir = os.path.join(state, "before-restore")
        step(f"restore as a request does, {KEPT} kept there", lambda: as_a_request(third.id))  # type: ignore[attr-defined]
        # Its parts that depend on what is kept there:
        step(f"  a sweep of the {KEPT + 1} kept there (each about.json read)", lambda: preimages.sweep(kept_dir))
        step("  a look at them (the total, as a reply or status gives it)", store.kept_sizes.report)
        shutil.rmtree(os.path.join(kept_dir, sorted(os.listdir(kept_dir))[0]))  # the oldest, by the user
        step("  the first look after one was removed by hand", store.kept_sizes.report)
    finally:
        treewalk.remove_tree(base)


if __name__ == "__main__":
    main()
