"""The per-call path of ``read_file``, both sides, without a sandbox or a daemon.

The real client path (``Registry.get("read_file").call`` through
``Session.call_tool`` and ``_transport.Connection``) against the real tool server
(``Channel``/``_Server``, forked, over a socketpair), beside the bare pair
(``FrameSocket`` echo): what our layers cost over the frames. Timings on a
shared VM move by 2x from one run to the next; instructions do not, so
``--count`` counts them with callgrind (the difference of two run lengths,
per process). See docs/performance.md.

    python bench/callpath.py [--calls N] [--blocks N]   p50 and CPU a call, alternated with the bare pair
    python bench/callpath.py --count [read|registry|bare]   instructions a call, client and server (valgrind)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "client")]

from dispatch import _lost, _session as dc  # noqa: E402
from dispatch.tools import Registry  # noqa: E402
from dispatchd import protocol  # noqa: E402
from dispatchd.policy import Limits  # noqa: E402
from dispatchd.catalogue import schemas_for  # noqa: E402
from dispatchd.worker.fork_server import fork_serving  # noqa: E402

_TOOLS = ["read_file", "write_file", "shell_exec"]


def _tool_server(sock: socket.socket, wt: str) -> None:
    from dispatchd.worker import tool_server

    # A plan that may sleep (can_sleep), as a real session's: its channels read with SO_RCVTIMEO.
    plan = types.SimpleNamespace(paths=types.SimpleNamespace(worktree=wt, scratch=wt + "/.scratch"),
                                 limits=Limits(), env={}, writable=True, tools=_TOOLS,
                                 namespaces=types.SimpleNamespace(user=True, mount=True, pid=True),
                                 mounts=types.SimpleNamespace(root="minimal"), checkpoint_writes=False)
    os.makedirs(plan.paths.scratch, exist_ok=True)
    server = tool_server._Server(plan, None)  # type: ignore[arg-type]
    if os.environ.get("CALLPATH_BY_PATH"):
        # Under valgrind (--count): its 3.19 does not know openat2 (ENOSYS),
        # so read_file runs by path, without the root fd (docs/architecture.md,
        # "Reads by descriptor"): a few thousand instructions more than the real call.
        server.ctx = dataclasses.replace(server.ctx, root_fd=-1)
    server.add_channel(sock)
    while threading.active_count() > 1:  # until the channel's thread ends (valgrind then writes its counts)
        time.sleep(0.02)


def _bare_server(sock: socket.socket, wt: str) -> None:
    frames, body = protocol.FrameSocket(sock), "x" * 4096
    while (req := frames.recv(protocol.channel_request_decoder)) is not None:
        frames.send(protocol.ToolReply(id=req.id, success=True, output=body, metadata={"path": "f"}))


def _spawn(serve: Any, wt: str) -> tuple[socket.socket, int]:
    pid, ours = fork_serving(lambda theirs: serve(theirs, wt), exit_code=0)
    return ours, pid


def _session(sock: socket.socket) -> dc.Session:
    """A Session on ``sock`` without a daemon: its fields as ``_attach`` sets them."""
    s = object.__new__(dc.Session)
    s._client = types.SimpleNamespace(call_margin=30.0)  # type: ignore[assignment]
    s._info = types.SimpleNamespace(limits={"command_timeout_s": 120.0}, id="bench")  # type: ignore[assignment]
    s._owned, s._own_limit, s._lock = False, (None, 0.0), threading.Lock()
    s._channel = _lost.Channel(sock, 1)  # the open's sandbox
    s._tools = [protocol.ToolSchema(**x) for x in schemas_for(_TOOLS)]
    s._schemas = {t.name: t for t in s._tools}
    s._in_flight, s._in_flight_lock = {}, threading.Lock()
    s.registry = Registry((checked._with_func(s._remote_call(checked.name))
                           for checked in dc._checked_tools(s._tools)), output_budget=16384)
    return s


def _caller(kind: str, wt: str) -> tuple[Any, int, socket.socket]:
    if kind in ("read", "registry"):
        sock, pid = _spawn(_tool_server, wt)
        registry = _session(sock).registry
        read = registry.get("read_file")
        params = {"path": "f4k.txt"}

        def call() -> None:
            # "registry": the registry's gate, Registry.call; "read": a held Definition's call.
            result = registry.call("read_file", params) if kind == "registry" else read.call(params)
            if not result.is_success:  # a failing path would count the wrong thing
                raise SystemExit(f"callpath: read_file failed: {result.error}")

        return call, pid, sock
    sock, pid = _spawn(_bare_server, wt)
    frames = protocol.FrameSocket(sock)

    def bare() -> None:
        frames.send(protocol.CallTool(id=1, tool="read_file", params={"path": "f"}))
        frames.recv(protocol.channel_reply_decoder)

    return bare, pid, sock


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timings(wt: str, calls: int, blocks: int) -> None:
    callers = {kind: _caller(kind, wt) for kind in ("read", "bare")}
    rows: dict[str, dict[str, list[float]]] = {k: {"p50": [], "client": [], "server": []} for k in callers}
    for fn, _, _ in callers.values():
        for _ in range(500):
            fn()
    for _ in range(blocks):
        for kind, (fn, pid, _) in callers.items():  # alternated, block by block
            times = []
            s0, c0 = _cpu_of(pid), time.thread_time()
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            c1, s1 = time.thread_time(), _cpu_of(pid)
            rows[kind]["p50"].append(statistics.median(times))
            rows[kind]["client"].append((c1 - c0) / calls)
            rows[kind]["server"].append((s1 - s0) / calls)
    for kind, row in rows.items():
        p50, client, server = (statistics.median(row[k]) * 1e6 for k in ("p50", "client", "server"))
        print(f"{kind:5s} p50 {p50:6.1f} µs   CPU a call: client {client:5.1f} µs, server {server:5.1f} µs "
              "(the server's in clock ticks: coarse)")
    # Every socket closed before any wait: the bare server, forked second,
    # holds the read server's client end too, so it must end first.
    for _, _, sock in callers.values():
        sock.close()
    for _, pid, _ in reversed(callers.values()):
        os.waitpid(pid, 0)


def loop(wt: str, kind: str, n: int) -> None:
    fn, pid, sock = _caller(kind, wt)
    print(f"server pid {pid}", flush=True)  # for count(): pids wrap, so their order cannot say which is which
    for _ in range(200 + n):
        fn()
    sock.close()
    os.waitpid(pid, 0)


def count(kind: str) -> None:
    """Instructions a call: callgrind over ``--loop`` at two lengths, per process."""
    if shutil.which("valgrind") is None:
        sys.exit("callpath: --count needs valgrind")
    totals = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (300, 1300):
            out = os.path.join(tmp, str(n))
            os.mkdir(out)
            run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p",
                                  sys.executable, __file__, "--loop", kind, str(n)],
                                 check=True, capture_output=True, text=True,
                                 # the same dicts' layouts each run; read_file by path (valgrind lacks openat2)
                                 env={**os.environ, "PYTHONHASHSEED": "0", "CALLPATH_BY_PATH": "1"})
            server = f"{out}/cg.{run.stdout.split('server pid ', 1)[1].split()[0]}"
            files = sorted(glob.glob(f"{out}/cg.*"), key=lambda p: p == server)  # the client's, then the server's
            totals.append([next(int(line.split()[1]) for line in open(f) if line.startswith(("summary:", "totals:")))
                           for f in files])
    (c0, s0), (c1, s1) = totals
    print(f"{kind}: instructions a call: client {(c1 - c0) / 1000:,.0f}, server {(s1 - s0) / 1000:,.0f}"
          + (" (read_file by path: valgrind lacks openat2)" if kind != "bare" else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--count", nargs="?", const="read", choices=("read", "registry", "bare"))
    ap.add_argument("--loop", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.count:
        count(args.count)
        return 0
    with tempfile.TemporaryDirectory() as wt:
        Path(wt, "f4k.txt").write_text(("0123456789abcdef" * 4 + "\n") * 63)  # as ./scripts/bench's
        if args.loop:
            loop(os.path.realpath(wt), args.loop[0], int(args.loop[1]))
        else:
            timings(os.path.realpath(wt), args.calls, args.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
