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
- opening a session (until every protection is in force) beside the same
  open with the host's root (policy ``root = "host"``: the host's ``/``
  read-only, as before the minimal root), and switching its network (the
  sandbox is replaced). With ``--cgroup DIR`` (a delegated cgroup
  v2 directory; ``./scripts/bench`` run as root makes one) the daemon gives
  each session a cgroup, and the open includes making and joining it;
- search_files over 2,000 files (7 MiB) beside ``rg -n`` (the whole process,
  output captured), once for a query with a few hundred matching lines and
  once for tens of thousands; the bench's policy raises
  ``search_max_results`` so that both return every match (the counts are
  compared and printed);
- 8 clients (processes, a session each) calling read_file as fast as they
  can: calls per second in all, beside 8 bare clients each with a bare
  server of its own; and the same 8 calls from 8 threads sharing one
  session (the client's and the tool server's locks and the GIL);
- 16 clients (processes, a session each): p50 and p99 of read_file beside
  16 bare pairs running at the same time;
- an idle session's cost: processes, the drop in ``MemAvailable`` per
  session (everything: page tables, kernel objects, private pages) beside
  the same number of idle bare Python servers, and USS where it can be read
  (session processes are not dumpable: root only; bench/density.py does
  the same at scale, ``./scripts/bench --density [N]``);
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
import multiprocessing
import os
import random
import shutil
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
listener.bind(sys.argv[1]); listener.listen(64)
print("ready", flush=True)
body = "x" * 4096

def serve(conn):
    frames = protocol.FrameSocket(conn)
    while True:
        req = frames.recv(protocol.channel_request_decoder)
        if req is None:
            break
        frames.send(protocol.ToolReply(id=req.id, success=True, output=body, metadata={"path": "f"}))

# A process per connection, as a session has a tool server of its own: the
# bare floor at any concurrency. The first connection is served here.
conn, _ = listener.accept()
import os
while int(sys.argv[3]) > 1:
    if os.fork() == 0:
        listener.close()
        serve(conn)
        os._exit(0)
    conn.close()
    conn, _ = listener.accept()
