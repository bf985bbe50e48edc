"""dispatchd benchmark: what confinement costs, as ratios against baselines
measured in the same run (the machines are shared and noisy; only ratios
carry over).

    ./scripts/bench            (or: .venv/bin/python bench/bench.py [--rounds N])

It starts its own daemon on a temporary socket, as the user who runs it (not
root), and prints one table:

- read_file of a 4 KiB file through ``dispatch`` (client -> worker, one hop)
  beside a bare request/response between two Python processes over a Unix
  socket (same framing and codec, 4 KiB reply): the IPC floor;
- shell_exec of ``true`` beside ``subprocess.run(["bash", "-c", "true"])``
  with no sandbox, also with streaming asked for (``on_output``);
- the first byte's latency when streaming: from the moment a command writes
  (bash's ``$EPOCHREALTIME`` just before ``printf``) to the client's
  ``on_output`` callback (wall clock of one machine), and how long a cancel
  of a running ``sleep`` takes to come back as a cancelled Result;
- opening a session (until every protection is in force), and switching its
  network (the sandbox is replaced). With ``--cgroup DIR`` (a delegated cgroup
  v2 directory; ``./scripts/bench`` run as root makes one) the daemon gives
  each session a cgroup, and the open includes making and joining it;
- opening a session with network "domains" (its namespace, the proxy's
  listener handed to the daemon) beside the plain open, and a 16 MiB download
  through the proxy (curl in the session) beside the same curl unsandboxed,
  from a local HTTP server (the daemon's testing option lets its proxy reach
  ``bench.test`` on the host's loopback);
- with ``--log-cost``: read_file through a second daemon logging at debug (a
  line per tool call, to a file) beside the main one at info (no per-call
  line), interleaved: what per-call logging costs.

Baselines and measurements are interleaved round by round, so a noisy
neighbour slows both. This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import dispatch  # noqa: E402
from dispatchd import protocol  # noqa: E402

_ECHO_SERVER = r"""
import socket, sys
sys.path.insert(0, sys.argv[2])
from dispatchd import protocol
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1]); listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept()
frames = protocol.FrameSocket(conn)
body = "x" * 4096
while True:
    req = frames.recv(protocol.worker_decoder)
    if req is None:
        break
    frames.send(protocol.ToolReply(id=req.id, success=True, output=body, metadata={"path": "f"}))
"""


class BareClient:
    """Two Python processes, one Unix socket, msgspec frames: the floor."""

    def __init__(self, tmp: str) -> None:
        path = os.path.join(tmp, "bare.sock")
        self.proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, path, str(REPO)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        self.frames = protocol.FrameSocket(sock)
        self.n = 0

    def call(self) -> None:
        self.n += 1
        self.frames.send(protocol.CallTool(id=self.n, tool="read_file", params={"path": "f"}))
        self.frames.recv(protocol.worker_decoder)

    def close(self) -> None:
        self.frames.close()
        self.proc.wait(5)


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fmt(s: float) -> str:
    return f"{s * 1e6:8.0f} µs" if s < 1e-3 else f"{s * 1e3:8.2f} ms"


DOWNLOAD_MB = 128
_DOWNLOAD = ("import socket, sys\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])))\nn = 0\n"
             "while (d := s.recv(1 << 20)):\n    n += len(d)\nassert n == int(sys.argv[3]), n\n")


class BulkServer:
    """On the host's loopback: sends DOWNLOAD_MB to every client, then closes."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.size = DOWNLOAD_MB << 20
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        chunk = b"x" * (1 << 20)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                for _ in range(DOWNLOAD_MB):
                    conn.sendall(chunk)


def first_byte(shell: dispatch.Definition, n: int) -> list[float]:
    """Seconds from a command's write to the client's on_output, ``n`` times."""
    out = []
    for _ in range(n):
        got: list[float] = []

        def on_output(_stream: str, text: str) -> None:
            if not got:
                got.append(time.time() - float(text.split()[0]))

        shell.call({"command": 'printf "%s\\n" "$EPOCHREALTIME"; sleep 0.02'}, on_output=on_output)
        out += got
    return out


