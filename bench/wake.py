"""What waking a sleeping session costs, beside a call to an awake one.

    ./scripts/bench --wake [N]      (or: .venv/bin/python bench/wake.py [N])

Starts its own daemon with a policy that sleeps after 0.3 s and one session,
then N times (default 30): waits until the session is asleep, times a
``read_file`` (the wake and the call), and then a second ``read_file`` on the
woken session (the awake baseline, in the same round). Prints the p50 and p99
of both and their ratio, and the median of the wake's steps as the daemon
logged them (``event=session_woken ms=``: the fork server's request to the
new tool server's report; ``steps_ms``: the new pid 1's own confinement
steps). The machine is shared: read the ratio, not the figures.
"""

from __future__ import annotations

import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import REPO, fmt, pct, run_small, start_daemon, stop_daemon  # noqa: E402  (and the repository on the path)

import dispatch  # noqa: E402


def main(rounds: int, tmp: str) -> int:
    policies = Path(tmp, "policies")
    shutil.copytree(REPO / "policies", policies)
    Path(policies, "nap.toml").write_text('description = "sleeps after 0.3 s"\n[limits]\nsleep_after_s = 0.3\n')
    daemon, sock = start_daemon(tmp, "--policies", str(policies), "--log-level", "debug")
    wt = Path(tmp, "wt")
    wt.mkdir()
    Path(wt, "f.txt").write_text("hello\n" * 100)
    woken: list[float] = []
    awake: list[float] = []
    try:
        with dispatch.connect(sock) as client:
            s = client.open_session(str(wt), policy="nap", network=False)
            read = s.registry.get("read_file")
            read.call({"path": "f.txt"})
            for _ in range(rounds):
                deadline = time.monotonic() + 30
                while not any(i["id"] == s.id and i["asleep"] for i in client.list_sessions()):
                    if time.monotonic() > deadline:
                        print("wake: the session never fell asleep", file=sys.stderr)
                        return 1
                    time.sleep(0.02)
                t = time.perf_counter()
                assert read.call({"path": "f.txt"}).is_success
                woken.append(time.perf_counter() - t)
                t = time.perf_counter()
                assert read.call({"path": "f.txt"}).is_success
                awake.append(time.perf_counter() - t)
            s.close()
    finally:
        stop_daemon(daemon, 30)
        log = Path(tmp, "daemon.log").read_text(errors="replace")
        shutil.rmtree(tmp, ignore_errors=True)
    served = [float(m) for m in re.findall(r"event=session_woken session=\w+ ms=([\d.]+)", log)]
    steps: dict[str, list[float]] = {}
    for line in re.findall(r"woken=1 steps_ms=(\S+)", log):
        for part in line.split(","):
            name, _, ms = part.partition(":")
            steps.setdefault(name, []).append(float(ms))
    print(f"dispatchd wake: {rounds} sleeps of one session")
    print(f"first read_file after a sleep (the wake): p50 {fmt(statistics.median(woken)).strip()}, "
          f"p99 {fmt(pct(woken, 0.99)).strip()}")
    print(f"the next read_file (awake):               p50 {fmt(statistics.median(awake)).strip()}, "
          f"p99 {fmt(pct(awake, 0.99)).strip()}")
    print(f"ratio (p50): {statistics.median(woken) / statistics.median(awake):.1f}x")
    if served:
        print(f"daemon's wake (fork server request to the new tool server's report): p50 {statistics.median(served):.2f} ms")
    if steps:
        print("new pid 1's steps, p50 ms: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in steps.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_small("wake", __doc__, 30, main))