serve(conn)
"""


class BareClient:
    """Two Python processes, one Unix socket, msgspec frames: the floor."""

    def __init__(self, tmp: str, name: str = "bare.sock", forking: bool = False) -> None:
        self.path = os.path.join(tmp, name)
        self.proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, self.path, str(REPO), "2" if forking else "1"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.forking = forking
        self.frames = self.connect(self.path)
        self.n = 0

    @staticmethod
    def connect(path: str) -> protocol.FrameSocket:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        return protocol.FrameSocket(sock)

    def call(self) -> None:
        self.n += 1
        self.frames.send(protocol.CallTool(id=self.n, tool="read_file", params={"path": "f"}))
        self.frames.recv(protocol.channel_reply_decoder)

    def close(self) -> None:
        self.frames.close()
        if self.forking:  # its children end with their connections
            self.proc.terminate()
        self.proc.wait(5)


class BareConnection:
    """One more client of a forking bare server (a server process of its own)."""

    def __init__(self, path: str) -> None:
        self.frames = BareClient.connect(path)
        self.n = 0

    call = BareClient.call


# -- many clients at once ------------------------------------------------------


def _client_process(pipe: multiprocessing.connection.Connection, sock: str, wt: str, bare_path: str) -> None:
    """One client of the concurrency rows: a session and a bare connection of
    its own; runs what the parent asks, starting all together at a time set
    by the parent (CLOCK_MONOTONIC is one clock for every process)."""
    with dispatch.connect(sock) as client:
        session = client.open_session(wt, network=False)
        read = session.registry.get("read_file")
        bare = BareConnection(bare_path)
        calls = {"read": lambda: read.call({"path": "f4k.txt"}), "bare": bare.call}
        for fn in calls.values():
            for _ in range(20):
                fn()
        pipe.send("ready")
        while True:
            order = pipe.recv()
            if order is None:
                break
            kind, how, amount, start_at = order
            fn = calls[kind]
            # One call before the start: a session asleep since the last row
            # (idle over sleep_after_s) wakes outside the measured window.
            fn()
            while time.monotonic() < start_at:
                time.sleep(0.0005)
            if how == "for":  # as many calls as fit in ``amount`` seconds
                n, end = 0, start_at + amount
                while time.monotonic() < end:
                    fn()
                    n += 1
                pipe.send(n)
            else:  # ``amount`` calls, each timed
                pipe.send(timed(fn, amount))
        session.close()


class Clients:
    """N client processes; ``run`` makes them all start at once."""

    def __init__(self, n: int, sock: str, wt: str, bare_path: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.pipes, self.procs = [], []
        for _ in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(theirs, sock, wt, bare_path), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def run(self, n: int, kind: str, how: str, amount: float) -> list:
        start_at = time.monotonic() + 0.1  # after each client's first call (a wake takes about 8 ms)
        for pipe in self.pipes[:n]:
            pipe.send((kind, how, amount, start_at))
        return [pipe.recv() for pipe in self.pipes[:n]]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(10)


def threads_for(n: int, fn: Callable[[], object], seconds: float) -> int:
    """Calls made by ``n`` threads running ``fn`` for ``seconds``, in all."""
    counts = [0] * n
    start_at = time.monotonic() + 0.02
    end = start_at + seconds

    def loop(i: int) -> None:
        while time.monotonic() < start_at:
            time.sleep(0.0005)
        while time.monotonic() < end:
            fn()
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


# -- search --------------------------------------------------------------------

_WORDS = ("alpha beta gamma delta epsilon config value index buffer token parse render "
          "worker session client server handle result error status record stream").split()


def make_search_tree(root: str, files: int = 2000) -> None:
    """``files`` text files of about 3.5 KiB (7 MiB in all) in 20 folders.
    ``needle_marker`` is on one line of every fifth file (400 lines);
    ``value`` is on about half of all lines (tens of thousands)."""
    rng = random.Random(17)
    for i in range(files):
        folder = os.path.join(root, f"pkg{i % 20:02d}")
        os.makedirs(folder, exist_ok=True)
        lines = []
        for j in range(90):
            words = rng.choices(_WORDS, k=6)
            if i % 5 == 0 and j == 45:
                words.append("needle_marker")
            lines.append(f"    {' '.join(words)} = {j}")
        Path(folder, f"mod{i:04d}.py").write_text("\n".join(lines) + "\n")


def rg_count(wt: str, query: str) -> int:
    out = subprocess.run(["rg", "-n", "--no-heading", "--color", "never", "-F", "-e", query, "."],
                         cwd=wt, capture_output=True, check=False).stdout
    return out.count(b"\n")


def bench_policies(tmp: str) -> str:
    """The installed policies, with search_max_results raised so that
    search_files returns every match, as rg does."""
    src = REPO / "dispatchd" / "policies"
    dst = os.path.join(tmp, "policies")
    os.mkdir(dst)
    for f in src.glob("*.toml"):
        text = f.read_text().replace("search_max_results = 100\n", "search_max_results = 1000000\n")
        Path(dst, f.name).write_text(text)
    return dst


# -- memory --------------------------------------------------------------------


def mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, from /proc."""
    out, pending = [], [pid]
    while pending:
        p = pending.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children", encoding="ascii") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        out += kids
        pending += kids
    return out


def user_cpu() -> dict[int, int]:
    """Clock ticks of CPU (user and system) of each process of this user, by
    pid: the clients, the daemon, every session's processes (in their own
    pid namespaces, but this user's), the bare servers."""
    uid, ticks = os.getuid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        ticks[int(name)] = int(fields[11]) + int(fields[12])
    return ticks


def cpu_a_call(run: Callable[[], int]) -> tuple[int, float]:
    """``run()``'s calls and the CPU seconds a call that every process of
    this user spent meanwhile (processes there before and after only: one
    that ended takes its ticks with it). On a shared machine the calls a
    second move with the others' load; the CPU a call moves far less, and
    ``os.cpu_count() / cpu`` is what this machine would reach alone."""
    before = user_cpu()
    calls = run()
    after = user_cpu()
    spent = sum(after[pid] - before[pid] for pid in after.keys() & before.keys())
    return calls, spent / os.sysconf("SC_CLK_TCK") / max(calls, 1)


def uss(pid: int) -> int | None:
    """Private (unique) memory of one process, or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            return sum(int(line.split()[1]) * 1024 for line in f
                       if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except OSError:
        return None


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


def ordinary_user(name: str) -> bool:
    """Whether this runs as an ordinary user; if not, say so: dispatchd refuses root."""
    if os.geteuid() == 0:
        print(f"{name}: run as an ordinary user (dispatchd refuses root)", file=sys.stderr)
        return False
    return True


def bench_dir(name: str, home: bool = False) -> str:
    """A temporary directory for a bench script's daemon and worktrees; under
    the home directory with ``home`` (where a user's are: under /tmp a
    session's paths are mount points made inside its private /tmp, on disk,
    at every open)."""
    return tempfile.mkdtemp(prefix=f".dispatchd-{name}-" if home else f"dispatchd-{name}-",
                            dir=os.path.expanduser("~") if home else None)


def run_small(name: str, doc: str, rounds: int, body: Callable[[int, str], int]) -> int:
    """A small bench script, started: its one optional argument (how many
    rounds, ``rounds`` by default), the refusal of root and its temporary
    directory, then ``body(rounds, tmp)``; 2 when it must not run."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("rounds", type=int, nargs="?", default=rounds)
    args = ap.parse_args()
    if not ordinary_user(name):
        return 2
    return body(args.rounds, bench_dir(name))


