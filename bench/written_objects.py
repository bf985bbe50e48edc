"""What a session's private pages were written for, by the kind of object (root only).

    git apply bench/objmap.patch        # in a copy: the fork server maps its objects
    ./scripts/bench --density 16 --hold 40 --pidfile /tmp/w.pids   # from that copy
    sudo .venv/bin/python bench/written_objects.py /tmp/objmap-FS.txt $(head -12 /tmp/w.pids)

(FS: the fork server's pid. The pid file lists the pool's sandboxes made
ahead too, last: leave those out, as ``head`` does here. A pid that has
ended, or whose parent is not the fork server the map is of, is skipped
and said.)

For each page a worker holds alone (``private_pages.py``) and that differs
from the fork server's page at the same address, each 8-byte word that
differs is put down to the object of the fork server's map it falls in (its
first word is the reference count), or to "no object" (memory no object the
map knows held at the fork: a new object in a free block, a pool's header,
the allocator's own words). A page counts once, split among the kinds of its
changed words; code objects are also counted by module. Pages written back
unchanged (a reference taken and dropped) are counted apart, unattributed.
The fork server moves on after the fork too: read it as an estimate. This is
a measuring tool, not a test.
"""

from __future__ import annotations

import bisect
import collections
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from private_pages import PAGE, _parent, _read, private_pages  # noqa: E402


def main() -> int:
    if len(sys.argv) < 3 or os.geteuid() != 0:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    rows = sorted((int(a), int(b), c.strip()) for a, b, c in
                  (line.split(None, 2) for line in open(sys.argv[1], encoding="utf-8")))
    starts = [r[0] for r in rows]
    fork_server = int(os.path.basename(sys.argv[1]).removeprefix("objmap-").removesuffix(".txt"))
    pids = []
    for pid in map(int, sys.argv[2:]):
        try:
            parent = _parent(pid)
        except OSError:
            print(f"{pid}: ended, skipped", file=sys.stderr)
            continue
        if parent != fork_server:
            print(f"{pid}: a child of {parent}, not of the fork server {fork_server}: skipped", file=sys.stderr)
            continue
        pids.append(pid)
    if not pids:
        return 2

    def owner(addr: int) -> tuple[str | None, int]:
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < rows[i][0] + rows[i][1]:
            return rows[i][2], addr - rows[i][0]
        return None, -1

    states: collections.Counter[str] = collections.Counter()
    pages: collections.Counter[str] = collections.Counter()
    words: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    code_by_module: collections.Counter[str] = collections.Counter()
    with open("/proc/kpagecount", "rb") as kpagecount:
        for pid in pids:
            with open(f"/proc/{pid}/mem", "rb", buffering=0) as worker, \
                    open(f"/proc/{_parent(pid)}/mem", "rb", buffering=0) as parent:
                for (_, _, label), addr in private_pages(pid, kpagecount):
                    where = label.split()[0]
                    mine, theirs = _read(worker, addr), _read(parent, addr)
                    if mine is None or theirs is None:
                        states[f"{where} new"] += 1
                        continue
                    if mine == theirs:
                        states[f"{where} written back unchanged"] += 1
                        continue
                    states[f"{where} changed"] += 1
                    a = struct.unpack(f"{PAGE // 8}Q", mine)
                    b = struct.unpack(f"{PAGE // 8}Q", theirs)
                    here: collections.Counter[str] = collections.Counter()
                    codes = set()
                    for k in range(PAGE // 8):
                        if a[k] != b[k]:
                            name, offset = owner(addr + 8 * k)
                            kind = (name or f"(no object: {where})").split(":", 2)
                            here[":".join(kind[:2]) if kind[0] != "code" else "code"] += 1
                            if offset == 0:
                                counts[":".join(kind[:2]) if kind[0] != "code" else "code"] += 1
                            if kind[0] == "code":
                                codes.add((kind[1], kind[2]))
                    total = sum(here.values())
                    for kind, n in here.items():
                        pages[kind] += n / total
                        words[kind] += n
                    for module, _ in codes:
                        code_by_module[module] += 1
    n = len(pids)
    print(f"{n} process(es), per process:")
    for state, c in sorted(states.items()):
        print(f"  {c / n:7.0f} pages  {state}")
    print("changed pages, split by what their changed words fall in:")
    for kind, c in pages.most_common(20):
        print(f"  {c / n:7.1f} pages  {kind:42s} {words[kind] / n:6.0f} words, {counts[kind] / n:5.0f} of them counts")
    print("code objects written, by module (each once a page):")
    for module, c in code_by_module.most_common(15):
        print(f"  {c / n:7.1f}  {module}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
