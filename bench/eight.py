"""8 client processes calling read_file as fast as they can through the
public client, beside 8 bare request/response pairs: calls a second and the
CPU a call, round by round, the two interleaved in the same minutes.

Each client process does what a user's program does: ``dispatch.connect()``,
``client.open_session(wt)``, then calls ``read_file`` and reads the
Result's ``output``, in one of the public spellings:

- ``definition``: ``read = session.registry.get("read_file")`` once, then
  ``read.call({"path": ...})`` (the contract's example);
- ``registry``: ``session.registry.call("read_file", {"path": ...})`` (the
  registry's gate: the tool looked up, approval asked where its risk needs it);
- ``bare``: the floor, a ``CallTool`` frame to a process of its own that
  answers a 4 KiB ``ToolReply`` (msgspec frames, no dispatchd code).

The CPU a call counts only this run's processes (this bench, its daemon and
everything under it, the clients, the bare servers), by /proc; other work
on the machine moves the calls a second, not that. ``2 / CPU a call`` is
what the 2-CPU machine would reach with nothing else running.

    ./scripts/bench --eight [--seconds S] [--rounds N] [--kinds bare,definition,registry] [--shared]
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import dispatch  # noqa: E402
from bench import (  # noqa: E402
    BareClient,
    BareConnection,
    bench_dir,
    descendants,
    ordinary_user,
    start_daemon,
    stop_daemon,
    threads_for,
)

KINDS = ("bare", "definition", "registry")
PARAMS = {"path": "f4k.txt"}
BODY = ("0123456789abcdef" * 4 + "\n") * 63  # as ./scripts/bench's: 4,095 bytes


def _client(pipe: multiprocessing.connection.Connection, sock: str, wt: str, bare_path: str) -> None:
    """One client: a session of its own through the public client, and a
    bare connection of its own; runs the kind the parent asks, all clients
    starting at the time the parent sets (CLOCK_MONOTONIC is one clock)."""
    with dispatch.connect(sock) as client:
        session = client.open_session(wt, network=False)
        tools = session.registry
        read = tools.get("read_file")
        bare = BareConnection(bare_path)

        def by_definition() -> None:
            result = read.call(PARAMS)
            if not result.is_success:  # a failure is fast: it would count the wrong thing
                raise SystemExit(f"eight: read_file failed: {result.error}")
            result.output  # noqa: B018  (what a user reads)

        def by_registry() -> None:
            result = tools.call("read_file", PARAMS)
            if not result.is_success:
                raise SystemExit(f"eight: read_file failed: {result.error}")
            result.output  # noqa: B018

        calls: dict[str, Callable[[], None]] = {"bare": bare.call, "definition": by_definition,
                                                "registry": by_registry}
        first = read.call(PARAMS)
        # The same text the file holds, numbered: the public client's results are the real ones.
        assert first.is_success and first.output is not None and first.output.count("\n") >= 62, first
        for fn in calls.values():
            for _ in range(20):
                fn()
        pipe.send("ready")
        while True:
            order = pipe.recv()
            if order is None:
                break
            kind, seconds, start_at = order
            fn = calls[kind]
            fn()  # a session asleep since the last row wakes outside the window
            while time.monotonic() < start_at:
                time.sleep(0.0005)
            n, end = 0, start_at + seconds
            while time.monotonic() < end:
                fn()
                n += 1
            pipe.send(n)
        session.close()


class Clients:
    def __init__(self, n: int, sock: str, wt: str, bare_path: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for _ in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(theirs, sock, wt, bare_path), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def run(self, kind: str, seconds: float) -> int:
        start_at = time.monotonic() + 0.1
        for pipe in self.pipes:
            pipe.send((kind, seconds, start_at))
        return sum(pipe.recv() for pipe in self.pipes)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(10)


def our_cpu(roots: list[int]) -> dict[int, int]:
    """Clock ticks (user and system) of ``roots`` and their descendants, by pid."""
    ticks = {}
    for pid in {p for root in roots for p in (root, *descendants(root))}:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        ticks[pid] = int(fields[11]) + int(fields[12])
    return ticks


def measured(roots: list[int], clients: set[int], run: Callable[[], int], seconds: float) -> tuple[str, float, float]:
    """``run()``'s calls a second, and the CPU a call (µs) in all and of the clients."""
    before = our_cpu(roots)
    calls = run()
    after = our_cpu(roots)
    spent = {pid: after[pid] - before[pid] for pid in after.keys() & before.keys()}
    tick = os.sysconf("SC_CLK_TCK") * max(calls, 1) / 1e6  # ticks a call -> µs
    ours = sum(t for pid, t in spent.items() if pid in clients) / tick
    total = sum(spent.values()) / tick
    return (f"{calls / seconds:8,.0f}/s {total:5.1f} µs a call (clients {ours:4.1f}, servers {total - ours:4.1f})",
            calls / seconds, total)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds a window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"which of {', '.join(KINDS)}, in this order")
    ap.add_argument("--shared", action="store_true", help="and 8 threads sharing one session, as a last row")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}")
    if not ordinary_user("eight"):
        return 2
    tmp = bench_dir("eight", home=True)
    try:
        run(args, kinds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the daemon's socket, the worktree: nothing left in the home
    return 0


def run(args: argparse.Namespace, kinds: list[str], tmp: str) -> None:
    daemon, sock = start_daemon(tmp)
    wt = os.path.join(tmp, "wt")
    os.mkdir(wt)
    Path(wt, "f4k.txt").write_text(BODY)
    many = BareClient(tmp, "bare-many.sock", forking=True)
    clients = Clients(8, sock, wt, many.path)
    shared = dispatch.connect(sock) if args.shared else None
    read = shared.open_session(wt, network=False).registry.get("read_file") if shared else None
    roots, procs = [os.getpid()], {p.pid for p in clients.procs if p.pid is not None}
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 CPUs; the CPU a call counts this run's processes only)",
          flush=True)
    sums: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for kind in kinds:  # warm up
            clients.run(kind, 0.5)
        for n in range(args.rounds):
            row = []
            for kind in kinds if n % 2 == 0 else kinds[::-1]:  # each kind first in turn
                text, rate, cpu = measured(roots, procs, lambda: clients.run(kind, args.seconds), args.seconds)
                sums[kind].append(cpu)
                row.append(f"{kind} {text}")
            if read is not None:
                text, _, _ = measured(roots, {os.getpid()},
                                      lambda: threads_for(8, lambda: read.call(PARAMS), args.seconds), args.seconds)
                row.append(f"shared {text}")
            print(f"round {n + 1}:\n  " + "\n  ".join(row), flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        for kind, cpus in sums.items():
            best = min(cpus)
            print(f"{kind:10s} least CPU a call {best:5.1f} µs -> {2e6 / best:8,.0f}/s on 2 idle CPUs")
    finally:
        if shared is not None:
            shared.close()
        clients.close()
        many.close()
        stop_daemon(daemon)


if __name__ == "__main__":
    sys.exit(main())