def stop_daemon(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, and SIGKILL if it has not ended within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_daemon(tmp: str, *extra: str, code: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """A daemon on a socket under ``tmp``; ``code``: run the ``dispatchd``
    package of that checkout instead of this one (A/B runs)."""
    sock = os.path.join(tmp, "run", "d.sock")
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(tmp, "state"))
    if code:
        env["PYTHONPATH"] = code  # and run from there: `python -m` puts the working directory first
    log = open(os.path.join(tmp, "daemon.log"), "wb")  # noqa: SIM115 (lives as long as the daemon)
    proc = subprocess.Popen([sys.executable, "-m", "dispatchd", "--socket", sock, *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=code or None)
    for _ in range(400):
        if os.path.exists(sock):
            break
        time.sleep(0.025)
    return proc, sock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200, help="calls per round for the round-trip rows")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per round for the throughput rows")
    ap.add_argument("--idle", type=int, default=50, metavar="N", help="idle sessions for the memory row")
    ap.add_argument("--no-user-namespaces", action="store_true", help="benchmark the degraded mode")
    ap.add_argument("--cgroup", metavar="DIR", nargs="?", const=os.environ.get("DISPATCHD_TEST_CGROUP", ""),
                    help="per-session cgroups under DIR/bench-PID (DIR: a delegated cgroup v2 directory; "
                         "default: $DISPATCHD_TEST_CGROUP)")
    ap.add_argument("--log-cost", action="store_true",
                    help="also read_file through a daemon at --log-level debug (a log line per call)")
    ap.add_argument("--daemon-args", default="", metavar="ARGS",
                    help="the daemon's own options, e.g. \"--network-stack pasta\"")
    args = ap.parse_args()
    if os.geteuid() == 0:
        print("bench: run as an ordinary user (dispatchd refuses root)", file=sys.stderr)
        return 2
    # Worktrees and the daemon's state under the home directory, where a user's
    # are: under /tmp a session's paths are mount points made inside its
    # private /tmp, on disk, at every open (docs/architecture.md).
    tmp = tempfile.mkdtemp(prefix=".dispatchd-bench-", dir=os.path.expanduser("~"))
    extra = ["--no-user-namespaces"] if args.no_user_namespaces else []
    extra += ["--proxy-hosts-for-testing", "bench.test=127.0.0.1", *args.daemon_args.split()]
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
    policies = bench_policies(tmp)
    # The baseline of the minimal root: the host's root, from the same daemon.
    Path(policies, "host-root.toml").write_text('[filesystem]\nroot = "host"\n')
    daemon, sock = start_daemon(tmp, "--policies", policies, *extra)
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
    search_wt = os.path.join(tmp, "search")
    make_search_tree(search_wt)
    have_rg = shutil.which("rg") is not None
    queries = {"few": "needle_marker", "many": "value"}
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("bare", "read", "spawn", "shell", "shell_stream", "first_byte", "cancel",
                                     "open", "switch", "open_plain", "read_debug",
                                     "open_domains", "fetch_plain", "fetch_domains",
                                     "open_on", "switch_off", "download_plain", "download",
                                     "rg_few", "search_few", "rg_many", "search_many",
                                     "bare8", "read8", "threads8", "bare16", "read16", "open_host",
                                     "bare8_cpu", "read8_cpu")}
    counts: dict[str, int] = {}
    memory: dict[str, float] = {}
    debug = None
    if args.log_cost:
        os.mkdir(os.path.join(tmp, "debug"))
        debug, debug_sock = start_daemon(os.path.join(tmp, "debug"), "--log-level", "debug", "--log-file",
                                         os.path.join(tmp, "debug", "daemon-debug.log"), *extra)
    try:
        bare = BareClient(tmp)
        many = BareClient(tmp, "bare-many.sock", forking=True)
        with dispatch.connect(sock) as client:
            session = client.open_session(wt, network=False)
            read = session.registry.get("read_file")
            shell = session.registry.get("shell_exec")
            searcher = client.open_session(search_wt, network=False)
            search = searcher.registry.get("search_files")
            read_debug = None
            if debug is not None:
                debug_client = dispatch.connect(debug_sock)
                read_debug = debug_client.open_session(wt, network=False).registry.get("read_file")
            for _ in range(20):  # warm up both paths
                bare.call()
                read.call({"path": "f4k.txt"})
                if read_debug is not None:
                    read_debug.call({"path": "f4k.txt"})
            for name, query in queries.items():
                result = search.call({"query": query})
                counts[f"search_{name}"] = result.metadata.get("count", -1)
                if have_rg:
                    counts[f"rg_{name}"] = rg_count(search_wt, query)
            clients = Clients(16, sock, wt, many.path)
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
                for name, query in queries.items():
                    if have_rg:
                        rows[f"rg_{name}"] += timed(lambda q=query: subprocess.run(  # type: ignore[misc]
                            ["rg", "-n", "--no-heading", "--color", "never", "-F", "-e", q, "."],
                            cwd=search_wt, capture_output=True), 3)
                    rows[f"search_{name}"] += timed(lambda q=query: search.call({"query": q}), 3)  # type: ignore[misc]
                # Throughput: calls per second in all, as one sample a round.
                for kind in ("bare", "read"):
                    calls, cpu = cpu_a_call(lambda k=kind: sum(clients.run(8, k, "for", args.seconds)))  # type: ignore[misc]
                    rows[f"{kind}8"].append(calls / args.seconds)
                    rows[f"{kind}8_cpu"].append(cpu)
                rows["threads8"].append(threads_for(8, lambda: read.call({"path": "f4k.txt"}), args.seconds)
                                        / args.seconds)
                for lat in clients.run(16, "bare", "calls", args.calls // 2):
                    rows["bare16"] += lat
                for lat in clients.run(16, "read", "calls", args.calls // 2):
                    rows["read16"] += lat
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
                    t = time.perf_counter()
                    s = client.open_session(wt, policy="host-root")
                    rows["open_host"].append(time.perf_counter() - t)
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
            clients.close()
            memory = idle_memory(client, wt, tmp, daemon.pid, args.idle)
            mode = session.status()["protections"]["mode"]
            cgroups = client.status()["kernel"]["cgroup_delegation"]
            session.close()
            searcher.close()
        bare.close()
        many.close()
    finally:
        for proc in (daemon, plain, debug):
            if proc is not None:
                stop_daemon(proc, 20)
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
    print(f"{'what':56} {'p50':>11} {'p99':>11}  ratio (p50)")

    def line(label: str, key: str, base: str | None, note: str = "") -> None:
        ratio = f"{p50[key] / p50[base]:.2f}× {note}" if base else note
        print(f"{label:56} {fmt(p50[key]):>11} {fmt(pct(rows[key], 0.99)):>11}  {ratio}")

    def rate(label: str, key: str, base: str | None, note: str = "") -> None:
        ratio = f"{p50[key] / p50[base]:.2f}× {note}" if base else note
        print(f"{label:56} {p50[key]:>8.0f}/s {'':>11}  {ratio}")

    line("bare request/response, 2 Python processes (4 KiB)", "bare", None, "1.00× (baseline)")
    line("read_file 4 KiB through dispatch", "read", "bare", "of bare (target ≤ 2×)")
    if rows["read_debug"]:
        print(f"{'  the same, daemon logging each call (debug)':56} {fmt(p50['read_debug']):>11} "
              f"{fmt(pct(rows['read_debug'], 0.99)):>11}  {p50['read_debug'] / p50['read']:.2f}× of info; "
              f"p99 {pct(rows['read_debug'], 0.99) / pct(rows['read'], 0.99):.2f}× of info")
    line("subprocess.run(['bash','-c','true']), no sandbox", "spawn", None, "1.00× (baseline)")
    line("shell_exec 'true' through dispatch", "shell", "spawn", "of plain spawn (target ≤ 1.15×)")
    print(f"{'  same, p99 against p99':56} {'':>11} {'':>11}  "
          f"{pct(rows['shell'], 0.99) / pct(rows['spawn'], 0.99):.2f}× (target ≤ 1.15×)")
    line("shell_exec 'true', streaming asked for", "shell_stream", "spawn", "of plain spawn")
    line("streaming: a command's write → client on_output", "first_byte", None, "(target: a few ms)")
    line("session.cancel() → cancelled Result (sleep)", "cancel", None, "(the kill, then the reply)")
    for name in queries:
        n_ours, n_rg = counts.get(f"search_{name}", -1), counts.get(f"rg_{name}")
        if have_rg:
            line(f"rg -n over 2,000 files, {n_rg} matching lines", f"rg_{name}", None, "1.00× (baseline)")
            line(f"search_files, same query, {n_ours} lines" + ("" if n_ours == n_rg else " (MISMATCH)"),
                 f"search_{name}", f"rg_{name}", "of rg (target ≤ 1.5×)")
        else:
            line(f"search_files over 2,000 files, {n_ours} lines (no rg)", f"search_{name}", None, "")
    rate("8 bare clients, a server process each: calls/s in all", "bare8", None, "1.00× (baseline)")
    rate("8 clients, a session each: read_file calls/s in all", "read8", "bare8", "of bare (target ≥ 40,000/s)")
    cpus = os.cpu_count() or 1
    line("  CPU a call, bare (every process of the run)", "bare8_cpu", None, "1.00× (baseline)")
    line("  CPU a call, read_file (every process of the run)", "read8_cpu", "bare8_cpu",
         f"of bare; {cpus} CPUs alone: {cpus / p50['read8_cpu']:,.0f}/s")
    rate("8 threads sharing one session: read_file calls/s", "threads8", "bare8", "of bare")
    line("16 bare clients at once, a server each (baseline)", "bare16", None, "1.00× (baseline)")
    line("16 clients at once, a session each: read_file", "read16", "bare16", "of bare")
    print(f"{'  same, p99 against p99':56} {'':>11} {'':>11}  "
          f"{pct(rows['read16'], 0.99) / pct(rows['bare16'], 0.99):.2f}× "
          f"(p99 of ours against the bare p50: {pct(rows['read16'], 0.99) / p50['bare16']:.1f}×; target ≤ 5×)")
    if rows["open_plain"]:
        line("open a session, no cgroup (baseline)", "open_plain", None, "1.00× (baseline)")
        line("open a session with its own cgroup", "open", "open_plain", "of the open without (target ≤ 1.1×)")
    else:
        line("open a session, the host's root (baseline)", "open_host", None, "1.00× (baseline)")
        line("open a session (confined, ready)", "open", "open_host", "of the host's root (target ≤ 5 ms; ≤ 1.1× the host's root)")
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
    if memory:
        n = args.idle
        print(f"idle, {n} at once (MemAvailable drop each; noisy on a shared machine):")
        print(f"  {'bare Python server forked from one parent (baseline)':54} {memory['bare'] / 2**20:8.2f} MiB"
              f" {'':>11}  1.00× (baseline)")
        print(f"  {'idle session, ' + format(memory['procs'], '.1f') + ' processes':54} "
              f"{memory['session'] / 2**20:8.2f} MiB {'':>11}  "
              + (f"{memory['session'] / memory['bare']:.2f}× " if memory["bare"] > 2**17 else "(baseline lost in noise) ")
              + "(target ≤ 2 MiB USS)")
        uss_text = (f"{memory['uss'] / 2**20:.2f} MiB a session" if memory["uss"] >= 0
                    else "n/a (session processes are not dumpable: root only)")
        print(f"  {'unique memory (USS)':54} {uss_text}")
    return 0


def idle_memory(client: dispatch.Client, wt: str, tmp: str, daemon_pid: int, n: int) -> dict[str, float]:
    """What ``n`` idle sessions cost the host, beside ``n`` idle bare servers."""
    if n <= 0:
        return {}
    time.sleep(0.5)
    before = mem_available()
    server = BareClient(tmp, "bare-idle.sock", forking=True)
    conns = [BareConnection(server.path) for _ in range(n - 1)]
    for c in conns:
        c.call()
    server.call()
    time.sleep(1.0)
    bare = (before - mem_available()) / n
    for c in conns:
        c.frames.close()
    server.close()
    time.sleep(0.5)
    known = {daemon_pid, *descendants(daemon_pid)}
    before = mem_available()
    sessions = []
    for _ in range(n):
        s = client.open_session(wt, network=False)
        s.registry.get("read_file").call({"path": "f4k.txt"})
        sessions.append(s)
    time.sleep(1.0)
    drop = (before - mem_available()) / n
    procs = [p for p in descendants(daemon_pid) if p not in known]
    private = [uss(p) for p in procs]
    for s in sessions:
        s.close()
    readable = [u for u in private if u is not None]
    return {"bare": bare, "session": drop, "procs": len(procs) / n,
            "uss": sum(readable) / n if readable and len(readable) == len(private) else -1}


if __name__ == "__main__":
    raise SystemExit(main())
