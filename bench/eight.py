"""8 clients calling read_file as fast as they can, beside 8 bare pairs:
calls a second and the CPU a call of every process of the run, round by
round (``./scripts/bench``'s 8-client rows alone, with longer windows).

For an A/B of two trees, run it from two checkouts by turns in the same
minutes (the machine's phase moves both figures; compare the rounds that
ran next to each other). See docs/performance.md.

    ./scripts/bench --eight [--seconds S] [--rounds N] [--shared]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import dispatch  # noqa: E402
from bench import BareClient, Clients, bench_dir, ordinary_user, start_daemon, stop_daemon, threads_for, user_cpu  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds a window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shared", action="store_true", help="and 8 threads sharing one session, as a third row")
    args = ap.parse_args()
    if not ordinary_user("eight"):
        return 2
    tmp = bench_dir("eight", home=True)
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the daemon's socket, the worktree: nothing left in the home
    return 0


def run(args: argparse.Namespace, tmp: str) -> None:
    daemon, sock = start_daemon(tmp)
    wt = os.path.join(tmp, "wt")
    os.mkdir(wt)
    Path(wt, "f4k.txt").write_text(("0123456789abcdef" * 4 + "\n") * 63)  # as ./scripts/bench's
    many = BareClient(tmp, "bare-many.sock", forking=True)
    clients = Clients(8, sock, wt, many.path)
    shared = dispatch.connect(sock) if args.shared else None
    read = shared.open_session(wt, network=False).registry.get("read_file") if shared else None
    try:
        for kind in ("read", "bare"):  # warm up
            clients.run(8, kind, "for", 0.5)
        for n in range(args.rounds):
            row = []
            for kind in ("bare", "read"):
                before = user_cpu()
                calls = sum(clients.run(8, kind, "for", args.seconds))
                after = user_cpu()
                spent = {pid: after[pid] - before[pid] for pid in after.keys() & before.keys()}
                ours = sum(spent.get(p.pid, 0) for p in clients.procs)
                tick = os.sysconf("SC_CLK_TCK") * max(calls, 1) / 1e6  # ticks a call -> µs
                row.append(f"{kind} {calls / args.seconds:8,.0f}/s {sum(spent.values()) / tick:5.1f} µs a call "
                           f"(clients {ours / tick:4.1f}, servers {(sum(spent.values()) - ours) / tick:4.1f})")
            if read is not None:
                before = user_cpu()
                calls = threads_for(8, lambda: read.call({"path": "f4k.txt"}), args.seconds)
                after = user_cpu()
                spent = {pid: after[pid] - before[pid] for pid in after.keys() & before.keys()}
                tick = os.sysconf("SC_CLK_TCK") * max(calls, 1) / 1e6
                ours = spent.get(os.getpid(), 0)
                row.append(f"shared {calls / args.seconds:8,.0f}/s {sum(spent.values()) / tick:5.1f} µs a call "
                           f"(client {ours / tick:4.1f}, server {(sum(spent.values()) - ours) / tick:4.1f})")
            print(f"round {n + 1}: " + "   ".join(row), flush=True)
    finally:
        if shared is not None:
            shared.close()
        clients.close()
        many.close()
        stop_daemon(daemon)


if __name__ == "__main__":
    sys.exit(main())
