"""8 clients' read_file calls against the same tool server code in different places.

Where a sandboxed call's extra cost comes from, measured: each of N client
processes (a session of a real daemon each, as ``./scripts/bench``'s 8-client
row) also runs the unsandboxed tool server of ``bench/callpath.py`` (the real
``Channel``/``_Server``, no sandbox) three ways, and a bare echo pair:

- ``sandbox``: the session's tool server (confined; in the fork server's
  session, so one scheduler autogroup for every session's tool server);
- ``same group``: forked by the client (same session, same autogroup);
- ``own session``: forked by the client, then ``setsid`` (an autogroup of its
  own, as a session's tool server had before it shared the fork server's);
- ``one other session``: forked by one ``setsid`` process for every client
  (one autogroup for all tool servers, not the clients');
- ``bare``: ``bench.py``'s echo pair (a process per connection), forked by
  the benchmark (the clients' session); ``bare own``: the same echo server
  started in a session of its own (``setsid``), as the daemon is.

Rows are interleaved round by round. Per row: calls/s in all, CPU a call
(every process of the run, from /proc), times scheduled in a call (every
thread's ``schedstat``), and our share of the machine's CPU time (the rest
went to whatever else ran). See docs/performance.md.

    python bench/schedgroups.py [--clients 8] [--rounds 3] [--seconds 1]    (as an ordinary user)
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (puts the repository on the path)
import callpath  # noqa: E402
import dispatch  # noqa: E402

ROWS = {"sandbox": "sandbox (a session each)", "same": "same group (forked by the client)",
        "own": "own session (setsid, no sandbox)", "shared": "one other session (all servers)",
        "bare": "bare echo pairs", "bare_own": "bare echo pairs, server's own session"}


def _factory(path: str) -> None:
    """A process in a session of its own that forks a tool server for each
    socket sent to it: the ``shared`` row's servers, one autogroup for all."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    if os.fork():
        listener.close()
        return
    os.setsid()
    while True:
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        conn.close()
        if not fds:
            os._exit(0)
        if os.fork() == 0:
            listener.close()
            callpath._tool_server(socket.socket(fileno=fds[0]), msg.decode())
            os._exit(0)
        os.close(fds[0])


def _read(sock: socket.socket) -> Callable[[], object]:
    read = callpath._session(sock).registry.get("read_file")
    return lambda: read.call({"path": "f4k.txt"})


def _own_session_server(sock: socket.socket, wt: str) -> None:
    os.setsid()
    callpath._tool_server(sock, wt)


class _BareOwnSession(bench.BareClient):
    """``bench.BareClient``'s forking echo server, started in a session of its own."""

    def __init__(self, tmp: str) -> None:
        self.path = os.path.join(tmp, "bare-own.sock")
        self.proc = subprocess.Popen([sys.executable, "-c", bench._ECHO_SERVER, self.path, str(bench.REPO), "2"],
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.forking = True
        self.frames = self.connect(self.path)
        self.n = 0


def _client(pipe: multiprocessing.connection.Connection, sock: str, wt: str, bare: str, factory: str,
            bare_own: str) -> None:
    with dispatch.connect(sock) as client:
        session = client.open_session(wt, network=False)
        read = session.registry.get("read_file")
        calls: dict[str, Callable[[], object]] = {"sandbox": lambda: read.call({"path": "f4k.txt"}),
                                                  "bare": bench.BareConnection(bare).call,
                                                  "bare_own": bench.BareConnection(bare_own).call}
        same, _ = callpath._spawn(callpath._tool_server, wt)
        own, _ = callpath._spawn(_own_session_server, wt)
        ours, theirs = socket.socketpair()
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(factory)
            socket.send_fds(c, [wt.encode()], [theirs.fileno()])
        theirs.close()
        calls |= {"same": _read(same), "own": _read(own), "shared": _read(ours)}
        for fn in calls.values():
            for _ in range(50):
                fn()
        pipe.send("ready")
        while (order := pipe.recv()) is not None:
            kind, start_at, seconds = order
            fn, n = calls[kind], 0
            while time.monotonic() < start_at:
                time.sleep(0.0005)
            while time.monotonic() < start_at + seconds:
                fn()
                n += 1
            pipe.send(n)
        session.close()
    os._exit(0)  # the forked servers see their channels close


def _ours() -> tuple[float, int]:
    """CPU seconds and times scheduled in, of this process and every descendant."""
    tck, cpu, slices = os.sysconf("SC_CLK_TCK"), 0.0, 0
    for pid in [os.getpid(), *bench.descendants(os.getpid())]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tck
            for tid in os.listdir(f"/proc/{pid}/task"):
                slices += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[2])
        except OSError:
            continue  # ended meanwhile
    return cpu, slices


def _machine() -> float:
    """CPU seconds the machine has had (every CPU, busy or idle)."""
    with open("/proc/stat", encoding="ascii") as f:
        return sum(int(x) for x in f.readline().split()[1:9]) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="only these rows")
    args = ap.parse_args()
    if not bench.ordinary_user("schedgroups"):
        return 2
    tmp = bench.bench_dir("groups", home=True)
    wt = os.path.join(tmp, "wt")
    os.mkdir(wt)
    Path(wt, "f4k.txt").write_text(("0123456789abcdef" * 4 + "\n") * 63)  # as ./scripts/bench's
    factory = os.path.join(tmp, "factory.sock")
    _factory(factory)
    daemon, sock = bench.start_daemon(tmp)
    bare = bench.BareClient(tmp, "bare.sock", forking=True)
    bare_own = _BareOwnSession(tmp)
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    rows: dict[str, dict[str, list[float]]] = {k: {"rate": [], "cpu": [], "switches": [], "share": []}
                                               for k in ROWS if k in args.rows}
    try:
        for _ in range(args.clients):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(theirs, sock, wt, bare.path, factory, bare_own.path), daemon=True)
            proc.start()
            pipes.append(ours)
            procs.append(proc)
        for pipe in pipes:
            assert pipe.recv() == "ready"
        for _ in range(args.rounds):
            for kind, row in rows.items():
                (c0, s0), m0 = _ours(), _machine()
                start_at = time.monotonic() + 0.05
                for pipe in pipes:
                    pipe.send((kind, start_at, args.seconds))
                n = sum(pipe.recv() for pipe in pipes)
                (c1, s1), m1 = _ours(), _machine()
                row["rate"].append(n / args.seconds)
                row["cpu"].append((c1 - c0) / n)
                row["switches"].append((s1 - s0) / n)
                row["share"].append((c1 - c0) / (m1 - m0))
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(10)
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(factory)
            c.send(b"q")
        bare.close()
        bare_own.close()
        bench.stop_daemon(daemon, 10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.clients} clients, medians of {args.rounds} rounds of {args.seconds:g} s; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'':40s} {'calls/s':>9s} {'CPU a call':>11s} {'switches':>9s} {'our share':>10s}")
    for kind in rows:
        label = ROWS[kind]
        m: dict[str, Any] = {k: statistics.median(v) for k, v in rows[kind].items()}
        print(f"{label:40s} {m['rate']:9,.0f} {m['cpu'] * 1e6:8.1f} µs {m['switches']:9.2f} {m['share']:9.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
