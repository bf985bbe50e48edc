"""USS of the processes listed in a pids file, grouped by their parent (root).

    python bench/uss_of.py /tmp/idle3.pids

Prints, for each pid and its descendants, private KiB (smaps_rollup's
Private_Clean + Private_Dirty), so that a session's pid 1 and its tool
server (when they are two) are read apart. Measurement only.
"""

from __future__ import annotations

import statistics
import sys


def uss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except OSError:
        return None


def kids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(k) for k in f.read().split()]
    except OSError:
        return []


def ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return 0


def main() -> None:
    pids = [int(x) for x in open(sys.argv[1]).read().split()]
    if "--kill-children" in sys.argv:  # the second processes gone: what the first keeps alone
        import os
        import signal
        import time
        listed = set(pids)
        zyg = {q for q in listed if len([c for c in kids(q) if c in listed]) > 1}
        for p in pids:
            if p in zyg or any(p in kids(q) for q in listed - zyg):
                continue  # a second process itself
            for c in kids(p):
                os.kill(c, signal.SIGKILL)
        time.sleep(1)
    listed = set(pids)
    # A parent of several listed processes (a zygote) is no session: its children are.
    zygotes = {q for q in listed if len([c for c in kids(q) if c in listed]) > 1}
    tops = [p for p in pids if p not in zygotes and not any(p in kids(q) for q in listed - zygotes)]
    for z in zygotes:
        print(f"zygote {z}: {uss_kib(z)} KiB")
    firsts, seconds, totals = [], [], []
    for top in tops:
        u1 = uss_kib(top)
        below = [c for c in kids(top)]
        u2 = sum(uss_kib(c) or 0 for c in below)
        if u1 is None:
            continue
        firsts.append(u1)
        seconds.append(u2)
        totals.append(u1 + u2)
        print(f"{top} (parent {ppid(top)}, its parent {ppid(ppid(top))}, uss {uss_kib(ppid(top))}): {u1} KiB; children {below}: {u2} KiB")
    if firsts:
        print(f"sessions {len(firsts)}: first process median {statistics.median(firsts)} KiB, mean "
              f"{statistics.mean(firsts):.0f}; below it median {statistics.median(seconds)}; "
              f"all median {statistics.median(totals)} mean {statistics.mean(totals):.0f} KiB")


if __name__ == "__main__":
    main()
