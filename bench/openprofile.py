"""Where opening a session goes: ``./scripts/bench --open-profile [N]``.

Starts two daemons on temporary sockets, one with sandboxes made ahead (the
default ``--pool``) and one without (``--pool 0``, the baseline), and opens
N sessions on each, interleaved, a pause between opens (an agent's opens
come with its model's thinking between them: the pool refills meanwhile).
Prints, per daemon, the client's open → ready and open → first ``read_file``
(p50, p99), how many opens were served by a sandbox made ahead, and the
daemon's own steps from its debug log: the worker's steps at open (for one
made ahead, only what it applies at adoption) and the daemon's whole start
of the worker. A benchmark, not a test.

``--against DIR`` (an A/B of two checkouts in the same minutes): the
baseline is instead a pooled daemon running the ``dispatchd`` package of the
checkout DIR (the same client library, this one's); each round opens on the
two in turn, in alternating order.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import dispatch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import bench_dir, ordinary_user, start_daemon, stop_daemon  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def _row(what: str, xs: list[float], base: list[float] | None = None) -> None:
    p50 = statistics.median(xs)
    ratio = f"  {p50 / statistics.median(base):.2f}× the baseline" if base else ""
    print(f"{what:<52} {p50 * 1e3:8.2f} ms {_pct(xs, 0.99) * 1e3:8.2f} ms{ratio}")


def _steps(log: str) -> tuple[dict[str, list[float]], list[float]]:
    steps: dict[str, list[float]] = {}
    for m in re.finditer(r"event=worker_ready session=\w+ pid=\d+ made_ahead=(\d) channel_ahead=\d steps_ms=(\S*)", log):
        for part in m.group(2).split(","):
            if ":" in part:
                name, ms = part.split(":")
                steps.setdefault(f"{'adopt' if m.group(1) == '1' else 'fresh'} {name}", []).append(float(ms))
    total = [float(x) for x in re.findall(r"event=worker_started session=\w+ total_ms=([\d.]+)", log)]
    for m in re.finditer(r"event=open_steps session=\w+ steps_ms=(\S*)", log):
        for part in m.group(1).split(","):
            name, ms = part.split(":")
            steps.setdefault(f"daemon {name}", []).append(float(ms))
    return steps, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=40)
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between opens (default 0.05)")
    ap.add_argument("--network", default="off", help="the sessions' network mode (default off)")
    ap.add_argument("--against", metavar="DIR", default="",
                    help="A/B: a third daemon, pooled, running the dispatchd package of the checkout DIR "
                         "(another branch; the same client)")
    args = ap.parse_args()
    if not ordinary_user("openprofile"):
        return 2
    tmp = bench_dir("openprofile", home=True)
    wt = os.path.join(tmp, "wt")
    os.makedirs(wt)
    Path(wt, "f.txt").write_text("hello\n" * 60)
    daemons = {}
    runs: list[tuple[str, list[str], str]] = [("pool", [], "")]
    # A/B: the other checkout's pooled daemon is the baseline (no --pool 0 one: its opens only add noise).
    runs.append(("against", [], os.path.abspath(args.against)) if args.against else ("nopool", ["--pool", "0"], ""))
    for name, extra, code in runs:
        d = os.path.join(tmp, name)
        os.makedirs(d)
        daemons[name] = (*start_daemon(d, "--log-level", "debug", *extra, code=code), d)
    try:
        clients = {name: dispatch.connect(sock) for name, (_, sock, _) in daemons.items()}
        ready: dict[str, list[float]] = {name: [] for name in daemons}
        first: dict[str, list[float]] = {name: [] for name in daemons}
        calls: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in daemons}  # 1st, 2nd call
        made_ahead = 0
        time.sleep(1.0)  # the pool's first sandboxes
        for i in range(args.n + 2):
            # Each round in another order: an open's place after another
            # daemon's close (its teardown) is not always the same daemon's.
            order = list(clients.items())
            for name, client in order[i % len(order):] + order[:i % len(order)]:
                time.sleep(args.pause)
                t = time.perf_counter()
                s = client.open_session(wt, network=args.network)
                opened = time.perf_counter() - t
                r = s.registry.get("read_file").call({"path": "f.txt"})
                read = time.perf_counter() - t
                assert r.is_success, r.error
                t2 = time.perf_counter()
                s.registry.get("read_file").call({"path": "f.txt"})
                second = time.perf_counter() - t2
                if i >= 2:  # the first opens warm both daemons up
                    ready[name].append(opened)
                    first[name].append(read)
                    calls[name][0].append(read - opened)
                    calls[name][1].append(second)
                    if name == "pool":
                        made_ahead += bool(s.status()["protections"].get("made_ahead"))
                s.close()
        print(f"{args.n} opens each, network {args.network}, {args.pause:g} s apart; "
              f"{made_ahead} of {args.n} served by a sandbox made ahead")
        print(f"{'what':<52} {'p50':>11} {'p99':>11}")
        if not args.against:
            _row("open → ready, no pool (baseline)", ready["nopool"])
            _row("open → ready, sandboxes made ahead", ready["pool"], ready["nopool"])
            _row("open → first read_file, no pool (baseline)", first["nopool"])
            _row("open → first read_file, sandboxes made ahead", first["pool"], first["nopool"])
        else:
            _row("open → ready, made ahead, --against (baseline)", ready["against"])
            _row("open → ready, made ahead, this checkout", ready["pool"], ready["against"])
            _row("open → first read_file, made ahead, --against (baseline)", first["against"])
            _row("open → first read_file, made ahead, this checkout", first["pool"], first["against"])
        for name in daemons:
            print(f"daemon {name}: the session's first read_file {statistics.median(calls[name][0]) * 1e3:.3f} ms, "
                  f"its second {statistics.median(calls[name][1]) * 1e3:.3f} ms (p50)")
        for name in daemons:
            log_text = Path(daemons[name][2], "daemon.log").read_text(errors="replace")
            slow = max(re.findall(r"event=open_steps session=(\w+) steps_ms=(\S*)", log_text),
                       key=lambda m: sum(float(p.split(":")[1]) for p in m[1].split(",")), default=None)
            if slow is not None:
                ready_line = re.search(rf"event=worker_ready session={slow[0]} \S+ (.*)", log_text)
                print(f"daemon {name}: its slowest open: {slow[1]}; {ready_line.group(1) if ready_line else ''}")
            steps, total = _steps(log_text)
            print(f"daemon {name}: its start of the worker, p50 {statistics.median(total):.2f} ms; worker steps p50 (ms): "
                  + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in sorted(steps.items())))
    finally:
        for proc, _, _ in daemons.values():
            stop_daemon(proc, 20)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