def cancel_latency(session: dispatch.Session, shell: dispatch.Definition, n: int) -> list[float]:
    """Seconds from ``session.cancel()`` to the cancelled Result of a running sleep."""
    import threading

    out = []
    for _ in range(n):
        started = threading.Event()
        done: list[float] = []

        def run() -> None:
            shell.call({"command": "echo up; sleep 100"}, on_output=lambda s, t: started.set())
            done.append(time.perf_counter())

        t = threading.Thread(target=run)
        t.start()
        started.wait(10)
        at = time.perf_counter()
        session.cancel()
        t.join(10)
        out += [d - at for d in done]
    return out


def _ok(result: dispatch.Result) -> None:
    if not result.is_success:
        raise SystemExit(f"bench: the download through the proxy failed: {result.error}")


class _BigServer:
    """16 MiB on every GET, from a thread, on the host's loopback."""

    SIZE = 16 * 1024 * 1024

    def __init__(self) -> None:
        import http.server
        import threading

        body = b"x" * self.SIZE

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_daemon(tmp: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    sock = os.path.join(tmp, "run", "d.sock")
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmp, "state"))
    log = open(os.path.join(tmp, "daemon.log"), "wb")  # noqa: SIM115 (lives as long as the daemon)
    proc = subprocess.Popen([sys.executable, "-m", "dispatchd", "--socket", sock, *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    for _ in range(400):
        if os.path.exists(sock):
            break
        time.sleep(0.025)
    return proc, sock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200, help="calls per round for the round-trip rows")
    ap.add_argument("--no-user-namespaces", action="store_true", help="benchmark the degraded mode")
    ap.add_argument("--cgroup", metavar="DIR", nargs="?", const=os.environ.get("DISPATCHD_TEST_CGROUP", ""),
                    help="per-session cgroups under DIR/bench-PID (DIR: a delegated cgroup v2 directory; "
                         "default: $DISPATCHD_TEST_CGROUP)")
    ap.add_argument("--log-cost", action="store_true",
                    help="also read_file through a daemon at --log-level debug (a log line per call)")
    args = ap.parse_args()
    if os.geteuid() == 0:
        print("bench: run as an ordinary user (dispatchd refuses root)", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="dispatchd-bench-")
    extra = ["--no-user-namespaces"] if args.no_user_namespaces else []
    extra += ["--proxy-hosts-for-testing", "bench.test=127.0.0.1"]
    big = _BigServer()
    cgroup = ""
    if args.cgroup is not None:
        if not args.cgroup:
            print("bench: --cgroup needs a delegated cgroup v2 directory ($DISPATCHD_TEST_CGROUP is unset)",
                  file=sys.stderr)
            return 2
        for controller in Path(args.cgroup, "cgroup.controllers").read_text().split():
            try:
                Path(args.cgroup, "cgroup.subtree_control").write_text(f"+{controller}")
            except OSError:
                pass
        cgroup = os.path.join(args.cgroup, f"bench-{os.getpid()}")
        extra += ["--cgroup", cgroup]
    daemon, sock = start_daemon(tmp, *extra)
    plain = None
    if cgroup:
        # The baseline for the cost of a cgroup: the same opens, interleaved,
        # from a second daemon that uses none.
        os.mkdir(os.path.join(tmp, "plain"))
        plain, plain_sock = start_daemon(os.path.join(tmp, "plain"), "--cgroup", "off",
                                         *(["--no-user-namespaces"] if args.no_user_namespaces else []))
    wt = os.path.join(tmp, "wt")
    os.mkdir(wt)
    wt_net = os.path.join(tmp, "wt-net")
    os.mkdir(wt_net)
    Path(wt, "f4k.txt").write_text(("0123456789abcdef" * 4 + "\n") * 63)  # 4095 bytes, 63 lines
    wt_dl = os.path.join(tmp, "wt-download")  # its own: the first session holds wt's write lock
    os.mkdir(wt_dl)
    Path(wt_dl, "download.py").write_text(_DOWNLOAD)
    bulk = BulkServer()
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("bare", "read", "spawn", "shell", "shell_stream", "first_byte", "cancel",
                                     "open", "switch", "open_plain", "read_debug",
                                     "open_on", "switch_off", "download_plain", "download",
                                     "open_domains", "fetch_plain", "fetch_domains")}
    debug = None
    if args.log_cost:
        os.mkdir(os.path.join(tmp, "debug"))
        debug, debug_sock = start_daemon(os.path.join(tmp, "debug"), "--log-level", "debug", "--log-file",
                                         os.path.join(tmp, "debug", "daemon-debug.log"), *extra)
    try:
        bare = BareClient(tmp)
        with dispatch.connect(sock) as client:
            session = client.open_session(wt, network=False)
            read = session.registry.get("read_file")
            shell = session.registry.get("shell_exec")
            read_debug = None
            if debug is not None:
                debug_client = dispatch.connect(debug_sock)
                read_debug = debug_client.open_session(wt, network=False).registry.get("read_file")
            for _ in range(20):  # warm up both paths
                bare.call()
                read.call({"path": "f4k.txt"})
                if read_debug is not None:
                    read_debug.call({"path": "f4k.txt"})
            for _ in range(args.rounds):
                rows["bare"] += timed(bare.call, args.calls)
                rows["read"] += timed(lambda: read.call({"path": "f4k.txt"}), args.calls)
                if read_debug is not None:
                    rows["read_debug"] += timed(lambda: read_debug.call({"path": "f4k.txt"}), args.calls)
                rows["spawn"] += timed(lambda: subprocess.run(["bash", "-c", "true"], capture_output=True), 20)
                rows["shell"] += timed(lambda: shell.call({"command": "true"}), 20)
                rows["shell_stream"] += timed(lambda: shell.call({"command": "true"}, on_output=lambda s, t: None), 20)
                rows["first_byte"] += first_byte(shell, 5)
                rows["cancel"] += cancel_latency(session, shell, 2)
                for _ in range(3):
                    t = time.perf_counter()
                    s = client.open_session(wt)
                    rows["open"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    s.set_network(True)
                    rows["switch"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    s.set_network(False)
                    rows["switch_off"].append(time.perf_counter() - t)
                    s.close()
                    t = time.perf_counter()
                    s = client.open_session(wt, network=True)
                    rows["open_on"].append(time.perf_counter() - t)
                    s.close()
                    if not args.no_user_namespaces:  # degraded mode refuses "domains"
                        t = time.perf_counter()
                        # A worktree of its own: the session above holds the write lock on wt.
                        s = client.open_session(wt_net, network="domains", domains=[f"bench.test:{big.port}"])
                        rows["open_domains"].append(time.perf_counter() - t)
                        fetch = s.registry.get("shell_exec")
                        url = f"http://bench.test:{big.port}/"
                        cmd = {"command": f"curl -sSf -o /dev/null {url}"}
                        rows["fetch_domains"] += timed(lambda: _ok(fetch.call(cmd)), 1)
                        s.close()
                        rows["fetch_plain"] += timed(lambda: subprocess.run(
                            ["curl", "-sf", "-o", "/dev/null", f"http://127.0.0.1:{big.port}/"], check=True), 1)
                    if plain is not None:
                        with dispatch.connect(plain_sock) as other:
                            t = time.perf_counter()
                            s = other.open_session(wt)
                            rows["open_plain"].append(time.perf_counter() - t)
                            s.close()
                # A bulk download from the host's loopback: unsandboxed, then
                # through the session's stack (pasta in full mode).
                with client.open_session(wt_dl, network=True) as s:
                    host = "10.0.2.2" if s.status()["protections"]["network"].get("stack") else "127.0.0.1"
                    dl = s.registry.get("shell_exec")
                    command = f"/usr/bin/python3 download.py {host} {bulk.port} {bulk.size}"
                    t = time.perf_counter()
                    subprocess.run(["/usr/bin/python3", "download.py", "127.0.0.1", str(bulk.port), str(bulk.size)],
                                   cwd=wt_dl, check=True)
                    rows["download_plain"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    r = dl.call({"command": command, "timeout": 120})
                    rows["download"].append(time.perf_counter() - t)
                    assert r.is_success and r.metadata.get("exit_code") == 0, (r.error, r.metadata)
            mode = session.status()["protections"]["mode"]
            cgroups = client.status()["kernel"]["cgroup_delegation"]
            session.close()
        bare.close()
    finally:
        for proc in (daemon, plain, debug):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
        big.close()
        if cgroup:
            for leaf in ("daemon", ""):
                try:
                    os.rmdir(os.path.join(cgroup, leaf))
                except OSError:
                    pass

    p50 = {k: statistics.median(v) for k, v in rows.items() if v}
    print(f"dispatchd benchmark: {args.rounds} rounds, sandbox mode {mode!r}, python {sys.version.split()[0]} "
          f"({sys.executable}); per-session cgroups: {cgroups}")
    print(f"{'what':52} {'p50':>11} {'p99':>11}  ratio (p50)")
    def line(label: str, key: str, base: str | None, note: str = "") -> None:
        ratio = f"{p50[key] / p50[base]:.2f}× {note}" if base else note
        print(f"{label:52} {fmt(p50[key]):>11} {fmt(pct(rows[key], 0.99)):>11}  {ratio}")
    line("bare request/response, 2 Python processes (4 KiB)", "bare", None, "1.00× (baseline)")
    line("read_file 4 KiB through dispatch", "read", "bare", "of bare (target ≤ 2×)")
    if rows["read_debug"]:
        print(f"{'  the same, daemon logging each call (debug)':52} {fmt(p50['read_debug']):>11} "
              f"{fmt(pct(rows['read_debug'], 0.99)):>11}  {p50['read_debug'] / p50['read']:.2f}× of info; "
              f"p99 {pct(rows['read_debug'], 0.99) / pct(rows['read'], 0.99):.2f}× of info")
    line("subprocess.run(['bash','-c','true']), no sandbox", "spawn", None, "1.00× (baseline)")
    line("shell_exec 'true' through dispatch", "shell", "spawn", "of plain spawn (target ≤ 1.3×)")
    line("shell_exec 'true', streaming asked for", "shell_stream", "spawn", "of plain spawn")
    line("streaming: a command's write → client on_output", "first_byte", None, "(target: a few ms)")
    line("session.cancel() → cancelled Result (sleep)", "cancel", None, "(the kill, then the reply)")
    if rows["open_plain"]:
        line("open a session, no cgroup (baseline)", "open_plain", None, "1.00× (baseline)")
        line("open a session with its own cgroup", "open", "open_plain", "of the open without")
    else:
        line("open a session (confined, ready)", "open", None, "(target < 10 ms)")
    line("open a session, network on", "open_on", "open", "of the open with the network off")
    line("switch network off → on", "switch", "open", "of an open (network off)")
    line("switch network on → off", "switch_off", "open", "of an open (network off)")
    mbps = DOWNLOAD_MB / p50["download_plain"]
    line(f"download {DOWNLOAD_MB} MiB from the host's loopback, unsandboxed", "download_plain", None,
         f"1.00× (baseline, {mbps:.0f} MiB/s)")
    line("the same download from a session, network on", "download", "download_plain",
         f"of unsandboxed ({DOWNLOAD_MB / p50['download']:.0f} MiB/s)")
    if rows["open_domains"]:
        line("open a session, network domains", "open_domains", "open", "of the open above")
        line("curl 16 MiB from loopback, no sandbox", "fetch_plain", None, "1.00× (baseline)")
        line("the same through shell_exec and the domains proxy", "fetch_domains", "fetch_plain", "of plain curl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
