"""dispatchd density benchmark: many idle sessions on one host.

    ./scripts/bench --density [N] [--close-with C]
    (or: .venv/bin/python bench/density.py [N] [--close-with C])

Starts its own daemon on a temporary socket and opens N sessions (default
1,000) on one worktree, each made to answer one ``read_file`` so that it is
really up, then reports:

- how many opens failed, and the first error;
- the time of each open (p50, p99) and of closing them all;
- with ``--asleep``: the time until every session sleeps (the default
  policy's ``sleep_after_s``), what they cost then, and what the first
  ``read_file`` after a sleep (the wake) takes, p50 and p99;
- what the sessions cost the host: the drop in ``MemAvailable``
  (/proc/meminfo) while they are open, which counts everything (page
  tables, kernel objects, private pages), and, per session, the processes
  it holds and their unique memory (USS) where it can be read. Session
  processes are not dumpable, so their ``smaps_rollup`` is readable only by
  root: run as an ordinary user this prints "n/a" for USS and the
  ``MemAvailable`` figure carries the story.

``--daemon-args "ARGS"``: the daemon's own options (e.g. ``"--network-stack pasta"``).

``--against DIR`` starts a second daemon from the checkout DIR (a baseline,
e.g. main, its C helper built in place) and opens the sessions on both,
alternately, in the same minutes: each side's figures are printed, and with
``--hold`` its pids go to PIDFILE (this checkout) and PIDFILE.against.

This process holds a channel (a descriptor) per session: it raises its own
soft ``RLIMIT_NOFILE`` to the hard limit first, and says so when that is too
few. ``--hold S`` keeps the sessions open S seconds after measuring and
writes their process ids to a file, so that root can read what they hold
(``/proc/PID/smaps_rollup``).

The machine is shared and noisy: ``MemAvailable`` moves with everything
else running, so read it as an estimate. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import dispatch  # noqa: E402
from bench import bench_dir, descendants as children, fmt, ordinary_user, pct, start_daemon, stop_daemon, uss  # noqa: E402


def meminfo() -> dict[str, int]:
    """/proc/meminfo, in bytes."""
    out = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            out[name] = int(rest.split()[0]) * 1024
    return out


def mem_available() -> int:
    return meminfo().get("MemAvailable", 0)


# Where the memory of idle sessions goes, as the kernel counts it host-wide:
# process memory (anonymous pages: what copy-on-write copied), page tables,
# kernel stacks (one per thread), kernel objects (namespaces, mounts,
# sockets, task structs: unreclaimable slab; the dentries and inodes of each
# session's /proc and mounts: reclaimable slab).
_BREAKDOWN = ("AnonPages", "PageTables", "KernelStack", "SUnreclaim", "SReclaimable", "Shmem")
_USER = ("AnonPages", "Shmem")
_KERNEL = ("PageTables", "KernelStack", "SUnreclaim", "SReclaimable")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sessions", type=int, nargs="?", default=1000)
    ap.add_argument("--hold", type=float, default=0.0, metavar="S",
                    help="keep the sessions open S seconds after measuring; their pids go to PIDFILE")
    ap.add_argument("--pidfile", default="/tmp/dispatchd-density.pids")
    ap.add_argument("--pace", type=float, default=0.0, metavar="S",
                    help="wait S seconds between opens (e.g. 0.1: every open is then served by a sandbox made "
                         "ahead; back to back, some are made at open, which costs less memory)")
    ap.add_argument("--close-with", type=int, default=1, metavar="N",
                    help="close the sessions over N connections at once (default 1: one after another)")
    ap.add_argument("--network", default="off", help="the sessions' network mode (default off)")
    ap.add_argument("--against", metavar="DIR", default="",
                    help="also a daemon of the checkout DIR, its sessions opened alternately with ours")
    ap.add_argument("--daemon-args", default="", metavar="ARGS",
                    help="the daemon's own options, e.g. \"--network-stack pasta\"")
    ap.add_argument("--asleep", action="store_true",
                    help="measure once every session sleeps (sleep_after_s), then wake each with a read_file")
    args = ap.parse_args()
    if not ordinary_user("density"):
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < args.sessions + 64:
        print(f"density: this process may hold {hard} descriptors, a session takes one: expect failures",
              file=sys.stderr)
    if args.against:
        return against(args)
    tmp = bench_dir("density")
    daemon, sock = start_daemon(tmp, *args.daemon_args.split())
    wt = os.path.join(tmp, "wt")
    os.mkdir(wt)
    Path(wt, "f.txt").write_text("hello\n")
    opens: list[float] = []
    failures: list[str] = []
    sessions: list[dispatch.Session] = []
    try:
        with dispatch.connect(sock) as client:
            time.sleep(0.5)
            before_info = meminfo()
            before = before_info["MemAvailable"]
            fork_server_and_daemon = {daemon.pid, *children(daemon.pid)}
            # The daemon's and this client's own growth are part of the drop
            # but not of the sessions: measured apart (both are readable).
            own_before = {"daemon": uss(daemon.pid) or 0, "client": uss(os.getpid()) or 0}
            for _ in range(args.sessions):
                t = time.perf_counter()
                try:
                    s = client.open_session(wt, network=args.network)
                    s.registry.get("read_file").call({"path": "f.txt"})
                except Exception as exc:  # counted and reported, not raised
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                opens.append(time.perf_counter() - t)
                sessions.append(s)
                if args.pace:
                    time.sleep(args.pace)
            time.sleep(1.0)
            slept_after = None
            if args.asleep:
                t = time.perf_counter()
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    asleep = sum(1 for info in client.list_sessions() if info.get("asleep"))
                    if asleep >= len(sessions):
                        slept_after = time.perf_counter() - t
                        break
                    time.sleep(0.5)
                time.sleep(1.0)
            during_info = meminfo()
            during = during_info["MemAvailable"]
            own_growth = {"daemon": (uss(daemon.pid) or 0) - own_before["daemon"],
                          "client": (uss(os.getpid()) or 0) - own_before["client"]}
            procs = [p for p in children(daemon.pid) if p not in fork_server_and_daemon]
            private = [uss(p) for p in procs]
            readable = [u for u in private if u is not None]
            wakes: list[float] = []
            if args.asleep:
                for s in sessions:
                    c = time.perf_counter()
                    s.registry.get("read_file").call({"path": "f.txt"})
                    wakes.append(time.perf_counter() - c)
            if args.hold > 0:
                Path(args.pidfile).write_text("\n".join(map(str, procs)) + "\n")
                print(f"holding {len(sessions)} sessions for {args.hold:g} s; their pids: {args.pidfile}", flush=True)
                time.sleep(args.hold)
            closes: list[float] = []
            t = time.perf_counter()
            if args.close_with <= 1:
                for s in sessions:
                    c = time.perf_counter()
                    s.close()
                    closes.append(time.perf_counter() - c)
            else:
                ids = [s.id for s in sessions]
                for s in sessions:
                    s.detach()  # our channel only; the daemon closes the session below

                def close_some(part: list[str]) -> None:
                    with dispatch.connect(sock) as other:
                        for sid in part:
                            c = time.perf_counter()
                            other.close_session(sid)
                            closes.append(time.perf_counter() - c)

                threads = [threading.Thread(target=close_some, args=(ids[i::args.close_with],))
                           for i in range(args.close_with)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            close_all = time.perf_counter() - t
    finally:
        stop_daemon(daemon, 60)
        shutil.rmtree(tmp, ignore_errors=True)

    n = max(1, len(sessions))
    print(f"dispatchd density: {args.sessions} sessions asked, {len(sessions)} open, {len(failures)} failed"
          + (f" (first: {failures[0]})" if failures else ""))
    if opens:
        print(f"open → first read_file: p50 {fmt(statistics.median(opens)).strip()}, p99 {fmt(pct(opens, 0.99)).strip()}")
    if args.asleep:
        print("all asleep " + (f"{slept_after:.1f} s after the last open" if slept_after is not None
                               else "NOT reached within 120 s"))
        if wakes:
            print(f"first read_file after a sleep (the wake): p50 {fmt(statistics.median(wakes)).strip()}, "
                  f"p99 {fmt(pct(wakes, 0.99)).strip()}")
    print(f"close all: {close_all:.2f} s over {args.close_with} connection(s)"
          + (f"; each close p50 {fmt(statistics.median(closes)).strip()}, p99 {fmt(pct(closes, 0.99)).strip()}"
             if closes else ""))
    print(f"host memory (MemAvailable drop): {(before - during) / 2**20:.0f} MiB in all, "
          f"{(before - during) / n / 2**20:.2f} MiB a session")
    print(f"  of which the daemon's own growth {own_growth['daemon'] / n / 2**20:.2f} MiB a session, this client's "
          f"{own_growth['client'] / n / 2**20:.2f} MiB a session (its Session objects)")
    grew = {k: (during_info.get(k, 0) - before_info.get(k, 0)) / n / 2**20 for k in _BREAKDOWN}
    print("  host-wide, a session: " + ", ".join(f"{k} {v:.2f} MiB" for k, v in grew.items()))
    user, kernel = sum(grew[k] for k in _USER), sum(grew[k] for k in _KERNEL)
    print(f"  split: user pages {user:.2f} MiB, kernel {kernel:.2f} MiB (page tables, stacks, slab), "
          f"the rest of the drop {(before - during) / n / 2**20 - user - kernel:.2f} MiB (page cache, pipes, noise)")
    uss_text = (f"{sum(readable) / n / 2**20:.2f} MiB a session" if len(readable) == len(private)
                else "n/a (session processes are not dumpable: run as root to read them)")
    print(f"processes: {len(procs) / n:.1f} a session; unique memory (USS): {uss_text}")
    return 1 if failures else 0


def against(args: argparse.Namespace) -> int:
    """``--against DIR``: the same sessions on a daemon of this checkout and
    one of DIR, opened alternately (which side goes first alternates too),
    so that both see the same load; each side's opens, processes and USS."""
    tmp = bench_dir("density")
    sides = {"this": "", "against": os.path.abspath(args.against)}
    daemons: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    wt = os.path.join(tmp, "wt")
    os.mkdir(wt)
    Path(wt, "f.txt").write_text("hello\n")
    opens: dict[str, list[float]] = {name: [] for name in sides}
    failures: dict[str, list[str]] = {name: [] for name in sides}
    sessions: dict[str, list[dispatch.Session]] = {name: [] for name in sides}
    clients: dict[str, dispatch.Client] = {}
    before: dict[str, set[int]] = {}
    try:
        for name, code in sides.items():
            os.mkdir(os.path.join(tmp, name))
            daemons[name] = start_daemon(os.path.join(tmp, name), code=code)
            clients[name] = dispatch.connect(daemons[name][1])
        time.sleep(0.5)
        for name, (proc, _) in daemons.items():
            before[name] = {proc.pid, *children(proc.pid)}
        for i in range(args.sessions):
            for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                t = time.perf_counter()
                try:
                    s = clients[name].open_session(wt, network=args.network)
                    s.registry.get("read_file").call({"path": "f.txt"})
                except Exception as exc:  # counted and reported, not raised
                    failures[name].append(f"{type(exc).__name__}: {exc}")
                    continue
                opens[name].append(time.perf_counter() - t)
                sessions[name].append(s)
                if args.pace:
                    time.sleep(args.pace)
        time.sleep(1.0)
        procs = {name: [p for p in children(proc.pid) if p not in before[name]]
                 for name, (proc, _) in daemons.items()}
        for name in sides:
            private = [uss(p) for p in procs[name]]
            readable = [u for u in private if u is not None]
            n = max(1, len(sessions[name]))
            uss_text = (f"{sum(readable) / n / 1024:.0f} KiB a session" if readable and len(readable) == len(private)
                        else "n/a (not dumpable: run bench/uss_of.py as root on the pid file)")
            print(f"{name}: {len(sessions[name])} open, {len(failures[name])} failed"
                  + (f" (first: {failures[name][0]})" if failures[name] else "")
                  + (f"; open → first read_file p50 {fmt(statistics.median(opens[name])).strip()}, "
                     f"p99 {fmt(pct(opens[name], 0.99)).strip()}" if opens[name] else "")
                  + f"; processes {len(procs[name]) / n:.1f} a session; USS {uss_text}", flush=True)
        if args.hold > 0:
            for name in sides:
                path = args.pidfile + ("" if name == "this" else ".against")
                Path(path).write_text("\n".join(map(str, procs[name])) + "\n")
            print(f"holding for {args.hold:g} s; pids: {args.pidfile} (this), {args.pidfile}.against", flush=True)
            time.sleep(args.hold)
        for name in sides:
            for s in sessions[name]:
                s.close()
    finally:
        for c in clients.values():
            c.close()
        for proc, _ in daemons.values():
            stop_daemon(proc, 60)
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
