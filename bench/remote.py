"""What a bridge adds to a call: read_file local, through a local bridge, and through ssh to localhost.

    ./scripts/bench --remote [N]      (or: .venv/bin/python bench/remote.py [N])

Starts its own daemon, and an sshd of this user on 127.0.0.1 (tests/sshd.py).
Opens one session on the same worktree three ways: a local client; a client
whose host command runs ``dispatch bridge`` as a local process (the link's
cost alone: two pumps and two pipes); and a client through ``ssh`` to that
sshd (the link plus ssh's encryption and its two processes). Then N rounds
(default 300), each a ``read_file`` of a small file on every one of the three
in turn (interleaved, so the shared machine's noise falls on all alike), and
20 rounds of a 4 MiB ``read_file`` (a large reply: the window and the pipes).
Prints p50 and p99 of each and what the bridge adds at the median.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import fmt, pct, run_small, start_daemon, stop_daemon  # noqa: E402  (and the repository on the path)

import dispatch  # noqa: E402
from tests.sshd import Sshd  # noqa: E402


def main(rounds: int, tmp: str) -> int:
    daemon, sock = start_daemon(tmp)
    sshd = Sshd(Path(tmp, "sshd"), f"{os.path.dirname(sys.executable)}:/usr/bin:/bin")
    wt = Path(tmp, "wt")
    wt.mkdir()
    Path(wt, "small.txt").write_text("hello\n" * 20)
    Path(wt, "big.txt").write_text(("x" * 1023 + "\n") * 4096)
    bridge = shlex.join([sys.executable, "-m", "dispatch.cli", "--no-autostart", "bridge", "--socket", sock])
    ssh = shlex.join(["ssh", "-F", str(sshd.client_config), "-T", "127.0.0.1",
                      os.path.join(os.path.dirname(sys.executable), "dispatch"), "--no-autostart", "bridge",
                      "--socket", sock])
    clients = {"local": dispatch.connect(sock), "bridge": dispatch.connect(host_command=bridge),
               "ssh": dispatch.connect(host_command=ssh)}
    try:
        sessions = {name: c.open_session(str(wt)) for name, c in clients.items()}
        reads: dict[str, Callable[[dict[str, object]], dispatch.Result]] = {
            name: s.registry.get("read_file").call for name, s in sessions.items()}
        small: dict[str, list[float]] = {name: [] for name in reads}
        big: dict[str, list[float]] = {name: [] for name in reads}
        for name, read in reads.items():  # warm: first calls, caches
            for _ in range(20):
                assert read({"path": "small.txt"}).is_success
        for _ in range(rounds):
            for name, read in reads.items():
                t0 = time.perf_counter()
                r = read({"path": "small.txt"})
                small[name].append(time.perf_counter() - t0)
                assert r.is_success, r.error
        for _ in range(20):
            for name, read in reads.items():
                t0 = time.perf_counter()
                r = read({"path": "big.txt"})
                big[name].append(time.perf_counter() - t0)
                assert r.is_success, r.error
        print(f"read_file, {rounds} rounds (small file) and 20 (4 MiB), interleaved")
        base_small, base_big = pct(small["local"], 0.5), pct(big["local"], 0.5)
        for name in reads:
            s50, b50 = pct(small[name], 0.5), pct(big[name], 0.5)
            added = "" if name == "local" else f"   adds {fmt(s50 - base_small).strip()} / {fmt(b50 - base_big).strip()}"
            print(f"  {name:7} small p50 {fmt(s50)}  p99 {fmt(pct(small[name], 0.99))}   "
                  f"4 MiB p50 {fmt(b50)}  p99 {fmt(pct(big[name], 0.99))}{added}")
        for s in sessions.values():
            s.close()
    finally:
        for c in clients.values():
            c.close()
        sshd.stop()
        stop_daemon(daemon, 15)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_small("remote", __doc__, 300, main))
