"""What a fork of a process holding the fork server's modules costs (root or
not; measurement only): the time from os.fork() to the child's first byte
read by the parent, and to its reaped exit, the child doing nothing.

    /tmp/rootvenv/bin/python bench/fork_cost.py [N]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dispatchd import catalogue  # noqa: E402
from dispatchd.worker import fork_server, forkhooks  # noqa: E402,F401

catalogue.warm_conversions()
forkhooks.leave_out()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
first, whole = [], []
for _ in range(n):
    r, w = os.pipe()
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"x")
        os._exit(0)
    os.read(r, 1)
    first.append(time.perf_counter() - t)
    os.waitpid(pid, 0)
    whole.append(time.perf_counter() - t)
    os.close(r)
    os.close(w)
with open(f"/proc/{os.getpid()}/status") as f:
    rss = next(line for line in f if line.startswith("VmRSS")).split()[1]
print(f"fork of a {int(rss) / 1024:.1f} MiB process: child running after p50 "
      f"{statistics.median(first) * 1e3:.3f} ms (p90 {sorted(first)[int(n * .9)] * 1e3:.3f}); "
      f"fork+exit+wait p50 {statistics.median(whole) * 1e3:.3f} ms")
