"""Sessions opened back to back, as an agent platform opens them: open ->
first call -> close on one worktree, each session closed before the next
opens, alternating the network (off, on) and the first call (read_file,
shell_exec true), through the public client library.

    python bench/backtoback.py [--rounds 40] [--files 2000] [--packed] [--against DIR] [--steps] [--under DIR]
                               [--daemon-args ARGS] [--settle S]

Starts its own daemon (the default pool of sandboxes made ahead) on a
temporary socket, with a worktree that is a git repository of --files
files, committed once: its 2,042 objects loose, the worst case of the end's
look at each kept object file (``--packed``: ``git gc`` then, one pack, as a
clone leaves a repository). Prints p50 and p99 in milliseconds of: open to the first call's
answer, the close, and, as the baseline of the same run, a bare Unix-socket
round trip of the daemon's (a status request); then the CPU a session took,
the daemon's and every process it started (pasta and the sandboxes too).

``--against DIR`` (an A/B of two checkouts in the same minutes, on a shared
machine): a second daemon runs the ``dispatchd`` package of the checkout
DIR (the same client library, this one's), on a worktree of its own made
alike; each step goes to the two in turn, in alternating order, and each
row is printed for both, with this checkout's p50 as a ratio of DIR's
(use an even --rounds: each daemon then goes first in as many rounds).

``--against-args "ARGS"``: the second daemon is also started with ARGS
(the checkout DIR's, or this one's without ``--against``): e.g.
``--against-args "--network-stack pasta"`` sets the stacks side by side.

``--steps``: the daemons log at debug level, and the median milliseconds of
each step of their opens (``event=open_steps``), of the worker's part
(``event=worker_ready``) and of their closes (``event=close_steps``: the
network stopped, the processes' exit, the git check, the sweep; told apart by the
session's network and first call) are printed
after the table, and how many opens of each network found a sandbox made
ahead.

``--under DIR``: where the worktrees and the daemons' state are made
(default: the home directory, where users keep theirs).

``--daemon-args "ARGS"``: this checkout's daemon's own options; with
``--settle S`` (seconds to wait after the warm-up) e.g. ``--daemon-args
"--pool 85" --settle 8`` has every sandbox made before the rounds begin, so
that no make of the pool runs beside a session (docs/performance.md, "What
the pool's make costs the session beside it"). ``--steps`` also prints the
pool's makes' steps (``make/off ...``), the daemon's CPU for each among them.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dispatch  # noqa: E402
import psutil  # noqa: E402
from bench import pct, start_daemon, stop_daemon  # noqa: E402


def make_worktree(path: str, files: int, packed: bool = False) -> None:
    os.makedirs(path)
    for i in range(files):
        d = os.path.join(path, f"d{i % 40}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i}.py"), "w") as f:
            f.write(f"x = {i}\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@x", GIT_COMMITTER_NAME="b", GIT_COMMITTER_EMAIL="b@x")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]) + ((["gc", "-q"],) if packed else ()):
        subprocess.run(["git", *args], cwd=path, check=True, env=env)


FIRST: dict[str, str] = {}  # session id -> its network and first call: the close's steps told apart (--steps)


def one(client: dispatch.Client, wt: str, network: bool, first: str, rows: dict[str, list[float]]) -> None:
    """One session: open -> first call -> close, and a status round trip."""
    t0 = time.perf_counter()
    s = client.open_session(wt, network=network)
    if first == "read_file":
        r = s.registry.call("read_file", {"path": "d0/f0.py"})
    else:
        r = s.registry.call("shell_exec", {"command": "true"})
    t1 = time.perf_counter()
    assert r.is_success, r.error
    key = f"{'on' if network else 'off'}/{first}"
    FIRST[s.id] = key
    s.close()
    t2 = time.perf_counter()
    rows.setdefault(f"open -> first {key}", []).append(t1 - t0)
    rows.setdefault(f"close ({'on' if network else 'off'})", []).append(t2 - t1)
    # A close after a command also ends what the command left (its watch of
    # the worktree: metadata["changed"]), so each first call's close is told too.
    rows.setdefault(f"close ({key})", []).append(t2 - t1)
    t = time.perf_counter()
    client.status()
    rows.setdefault("baseline: status round trip", []).append(time.perf_counter() - t)


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and every process below it, those already
    reaped by their parents included (their parents' children's times): the
    difference of two readings is what the tree used between them."""
    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue  # gone meanwhile: its parent's children's times hold it at the next reading
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _add_steps(into: dict[str, list[float]], prefix: str, text: str) -> None:
    """A log line's ``steps_ms`` (``name:ms,name:ms``) added to ``into``, each under ``prefix name``."""
    for part in text.split(","):
        if ":" in part:
            k, v = part.split(":")
            into.setdefault(f"{prefix} {k}", []).append(float(v))


