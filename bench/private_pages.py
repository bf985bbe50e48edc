"""Which pages a session's worker owns privately, and what wrote them (root only).

    sudo .venv/bin/python bench/private_pages.py PID [PID ...] [--diff] [--dups]
    (PIDs: workers, e.g. from ``./scripts/bench --density N --hold S``'s pid file)

A worker is a copy-on-write child of the fork server: a page is its own once
either of them wrote it after the fork. This reads ``/proc/PID/pagemap`` (the
frame of every present page) and ``/proc/kpagecount`` (how many mappings a
frame has): a page mapped once is private. It prints, per mapping and on
average over the PIDs given, the private KiB (their sum is the USS that
``smaps_rollup`` reports).

``--diff`` compares each private page with the same address in the worker's
parent (the fork server): *changed* pages hold words that differ (reference
counts, code objects' warm-up counters and inline caches, new objects in
free blocks, pool headers), *identical* ones were written and left as they
were (a reference taken and dropped) or were copied by the fork server
writing its own copy. The fork server has moved on since the fork, so read
it as an estimate. ``--dups`` counts the private pages whose content another
worker's private page repeats (what a page-merging kernel could share).

Session processes are not dumpable: their ``pagemap`` frames and ``mem`` are
root's to read. This is a measuring tool, not a test.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import struct
import sys
from collections.abc import Iterator
from typing import BinaryIO

PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_PFN_MASK = (1 << 55) - 1

Mapping = tuple[int, int, str]  # start, end, label


def mappings(pid: int) -> list[Mapping]:
    out = []
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            name = parts[5].strip() if len(parts) > 5 else ""
            if name == "[vsyscall]":
                continue
            out.append((lo, hi, f"{os.path.basename(name) or '[anon]'} {parts[1]}"))
    return out


def private_pages(pid: int, kpagecount: BinaryIO) -> Iterator[tuple[Mapping, int]]:
    """(mapping, address) of every present page of ``pid`` mapped only once."""
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for m in mappings(pid):
            lo, hi, _ = m
            pagemap.seek(lo // PAGE * 8)
            raw = pagemap.read((hi - lo) // PAGE * 8)
            for i, entry in enumerate(struct.unpack(f"{len(raw) // 8}Q", raw)):
                pfn = entry & _PFN_MASK
                if not entry & _PRESENT or pfn == 0:
                    continue
                kpagecount.seek(pfn * 8)
                if struct.unpack("Q", kpagecount.read(8))[0] == 1:
                    yield m, lo + i * PAGE


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return int(raw[raw.rfind(b")") + 2 :].split()[1])


def _read(mem: BinaryIO | None, addr: int) -> bytes | None:
    if mem is None:
        return None
    try:
        mem.seek(addr)
        data = mem.read(PAGE)
    except (OSError, ValueError, OverflowError):
        return None
    return data if len(data) == PAGE else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pids", type=int, nargs="+")
    ap.add_argument("--diff", action="store_true", help="compare each private page with the fork server's")
    ap.add_argument("--dups", action="store_true", help="count private pages another worker repeats")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("private_pages: run as root (pagemap frames and kpagecount are root's)", file=sys.stderr)
        return 2
    per_map: collections.Counter[str] = collections.Counter()
    states: collections.Counter[tuple[str, str]] = collections.Counter()
    contents: collections.Counter[bytes] = collections.Counter()
    total = 0
    with open("/proc/kpagecount", "rb") as counts:
        for pid in list(args.pids):
            if not os.path.exists(f"/proc/{pid}/mem"):
                args.pids.remove(pid)  # ended since it was listed (a sandbox of the pool, adopted or retired)
                continue
            worker = open(f"/proc/{pid}/mem", "rb", buffering=0) if args.diff or args.dups else None  # noqa: SIM115
            parent = open(f"/proc/{_parent(pid)}/mem", "rb", buffering=0) if args.diff else None  # noqa: SIM115
            try:
                for (_, _, label), addr in private_pages(pid, counts):
                    total += 1
                    kind = label.split()[0]
                    per_map[kind] += 1
                    mine = _read(worker, addr)
                    if args.dups and mine is not None:
                        contents[hashlib.sha1(mine).digest()] += 1
                    if parent is not None:
                        theirs = _read(parent, addr)
                        state = ("new since the fork" if theirs is None or mine is None
                                 else "identical" if mine == theirs else "changed")
                        states[(kind, state)] += 1
            finally:
                for f in (worker, parent):
                    if f is not None:
                        f.close()
    n = len(args.pids)
    kib = PAGE // 1024
    print(f"{n} process(es): {total * kib / n:.0f} KiB private each (mean)")
    for kind, pages in per_map.most_common():
        line = f"  {pages * kib / n:8.0f} KiB  {kind}"
        if args.diff:
            line += "  (" + ", ".join(f"{s} {states[(kind, s)] * kib / n:.0f}"
                                     for s in ("changed", "identical", "new since the fork") if states[(kind, s)]) + ")"
        print(line)
    if args.dups and total:
        print(f"  distinct contents: {len(contents)} of {total} private pages ({len(contents) / total:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
