"""Sessions opened back to back, as an agent platform opens them: open ->
first call -> close on one worktree, each session closed before the next
opens, alternating the network (off, on) and the first call (read_file,
shell_exec true), through the public client library.

    python bench/backtoback.py [--rounds 40] [--files 2000]

Starts its own daemon (the default pool of sandboxes made ahead) on a
temporary socket, with a worktree that is a git repository of --files
files. Prints p50 and p99 in milliseconds of: open to the first call's
answer, the close, and, as the baseline of the same run, a bare Unix-socket
round trip of the daemon's (a status request).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dispatch  # noqa: E402
from bench import pct, start_daemon, stop_daemon  # noqa: E402


def make_worktree(path: str, files: int) -> None:
    os.makedirs(path)
    for i in range(files):
        d = os.path.join(path, f"d{i % 40}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i}.py"), "w") as f:
            f.write(f"x = {i}\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@x", GIT_COMMITTER_NAME="b", GIT_COMMITTER_EMAIL="b@x")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=path, check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--files", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wt = os.path.join(tmp, "wt")
        make_worktree(wt, args.files)
        proc, sock = start_daemon(tmp)
        try:
            rows: dict[str, list[float]] = {}
            with dispatch.connect(sock) as client:
                for network in (False, True):  # warm the pool's kinds
                    client.open_session(wt, network=network).close()
                for i in range(args.rounds * 4):
                    network = bool(i % 2)
                    first = "read_file" if (i // 2) % 2 == 0 else "shell_exec"
                    t0 = time.perf_counter()
                    s = client.open_session(wt, network=network)
                    if first == "read_file":
                        r = s.registry.call("read_file", {"path": "d0/f0.py"})
                    else:
                        r = s.registry.call("shell_exec", {"command": "true"})
                    t1 = time.perf_counter()
                    assert r.is_success, r.error
                    s.close()
                    t2 = time.perf_counter()
                    key = f"{'on' if network else 'off'}/{first}"
                    rows.setdefault(f"open -> first {key}", []).append(t1 - t0)
                    rows.setdefault(f"close ({'on' if network else 'off'})", []).append(t2 - t1)
                    t = time.perf_counter()
                    client.status()
                    rows.setdefault("baseline: status round trip", []).append(time.perf_counter() - t)
            width = max(len(k) for k in rows)
            print(f"{'pattern':<{width}}  {'p50 ms':>8}  {'p99 ms':>8}  n")
            for key, xs in sorted(rows.items()):
                print(f"{key:<{width}}  {pct(xs, 0.5) * 1e3:8.2f}  {pct(xs, 0.99) * 1e3:8.2f}  {len(xs)}")
        finally:
            stop_daemon(proc)


if __name__ == "__main__":
    main()