def print_steps(name: str, log_path: str) -> None:
    """The medians of the open's and the close's steps in one daemon's debug log."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    steps: dict[str, list[float]] = {}
    for m in re.finditer(r"event=(open_steps|worker_ready|close_steps) session=(\w+) "
                         r"(?:pid=\d+ made_ahead=(\d) (?:channel_ahead=\d )?)?steps_ms=(\S*)", log):
        prefix = {"open_steps": "open", "close_steps": "close"}.get(m.group(1)) or (
            "adopt" if m.group(3) == "1" else "fresh")
        if prefix == "close" and m.group(2) in FIRST:
            prefix = f"close/{FIRST[m.group(2)]}"
        if prefix == "fresh":
            continue  # the pool's sandboxes made ahead: not on an open's path
        _add_steps(steps, prefix, m.group(4))
    print(f"[{name}] " + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in steps.items()))
    # The pool's makes (off every open's path, but on the same CPUs), by kind.
    made: dict[str, list[float]] = {}
    for m in re.finditer(r"event=pool_made kind=\S+/(\w+) session=\w+ pid=\d+ steps_ms=(\S*)", log):
        _add_steps(made, f"make/{m.group(1)}", m.group(2))
    print(f"[{name}] " + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in made.items()))
    # Which opens found a sandbox made ahead (the pool keeping up), by network.
    served: dict[str, list[int]] = {}
    for m in re.finditer(r"event=session_open session=\w+ policy=\S+ network=(\w+) mode=\S+ made_ahead=(\d)", log):
        served.setdefault(m.group(1), []).append(int(m.group(2)))
    print(f"[{name}] made ahead: " + "  ".join(f"network {k} {sum(v)}/{len(v)}" for k, v in sorted(served.items())))
    pool: dict[str, int] = {}
    for m in re.finditer(r"event=(pool_\w+)", log):
        pool[m.group(1)] = pool.get(m.group(1), 0) + 1
    print(f"[{name}] the pool's events: " + "  ".join(f"{k} {v}" for k, v in sorted(pool.items())))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--against", metavar="DIR", default="",
                    help="A/B: a second daemon running the dispatchd package of the checkout DIR")
    ap.add_argument("--against-args", default="", metavar="ARGS",
                    help="the second daemon's own options (with no --against: this checkout's, so started)")
    ap.add_argument("--daemon-args", default="", metavar="ARGS",
                    help="this checkout's daemon's own options, e.g. \"--pool 100\"")
    ap.add_argument("--settle", type=float, default=0.0, metavar="S",
                    help="seconds to wait after the warm-up (the pool's first makes done)")
    ap.add_argument("--packed", action="store_true", help="the worktree's objects in one pack (git gc), as cloned")
    ap.add_argument("--steps", action="store_true", help="also the daemons' open steps (debug log), medians")
    ap.add_argument("--under", default=os.path.expanduser("~"), metavar="DIR",
                    help="where the worktrees and the daemons' state go (default: the home directory)")
    args = ap.parse_args()
    extra = ["--log-level", "debug"] if args.steps else []
    # Under the home directory by default, where a user's worktrees are (as
    # bench.py): a worktree under /tmp is bound at a mount point made in the
    # session's private /tmp, on disk, at every open (--under /tmp measures that).
    with tempfile.TemporaryDirectory(prefix=".dispatchd-b2b-", dir=args.under) as tmp:
        names = ["this"] + (["against"] if args.against or args.against_args else [])
        daemons = {}
        for name in names:
            d = os.path.join(tmp, name)
            make_worktree(os.path.join(d, "wt"), args.files, args.packed)
            own = args.against_args.split() if name == "against" else args.daemon_args.split()
            daemons[name] = start_daemon(d, *extra, *own,
                                         code=os.path.abspath(args.against) if name == "against" and args.against else "")
        try:
            rows: dict[str, dict[str, list[float]]] = {name: {} for name in names}
            clients = {name: dispatch.connect(sock) for name, (_, sock) in daemons.items()}
            wts = {name: os.path.join(tmp, name, "wt") for name in names}
            for name in names:
                for network in (False, True):  # warm the pool's kinds
                    clients[name].open_session(wts[name], network=network).close()
            time.sleep(args.settle)
            cpu_before = {name: tree_cpu(proc.pid) for name, (proc, _) in daemons.items()}
            for i in range(args.rounds * 4):
                network = bool(i % 2)
                first = "read_file" if (i // 2) % 2 == 0 else "shell_exec"
                # Who goes first flips every 4 sessions, not every session: flipped
                # with the network (every other one), the same daemon always came
                # right after a network-on close (pasta's exit still running in
                # the kernel) and was slower for it. Flipped by the block of 4,
                # each pattern has each daemon after such a close equally often.
                # (And so each pattern, network and first call, has either daemon
                # first half the time.)
                order = names if (i // 4) % 2 == 0 else names[::-1]
                for name in order:
                    one(clients[name], wts[name], network, first, rows[name])
            # CPU a session, every process of the daemon's included (pasta, the
            # sandboxes, the fork server): on a busy machine the figure that
            # moves least from run to run, where the latencies share the CPUs.
            cpu = {name: (tree_cpu(proc.pid) - cpu_before[name]) / (args.rounds * 4)
                   for name, (proc, _) in daemons.items()}
            for client in clients.values():
                client.close()
            width = max(len(k) for k in rows["this"])
            print(f"{'pattern':<{width}}  {'p50 ms':>8}  {'p99 ms':>8}  n")
            for key in sorted(rows["this"]):
                for name in names:
                    xs = rows[name][key]
                    label = key if len(names) == 1 else f"{key} [{name}]"
                    ratio = ""
                    if name == "this" and len(names) > 1:
                        ratio = f"  {pct(xs, 0.5) / pct(rows['against'][key], 0.5):.2f}x against"
                    print(f"{label:<{width + 10}}  {pct(xs, 0.5) * 1e3:8.2f}  {pct(xs, 0.99) * 1e3:8.2f}  "
                          f"{len(xs)}{ratio}")
            for name in names:
                ratio = f"  {cpu['this'] / cpu['against']:.2f}x against" if name == "this" and len(names) > 1 else ""
                print(f"CPU a session, the daemon and every process it started [{name}]: "
                      f"{cpu[name] * 1e3:.1f} ms{ratio}")
        finally:
            for proc, _ in daemons.values():
                stop_daemon(proc)
        if args.steps:
            for name in names:
                print_steps(name, os.path.join(tmp, name, "daemon.log"))


if __name__ == "__main__":
    main()
